"""ModelConfig: the shape of a Llama-family decoder, built from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# HF `architectures` names we can serve, mapped to the family they belong to. All of them are the
# same decoder (GQA, RMSNorm, SwiGLU, RoPE); they differ in biases, q/k norms, rope scaling and
# tying.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # RMSNorm on each head's q and k before RoPE
    "Phi3ForCausalLM": "phi3",  # q/k/v and gate/up fused in the checkpoint (split at load)
    # mixture of experts (models/moe.py): a routed set of SwiGLU experts in place of the MLP
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # and Qwen3's q/k norms
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style scaling: (factor, low_freq_factor, high_freq_factor, original_max_position).
    rope_scaling: tuple[float, float, float, int] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (head_dim), before RoPE
    # Keys older than this many positions are out of a query's view. Not served yet: an engine
    # refuses a max_model_len above it (within it, the window changes nothing).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (models/moe.py); num_experts 0: a dense MLP in every layer.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k: the experts each token is routed to
    moe_intermediate_size: int = 0  # F of each expert
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts
                                and self.moe_intermediate_size > 0):
            raise ValueError(
                f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, "
                f"num_experts ({self.num_experts})] and moe_intermediate_size "
                f"({self.moe_intermediate_size}) positive")

    @property
    def projection_weights(self) -> int:
        """How many weights each token's row multiplies by in the layers' projections (q, k,
        v, o, gate, up, down): one multiply-add each. (The head's hidden_size x vocab_size
        come on top, for the rows that produce logits.)"""
        d, n, kh, h, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                          self.intermediate_size)
        if self.is_moe:  # the router, and the k experts a token is routed to
            e, k, f = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
            return self.num_layers * (2 * d * n * h + 2 * d * kh * h + d * e + 3 * k * d * f)
        return self.num_layers * (2 * d * n * h + 2 * d * kh * h + 3 * d * f)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers `PretrainedConfig` or a config.json dict."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = d.get("model_type")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(model_type)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        family = SUPPORTED_ARCHITECTURES[arch]
        # Qwen's configs name a window that only use_sliding_window turns on
        window = (d.get("sliding_window") if family in ("mistral", "phi3", "mixtral")
                  or d.get("use_sliding_window") else None)
        # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = d.get("rope_parameters") or {}
        partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE rotates "
                             f"whole heads)")
        return cls(**_moe_fields(d, family),
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if family == "qwen2" else 1e-5),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_parse_rope_scaling(d.get("rope_scaling") or rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=int(window) if window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _moe_fields(d: dict, family: str) -> dict:
    """The mixture-of-experts fields of a HF config dict (none for a dense family)."""
    if family == "mixtral":  # softmax over the k chosen logits: renormalised top-k
        return dict(num_experts=d["num_local_experts"],
                    num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
    if family != "qwen3_moe":
        return {}
    # every layer sparse: dense layers between them would need a second layer body
    if d.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers {d['mlp_only_layers']} is not supported (every layer "
                         f"must be a mixture of experts)")
    if d.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"decoder_sparse_step {d['decoder_sparse_step']} is not supported "
                         f"(only 1: every layer a mixture of experts)")
    return dict(num_experts=d.get("num_experts") or d["num_local_experts"],
                num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)))


def _parse_rope_scaling(rs: dict | None) -> tuple[float, float, float, int] | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3')")
    return (float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)))


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies (H/2,), with llama3 scaling applied when configured (numpy)."""
    import numpy as np

    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike.
    exps = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    inv = np.float32(1.0) / (np.float32(cfg.rope_theta) ** exps)
    if cfg.rope_scaling is None:
        return inv.astype(np.float32)
    factor, low, high, old_len = cfg.rope_scaling
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled).astype(np.float32)
