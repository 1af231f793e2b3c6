"""GGUF blocks read by the matmul on a GPU: the codes stream from memory as they are and are
dequantized in registers, a block at a time, right before the tile's dot.

XLA:GPU fuses a convert of the weight, and a scale per output column, into its GEMM, but not a
scale per block of 32 along the contraction (kernels/quant.py's int8 form): it writes the
dequantized bfloat16 weight to memory and reads it back, more bytes than a bfloat16 model.
So off the CPU the layer projections take the form `gpu_form` makes, which this module's
kernel reads:

    {"g8": int8 (K, N), "scale": (K / B, N)[, "min": (K / B, N)]}   w = g8 * scale + min
    {"g4": (K / 2, N) nibbles, "scale", ["min"]}  row k's code in the low nibble of byte
                                                  k, row K / 2 + k's in its high nibble

with K the weight's contracted axes flattened, N its output axes, B (32, or Q6_K's 16) values
per block. Nibbles are signed (int8 bytes, two's complement: Q4_0's -8..7) or not (uint8:
Q4_1's and Q4_K's 0..15). The scale is float16 where that holds every one exactly (GGUF's d
is a float16: Q8_0, Q4_0, Q5_0), else float32 (a K-quant's d * sc); the minimum is dropped
where every one is 0 (Q8_0, Q4_0, Q6_K), else kept in the scale's dtype if that holds it
exactly. So Q8_0 streams 1.06 bytes a weight, Q4_0 0.56, Q4_K 0.75, where bfloat16 takes 2.

Each weight is the same number the int8 form gives (q * scale + min in float32, one rounding,
then the compute dtype): the kernel and `dequantize` both form it so.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxserve.kernels import quant

try:  # deprecated in JAX 0.11, and gone from later JAX
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the JAX
    plgpu = None

MIN_DOT = 16  # Triton's smallest dot: rows of x are padded up to it


def is_gpu_form(w) -> bool:
    return isinstance(w, Mapping) and ("g8" in w or "g4" in w)


def block_of(w: Mapping) -> int:
    """Values per block of a weight in the GPU form: 32, or 16."""
    rows = w["g8"].shape[-2] if "g8" in w else 2 * w["g4"].shape[-2]
    return rows // w["scale"].shape[-2]


def _exact_as(a: np.ndarray, dtype) -> bool:
    return bool(np.array_equal(a.astype(dtype).astype(np.float32), a))


def gpu_form(w: Mapping, batch_dims: int = 0) -> dict[str, np.ndarray] | None:
    """An int8-form weight (numpy; its first `batch_dims` axes stacked layers), contracted
    over its axes up to and including the block axis, in the GPU form (module doc), or None
    where its blocks run along a stacked axis. Codes that fit a nibble are packed two to a
    byte where K holds an even number of blocks."""
    q, scale, minimum = (np.asarray(w[k]) for k in quant.PLANES)
    ax = quant.block_axis(w)
    lead = q.shape[:batch_dims]
    k = math.prod(q.shape[batch_dims:ax + 1])
    if ax < batch_dims:
        return None
    two = lambda a: a.reshape(*lead, -1, math.prod(a.shape[ax + 1:]))  # noqa: E731
    q, scale, minimum = two(q), two(scale), two(minimum)
    out = {}
    lo, hi = int(q.min(initial=0)), int(q.max(initial=0))
    halves = k % (2 * quant.block_of(w)) == 0  # nibbles pair row k with row K / 2 + k
    if halves and (-8 <= lo < 0 and hi <= 7 or lo >= 0 and hi <= 15):
        unsigned = lo >= 0
        codes = q.astype(np.uint8 if unsigned else np.int8).view(np.uint8) & 15
        half = q.shape[-2] // 2
        packed = codes[..., :half, :] | (codes[..., half:, :] << 4)
        out["g4"] = packed.astype(np.uint8) if unsigned else packed.view(np.int8)
    else:
        out["g8"] = q.astype(np.int8)
    dtype = np.float16 if _exact_as(scale, np.float16) else np.float32
    out["scale"] = scale.astype(dtype)
    if np.any(minimum):
        out["min"] = minimum.astype(dtype if _exact_as(minimum, dtype) else np.float32)
        if out["min"].dtype != dtype:
            out["scale"] = scale
    return out


def to_gpu_forms(params: dict) -> dict:
    """A step's param tree (runner layout: "layers_i", or "layers" stacked on a leading axis)
    with each layer projection in the int8 form that `gpu_form` takes in that form, in place,
    a weight at a time; a mixture's experts ("moe") and traced (abstract) weights as they
    were. Returns `params`."""
    for key, layer in params.items():
        if not (key == "layers" or key.startswith("layers_")) or not isinstance(layer, dict):
            continue
        for name, w in layer.items():
            if (isinstance(w, Mapping) and set(w) == set(quant.PLANES)
                    and all(isinstance(w[k], np.ndarray) for k in quant.PLANES)):
                form = gpu_form(w, batch_dims=int(key == "layers"))
                if form is not None:
                    layer[name] = form
    return params


# ----------------------------------------------------------------------------------- kernel body


def _kernel(x_ref, g_ref, s_ref, *refs, bm: int, bn: int, block: int, nibbles: bool,
            has_min: bool):
    # x_ref (M, K); g_ref (K, N) int8 or (K / 2, N) nibbles; s_ref, m_ref (K / B, N);
    # o_ref (M, N). This program: rows from program_id(0) * bm, outputs from
    # program_id(1) * bn; it walks K a block (B rows) at a time.
    m_ref, o_ref = refs if has_min else (None, refs[0])
    rows = pl.ds(pl.program_id(0) * bm, bm)
    cols = pl.ds(pl.program_id(1) * bn, bn)
    steps = s_ref.shape[0] // 2 if nibbles else s_ref.shape[0]  # blocks per pass over g_ref

    def weights(c, j):  # codes (B, bn) of block row j -> (B, bn) in x's dtype
        w = c.astype(jnp.float32) * s_ref[pl.ds(j, 1), cols].astype(jnp.float32)
        if has_min:
            w = w + m_ref[pl.ds(j, 1), cols].astype(jnp.float32)
        return w.astype(x_ref.dtype)

    def dot(acc, k, c, j):
        x = x_ref[rows, pl.ds(k * block, block)]  # (bm, B)
        return acc + jnp.dot(x, weights(c, j), preferred_element_type=jnp.float32)

    def body(j, acc):
        g = g_ref[pl.ds(j * block, block), cols]  # (B, bn)
        if not nibbles:
            return dot(acc, j, g, j)
        if g.dtype == jnp.int8:
            lo, hi = (g << 4) >> 4, g >> 4
        else:
            lo, hi = g & 15, g >> 4
        return dot(dot(acc, j, lo, j), steps + j, hi, steps + j)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[rows, cols] = acc.astype(o_ref.dtype)


# ----------------------------------------------------------------------------- pallas_call build


def _tile(n: int, most: int) -> int | None:
    """The largest power of two <= most dividing n, at least MIN_DOT."""
    t = most
    while t >= MIN_DOT:
        if n % t == 0:
            return t
        t //= 2
    return None


def _build(m: int, n: int, bm: int, bn: int, dtype, *, block: int, nibbles: bool,
           has_min: bool, interpret: bool):
    kernel = functools.partial(_kernel, bm=bm, bn=bn, block=block, nibbles=nibbles,
                               has_min=has_min)
    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=3)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(m // bm, n // bn),
        interpret=interpret,
        compiler_params=params,
        name="gguf_block_matmul",
    )


# ---------------------------------------------------------------------------------- public entry


def fits(w: Mapping) -> bool:
    """Whether the kernel reads GPU-form weight `w` (2-D planes): outputs in tiles of 16."""
    return _tile(w["scale"].shape[-1], 128) is not None and w["scale"].ndim == 2


@functools.partial(jax.jit, static_argnames=("interpret",))
def block_matmul(x: jax.Array, w: Mapping, interpret: bool = False) -> jax.Array:
    """x (M, K) @ GPU-form weight w (K, N) -> (M, N) in x's dtype, float32 accumulation.

    Raises ValueError where w's planes do not match x's K or the kernel cannot tile N."""
    block, nibbles = block_of(w), "g4" in w
    k, n = w["scale"].shape[0] * block, w["scale"].shape[1]
    if x.ndim != 2 or x.shape[1] != k or not fits(w):
        raise ValueError(f"block_matmul: x {x.shape} and a weight of {k} x {n} in blocks of "
                         f"{block} (outputs in tiles of {MIN_DOT} or more)")
    m = x.shape[0]
    bm = min(64, max(MIN_DOT, 1 << (m - 1).bit_length()))
    padded = -(-m // bm) * bm
    xp = jnp.pad(x, ((0, padded - m), (0, 0))) if padded != m else x
    planes = [w["g4" if nibbles else "g8"], w["scale"]] + ([w["min"]] if "min" in w else [])
    call = _build(padded, n, bm, _tile(n, 128), x.dtype, block=block, nibbles=nibbles,
                  has_min="min" in w, interpret=interpret)
    return call(xp, *planes)[:m]


def block_matmul_reference(x: jax.Array, w: Mapping) -> jax.Array:
    """The same product in plain jnp: the weight dequantized (as `dequantize` does), one dot."""
    return x @ dequantize(w, x.dtype)


def dequantize(w: Mapping, dtype) -> jax.Array:
    """A GPU-form weight's (..., K, N) weights in `dtype`, formed as the int8 form's are."""
    return quant.dequantize(w, dtype)


def matmul(x: jax.Array, w: Mapping) -> jax.Array:
    """x (M, K) @ GPU-form w: the kernel when lowered for a GPU, the reference elsewhere."""
    if plgpu is None or not fits(w):
        return block_matmul_reference(x, w)
    return jax.lax.platform_dependent(
        x, w, cuda=lambda x, w: block_matmul(x, w), default=block_matmul_reference)
