"""Shared fixtures: the real default model (loaded once), its HF oracle, and tiny random models."""

from __future__ import annotations

import os
import tempfile

import pytest

# Four CPU devices for the tensor-parallel tests (set before jax is imported; a single-device
# engine still runs on the first). A flag given from outside wins.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

# One OpenMP thread for torch (the HF oracle, Triton's interpreter) and numpy's BLAS: two
# workers share two cores, and an OpenMP thread that spins waiting for a busy core slows a
# greedy HF generate several times over (read when torch or numpy starts its thread pool).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from jaxserve.runtime import compile_cache  # noqa: E402
from jaxserve.testing.tiny import write_tiny_llama  # noqa: E402

# Many tests build engines over the same model; identical programs then come from the cache,
# kept apart from the user's own cache.
compile_cache.enable(os.environ.get(
    "JAXSERVE_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")))

TINY_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct GGUF), loaded once for the whole run."""
    from jaxserve.models.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own load of the same GGUF: the oracle for greedy token ids."""
    pytest.importorskip("torch")
    from jaxserve.testing.oracle import load_hf_model

    return load_hf_model(None)  # the default model's GGUF, float32


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (directory, torch model)} for the tiny random models of TINY_ARCHS."""
    pytest.importorskip("torch")
    from jaxserve.testing.oracle import make_tiny_hf_model

    out = {}
    for i, arch in enumerate(TINY_ARCHS):
        d = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        out[arch] = (d, make_tiny_hf_model(arch, d, seed=i))
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny Llama written without needing torch at test time (safetensors from numpy)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-np"), 512, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_for_smollm(tmp_path_factory, smollm):
    """A tiny random Llama with the default model's vocabulary: a draft model that proposes
    badly (speculative decoding must still give the target's tokens)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), smollm.config.vocab_size,
                             seed=1)
