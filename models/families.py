"""The model families jaxserve serves: each Hugging Face architecture name -> its `Family`.

One table for every reader: `ModelConfig.from_hf` resolves a config's architecture here and
reads its fields by the family's name, the GGUF loader maps llama.cpp's architecture names
through it, and the runner builds the family's model class. Imports no jax: the class is named
as "module:Class" and imported when a runner first builds it.

A new family is a module with its model (a Flax module taking Transformer's arguments, e.g. a
subclass of `llama.Transformer`) and one line in ARCHITECTURES.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str  # HF's model_type; ModelConfig.from_hf reads family-specific fields by it
    gguf: str | None = None  # llama.cpp's general.architecture for it (None: no GGUF load)
    model: str = "jaxserve.models.llama:Transformer"  # "module:Class" of its model
    model_types: tuple[str, ...] = ()  # further model_type names its configs carry

    def model_class(self) -> type:
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)


# All of these are the one Llama-family decoder (GQA, RMSNorm, SwiGLU, RoPE); they differ in
# biases, q/k norms, rope scaling and tying, which ModelConfig carries.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", gguf="llama"),
    "MistralForCausalLM": Family("mistral", gguf="mistral"),
    "Qwen2ForCausalLM": Family("qwen2", gguf="qwen2"),
    "Qwen3ForCausalLM": Family("qwen3", gguf="qwen3"),  # RMSNorm on each head's q, k
    "Phi3ForCausalLM": Family("phi3"),  # q/k/v and gate/up fused in the checkpoint
    # mixture of experts (models/moe.py): a routed set of SwiGLU experts in place of the MLP
    "MixtralForCausalLM": Family("mixtral"),  # GGUF: "llama" with experts (loader.py)
    "Qwen3MoeForCausalLM": Family("qwen3_moe", gguf="qwen3moe"),  # and Qwen3's q/k norms
    # local (sliding-window) and global layers, soft-capping, (1 + w) norms, GeGLU
    "Gemma3ForCausalLM": Family("gemma3", model_types=("gemma3_text",)),
}


def architecture_of(architectures: list[str], model_type: str | None) -> str:
    """The registered architecture a HF config names: the first of its `architectures` that
    is one, else the one whose family its `model_type` is."""
    arch = next((a for a in architectures if a in ARCHITECTURES), None)
    if arch is None:
        arch = next((a for a, f in ARCHITECTURES.items()
                     if model_type in (f.name, *f.model_types)), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {architectures or model_type!r}; "
                         f"supported: {sorted(ARCHITECTURES)}")
    return arch


def family(architecture: str) -> Family:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{sorted(ARCHITECTURES)}")
    return ARCHITECTURES[architecture]


def gguf_architectures() -> dict[str, str]:
    """llama.cpp's architecture names -> the HF architecture each loads as."""
    return {f.gguf: arch for arch, f in ARCHITECTURES.items() if f.gguf}
