"""FP8 weights as published checkpoints carry them: float8_e4m3fn codes and float32 scales,
kept so in device memory and dequantized inside the step.

Two conventions of a HF config.json's `quantization_config` are read:
- quant_method "fp8" (DeepSeek-V3, Qwen3-FP8): `weight_block_size` [128, 128]; `<name>.weight`
  float8_e4m3fn (out, in) and `<name>.weight_scale_inv` float32 (ceil(out / 128),
  ceil(in / 128)): w = code * scale_inv over each 128 x 128 tile.
- quant_method "compressed-tensors", format "float-quantized" (llm-compressor's FP8):
  config_groups' weights {num_bits 8, type "float", strategy "channel" or "tensor"};
  `<name>.weight` float8_e4m3fn and `<name>.weight_scale` (out, 1), or () / (1,) per tensor.
  An `<name>.input_scale` (static activations) is dropped: activations stay in the model's
  dtype, so only the weights are FP8.
Modules the config leaves out (`ignore`, `modules_to_not_convert`: lm_head, ...) come in a float
dtype and load as float weights.

At load a weight becomes `Fp8` in the HF layout: codes (out, in) and a scale per output row
and per block of b inputs, (out, in / b): a tile's scale repeated over its rows, and b =
gcd(128, in) (b = in for a per-channel or per-tensor scale). That is the same weights at
4 / b bytes a weight more (1/32 for b = 128), and every layout change the loader makes
(transposes, the out axis split into heads) applies to both planes alike, as to GGUF's
blocks (quant.py). Where a layout splits the inputs into heads (wo), b is cut to divide the
head dim (`Fp8.with_block`).

In the param tree an FP8 weight is {"fp8": codes, "scale": float32}, both of the weight's
rank; along each axis the scale's length is the codes', 1, or a divisor (blocks). `dequantize`
forms codes * scale in the compute dtype right before the matmul, where XLA on a GPU fuses it
into the dot: the step streams 1 byte a weight (and its scales). XLA:CPU gains nothing from
that, so on a CPU the runner expands the weights at load (`expands_at_load`;
`in_step_on_cpu()` keeps them FP8 there, for tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

CODE_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
PLANES = ("fp8", "scale")
BLOCK = 128  # the block form's tile side
METHODS = ("fp8", "compressed-tensors")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a checkpoint's FP8 weights are stored (parsed from its quantization_config)."""

    method: str  # "fp8" or "compressed-tensors"
    scale_suffix: str  # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None  # (out, in) tile of one scale; None: per channel or tensor


def scheme_of(hf: Mapping) -> Scheme | None:
    """The FP8 scheme of a HF config dict, None where it has no quantization_config; a
    ValueError naming the field for anything else this module does not read."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {list(METHODS)}")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r}: only e4m3 weights are supported")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"quantization_config.weight_block_size {block!r}: expected "
                             f"[rows, columns]")
        return Scheme(method, "weight_scale_inv", None if block is None else tuple(block))
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format {fmt!r}: only float-quantized "
                         f"(FP8) compressed-tensors are supported")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        field = f"quantization_config.config_groups.{name}.weights"
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(f"{field}: expected num_bits 8, type float; got "
                             f"{w.get('num_bits')!r}, {w.get('type')!r}")
        if w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{field}.strategy {w.get('strategy')!r}: expected channel or "
                             f"tensor")
    return Scheme(method, "weight_scale", None)


@dataclasses.dataclass(frozen=True)
class Fp8:
    """An HF-layout matrix (rows = outputs, cols = inputs) as FP8 codes and a scale per row
    and block of B columns: w[r, c] = fp8[r, c] * scale[r, c // B]."""

    fp8: np.ndarray  # float8_e4m3fn (rows, cols)
    scale: np.ndarray  # float32 (rows, cols / B)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.fp8.shape

    @property
    def block(self) -> int:
        return self.fp8.shape[-1] // self.scale.shape[-1]

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> Fp8:
        return Fp8(fn(self.fp8), fn(self.scale))

    def planes(self) -> dict[str, np.ndarray]:
        return {"fp8": self.fp8, "scale": self.scale}

    def __getitem__(self, index) -> Fp8:
        """Rows of it (a fused checkpoint tensor split: qkv_proj, gate_up_proj)."""
        return Fp8(self.fp8[index], self.scale[index])

    def with_block(self, block: int) -> Fp8:
        """The same weights in blocks of `block` columns (a divisor of the current one)."""
        if block == self.block:
            return self
        return Fp8(self.fp8, np.repeat(self.scale, self.block // block, axis=-1))

    def dequantize(self) -> np.ndarray:
        return dequantize_np(self.planes())


def from_checkpoint(name: str, codes: np.ndarray, scale: np.ndarray, scheme: Scheme) -> Fp8:
    """A checkpoint's FP8 weight `name` (codes (out, in)) and its scale tensor as `Fp8`."""
    if codes.dtype != CODE_DTYPE or codes.ndim != 2:
        raise ValueError(f"weight {name!r}: expected float8_e4m3fn (out, in) codes, got "
                         f"{codes.dtype} {codes.shape}")
    rows, cols = codes.shape
    scale = np.asarray(scale, np.float32)
    if scheme.block is not None:
        br, bc = scheme.block
        tiles = (-(-rows // br), -(-cols // bc))
        if scale.shape != tiles:
            raise ValueError(f"{name}_scale_inv has shape {scale.shape}, expected {tiles} "
                             f"for weight_block_size {list(scheme.block)}")
        b = math.gcd(bc, cols)
        # a tile's scale over its rows, and over the blocks of b columns it holds
        per_row = np.repeat(scale, br, axis=0)[:rows]
        return Fp8(codes, np.ascontiguousarray(np.repeat(per_row, bc // b, axis=1)[:, :cols // b]))
    if scale.size == 1:  # per tensor: one scale a row
        return Fp8(codes, np.full((rows, 1), scale.reshape(()), np.float32))
    if scale.shape not in ((rows, 1), (rows,)):
        raise ValueError(f"{name}_scale has shape {scale.shape}, expected ({rows}, 1) per "
                         f"channel or (1,) per tensor")
    return Fp8(codes, scale.reshape(rows, 1))


def assemble(tensors: dict[str, np.ndarray], scheme: Scheme) -> dict:
    """A checkpoint's tensors with each FP8 weight and its scale as one entry: `Fp8` for the
    layer projections (and experts), float32 for others (an embedding, a head). Drops the
    activation scales. A ValueError names a weight whose scale tensor is missing."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(("input_scale", "weight_scale", "weight_scale_inv")):
            continue
        if getattr(t, "dtype", None) != CODE_DTYPE:
            out[name] = t
            continue
        scale_name = name.removesuffix("weight") + scheme.scale_suffix
        if scale_name not in tensors:
            raise ValueError(f"FP8 weight {name!r} has no scale tensor {scale_name!r} "
                             f"(quantization_config.quant_method {scheme.method!r})")
        w = from_checkpoint(name, t, tensors[scale_name], scheme)
        layer = name.startswith("model.layers.") and (name.endswith("proj.weight")
                                                      or ".experts." in name)
        out[name] = w if layer else w.dequantize()
    return out


def is_fp8(w) -> bool:
    return isinstance(w, Mapping) and set(w) == set(PLANES)


def _broadcast(codes_shape: tuple[int, ...], scale_shape: tuple[int, ...]):
    """(codes' shape split into (scale length, block) on each blocked axis, the scale's shape
    with a 1 after each such length)."""
    split, scale = [], []
    for c, s in zip(codes_shape, scale_shape, strict=True):
        if s in (c, 1):
            split.append(c)
            scale.append(s)
        else:
            split += [s, c // s]
            scale += [s, 1]
    return split, scale


def dequantize(w: Mapping, dtype):
    """{"fp8", "scale"} (jax or numpy arrays) -> the weights in `dtype`: codes * scale formed
    in `dtype`, each scale over its block, row or whole weight. In that
    form (convert, multiply by a broadcast scale) XLA's GPU compiler fuses it into the dot
    (GPU_COMPILER_OPTIONS' sub-channel dequantisation fusion), where a float32 product
    converted after is made a weight apart. In float32 the product rounds once; in
    bfloat16 the scale rounds to 8 bits first, well inside FP8's own 4."""
    codes, scale = w["fp8"], w["scale"]
    split, s = _broadcast(codes.shape, scale.shape)
    wide = codes.astype(dtype).reshape(split) * scale.astype(dtype).reshape(s)
    return wide.reshape(codes.shape)


def dequantize_np(w: Mapping) -> np.ndarray:
    return dequantize({k: np.asarray(v) for k, v in w.items()}, np.float32)


def split_blocks(w: Mapping, axis: int, parts: int) -> dict:
    """FP8 weight `w` with its scale's blocks along `axis` made small enough to divide among
    `parts` devices (the same weights): blocks of gcd(block, length / parts)."""
    n, s = np.shape(w["fp8"])[axis], np.shape(w["scale"])[axis]
    if s == 1 or s % parts == 0:
        return dict(w)
    block = n // s
    finer = math.gcd(block, n // parts)
    scale = w["scale"]
    if not isinstance(scale, np.ndarray):  # traced: sharding.relayout_shapes
        import jax.numpy as np_like
    else:
        np_like = np
    return {"fp8": w["fp8"], "scale": np_like.repeat(scale, block // finer, axis)}


_FORCED = [False]


@contextlib.contextmanager
def in_step_on_cpu():
    """Within it, runners built on a CPU keep FP8 weights as such and dequantize them in the
    step, as on an accelerator (for tests of that path)."""
    _FORCED.append(True)
    try:
        yield
    finally:
        _FORCED.pop()


def expands_at_load(on_cpu: bool) -> bool:
    """Whether a runner expands FP8 weights at load: on a CPU, XLA:CPU has no FP8 matmul and
    dequantizing every step only costs time."""
    return on_cpu and not _FORCED[-1]


def expand_tree(tree: Mapping) -> tuple[int, int]:
    """Every FP8 weight of a nested dict replaced by its float32 weights, in place; returns
    (their bytes as FP8 codes and scales, their number of weights)."""
    held = count = 0
    for k, v in tree.items():
        if is_fp8(v):
            held += sum(np.asarray(a).nbytes for a in v.values())
            count += np.size(v["fp8"])
            tree[k] = dequantize_np(v)
        elif isinstance(v, dict):
            h, c = expand_tree(v)
            held, count = held + h, count + c
    return held, count


# A layer projection's block axis in a layer's own layout: the last of its inputs (wo's
# inputs are (N, H): its blocks lie within a head).
_BLOCK_AXIS = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 0, "w_up": 0, "w_down": 0}


def abstract_fp8(params, block: tuple[int, int] | None = (BLOCK, BLOCK)):
    """An abstract param tree (ShapeDtypeStructs, the loader's stacked "layers" layout) with
    its layer projections as the loader holds an FP8 checkpoint's: float8_e4m3fn codes and
    float32 scales of `block` tiles (None: per channel); embeddings, norms and the head as
    they are."""
    import jax

    def fp8_of(name, a):
        axis = 1 + _BLOCK_AXIS[name]  # after the layer axis
        cols = a.shape[axis]
        b = cols if block is None else math.gcd(block[1], cols)
        scale = list(a.shape)
        scale[axis] //= b
        return {"fp8": jax.ShapeDtypeStruct(a.shape, CODE_DTYPE),
                "scale": jax.ShapeDtypeStruct(tuple(scale), np.float32)}

    layers = {k: fp8_of(k, v) if k in _BLOCK_AXIS else v for k, v in params["layers"].items()}
    return {**params, "layers": layers}
