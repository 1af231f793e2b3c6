"""ModelConfig: the shape of a Llama-family decoder, built from a Hugging Face config."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from jaxserve.models import families

log = logging.getLogger(__name__)


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
    # HF's rope scaling as sorted (key, value) pairs, defaults filled in: _parse_rope_scaling
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (head_dim), before RoPE
    # A query sees only the newest `sliding_window` keys (its own included) in the layers that
    # have the window: every layer, or none of `global_layers` (Gemma 3's full-attention ones).
    sliding_window: int | None = None
    global_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the windowed layers (unscaled)
    final_softcap: float | None = None  # logits become c * tanh(logit / c)
    attn_scale: float | None = None  # query_pre_attn_scalar ** -0.5 (default head_dim ** -0.5)
    # Gemma: norms scale by (1 + weight), the attention and MLP outputs have norms of their own
    # before the residual add, the embedding is scaled by sqrt(hidden), the MLP gates with GELU.
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    hidden_act: str = "silu"
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
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.hidden_act must be 'silu' or 'gelu_tanh', got "
                             f"{self.hidden_act!r}")
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

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it sees its whole context."""
        return None if layer in self.global_layers else self.sliding_window

    @property
    def local_layers(self) -> tuple[int, ...]:
        """The layers with a sliding window."""
        return tuple(i for i in range(self.num_layers) if self.layer_window(i) is not None)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers `PretrainedConfig` or a config.json dict."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        arch = families.architecture_of(d.get("architectures") or [], d.get("model_type"))
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = _head_dim(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        family = families.family(arch).name
        # Qwen's configs name a window that only use_sliding_window turns on
        window = (d.get("sliding_window") if family in ("mistral", "phi3", "gemma3", "mixtral")
                  or d.get("use_sliding_window") else None)
        # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = d.get("rope_parameters") or {}
        partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE rotates "
                             f"whole heads)")
        gemma = _gemma3_fields(d) if family == "gemma3" else {}
        if gemma:
            rope = gemma.pop("rope")
        elif window and family in ("qwen2", "qwen3", "qwen3_moe"):
            gemma["global_layers"] = _qwen_global_layers(d)  # the first max_window_layers
        return cls(
            **_moe_fields(d, family),
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if family in ("qwen2", "gemma3") else 1e-5),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_parse_rope_scaling(d.get("rope_scaling") or rope, d),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "gemma3")),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=int(window) if window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **gemma,
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


def _qwen_global_layers(d: dict) -> tuple[int, ...]:
    """Qwen2/3 slide only from layer max_window_layers on (or where layer_types says)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", n) else "full_attention"
        for i in range(n)]
    return tuple(i for i, t in enumerate(types) if t != "sliding_attention")


def _gemma3_fields(d: dict) -> dict:
    """Gemma 3's ModelConfig fields from its text config, in either of transformers' forms:
    `layer_types` and `rope_parameters` per layer type, or the older `sliding_window_pattern`
    (every n-th layer global), `rope_theta`, `rope_local_base_freq` and `rope_scaling`."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types must name full_attention or sliding_attention for each of "
                         f"the {n} layers, got {types}")
    params = d.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or d.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention.rope_type "
                         f"{local['rope_type']!r} is not supported (only 'default')")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if d.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 reads the field and never applies it (Gemma 2 did; Gemma 3's
        # own configs leave it null): serve what it computes
        log.warning("attn_logit_softcapping %s is not applied: Gemma 3 has no attention "
                    "soft-capping (as in transformers)", d["attn_logit_softcapping"])
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal decoding only)")
    return dict(
        rope=full,
        global_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        local_rope_theta=float(local["rope_theta"]),
        final_softcap=d.get("final_logit_softcapping"),
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        norm_offset=1.0, sandwich_norms=True, embed_scale=float(d["hidden_size"]) ** 0.5,
        hidden_act="gelu_tanh",
    )


ROPE_TYPES = ("linear", "yarn", "llama3", "longrope")  # and "default": no scaling


def _parse_rope_scaling(rs: dict | None, d: dict) -> tuple[tuple[str, Any], ...] | None:
    """A config's rope scaling as sorted (key, value) pairs (hashable: ModelConfig is frozen),
    with every value rope_inv_freq needs filled in, or None for plain RoPE. `d`: the whole
    config, whose max_position_embeddings (and Phi-3's original_max_position_embeddings) the
    defaults come from. Raises ValueError naming the field for a kind not served."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind in (None, "default"):
        return None
    if kind == "dynamic":
        raise ValueError(
            "rope_scaling.rope_type 'dynamic' (dynamic NTK) is not supported: its frequencies "
            "follow the running sequence length, so keys cached at one length would be read "
            f"at another; supported: {', '.join(ROPE_TYPES)}")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    max_pos = d.get("max_position_embeddings", 2048)
    old_len = int(rs.get("original_max_position_embeddings")
                  or d.get("original_max_position_embeddings") or max_pos)
    out: dict[str, Any] = {"rope_type": kind}
    if kind == "linear":
        out["factor"] = float(rs["factor"])
    elif kind == "llama3":
        out |= dict(factor=float(rs["factor"]),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(rs.get(
                        "original_max_position_embeddings", 8192)))
    elif kind == "yarn":
        factor = float(rs.get("factor") or max_pos / old_len)
        attention = rs.get("attention_factor")
        if attention is None:
            mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else _yarn_mscale(factor, 1.0))
        out |= dict(factor=factor, attention_factor=float(attention),
                    beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow")
                                                                                or 1),
                    truncate=bool(rs.get("truncate", True)),
                    original_max_position_embeddings=old_len)
    else:  # longrope: per-frequency factors, the long ones from position old_len on
        half = _head_dim(d) // 2
        for name in ("short_factor", "long_factor"):
            if len(rs.get(name) or ()) != half:
                raise ValueError(f"rope_scaling.{name} must hold head_dim / 2 = {half} numbers")
        factor = float(rs.get("factor") or max_pos / old_len)
        attention = rs.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(old_len)))
        out |= dict(short_factor=tuple(map(float, rs["short_factor"])),
                    long_factor=tuple(map(float, rs["long_factor"])),
                    attention_factor=float(attention), original_max_position_embeddings=old_len)
    return tuple(sorted(out.items()))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _head_dim(d: dict) -> int:
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]


def rope_params(cfg: ModelConfig, local: bool = False) -> dict:
    """The rope scaling of the layers (`local`: the sliding-window ones) as a dict; empty for
    plain RoPE. Gemma 3's local layers rotate unscaled with a base of their own."""
    if cfg.rope_scaling is None or (local and cfg.local_rope_theta):
        return {}
    return dict(cfg.rope_scaling)


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor, else 1)."""
    return rope_params(cfg, local).get("attention_factor", 1.0)


def rope_long_from(cfg: ModelConfig, local: bool = False) -> int | None:
    """LongRoPE: the first position rotated with the long factors (each token picks by its own
    position, as HF does for a sequence's decode tokens), else None."""
    rope = rope_params(cfg, local)
    return rope["original_max_position_embeddings"] if rope.get("rope_type") == "longrope" else None


def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False):
    """Inverse frequencies (H/2,), with the config's rope scaling applied (numpy). `local`:
    those of the sliding-window layers, where the model gives them a base of their own
    (Gemma 3), unscaled. `long`: LongRoPE's long factors (else its short ones)."""
    import numpy as np

    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike.
    exps = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    theta = cfg.local_rope_theta if local and cfg.local_rope_theta else cfg.rope_theta
    base = np.float32(theta) ** exps
    inv = np.float32(1.0) / base
    rope = rope_params(cfg, local)
    kind = rope.get("rope_type")
    if kind == "linear":
        inv = inv / np.float32(rope["factor"])
    elif kind == "longrope":
        ext = np.asarray(rope["long_factor" if long else "short_factor"], np.float32)
        inv = np.float32(1.0) / (ext * base)
    elif kind == "yarn":
        inv = _yarn_inv_freq(rope, inv, base, float(theta), cfg.head_dim)
    elif kind == "llama3":
        inv = _llama3_inv_freq(rope, inv)
    return inv.astype(np.float32)


def _yarn_inv_freq(rope: dict, inv, base, theta: float, dim: int):
    """YaRN: each frequency a blend of itself and itself / factor, by a ramp over the
    dimensions between the ones that turn beta_fast and beta_slow times in the original
    context."""
    import numpy as np

    old_len = rope["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rope["beta_fast"]), dim_of(rope["beta_slow"])
    if rope["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (unscaled), 0: interpolate
    scaled = np.float32(1.0) / (np.float32(rope["factor"]) * base)
    return scaled * (1 - keep) + inv * keep


def _llama3_inv_freq(rope: dict, inv):
    import numpy as np

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled)
