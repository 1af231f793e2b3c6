"""Block-quantized weights kept as they come in a GGUF file, dequantized inside the step.

GGUF's simple block types store a matrix row by row in blocks of 32 values along the row (the
input dimension of the projection); each block has a float16 scale d, some a float16 minimum m,
and 32 small integers q:

    Q8_0  w = d * q          q int8 in [-128, 127]
    Q4_0  w = d * (q - 8)    q a nibble
    Q4_1  w = d * q + m      q a nibble
    Q5_0  w = d * (q - 16)   q 5 bits (a nibble plus one bit of a 32-bit word per block)
    Q5_1  w = d * q + m      q 5 bits

The K-quants Q4_K and Q5_K group 8 such blocks into a super-block of 256 with float16 d and
dmin, and give each block 6-bit integers sc and m: w = (d * sc) * q - dmin * m, q a nibble
(Q4_K) or 5 bits (Q5_K). Their blocks are kept the same way, with scale d * sc and minimum
-(dmin * m): both products are exact in float32 (11 by 6 significant bits), so they are block
types of float32 scales. Q6_K's super-block has 16 sub-blocks of 16 values, w = (d * sc) * q
with sc an int8 and q in [-32, 31]: kept as blocks of 16 (scale d * sc, exact, minimum 0).
A stack of layers mixing Q6_K with other types takes the others as blocks of 16 too (each
scale and minimum twice: the same weights); the CPU kernel's packing splits such a stack
back into one of each block length (`split_by_block`). The other types (Q2_K, Q3_K, IQ*,
TQ*, ...) are expanded to float32 at load (models/loader.py warns with the bytes that costs).

We keep q as int8 (the nibble types shifted to their signed value) and d, m as float32, and form
w = q * d + m in float32 inside the jitted step, right before the matmul that reads it. This is
bit-exact: d has 11 significant bits and |q| <= 128 (a K-quant's d * sc 17 bits and q < 32),
so q * d is exact in float32 and the one rounding is in "+ m", the same single rounding the
dequantized-to-float32 weights went through. The model therefore computes on identical
weights, while the step streams about a quarter of the bytes (1 + 8/32 per weight instead of
4), and under `lax.scan` slices a quarter of them out of the layer stacks.

A quantized weight is a dict {"q", "scale", "min"} (plain dicts, so the cache, jax.tree and the
sharding specs see three arrays). In any layout the three planes have the weight's rank; the
block axis is the one where scale is 32x shorter than q.

`pack_nibbles` gives a second form of the same weight, {"q4", "scale", "min"}, made for the
CPU block matmul (kernels/cpu_matmul.py): a nibble type's codes two to a byte and scale and min
as float16 (GGUF's own width) where that holds them, else as float32 (Q4_K's, d times a 6-bit
sub-scale), laid out panel by panel of 32 outputs in the order the kernel reads them
(kernels/cpu/block_matmul.cc describes it), held as uint32 words. It holds the same numbers
in half the bytes (0.625 per weight instead of 1.25; 0.75 with float32 scales) and one
contiguous stream per panel. Its planes no longer have the weight's shape, so reading it back
(`unpack_nibbles`, `dequantize`) takes that shape.

Q4_K's scales and minima in that form can be held as the file has them instead: per
super-block of 256 rows d and dmin, per block the 6-bit sc and m (0.09 bytes a weight where
float32 scales and minima take 0.25). `pack_six` gives codes in [-32, 31] without minima
(Q6_K's, Q5_0's) a form of nibbles plus a plane of their top two bits (0.75 bytes a weight
and no minimum plane, where the pair form takes 1 plus scales and minima).

`pack_pairs` gives the same kind of form to codes that do not fit nibbles (Q8_0's, such as the
head's): {"q8", "scale", "min"}, each pair of rows of a panel's int8 codes interleaved the way
the kernel's products read them (so widening them is one sign extension) and float32 scales
and minima, panel by panel; the same bytes as the int8 form, one contiguous stream per panel
instead of rows a whole weight's width apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from jaxserve.kernels import fp8

BLOCK = 32
HALF_BLOCK = 16  # Q6_K's scales cover 16 values: blocks of 16 along the same axis
PLANES = ("q", "scale", "min")
NIBBLE_PLANES = ("q4", "scale", "min")  # pack_nibbles' form
PAIR_PLANES = ("q8", "scale", "min")  # pack_pairs' form
SIX_PLANES = ("q6", "scale")  # pack_six's form: no minimum
NIBBLE_SUPER_PLANES = ("q4", "scale")  # pack_nibbles' form of Q4_K's: minima in the scales
GPU_FORMS = ({"g8", "scale"}, {"g8", "scale", "min"}, {"g4", "scale"}, {"g4", "scale", "min"})
SIX_PAIR_BYTES = 48  # a pair of rows of a panel in pack_six's form: 32 of nibbles, 16 of tops
PANEL = 32  # outputs per panel of the nibble form: the CPU block matmul's work item


@dataclasses.dataclass(frozen=True)
class Blocks:
    """An HF-layout matrix (rows = outputs, cols = inputs) in GGUF blocks of B (32, or 16
    for Q6_K's) along the columns: w[r, c] = q[r, c] * scale[r, c // B] + min[r, c // B]."""

    q: np.ndarray  # int8 (rows, cols)
    scale: np.ndarray  # float32 (rows, cols / B)
    min: np.ndarray  # float32 (rows, cols / B)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> Blocks:
        """The same re-layout applied to every plane (fn must leave the block axis as -1 or
        otherwise independent of its length)."""
        return Blocks(*(fn(getattr(self, k)) for k in PLANES))

    def planes(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in PLANES}

    def __getitem__(self, index) -> Blocks:
        """Rows (or, for a stack of matrices such as a GGUF's experts, matrices) of it."""
        return Blocks(*(getattr(self, k)[index] for k in PLANES))

    def dequantize(self) -> np.ndarray:
        return dequantize_np(self.planes())

    @property
    def block(self) -> int:
        return block_of(self.planes())

    def halved(self) -> Blocks:
        """The same weights in blocks of 16: each scale and minimum twice."""
        if self.block == HALF_BLOCK:
            return self
        return Blocks(self.q, *(np.repeat(a, 2, axis=-1) for a in (self.scale, self.min)))


def one_block(blocks: list[Blocks]) -> list[Blocks]:
    """Weights to stack, in one block length: where some are Q6_K's blocks of 16 (a Q4_K_M
    file's `ffn_down` and `attn_v` mix them with Q4_K layers), all of them as blocks of 16."""
    if len({b.block for b in blocks}) > 1:
        return [b.halved() for b in blocks]
    return blocks


def as_block32(w: Mapping) -> dict[str, np.ndarray] | None:
    """An int8-form weight (numpy) in blocks of 16 whose scales and minima come in equal
    pairs (one_block's halved blocks of 32) back in blocks of 32, else None."""
    ax = block_axis(w)
    if block_of(w) != HALF_BLOCK:
        return None
    pairs = {}
    for name in ("scale", "min"):
        a = np.asarray(w[name])
        even, odd = np.take(a, range(0, a.shape[ax], 2), ax), np.take(a, range(1, a.shape[ax], 2),
                                                                         ax)
        if not np.array_equal(even, odd):
            return None
        pairs[name] = even
    return {"q": w["q"], **pairs}


def split_by_block(w: Mapping) -> tuple[np.ndarray, dict, dict] | None:
    """A stack of layers (axis 0) in blocks of 16 mixing Q6_K's with other types' blocks of
    32 taken twice (one_block's): (slot (L,) int32, the stack of the layers that are blocks of
    32, as such, the stack of the others), slot[l] being layer l's entry in the first stack,
    or -1 - its entry in the second; None where the layers are not such a mixture."""
    layers = [as_block32({k: np.asarray(a)[i] for k, a in w.items()})
              for i in range(np.shape(w["q"])[0])]
    whole = [i for i, b in enumerate(layers) if b is not None]
    halves = [i for i, b in enumerate(layers) if b is None]
    if not whole or not halves:
        return None
    slot = np.empty(len(layers), np.int32)
    slot[whole] = np.arange(len(whole))
    slot[halves] = -1 - np.arange(len(halves))
    return (slot, {k: np.stack([layers[i][k] for i in whole]) for k in PLANES},
            {k: np.asarray(w[k])[halves] for k in PLANES})


def is_split(w) -> bool:
    """A stack split by block length (cpu_matmul.pack_weight of split_by_block's parts):
    {"parts": {"b32": ..., "b16": ...}, "slot": (L,) int32}."""
    return isinstance(w, Mapping) and set(w) == {"parts", "slot"}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) uint8 -> (n, 32) uint8: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _half(raw: np.ndarray) -> np.ndarray:
    """(n, 2) bytes of float16 -> (n,) float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[:, 0]


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian word -> (n, 32) uint8: bit i of the word, shifted to 16."""
    word = np.ascontiguousarray(qh).view("<u4")  # (n, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes -> its 8 sub-blocks' 6-bit scales and minima, (n, 8)
    each: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minima), 4-7 in the
    nibbles of bytes 8-11 with their top 2 bits in the spare top bits of bytes 0-7."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    minima = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales.astype(np.float32), minima.astype(np.float32)


def _k_codes(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32) low nibbles of a K-quant super-block: each 32 bytes hold
    two sub-blocks, the first in the low nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)


def _decode_block32(blocks: np.ndarray, type_name: str):
    """A 32-value type's blocks (n, bytes) -> codes (n, 32), scale (n,), minimum (n,)."""
    d = _half(blocks[:, :2])
    zero = np.zeros_like(d)
    if type_name == "Q8_0":
        return blocks[:, 2:].copy().view(np.int8), d, zero
    if type_name == "Q4_0":
        return _nibbles(blocks[:, 2:]).astype(np.int16) - 8, d, zero
    if type_name == "Q4_1":
        return _nibbles(blocks[:, 4:]), d, _half(blocks[:, 2:4])
    if type_name == "Q5_0":
        return (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int16) - 16, \
            d, zero
    # Q5_1
    return _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8]), d, _half(blocks[:, 2:4])


def _decode_k(blocks: np.ndarray, type_name: str):
    """A K-quant's super-blocks of 256 (n, bytes) -> its 8 sub-blocks of 32 each as codes
    (8n, 32), scale d * sc (8n,) and minimum -(dmin * m) (8n,): both products exact in
    float32 (11 by 6 significant bits), so q * scale + min rounds once, as gguf's does."""
    d, dmin = _half(blocks[:, 0:2])[:, None], _half(blocks[:, 2:4])[:, None]
    sc, m = _k_scales(blocks[:, 4:16])
    q = _k_codes(blocks[:, -128:])
    if type_name == "Q5_K":  # bit s of byte i of qh: the fifth bit of value i of sub-block s
        qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
    return q.reshape(-1, BLOCK), (d * sc).reshape(-1), (-(dmin * m)).reshape(-1)


def _decode_q6_k(blocks: np.ndarray, type_name: str):
    """Q6_K's super-blocks of 256 (n, 210 bytes: 128 of low nibbles, 64 of high 2-bit pairs,
    16 int8 scales, float16 d) -> 16 sub-blocks of 16 each: codes (16n, 16) in [-32, 31],
    scale d * sc (16n,) (exact: 11 by 8 significant bits), minimum 0. Each half of 128 values
    takes 64 bytes of low nibbles (values 0-63 low, 64-127 high) and 32 bytes of high bits
    (values 32j + i in bits 2j and 2j + 1 of byte i)."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1)
    q = ((low & 15).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)).astype(np.int16)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # (n, 16)
    d = _half(blocks[:, 208:210])[:, None]
    scale = (d * sc).reshape(-1)
    return (q - 32).reshape(-1, HALF_BLOCK), scale, np.zeros_like(scale)


BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # blocks of 32 values
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256: sub-blocks of 32 (Q6_K's of 16)
KEPT_TYPES = BLOCK_TYPES + K_TYPES
SUPER = 256
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176,
          "Q6_K": 210}


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Blocks | None:
    """A GGUF tensor's raw bytes (rows, bytes per row) as Blocks of HF shape (rows, cols), or
    None for a type this module does not keep (it is then dequantized to float32 at load)."""
    kept = type_name in KEPT_TYPES
    per_block = SUPER if type_name in K_TYPES else BLOCK
    if not kept or len(shape) != 2 or shape[1] % per_block:
        return None
    rows, cols = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per_block,
                                                                _BYTES[type_name])
    decoder = (_decode_q6_k if type_name == "Q6_K" else
               _decode_k if type_name in K_TYPES else _decode_block32)
    q, d, m = decoder(blocks, type_name)
    block = q.shape[-1]
    return Blocks(q.astype(np.int8).reshape(rows, cols), d.reshape(rows, cols // block),
                  m.astype(np.float32).reshape(rows, cols // block))


def is_blocks(w) -> bool:
    """A weight in GGUF's blocks, in any of this module's forms."""
    return isinstance(w, Mapping) and set(w) in (set(PLANES), set(NIBBLE_PLANES),
                                                  set(PAIR_PLANES), set(SIX_PLANES),
                                                  set(NIBBLE_SUPER_PLANES), *GPU_FORMS)


def is_quantized(w) -> bool:
    """A weight kept quantized: GGUF's blocks or FP8 codes (kernels/fp8.py)."""
    return is_blocks(w) or fp8.is_fp8(w)


def is_nibbles(w: Mapping) -> bool:
    return "q4" in w


def is_pairs(w: Mapping) -> bool:
    return "q8" in w


def is_six(w: Mapping) -> bool:
    return "q6" in w


def pair_block(w: Mapping) -> int:
    """Values per block of a weight in the pair or six-bit form: 32, or 16 (its scale plane
    is (..., N / 32, K / B, 32) and its codes (..., N / 32, K / 2, W) words)."""
    return 2 * w["q6" if is_six(w) else "q8"].shape[-2] // w["scale"].shape[-2]


def is_packed(w: Mapping) -> bool:
    """In one of the kernel's panel forms (nibbles, pairs or six bits), which need the
    weight's shape."""
    return is_nibbles(w) or is_pairs(w) or is_six(w)


def block_axis(w: Mapping) -> int:
    """The axis along which scale is 32 (or 16) times shorter than q (the int8 form)."""
    q, s = w["q"].shape, w["scale"].shape
    axes = [i for i, (a, b) in enumerate(zip(q, s, strict=True)) if a != b]
    if len(axes) != 1 or q[axes[0]] not in (s[axes[0]] * BLOCK, s[axes[0]] * HALF_BLOCK):
        raise ValueError(f"quantized weight planes of shapes q {q} and scale {s} do not "
                         f"differ by {BLOCK}x (or {HALF_BLOCK}x) along exactly one axis")
    return axes[0]


def block_of(w: Mapping) -> int:
    """Values per block of an int8-form weight: 32, or 16."""
    ax = block_axis(w)
    return w["q"].shape[ax] // w["scale"].shape[ax]


def _dequantize(w: Mapping, xp):
    """q * scale + min in float32, with xp (numpy or jax.numpy) broadcasting each block's scale
    and minimum over its values."""
    ax, block = block_axis(w), block_of(w)
    q = w["q"]
    split = q.shape[:ax] + (q.shape[ax] // block, block) + q.shape[ax + 1:]
    s, m = xp.expand_dims(w["scale"], ax + 1), xp.expand_dims(w["min"], ax + 1)
    return (q.reshape(split).astype(np.float32) * s + m).reshape(q.shape)


def pack_nibbles(w: Mapping, batch_dims: int = 0) -> dict[str, np.ndarray] | None:
    """A quantized weight {"q", "scale", "min"} (numpy; its first `batch_dims` axes stacked
    layers) in the nibble form, or None where that would not hold the same weights exactly:
    codes spanning more than 16 values, or outputs that are not whole panels of 32. Q4_1's
    codes (0-15) pack as they are; Q4_0's (-8-7, no minimum) as code + 8 with minimum -8 *
    scale (q * d and (q + 8) * d - 8 * d are both exact in float32, so the weights are too).

    The weight contracts over its axes up to the block axis (K rows of inputs) into N
    outputs. Per stacked layer: q4 (N / 32, K / 2, 32) bytes, scale and min (N / 32, K / 32,
    32) float16, each held as uint32 words (last axis 8, 16, 16): XLA:CPU slices a scanned
    model's layer out of the stacks a word at a time, much faster than byte by byte. Scales
    and minima float16 does not hold exactly stay float32 (N / 32, K / 32, 32)."""
    dims = _panel_dims(w, batch_dims)
    if dims is None or block_of(w) != BLOCK:
        return None
    q, lead, k, n = dims
    scale = np.asarray(w["scale"], np.float32)
    minimum = np.asarray(w["min"], np.float32)
    lo, hi = int(q.min(initial=0)), int(q.max(initial=0))
    if lo >= 0 and hi <= 15:
        offset = 0
    elif lo >= -8 and hi <= 7 and not minimum.any():
        offset = -8
    else:
        return None
    minimum = minimum + np.float32(offset) * scale
    scales = {"scale": scale.astype(np.float16), "min": minimum.astype(np.float16)}
    if not (np.array_equal(scales["scale"].astype(np.float32), scale)
            and np.array_equal(scales["min"].astype(np.float32), minimum)):
        supers = _super_scales(scale, minimum, lead, k, n)  # Q4_K's, as the file has them
        scales = {"scale": supers} if supers is not None else {"scale": scale, "min": minimum}
    q4 = np.empty((*lead, n // PANEL, k // 2, PANEL), np.uint8)
    for i in np.ndindex(*lead):  # a layer at a time: the temporaries stay one layer's size
        u = (q[i].astype(np.int16) - offset).astype(np.uint8)
        # (kp, e, p, h, c) -> (p, kp, h, c, e): row 2kp + e, column 32p + 16h + c; byte
        # j = 2c + e of a pair of rows holds the codes of h = 0 (low nibble) and h = 1 (high).
        u = u.reshape(k // 2, 2, n // PANEL, 2, PANEL // 2).transpose(2, 0, 3, 4, 1)
        u = u.reshape(n // PANEL, k // 2, 2, PANEL)
        q4[i] = u[..., 0, :] | (u[..., 1, :] << 4)

    planes = {"q4": q4, **{name: a if a.shape[-1] == SUPER_WORDS else
                           _scale_panels(a, lead, k, n) for name, a in scales.items()}}
    return {name: a.view(np.uint32) if a.dtype != np.float32 else a
            for name, a in planes.items()}


SUPER_BLOCKS = 8  # blocks of 32 in a K-quant's super-block
SUPER_WORDS = 2 * PANEL + 2 * SUPER_BLOCKS * PANEL // 4  # pack_nibbles' super-block scales


def _factor(a: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(R, 8) float32 products, each row some d times 6-bit integers -> (d (R,) float32,
    codes (R, 8) uint8) with d * codes == a exactly, else None. A K-quant's largest
    sub-scale is usually 63 (llama.cpp's quantizer picks d so); other divisors are tried for
    the rows that are not so."""
    top = np.take_along_axis(a, np.abs(a).argmax(axis=1)[:, None], 1)[:, 0]
    d, codes = np.zeros(len(a), np.float32), np.zeros(a.shape, np.uint8)
    todo = np.arange(len(a))
    for div in range(63, 0, -1):
        cand = top[todo] / np.float32(div)
        c = np.rint(a[todo] / np.where(cand == 0, np.float32(1), cand)[:, None])
        ok = ((c >= 0) & (c <= 63) & (c * cand[:, None] == a[todo])).all(axis=1)
        d[todo[ok]], codes[todo[ok]] = cand[ok], c[ok]
        todo = todo[~ok]
        if not len(todo):
            return d, codes
    return None


def _super_scales(scale: np.ndarray, minimum: np.ndarray, lead: tuple, k: int,
                  n: int) -> np.ndarray | None:
    """Q4_K's float32 block scales and minima (..., K / 32, N) as the products they are, d *
    sc and -dmin * m, held as such: per stacked layer (N / 32, K / 256, SUPER_WORDS) float32,
    per panel and super-block d (32 columns), -dmin (32), then the sub-scales sc (8 blocks x
    32 bytes) and sub-minima m (8 x 32), the bytes as float32 words (the kernel's
    NibbleSuperCodes). None where some super-block's are not such products."""
    if k % (BLOCK * SUPER_BLOCKS):
        return None
    s, p = k // (BLOCK * SUPER_BLOCKS), n // PANEL
    out = np.empty((*lead, p, s, SUPER_WORDS), np.float32)
    for i in np.ndindex(*lead):
        words = []
        for a in (scale[i], minimum[i]):
            rows = a.reshape(s, SUPER_BLOCKS, n).transpose(0, 2, 1).reshape(-1, SUPER_BLOCKS)
            parts = _factor(np.ascontiguousarray(rows))
            if parts is None:
                return None
            d, codes = parts  # (s n,), (s n, 8)
            words.append((d.reshape(s, p, PANEL).transpose(1, 0, 2),
                           codes.reshape(s, p, PANEL, SUPER_BLOCKS).transpose(1, 0, 3, 2)))
        (d, sc), (dmin, m) = words
        out[i] = np.concatenate(
            [d, dmin, np.ascontiguousarray(sc).reshape(p, s, -1).view(np.float32),
             np.ascontiguousarray(m).reshape(p, s, -1).view(np.float32)], axis=-1)
    return out


def _super_back(plane, xp) -> tuple:
    """_super_scales' plane of one layer -> its scales and minima as (N / 32, K / 32, 32)."""
    p, s = plane.shape[:2]
    halves = 2 * PANEL
    sub = _words_as(plane[..., halves:], np.uint8, xp).reshape(p, s, 2, SUPER_BLOCKS, PANEL)
    out = []
    for j in range(2):
        d = plane[..., j * PANEL:(j + 1) * PANEL]  # (p, s, 32)
        out.append((d[:, :, None, :] * sub[:, :, j].astype(np.float32)).reshape(
            p, s * SUPER_BLOCKS, PANEL))
    return tuple(out)


def _panel_dims(w: Mapping, batch_dims: int):
    """(codes, lead axes, K, N) of an int8-form weight whose outputs are whole panels, its
    first `batch_dims` axes stacked layers, else None."""
    if not is_quantized(w) or is_packed(w):
        return None
    q = np.asarray(w["q"])
    ax = block_axis(w)
    if ax < batch_dims:
        return None
    k, n = int(np.prod(q.shape[batch_dims:ax + 1])), int(np.prod(q.shape[ax + 1:]))
    return None if n % PANEL else (q, q.shape[:batch_dims], k, n)


def _scale_panels(a: np.ndarray, lead: tuple, k: int, n: int, block: int = BLOCK) -> np.ndarray:
    """(..., K / B, N) scales or minima -> (..., N / PANEL, K / B, PANEL), panel by panel."""
    a = a.reshape(*lead, k // block, n // PANEL, PANEL)
    return np.ascontiguousarray(np.swapaxes(a, len(lead), len(lead) + 1))


def _scales_back(a, scale_shape: tuple, xp):
    """_scale_panels' (N / PANEL, K / B, PANEL) back in the weight's layout, as float32."""
    return xp.swapaxes(a, 0, 1).reshape(scale_shape).astype(np.float32)


def pack_pairs(w: Mapping, batch_dims: int = 0) -> dict[str, np.ndarray] | None:
    """A quantized weight (numpy; first `batch_dims` axes stacked layers) in the pair form, or
    None where its outputs are not whole panels of 32. Per stacked layer: q8 (N / 32, K / 2,
    64) int8, byte 2c + e of pair kp of panel p the code of row 2kp + e, column 32p + c, held
    as uint32 words (last axis 16); scale and min (N / 32, K / B, 32) float32, B the
    weight's block (32, or Q6_K's 16). Any codes (Q8_0's, Q4's) hold exactly; pack_nibbles is
    the smaller form where it applies."""
    dims = _panel_dims(w, batch_dims)
    if dims is None:
        return None
    q, lead, k, n = dims
    block = block_of(w)
    q8 = np.empty((*lead, n // PANEL, k // 2, 2 * PANEL), np.int8)
    for i in np.ndindex(*lead):  # a layer at a time: the temporaries stay one layer's size
        # (kp, e, p, c) -> (p, kp, c, e)
        q8[i] = q[i].astype(np.int8, copy=False).reshape(k // 2, 2, n // PANEL, PANEL).transpose(
            2, 0, 3, 1).reshape(n // PANEL, k // 2, 2 * PANEL)
    return {"q8": q8.view(np.uint32),
            **{name: _scale_panels(np.asarray(w[name], np.float32), lead, k, n, block)
               for name in ("scale", "min")}}


def pack_six(w: Mapping, batch_dims: int = 0) -> dict[str, np.ndarray] | None:
    """A quantized weight (numpy; first `batch_dims` axes stacked layers) whose codes are in
    [-32, 31] with no minimum (Q6_K's, Q5_0's) in the six-bit form, or None where it is not
    that or its outputs are not whole panels of 32. Per stacked layer: q6 (N / 32, K / 2, 48)
    bytes, as uint32 words (last axis 12), and scale (N / 32, K / B, 32) float32 (B the
    weight's block, 16 or 32); no minimum plane. Pair kp of panel p holds the codes + 32 of
    its 64 slots (slot 2c + e of half h: row 2kp + e, column 32p + 16h + c) as 32 bytes of
    nibbles as pack_nibbles lays them out, then 16 bytes of their top two bits: byte j those
    of slots j, 16 + j, 32 + j and 48 + j, from the lowest bits. 0.75 bytes a weight plus
    the scales, where the pair form takes 1 plus scales and minima."""
    dims = _panel_dims(w, batch_dims)
    if dims is None or np.asarray(w["min"]).any():
        return None
    q, lead, k, n = dims
    if int(q.min(initial=0)) < -32 or int(q.max(initial=0)) > 31:
        return None
    q6 = np.empty((*lead, n // PANEL, k // 2, SIX_PAIR_BYTES), np.uint8)
    for i in np.ndindex(*lead):  # a layer at a time: the temporaries stay one layer's size
        u = (q[i].astype(np.int16) + 32).astype(np.uint8)
        # (kp, e, p, h, c) -> (p, kp, h, c, e): slot 32h + 2c + e of pair kp of panel p
        u = u.reshape(k // 2, 2, n // PANEL, 2, PANEL // 2).transpose(2, 0, 3, 4, 1)
        u = u.reshape(n // PANEL, k // 2, 2 * PANEL)
        q6[i][..., :PANEL] = (u[..., :PANEL] & 15) | ((u[..., PANEL:] & 15) << 4)
        top = (u >> 4).reshape(n // PANEL, k // 2, 4, PANEL // 2)
        q6[i][..., PANEL:] = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4)
                              | (top[..., 3, :] << 6))
    block = block_of(w)
    return {"q6": q6.view(np.uint32),
            "scale": _scale_panels(np.asarray(w["scale"], np.float32), lead, k, n, block)}


def unpack_six(w: Mapping, shape: tuple[int, ...], xp=np) -> dict:
    """The six-bit form of a weight of `shape` (one layer's) back in the int8 form."""
    q6 = _words_as(w["q6"], np.uint8, xp)
    n, k = q6.shape[0] * PANEL, q6.shape[1] * 2
    ax = _contracted_axis(shape, k, n, q6.shape == (n // PANEL, k // 2, SIX_PAIR_BYTES), "six")
    nib, tops = q6[..., :PANEL], q6[..., PANEL:]
    low = xp.concatenate([nib & 15, nib >> 4], axis=-1)  # (p, kp, 64) slots
    top = xp.concatenate([(tops >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    u = (low | (top << 4)).astype(np.int16) - 32
    q = u.reshape(n // PANEL, k // 2, 2, PANEL // 2, 2).transpose(1, 4, 0, 2, 3)
    scale_shape = (*shape[:ax], shape[ax] // pair_block(w), *shape[ax + 1:])
    scale = _scales_back(w["scale"], scale_shape, xp)
    return {"q": q.reshape(shape).astype(np.int8), "scale": scale, "min": xp.zeros_like(scale)}


def unpack_pairs(w: Mapping, shape: tuple[int, ...], xp=np) -> dict:
    """The pair form of a weight of `shape` (one layer's) back in the int8 form."""
    q8 = _words_as(w["q8"], np.int8, xp)
    n, k = q8.shape[0] * PANEL, q8.shape[1] * 2
    ax = _contracted_axis(shape, k, n, q8.shape == (n // PANEL, k // 2, 2 * PANEL), "pair")
    q = q8.reshape(n // PANEL, k // 2, PANEL, 2).transpose(1, 3, 0, 2).reshape(shape)
    scale_shape = (*shape[:ax], shape[ax] // pair_block(w), *shape[ax + 1:])
    return {"q": q, **{name: _scales_back(w[name], scale_shape, xp) for name in ("scale", "min")}}


def _contracted_axis(shape: tuple[int, ...], k: int, n: int, planes_fit: bool, form: str) -> int:
    """The block axis of a weight of `shape` whose K and N a packed form's planes give."""
    ax = next((i for i in range(len(shape)) if int(np.prod(shape[:i + 1])) == k), None)
    if ax is None or int(np.prod(shape[ax + 1:])) != n or not planes_fit:
        raise ValueError(f"{form} planes of K {k}, N {n} are not a weight of shape {shape}")
    return ax


def _words_as(a, dtype, xp):
    """uint32 words (..., W) as `dtype` (..., W * 4 / itemsize), the same bytes."""
    if xp is np:
        return np.ascontiguousarray(a).view(dtype)
    import jax

    parts = jax.lax.bitcast_convert_type(a, dtype)  # (..., W, 4 / itemsize)
    return parts.reshape(*a.shape[:-1], -1)


def unpack_nibbles(w: Mapping, shape: tuple[int, ...], xp=np) -> dict:
    """The nibble form of a weight of `shape` (one layer's) back in the int8 form, float32
    scales (xp: numpy or jax.numpy): the planes pack_nibbles started from (Q4_0's as their
    codes + 8 with minimum -8 * scale, the same weights)."""
    q4 = _words_as(w["q4"], np.uint8, xp)
    n, k = q4.shape[0] * PANEL, q4.shape[1] * 2
    ax = _contracted_axis(shape, k, n, q4.shape == (n // PANEL, k // 2, PANEL), "nibble")
    u = xp.stack([q4 & 15, q4 >> 4], axis=2).reshape(n // PANEL, k // 2, 2, PANEL // 2, 2)
    q = u.transpose(1, 4, 0, 2, 3).reshape(shape).astype(np.int8)
    scale_shape = (*shape[:ax], shape[ax] // BLOCK, *shape[ax + 1:])
    if "min" not in w:  # Q4_K's super-block scales
        scale, minimum = _super_back(w["scale"], xp)
        return {"q": q, "scale": _scales_back(scale, scale_shape, xp),
                "min": _scales_back(minimum, scale_shape, xp)}
    return {"q": q, **{name: _scales_back(w[name] if w[name].dtype == np.float32 else
                                          _words_as(w[name], np.float16, xp), scale_shape, xp)
                       for name in ("scale", "min")}}


def gpu_codes(w: Mapping, xp=np):
    """The int8 codes (..., K, N) of a weight in kernels/gpu_matmul.py's form."""
    if "g8" in w:
        return w["g8"]
    g = w["g4"]
    if g.dtype == np.int8:  # two's complement nibbles: shifts keep the sign
        lo, hi = xp.right_shift(xp.left_shift(g, 4), 4), xp.right_shift(g, 4)
    else:
        lo, hi = (g & 15).astype(np.int8), (g >> 4).astype(np.int8)
    return xp.concatenate([lo, hi], axis=-2)


def gpu_to_int8_form(w: Mapping, xp=np) -> dict:
    """The int8 form of a weight in kernels/gpu_matmul.py's form, as (..., K, N) planes."""
    scale = w["scale"].astype(np.float32)
    minimum = w["min"].astype(np.float32) if "min" in w else xp.zeros_like(scale)
    return {"q": gpu_codes(w, xp), "scale": scale, "min": minimum}


def dequantize(w, dtype, shape: tuple[int, ...] | None = None):
    """A param as the model reads it: a quantized dict (GGUF's blocks or FP8) -> float weights
    of `dtype`, formed in float32 inside the step (see the module doc for why this is exact);
    an array unchanged.
    The packed forms need the weight's `shape`."""
    if not is_quantized(w):
        return w
    import jax.numpy as jnp

    if fp8.is_fp8(w):
        return fp8.dequantize(w, dtype)

    if "g8" in w or "g4" in w:  # kernels/gpu_matmul.py's form: (K, N) planes
        w = gpu_to_int8_form(w, jnp)
        return _dequantize(w, jnp).astype(dtype).reshape(shape or w["q"].shape)
    if is_packed(w):
        if shape is None:
            raise ValueError("the packed (nibble or pair) form of a weight is read back with "
                             "its shape")
        w = (unpack_nibbles if is_nibbles(w) else unpack_six if is_six(w) else
             unpack_pairs)(w, shape, jnp)
    return _dequantize(w, jnp).astype(dtype)


def dequantize_np(w: Mapping) -> np.ndarray:
    return fp8.dequantize_np(w) if fp8.is_fp8(w) else _dequantize(w, np)


def dequantize_tree(tree):
    """Every quantized dict in a param tree replaced by its float32 weights (numpy)."""
    if is_quantized(tree):
        return dequantize_np(tree)
    if isinstance(tree, Mapping):
        return {k: dequantize_tree(v) for k, v in tree.items()}
    return tree


def map_planes(fn: Callable, w):
    """fn applied to an array, or to each plane of a quantized dict."""
    return {k: fn(v) for k, v in w.items()} if is_quantized(w) else fn(w)


def requantize_q8(w: np.ndarray, axis: int, chunk: int = 2048) -> dict[str, np.ndarray] | None:
    """Float weights as Q8_0-style blocks of 32 along `axis` (int8 q, scale = block max / 127,
    min 0), if those blocks give back every weight exactly, else None. A GGUF's Q8_0 tensor
    expanded at load (the embedding) comes back to its own blocks this way; trained float
    weights do not, and stay as they are. Worked `chunk` rows at a time, so the temporaries
    stay small (whole-array ones cost more in page faults than in arithmetic)."""
    moved = np.moveaxis(np.asarray(w, np.float32), axis, -1)
    if moved.shape[-1] % BLOCK:
        return None
    rows = moved.reshape(-1, moved.shape[-1] // BLOCK, BLOCK)  # (rows, blocks, 32)
    q = np.empty(rows.shape, np.int8)
    scale = np.empty(rows.shape[:2], np.float32)
    for lo in range(0, len(rows), chunk):
        blocks = rows[lo:lo + chunk]
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
        # Any q with q * d == w will do (checked next), so a reciprocal's product rounds well
        # enough and is much faster than dividing.
        c = np.rint(blocks * (np.float32(1) / np.where(d > 0, d, np.float32(1))))
        if np.abs(c).max(initial=0) > 127 or not np.array_equal(c * d, blocks):
            return None
        q[lo:lo + chunk], scale[lo:lo + chunk] = c, d[..., 0]
    back = lambda a, shape: np.ascontiguousarray(np.moveaxis(a.reshape(shape), -1, axis))  # noqa: E731
    scale = back(scale, (*moved.shape[:-1], -1))
    return {"q": back(q, moved.shape), "scale": scale, "min": np.zeros_like(scale)}
