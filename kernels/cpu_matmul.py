"""Matmuls on weights kept in GGUF blocks, as a C++ kernel for CPUs called through XLA's FFI.

`kernels/quant.py` keeps a GGUF's projections as int8 codes with a float32 scale and minimum per
block of 32 inputs. The jnp path expands such a weight to float32 in memory before its dot, so
a step writes and reads the expanded weights on top of streaming the codes. The kernel
(`cpu/block_matmul.cc`) never makes float weights: it scales each block of 32 values of a row
of x to int16 and multiplies the codes on integers, two products per int32 lane (AVX-512
VNNI's vpdpwssd where the CPU has it, AVX2's vpmaddwd on half-width registers without it),
then applies the block's scales in float32. Scaling x moves each value by at most 2^-16 of
its block's largest; the engine's greedy tokens still equal HF transformers'
(tests/models/test_hf_equivalence.py).

The runner gives it Q4 weights in their nibble form (`pack`, quant.pack_nibbles): half the
bytes, each panel of 32 outputs one contiguous stream, and a pair of rows widened to int16 by a
zero-extension, a mask and a shift (Q4_K's with its super-block scales, `TARGET_NIBBLES_SUPER`);
six-bit codes (Q6_K's, Q5_0's) as nibbles plus top bits (quant.pack_six); other codes in their
pair form (quant.pack_pairs), one stream per panel too, with blocks of 32 rows of k or 16. A
scanned model's stack mixing Q6_K layers with others is split in two (`pack_weight`), each
layer read from its part (`split_matmul`). The file comment of `cpu/block_matmul.cc` says when
the kernel widens codes in registers and when it tiles.

Weights that multiply the same x go to the kernel as one group (`block_matmul_group`: a layer's
q, k and v, its gate and up): x is scaled once and all their panels are shared out in one pass,
where separate calls would each scale x and wait for the helper threads, which counts at a few
rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxserve.kernels import quant
from jaxserve.kernels.cpu_library import library

TARGET = "jaxserve_block_matmul"
TARGET_NIBBLES = "jaxserve_block_matmul_q4"  # the nibble form (quant.pack_nibbles)
TARGET_NIBBLES_F32 = "jaxserve_block_matmul_q4f"  # the same with float32 scales
TARGET_NIBBLES_SUPER = "jaxserve_block_matmul_q4k"  # with Q4_K's super-block scales
TARGET_PAIRS = "jaxserve_block_matmul_q8"  # the pair form (quant.pack_pairs)
TARGET_PAIRS_HALF = "jaxserve_block_matmul_q8h"  # the pair form of blocks of 16
TARGET_SIX = "jaxserve_block_matmul_q6"  # the six-bit form (quant.pack_six)
TARGET_SIX_HALF = "jaxserve_block_matmul_q6h"  # the six-bit form of blocks of 16 (Q6_K's)
PANEL = quant.PANEL  # columns of y per work item: N must be a multiple
GROUPED = "jaxserve_grouped_"  # + a form's target: experts' rows grouped (grouped_block_matmul)


def available() -> str | None:
    """Why the kernel cannot run here, or None."""
    lib = library()
    return lib if isinstance(lib, str) else None


def fits(w: Mapping, contract: int, shape: tuple[int, ...] | None = None,
         stacked: bool = False) -> bool:
    """Whether quantized weight `w` (of `shape`; the int8 form's own by default), contracted
    over its first `contract` axes, has a layout the kernel reads: int8 codes with float32
    scales, blocks along the last contracted axis (so the rows of k group into whole blocks)
    and a multiple of PANEL outputs; or the nibble form (quant.pack_nibbles) or the pair form
    (quant.pack_pairs) of that. `stacked`: every plane has a leading axis of layers."""
    if not quant.is_blocks(w):
        return False
    lead = 1 if stacked else 0
    planes = list(w.values())
    if stacked and len({a.shape[:1] for a in planes if a.ndim}) != 1:
        return False
    if quant.is_packed(w):
        if shape is None:
            return False
        k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
        if n % PANEL or k % quant.BLOCK:
            return False
        scales = (n // PANEL, k // quant.BLOCK, PANEL)
        if quant.is_nibbles(w) and "min" not in w:  # Q4_K's super-block scales
            return (w["q4"].dtype == jnp.uint32 and k % (quant.SUPER_BLOCKS * quant.BLOCK) == 0
                    and w["q4"].shape[lead:] == (n // PANEL, k // 2, PANEL // 4)
                    and w["scale"].dtype == jnp.float32
                    and w["scale"].shape[lead:] == (n // PANEL, k // (quant.SUPER_BLOCKS
                                                                     * quant.BLOCK),
                                                    quant.SUPER_WORDS))
        if quant.is_nibbles(w):  # uint32 words: 32 bytes of codes, 32 float16 scales a row
            return (w["q4"].dtype == jnp.uint32
                    and w["q4"].shape[lead:] == (n // PANEL, k // 2, PANEL // 4)
                    and any(all(w[p].dtype == dtype and w[p].shape[lead:] == form
                                for p in ("scale", "min"))
                            for dtype, form in ((jnp.uint32, (*scales[:2], PANEL // 2)),
                                                (jnp.float32, scales))))
        halves = (n // PANEL, k // quant.HALF_BLOCK, PANEL)
        if quant.is_six(w):  # words: 48 bytes of codes a pair of rows; no minima
            return (w["q6"].dtype == jnp.uint32
                    and w["q6"].shape[lead:] == (n // PANEL, k // 2, quant.SIX_PAIR_BYTES // 4)
                    and w["scale"].dtype == jnp.float32
                    and w["scale"].shape[lead:] in (scales, halves))
        return (w["q8"].dtype == jnp.uint32
                and w["q8"].shape[lead:] == (n // PANEL, k // 2, PANEL // 2)
                and any(all(w[p].dtype == jnp.float32 and w[p].shape[lead:] == form
                            for p in ("scale", "min")) for form in (scales, halves)))
    if w["scale"].dtype != jnp.float32 or (shape is not None
                                           and w["q"].shape[lead:] != tuple(shape)):
        return False
    if quant.block_of(w) != quant.BLOCK:  # blocks of 16 are read in the pair form alone
        return False
    outputs = math.prod(w["q"].shape[lead + contract:])
    return quant.block_axis(w) == lead + contract - 1 and outputs % PANEL == 0


def pack_weight(a, batch_dims: int = 0):
    """A quantized weight in the panels the kernel reads in one stream: the nibble form
    (quant.pack_nibbles; the same weights in half the bytes) where it holds them, else the
    six-bit form (quant.pack_six), else the pair form (quant.pack_pairs) where the outputs
    are whole panels; else (and any other param) as it is. `batch_dims`: leading axes of
    stacked layers. Blocks of 32 that one_block took as 16 go back to 32; a stack of layers
    mixing them with Q6_K's (a Q4_K_M file's ffn_down) is split in two stacks, each in its
    own form, with the slot of each layer (quant.split_by_block, quant.is_split)."""
    if not quant.is_blocks(a) or quant.is_packed(a):
        return a
    if quant.block_of(a) == quant.HALF_BLOCK:
        whole = quant.as_block32(a)
        split = quant.split_by_block(a) if whole is None and batch_dims == 1 else None
        if whole is not None:
            a = whole
        elif split is not None:
            slot, b32, b16 = split
            parts = {"b32": _pack_one(b32, 1), "b16": _pack_one(b16, 1)}
            if all(quant.is_packed(p) for p in parts.values()):
                return {"parts": parts, "slot": slot}
    return _pack_one(a, batch_dims)


def _pack_one(a, batch_dims: int):
    return (quant.pack_nibbles(a, batch_dims) or quant.pack_six(a, batch_dims)
            or quant.pack_pairs(a, batch_dims) or a)


def split_matmul(x: jax.Array, w: Mapping, contract: int, shape: tuple[int, ...],
                 layer: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """block_matmul with layer `layer` of a stack split by block length (pack_weight): the
    product runs on the part that holds the layer, at its slot there."""
    slot = w["slot"][layer]
    return jax.lax.cond(
        slot >= 0,
        lambda: block_matmul(x, w["parts"]["b32"], contract, shape, slot, rows),
        lambda: block_matmul(x, w["parts"]["b16"], contract, shape, -1 - slot, rows))


def pack(params, batch_dims: int = 0):
    """`params` with every quantized weight as pack_weight gives it."""
    return jax.tree.map(lambda a: pack_weight(a, batch_dims), params, is_leaf=quant.is_quantized)


def block_matmul(x: jax.Array, w: Mapping, contract: int = 1,
                 shape: tuple[int, ...] | None = None,
                 layer: jax.Array | int | None = None,
                 rows: jax.Array | None = None) -> jax.Array:
    """x (M, prod(shape[:contract])) float32 @ the weight `w` (a quantized dict, see
    kernels/quant.py) of `shape` (needed for the packed forms) -> (M, *shape[contract:])
    float32. With `layer`, `w` is a stack of layers' weights on a leading axis and the product
    is with layer `layer` of it, read in place: a scanned model passes its stacks whole
    instead of slicing (which XLA does as a copy of every layer's weights every step). With
    `rows` (an int32 scalar), only x's first `rows` rows are computed; the rest of y is 0."""
    return block_matmul_group(x, [w], contract, [shape], layer, rows)[0]


def _form(w: Mapping) -> tuple[str, list[str]]:
    """(the FFI target that reads `w`'s form, its planes in the kernel's order)."""
    if quant.is_nibbles(w) and "min" not in w:  # the minima are in the scale plane
        return TARGET_NIBBLES_SUPER, ["q4", "scale", "scale"]
    if quant.is_nibbles(w):
        target = TARGET_NIBBLES_F32 if w["scale"].dtype == jnp.float32 else TARGET_NIBBLES
        return target, ["q4", "scale", "min"]
    if quant.is_six(w):  # no minima: the kernel takes the scales in their place, unread
        target = TARGET_SIX if quant.pair_block(w) == quant.BLOCK else TARGET_SIX_HALF
        return target, ["q6", "scale", "scale"]
    if quant.is_packed(w):
        target = TARGET_PAIRS if quant.pair_block(w) == quant.BLOCK else TARGET_PAIRS_HALF
        return target, ["q8", "scale", "min"]
    return TARGET, ["q", "scale", "min"]


def _shapes(ws: Sequence[Mapping], shapes, stacked: bool) -> list:
    """One shape per weight of `ws`: as given, else (where None) the int8 form's own."""
    shapes = [None] * len(ws) if shapes is None else list(shapes)
    if not ws or len(shapes) != len(ws):
        raise ValueError(f"block_matmul_group needs one shape per weight, got {len(ws)} "
                         f"weights and {len(shapes)} shapes")
    return [tuple(w["q"].shape[int(stacked):])
            if s is None and isinstance(w, Mapping) and "q" in w else s
            for w, s in zip(ws, shapes, strict=True)]


def _unread(ws: Sequence[Mapping], contract: int, shapes: list, stacked: bool) -> str | None:
    """Why the kernel cannot read the weights `ws` of `shapes` in one call, or None. (The
    model asks of float weights too: not quantized dicts.)"""
    for w, shape in zip(ws, shapes, strict=True):
        if not fits(w, contract, shape, stacked):
            return (f"block_matmul cannot read a weight of planes {_describe(w)} as "
                    f"{'a stack of ' if stacked else ''}shape {shape} contracted over "
                    f"{contract} axes")
    targets = [_form(w)[0] for w in ws]
    if len(set(targets)) != 1:
        return f"block_matmul_group needs its weights in one form, got {targets}"
    return None


def block_matmul_group(x: jax.Array, ws: Sequence[Mapping], contract: int = 1,
                       shapes: Sequence[tuple[int, ...] | None] | None = None,
                       layer: jax.Array | int | None = None,
                       rows: jax.Array | None = None) -> list[jax.Array]:
    """[x @ w for w in ws] (as block_matmul, each w of its shape in `shapes`) in one call of
    the kernel: it scales x once and shares all the weights' panels out in one pass, where
    separate calls would each scale x and wait for the helper threads (a layer's q, k and v,
    or its gate and up, at a few rows). The weights must be in one form."""
    stacked = layer is not None
    shapes = _shapes(ws, shapes, stacked)
    why = _unread(ws, contract, shapes, stacked)
    if why:
        raise ValueError(why)
    why = available()
    if why:
        raise ValueError(f"the cpu block matmul kernel cannot run: {why}")
    k = math.prod(shapes[0][:contract])
    if any(math.prod(s[:contract]) != k for s in shapes):
        raise ValueError(f"block_matmul_group's weights contract different sizes: {shapes}")
    if x.ndim != 2 or x.shape[1] != k or x.dtype != jnp.float32:
        raise ValueError(f"block_matmul needs x of shape (M, {k}) float32, got {x.shape} "
                         f"{x.dtype}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], math.prod(s[contract:])), jnp.float32)
            for s in shapes]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if rows is not None:  # the kernel reads (layer, rows)
        index = jnp.stack([index, jnp.asarray(rows, jnp.int32)])
    ys = jax.ffi.ffi_call(_form(ws[0])[0], outs)(x, index,
                                                 *_planes(ws, [o.shape[1] for o in outs]))
    return [y.reshape(x.shape[0], *s[contract:]) for y, s in zip(ys, shapes, strict=True)]


def _planes(ws: Sequence[Mapping], outputs: Sequence[int]) -> list[jax.Array]:
    """Each weight's planes in the kernel's order, any stacked axes merged into the first: the
    kernel takes a stack of L layers' (or experts') worth, (L K, N) int8 and (L K / 32, N)
    float32 x 2 in the int8 form (N = `outputs`, the weight's output axes together), (L N /
    32, ...) in the packed ones."""
    planes = []
    for w, n in zip(ws, outputs, strict=True):
        for p in _form(w)[1]:
            a = w[p]
            planes.append(a.reshape(-1, *a.shape[-2:]) if quant.is_packed(w)
                          else a.reshape(-1, n))
    return planes


def _outputs(w: Mapping) -> int:
    """N of a quantized weight whose last axis is its outputs (int8 form) or in panels."""
    if quant.is_packed(w):
        return w["scale"].shape[-3] * PANEL
    return w["q"].shape[-1]


def grouped_block_matmul(x: jax.Array, ws: Sequence[Mapping], sizes: jax.Array,
                         first: jax.Array | int = 0) -> list[jax.Array]:
    """A mixture's experts (models/moe.py) on weights kept in blocks: x (M, K) float32, its
    rows sorted by expert, sizes (E,) int32 the rows of each expert in turn; each w a stack
    of experts' (S..., K, N) weights in one form (several layers' stacks merge). -> [(M, N)
    per w]: each row times its expert's weight, the experts being stack entries [first,
    first + E); rows past sum(sizes) are zeros. One call shares every expert's panels out
    over the threads; no weight is expanded."""
    why = _grouped_unread(x, ws, sizes) or available()
    if why:
        raise ValueError(f"grouped_block_matmul: {why}")
    ns = [_outputs(w) for w in ws]
    outs = [jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32) for n in ns]
    return jax.ffi.ffi_call(GROUPED + _form(ws[0])[0].removeprefix("jaxserve_"), outs)(
        x, jnp.asarray(first, jnp.int32), sizes.astype(jnp.int32), *_planes(ws, ns))


def grouped_block_matmul_or_none(x: jax.Array, ws: Sequence[Mapping], sizes: jax.Array,
                                 first: jax.Array | int = 0) -> list[jax.Array] | None:
    """grouped_block_matmul where it reads x and every w, else None."""
    if _grouped_unread(x, ws, sizes):
        return None
    return grouped_block_matmul(x, ws, sizes, first)


def _grouped_unread(x: jax.Array, ws: Sequence[Mapping], sizes: jax.Array) -> str | None:
    """Why grouped_block_matmul cannot read x and the weights `ws` in one call, or None."""
    if x.ndim != 2 or x.dtype != jnp.float32 or sizes.ndim != 1 or not ws:
        return (f"needs x (M, K) float32, sizes (E,) and weights, got {x.shape} {x.dtype}, "
                f"{sizes.shape} and {len(ws)} weights")
    for w in ws:
        if not quant.is_blocks(w):
            return f"cannot read a weight of {_describe(w)}"
        flat = {p: a.reshape(-1, *a.shape[-(3 if quant.is_packed(w) else 2):])
                for p, a in w.items()}
        if not fits(flat, 1, (x.shape[1], _outputs(w)), stacked=True):
            return f"cannot read a weight of planes {_describe(w)} for x of shape {x.shape}"
    if len({_form(w)[0] for w in ws}) != 1:
        return "needs its weights in one form"
    return None


def _describe(w) -> object:
    if isinstance(w, Mapping):
        return {k: (a.shape, a.dtype.name) for k, a in w.items()}
    return type(w).__name__


def block_matmul_or_none(x: jax.Array, ws: Sequence[Mapping], contract: int = 1,
                         shapes: Sequence[tuple[int, ...] | None] | None = None,
                         layer: jax.Array | int | None = None,
                         rows: jax.Array | None = None) -> list[jax.Array] | None:
    """block_matmul_group where x and every w are what it reads, in one form, else None
    (models/llama.py's BlockMatmulFn: the step then expands the weights and runs the dots)."""
    if x.dtype != jnp.float32 or not ws:
        return None
    if any(quant.is_split(w) for w in ws):  # alone, at a layer: split_matmul
        if len(ws) != 1 or layer is None or shapes is None:
            return None
        return [split_matmul(x, ws[0], contract, shapes[0], layer, rows)]
    shapes = _shapes(ws, shapes, layer is not None)
    if _unread(ws, contract, shapes, layer is not None):
        return None
    return block_matmul_group(x, ws, contract, shapes, layer, rows)
