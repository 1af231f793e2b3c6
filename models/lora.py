"""LoRA adapters in PEFT's format, read for a Llama-family model, and the low-rank update of a
batch whose rows use different adapters.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, rank_pattern, alpha_pattern, ...) and `adapter_model.safetensors`, whose tensors
are `...layers.<i>.<self_attn|mlp>.<module>.lora_A.weight` (r, in) and `lora_B.weight` (out, r).
A module's output becomes W x + scaling * B A x, scaling = alpha / r (alpha / sqrt(r) with
use_rslora). What the step does not compute that way is refused, naming the field.

On the device every targeted projection has max_loras slots of A and B (slot s at index s - 1;
slot 0, the base model, has none), padded to the largest rank R and laid out so that the
slots concatenate along the rank axis: A (L, Din, S, R) and
B (L, S, R, Dout) read as (Din, S * R) and (S * R, Dout) matrices. A row's update is then
x @ A, masked to its slot's R columns, @ B: two plain matmuls for the whole mixed batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import jax
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import MappedTensors

# PEFT's module name -> (the model's param name, its block, contracted axes)
MODULES = {
    "q_proj": ("wq", "self_attn", 1),
    "k_proj": ("wk", "self_attn", 1),
    "v_proj": ("wv", "self_attn", 1),
    "o_proj": ("wo", "self_attn", 2),
    "gate_proj": ("w_gate", "mlp", 1),
    "up_proj": ("w_up", "mlp", 1),
    "down_proj": ("w_down", "mlp", 1),
}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


def module_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(Din, Dout) of each PEFT module of `cfg`'s layers (HF's in_features, out_features)."""
    d, q, kv, f = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def supported_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The PEFT modules an adapter of `cfg` may target (a mixture's MLP is its experts)."""
    return tuple(m for m in MODULES if not (cfg.is_moe and m in MLP_MODULES))


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights, per targeted param name, every layer stacked (zeros where a layer
    has none): a (L, Din, r) and b (L, r, Dout), b scaled by the module's scaling."""

    path: str
    rank: int  # the largest rank of any module
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    digest: str  # of the config and the weights: names what the adapter computes

    @property
    def num_bytes(self) -> int:
        return sum(w.nbytes for w in (*self.a.values(), *self.b.values()))


def _pattern_key(patterns, key: str) -> str | None:
    """PEFT's rule (utils.other.get_pattern_key): the first pattern that ends `key`."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return None


def _check_config(conf: dict, cfg: ModelConfig, max_rank: int) -> None:
    """Raise ValueError naming the first field of `conf` that the step cannot compute."""
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"peft_type: {conf.get('peft_type')!r} is not a LoRA adapter")
    refused = {  # field -> why, where set to anything but off
        "use_dora": "DoRA (use_dora) is not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
        "lora_bias": "lora_bias (a bias on lora_B) is not supported",
        "target_parameters": "target_parameters (adapters on MoE experts' parameters) is not "
                             "supported",
        "trainable_token_indices": "trainable_token_indices is not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
        "layer_replication": "layer_replication is not supported",
        "use_qalora": "QALoRA (use_qalora) is not supported",
    }
    for field, why in refused.items():
        if conf.get(field):
            raise ValueError(f"{field}: {why}")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"bias: only 'none' is supported, got {conf['bias']!r}")
    targets = conf.get("target_modules")
    allowed = supported_modules(cfg)
    if isinstance(targets, list | tuple):
        for t in targets:
            name = str(t).rsplit(".", 1)[-1]
            if name in MLP_MODULES and cfg.is_moe:
                raise ValueError(f"target_modules: {t!r} is a mixture of experts' MLP "
                                 f"(adapters on MoE experts are not supported); supported: "
                                 f"{', '.join(allowed)}")
            if name not in allowed:
                raise ValueError(f"target_modules: {t!r} is not supported; supported: "
                                 f"{', '.join(allowed)}")
    elif not isinstance(targets, str):
        raise ValueError(f"target_modules: must be a list of module names or a pattern, got "
                         f"{targets!r}")
    for field in ("r", "lora_alpha"):
        v = conf.get(field, 8)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"{field}: must be a positive number, got {v!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(conf.get(field) or {}, dict):
            raise ValueError(f"{field}: must be an object of pattern -> value")
    ranks = [("r", conf.get("r", 8))] + [("rank_pattern", r) for r in
                                         (conf.get("rank_pattern") or {}).values()]
    for field, r in ranks:
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"{field}: ranks must be positive ints, got {r!r}")
        if r > max_rank:
            raise ValueError(f"{field}: rank {r} exceeds max_lora_rank ({max_rank})")


def load_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in directory `path` for a model of `cfg`; ranks above
    `max_rank` are refused. Raises ValueError naming the field or file that is wrong."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory")
    conf_file, weights_file = (os.path.join(path, f) for f in (CONFIG_FILE, WEIGHTS_FILE))
    if not os.path.isfile(conf_file):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE}")
    with open(conf_file, "rb") as f:
        conf_bytes = f.read()
    try:
        conf = json.loads(conf_bytes)
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{CONFIG_FILE}: must be a JSON object")
    _check_config(conf, cfg, max_rank)
    if not os.path.isfile(weights_file):
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_FILE} (other weight files "
                         f"are not read)")

    mapped = MappedTensors()
    try:
        mapped.add(weights_file)
    except ValueError as e:
        raise ValueError(f"{WEIGHTS_FILE}: {e}") from None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    allowed, sizes = supported_modules(cfg), module_sizes(cfg)
    for key, t in mapped.tensors.items():
        m = _KEY.match(key)
        if m is None:
            why = ("adapters on MoE experts are not supported" if ".experts." in key else
                   "DoRA (use_dora) is not supported" if "lora_magnitude" in key else
                   "not a LoRA A or B of a layer's projection")
            raise ValueError(f"{WEIGHTS_FILE}: tensor {key!r}: {why}")
        layer, block, name, ab = int(m[1]), m[2], m[3], m[4]
        if name not in allowed or MODULES[name][1] != block:
            raise ValueError(f"target_modules: {block}.{name} (tensor {key!r}) is not "
                             f"supported; supported: {', '.join(allowed)}")
        if layer >= cfg.num_layers:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {key!r}: the model has "
                             f"{cfg.num_layers} layers")
        pairs.setdefault((layer, name), {})[ab] = t
    if not pairs:
        raise ValueError(f"{WEIGHTS_FILE}: no LoRA weights in it")

    r0, alpha0 = conf.get("r", 8), conf.get("lora_alpha", 8)
    ranks, alphas = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    rank = max(t["A"].shape[0] for t in pairs.values() if "A" in t)
    a, b = {}, {}
    for (layer, name), t in sorted(pairs.items()):
        key = f"model.layers.{layer}.{MODULES[name][1]}.{name}"
        if set(t) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_FILE}: {key} has lora_{next(iter(t))} without "
                             f"lora_{'B' if 'A' in t else 'A'}")
        rk, ak = _pattern_key(ranks, key), _pattern_key(alphas, key)
        r = ranks[rk] if rk is not None else r0
        alpha = alphas[ak] if ak is not None else alpha0
        din, dout = sizes[name]
        for ab, want in (("A", (r, din)), ("B", (dout, r))):
            if tuple(t[ab].shape) != want:
                field = "rank_pattern" if rk is not None else "r"
                raise ValueError(f"{WEIGHTS_FILE}: {key}.lora_{ab} has shape "
                                 f"{tuple(t[ab].shape)}, expected {want} ({field} {r}, the "
                                 f"model's sizes)")
        scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        param = MODULES[name][0]
        if param not in a:
            a[param] = np.zeros((cfg.num_layers, din, rank), np.float32)
            b[param] = np.zeros((cfg.num_layers, rank, dout), np.float32)
        a[param][layer, :, :r] = np.asarray(t["A"], np.float32).T
        b[param][layer, :r] = np.asarray(t["B"], np.float32).T * np.float32(scaling)
    digest = hashlib.blake2b(conf_bytes, digest_size=16)
    with open(weights_file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return LoRAAdapter(path, rank, a, b, digest.hexdigest())


# ----------------------------------------------------------------------------- device side


def empty_slots(cfg: ModelConfig, targets: tuple[str, ...], num_slots: int, rank: int,
                dtype) -> dict[str, dict[str, np.ndarray]]:
    """Zeroed slots of every targeted param (`targets`: PEFT names): {param: {"a": (L, Din,
    S, R), "b": (L, S, R, Dout)}}, S = num_slots: slot s (1..S) at index s - 1 (slot 0, no
    adapter, has no columns to compute)."""
    sizes = module_sizes(cfg)
    out = {}
    for name in targets:
        din, dout = sizes[name]
        out[MODULES[name][0]] = {
            "a": np.zeros((cfg.num_layers, din, num_slots, rank), dtype),
            "b": np.zeros((cfg.num_layers, num_slots, rank, dout), dtype)}
    return out


def slot_values(adapter: LoRAAdapter | None, slots: dict, dtype) -> dict:
    """`adapter`'s weights shaped as one slot of `slots` (empty_slots' tree): {param: {"a":
    (L, Din, R), "b": (L, R, Dout)}}, zero-padded to R, zeros for params it does not target
    (all zeros for None)."""
    out = {}
    for param, w in slots.items():
        num_layers, din, _, rank = w["a"].shape
        dout = w["b"].shape[-1]
        a = np.zeros((num_layers, din, rank), dtype)
        b = np.zeros((num_layers, rank, dout), dtype)
        if adapter is not None and param in adapter.a:
            r = adapter.a[param].shape[-1]
            a[..., :r] = adapter.a[param]
            b[:, :r] = adapter.b[param]
        out[param] = {"a": a, "b": b}
    return out


def write_slot(slots: dict, slot: jax.Array, values: dict) -> dict:
    """`slots` with slot `slot` (1..S) set to `values` (slot_values' tree); jitted with
    `slots` donated, it writes in place."""
    i = slot - 1
    return {p: {"a": w["a"].at[:, :, i].set(values[p]["a"]),
                "b": w["b"].at[:, i].set(values[p]["b"])} for p, w in slots.items()}
