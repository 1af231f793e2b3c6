"""The C++ block-matmul kernel (kernels/cpu_matmul.py) against float64 matmuls: of its own maths
(x scaled to int16 per block of 32, see cpu/block_matmul.cc) to float32 rounding, and of the
float x on the expanded weights within the bound that scaling allows; in both forms of the
codes (int8, and nibble pairs with float16 scales); and the head it computes from exact Q8
blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cpu_matmul, quant
from jaxserve.kernels.cpu_matmul import (
    block_matmul,
    block_matmul_group,
    block_matmul_or_none,
    fits,
    pack,
)
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import HEAD_BLOCKS, head_blocks, lm_logits
from tests.kernels.test_cpu_library import FEWER, fewer_targets, x86

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def make_weight(rng, shape, block_axis, kind="Q4_1"):
    """A quantized dict of `shape` in blocks of 32 along `block_axis`, with GGUF-like planes:
    Q4_1 nibbles with a minimum, Q4_0 ones (-8 to 7) without, Q8_0 codes without one, Q5_0
    (-16 to 15) and Q5_1 (0 to 31) codes, or a K-quant's sub-blocks (Q4_K's 0 to 15, Q5_K's
    0 to 31) whose scale d * sc and minimum -(dmin * m) are float32 products of a float16
    and a 6-bit integer (quant.decode makes them so), or Q6_K's blocks of 16 (-32 to 31, d * sc
    with sc an int8, no minimum)."""
    scale_shape = list(shape)
    scale_shape[block_axis] //= quant.HALF_BLOCK if kind == "Q6_K" else quant.BLOCK
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    if kind in ("Q4_1", "Q5_1"):
        q = rng.integers(0, 16 if kind == "Q4_1" else 32, shape)
        m = half(-rng.random(scale_shape, np.float32) * 0.1)
    elif kind in ("Q4_0", "Q5_0"):
        q = rng.integers(-8, 8, shape) if kind == "Q4_0" else rng.integers(-16, 16, shape)
        m = np.zeros(scale_shape, np.float32)
    elif kind == "Q6_K":
        q = rng.integers(-32, 32, shape)
        sc = rng.integers(-128, 128, scale_shape)
        s = (half(rng.random(scale_shape) * 1e-4 + 1e-6) * sc).astype(np.float32)
        m = np.zeros(scale_shape, np.float32)
        return {"q": jnp.asarray(q, jnp.int8), "scale": jnp.asarray(s), "min": jnp.asarray(m)}
    elif kind in ("Q4_K", "Q5_K"):
        q = rng.integers(0, 16 if kind == "Q4_K" else 32, shape)
        sc, mins = rng.integers(0, 64, scale_shape), rng.integers(0, 64, scale_shape)
        # d and dmin shared by the 8 blocks of a super-block where the blocks make whole ones
        supers = list(scale_shape)
        per = quant.SUPER_BLOCKS if supers[block_axis] % quant.SUPER_BLOCKS == 0 else 1
        supers[block_axis] //= per
        d, dmin = (np.repeat(half(rng.random(supers) * scale), per, block_axis)
                   for scale in (1e-3, 3e-3))
        s, m = (d * sc).astype(np.float32), (-(dmin * mins)).astype(np.float32)
        return {"q": jnp.asarray(q, jnp.int8), "scale": jnp.asarray(s), "min": jnp.asarray(m)}
    else:  # as llama.cpp makes them: each block's largest magnitude is the code +-127
        q = np.moveaxis(rng.integers(-126, 127, shape), block_axis, 0)
        q[::quant.BLOCK] = rng.choice([-127, 127], q[::quant.BLOCK].shape)
        q = np.moveaxis(q, 0, block_axis)
        m = np.zeros(scale_shape, np.float32)
    # float16 scales and minima, as GGUF stores them
    s = (rng.random(scale_shape, np.float32) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    return {"q": jnp.asarray(q, jnp.int8), "scale": jnp.asarray(s), "min": jnp.asarray(m)}


def in_form(w, form):
    """(w in the kernel's `form`, the int8-form planes of what that form holds): "int8" as
    made, "nibbles" (quant.pack_nibbles; Q4_0's codes come back + 8 with minimum -8 * scale,
    the same weights; Q4_K's scales stay float32) or "pairs" (quant.pack_pairs)."""
    if form == "int8":
        return w, w
    planes = {k: np.asarray(a) for k, a in w.items()}
    if form == "pairs":
        packed = quant.pack_pairs(planes)
        assert packed is not None and packed["q8"].dtype == np.uint32
        held = quant.unpack_pairs(packed, planes["q"].shape)
        np.testing.assert_array_equal(held["q"], planes["q"])
    elif form == "six":
        packed = quant.pack_six(planes)
        assert packed is not None and set(packed) == {"q6", "scale"}
        assert packed["q6"].nbytes * 4 == planes["q"].nbytes * 3  # 6 bits a weight
        held = quant.unpack_six(packed, planes["q"].shape)
        np.testing.assert_array_equal(held["q"], planes["q"])
    else:
        packed = quant.pack_nibbles(planes)
        halves = np.array_equal(planes["scale"].astype(np.float16).astype(np.float32),
                                planes["scale"])
        assert packed is not None and packed["q4"].dtype == np.uint32
        # float16 pairs in words where float16 holds the scales, else float32 (Q4_K's)
        assert packed["scale"].dtype == (np.uint32 if halves else np.float32)
        held = quant.unpack_nibbles(packed, planes["q"].shape)
    np.testing.assert_array_equal(quant.dequantize_np(held), quant.dequantize_np(planes))
    return ({k: jnp.asarray(a) for k, a in packed.items()},
            {k: jnp.asarray(a) for k, a in held.items()})


# (kind, form) pairs: Q8_0's and the 5-bit codes have no nibble form; Q4_K's has float32
# scales (at these sizes: test_q4_k_super_blocks has K a multiple of 256). Q6_K's blocks of
# 16 are read in the pair and six-bit forms alone; Q5_0's codes fit six bits too.
CASES = [("Q4_1", "int8"), ("Q4_1", "nibbles"), ("Q4_1", "pairs"), ("Q4_0", "int8"),
         ("Q4_0", "nibbles"), ("Q8_0", "int8"), ("Q8_0", "pairs"), ("Q5_0", "pairs"),
         ("Q5_0", "six"), ("Q5_1", "pairs"), ("Q4_K", "int8"), ("Q4_K", "nibbles"),
         ("Q4_K", "pairs"), ("Q5_K", "pairs"), ("Q6_K", "pairs"), ("Q6_K", "six")]


def expanded(w, contract):
    """The weight as float64 (K, N)."""
    wf = np.asarray(quant.dequantize_np({k: np.asarray(a) for k, a in w.items()}), np.float64)
    return wf.reshape(int(np.prod(wf.shape[:contract])), -1)


def int16_rows(x, block=quant.BLOCK):
    """x (M, K) as the kernel scales it, in float64: per block of 32 (or of the weight's 16),
    round(x * 32767 / amax) * amax / 32767, each step in float32 as the C++ does."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint((xb * inv).astype(np.float32))  # ties to even, as the kernel's rounding
    assert np.abs(xq).max(initial=0) <= 32767
    xs = (amax / np.float32(32767)).astype(np.float32)
    return (xq.astype(np.float64) * xs).reshape(x.shape)


def expected(x, w, contract):
    """float64 of the kernel's maths: the int16-scaled x @ the expanded weight, (M, *outputs).
    (Its sum over each block's x for the minimum term is of x itself; x and its scaled form
    differ by less than float32 rounding of y there.)"""
    shape = np.asarray(w["q"]).shape
    qs = expanded({**w, "min": np.zeros_like(w["min"])}, contract)  # q * scale: exact
    m = expanded({**w, "scale": np.zeros_like(w["scale"])}, contract)  # min, spread over k
    block = quant.block_of({k: np.asarray(a) for k, a in w.items()})
    out = int16_rows(x, block) @ qs + np.asarray(x, np.float64) @ m
    return out.reshape(x.shape[0], *shape[contract:])


def assert_within_scaling(got, x, wf, scaled=None):
    """got (M, N) is the float product x @ wf (K, N) up to what scaling x to int16 allows:
    each x moves at most amax / 65534 of its block, and only the codes' part of the weight
    (`scaled`, q * scale; wf where the weight has no minimum) multiplies the scaled x, so
    y[r, n] moves at most the sum over k of |scaled[k, n]| amax[r, k // 32] / 65534, plus
    float32 rounding."""
    want = np.asarray(x, np.float64) @ wf
    amax = np.abs(np.asarray(x, np.float64)).reshape(x.shape[0], -1, quant.BLOCK).max(-1)
    scaled = wf if scaled is None else scaled
    bound = np.repeat(amax, quant.BLOCK, 1) / 65534 @ np.abs(scaled)
    err = np.abs(np.asarray(got, np.float64).reshape(want.shape) - want)
    assert (err <= bound + 2e-6 * np.abs(want).max() + 1e-7).all()
    assert err.max() > 0 or not np.any(x)  # the bound is not met by being the float maths


def assert_close(got, want):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32
    # float32 sums of up to a few hundred terms: a few ulps of the largest magnitudes
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() + 1e-7)


def codes_part(w, contract):
    """The weight's q * scale (its minimum left out) as float64 (K, N)."""
    return expanded({**w, "min": jnp.zeros_like(w["min"])}, contract)


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 40])
@pytest.mark.parametrize("kind, form", CASES)
def test_matches_float64(rows, kind, form):
    """Rows around the register tiles (with AVX-512: 6 rows at a time the few-rows way, 12 a
    tile, the int8 form switching from the one to the other above 8; without: 2 rows at a time
    either way, the few-rows way up to 8 rows, the int8 form's up to 2), several panels of 32
    columns."""
    rng = np.random.default_rng(rows)
    w, held = in_form(make_weight(rng, (160, 96), 0, kind), form)
    x = jnp.asarray(rng.standard_normal((rows, 160)), jnp.float32)
    got = jax.jit(block_matmul, static_argnums=(2, 3))(x, w, 1, (160, 96))
    assert_close(got, expected(x, held, 1))
    assert_within_scaling(got, x, expanded(held, 1), codes_part(held, 1))


@pytest.mark.parametrize("rows", [1, 13, 40])
@pytest.mark.parametrize("kind, form", [("Q4_1", "nibbles"), ("Q4_1", "pairs"),
                                        ("Q8_0", "pairs"), ("Q4_K", "nibbles")])
def test_packed_forms_give_the_same_numbers(rows, kind, form):
    """Q4_1's and Q4_K's nibble forms, and any codes' pair form, hold the same codes, scales
    and minima, so the kernel's integer sums and epilogue are the same numbers: y is
    bit-identical to the int8 form's."""
    rng = np.random.default_rng(20 + rows)
    w = make_weight(rng, (256, 160), 0, kind)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(block_matmul(x, in_form(w, form)[0], 1, (256, 160))),
        np.asarray(block_matmul(x, w)))


@pytest.mark.parametrize("rows", [1, 2, 13, 40])
def test_the_six_bit_form_gives_the_pair_forms_numbers(rows):
    """Q6_K's codes in six bits (nibbles and a plane of top bits, 0.75 bytes a weight instead
    of 1, no minima) widen to the same int16 pairs as the pair form's: y bit-identical."""
    rng = np.random.default_rng(30 + rows)
    w = {k: np.asarray(a) for k, a in make_weight(rng, (256, 160), 0, "Q6_K").items()}
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    six, pairs = quant.pack_six(w), quant.pack_pairs(w)
    np.testing.assert_array_equal(np.asarray(block_matmul(x, six, 1, (256, 160))),
                                  np.asarray(block_matmul(x, pairs, 1, (256, 160))))
    assert quant.pack_six({**w, "min": w["scale"]}) is None  # a minimum: not this form
    assert quant.pack_six({**w, "q": w["q"] * 2}) is None  # codes past six bits


@pytest.mark.parametrize("rows", [1, 2, 7, 13, 40])
def test_q4_k_super_blocks(rows):
    """Q4_K's scales held as the file has them, per super-block of 256 rows d and dmin and
    per block 6-bit sc and m (0.59 bytes a weight instead of 0.75): the same weights, y
    bit-identical to the int8 form's, in place in a stack of layers; a weight whose scales are
    not such products keeps float32 ones."""
    rng = np.random.default_rng(40 + rows)
    layers = [{k: np.asarray(a) for k, a in make_weight(rng, (512, 96), 0, "Q4_K").items()}
              for _ in range(3)]
    stack = {k: np.stack([w[k] for w in layers]) for k in quant.PLANES}
    packed = quant.pack_nibbles(stack, 1)
    assert set(packed) == {"q4", "scale"}
    assert packed["scale"].shape == (3, 3, 2, quant.SUPER_WORDS)  # (L, N / 32, K / 256, .)
    nbytes = sum(a.nbytes for a in packed.values()) / stack["q"].size
    assert nbytes == 0.5 + 0.09375
    x = jnp.asarray(rng.standard_normal((rows, 512)), jnp.float32)
    run = jax.jit(lambda x, w, i: block_matmul(x, w, 1, (512, 96), i))
    for i, w in enumerate(layers):
        one = {k: a[i] for k, a in packed.items()}
        back = quant.unpack_nibbles(one, (512, 96))
        assert all(np.array_equal(back[k], w[k]) for k in quant.PLANES)
        np.testing.assert_array_equal(np.asarray(run(x, packed, i)),
                                      np.asarray(block_matmul(x, w)))
    odd = {**layers[0], "scale": layers[0]["scale"].copy()}
    odd["scale"][3, 5] = np.float32(np.pi)  # not a float16 times a 6-bit integer
    assert quant.pack_nibbles(odd)["scale"].dtype == np.float32
    assert "min" in quant.pack_nibbles(odd)


def test_a_stack_mixing_q6_k_layers_splits_by_block():
    """A stack of layers where some are Q6_K's blocks of 16 and the others blocks of 32
    taken as 16 (a Q4_K_M file's ffn_down) splits into a stack of each, each in its own form;
    block_matmul_or_none at a (traced) layer computes on the part that holds it, as the
    layer's own weight does. One such layer alone goes back to blocks of 32."""
    rng = np.random.default_rng(9)
    k4 = [{k: np.asarray(a) for k, a in make_weight(rng, (256, 64), 0, "Q4_K").items()}
          for _ in range(2)]
    k6 = [{k: np.asarray(a) for k, a in make_weight(rng, (256, 64), 0, "Q6_K").items()}
          for _ in range(2)]
    order = [k4[0], k6[0], k6[1], k4[1]]
    # as one_block stacks them: blocks of 32 as 16, each scale and minimum twice
    halved = [w if i in (1, 2) else {"q": w["q"], **{p: np.repeat(w[p], 2, 0)
                                                      for p in ("scale", "min")}}
              for i, w in enumerate(order)]
    stack = {k: np.stack([w[k] for w in halved]) for k in quant.PLANES}
    split = cpu_matmul.pack_weight(stack, 1)
    assert quant.is_split(split) and split["slot"].tolist() == [0, -1, -2, 1]
    assert "min" not in split["parts"]["b32"] and quant.is_six(split["parts"]["b16"])
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    run = jax.jit(lambda x, w, i: block_matmul_or_none(x, [w], 1, [(256, 64)], i)[0])
    for i, w in enumerate(order):
        np.testing.assert_array_equal(np.asarray(run(x, split, i)),
                                      np.asarray(block_matmul(x, cpu_matmul.pack_weight(w), 1,
                                                              (256, 64))))
    # in a group, or without a layer, the kernel does not take it
    assert block_matmul_or_none(x, [split, split], 1, [(256, 64)] * 2, 0) is None
    alone = cpu_matmul.pack_weight(halved[0])
    assert quant.is_nibbles(alone) and "min" not in alone


@pytest.mark.parametrize("kind, form", CASES)
def test_a_rows_result_does_not_depend_on_the_other_rows(kind, form):
    """Each row of y, bit for bit, whatever else x holds: 1 row, a few (taken a few at a time,
    codes widened in registers) or many (for the int8 form, the per-block tiles): the batch a
    sequence decodes in does not change its numbers."""
    rng = np.random.default_rng(77)
    w, _ = in_form(make_weight(rng, (128, 64), 0, kind), form)
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.float32)
    full = np.asarray(block_matmul(x, w, 1, (128, 64)))
    for lo, hi in [(0, 1), (3, 4), (0, 5), (2, 9), (0, 13), (20, 40)]:
        np.testing.assert_array_equal(np.asarray(block_matmul(x[lo:hi], w, 1, (128, 64))),
                                      full[lo:hi])


@pytest.mark.parametrize("kind, form", CASES)
def test_rows_computes_the_first_rows_alone(kind, form):
    """`rows` (traced): y's first rows as the whole product's, bit for bit, and zeros after
    (a step's padding sequences); more rows than x has means all of them."""
    rng = np.random.default_rng(78)
    w, _ = in_form(make_weight(rng, (128, 64), 0, kind), form)
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.float32)
    full = np.asarray(block_matmul(x, w, 1, (128, 64)))
    run = jax.jit(lambda x, n: block_matmul(x, w, 1, (128, 64), rows=n))
    for n in (0, 1, 5, 13, 40, 99):
        got = np.asarray(run(x, jnp.int32(n)))
        np.testing.assert_array_equal(got[:n], full[:n])
        assert not got[n:].any()


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(seed):
    rng = np.random.default_rng(50 + seed)
    k, n, rows = (int(rng.integers(1, 9)) * 32, int(rng.integers(1, 40)) * 32,
                  int(rng.integers(1, 80)))
    kind, form = CASES[int(rng.integers(len(CASES)))]
    w, held = in_form(make_weight(rng, (k, n), 0, kind), form)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    assert_close(block_matmul(x, w, 1, (k, n)), expected(x, held, 1))


@pytest.mark.parametrize("form", ["int8", "nibbles", "pairs"])
@pytest.mark.parametrize("shape, contract", [((64, 3, 32), 1), ((3, 64, 96), 2)])
def test_projection_layouts(shape, contract, form):
    """The model's layouts: wq (D, N, H) blocks along D, contracted over D; wo (N, H, D)
    blocks along H, contracted over N and H."""
    rng = np.random.default_rng(9)
    w, held = in_form(make_weight(rng, shape, contract - 1), form)
    x = jnp.asarray(rng.standard_normal((5, int(np.prod(shape[:contract])))), jnp.float32)
    got = block_matmul(x, w, contract, shape)
    assert got.shape == (5, *shape[contract:])
    assert_close(got, expected(x, held, contract))
    assert_within_scaling(got, x, expanded(held, contract), codes_part(held, contract))
    # The step's fallback (the weight expanded in jnp, then a dot) reads either form.
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w, jnp.float32, shape)),
                                  quant.dequantize_np({k: np.asarray(a) for k, a in held.items()}))


@pytest.mark.parametrize("in_place", [False, True], ids=["sliced", "in-place"])
@pytest.mark.parametrize("form", ["int8", "nibbles", "pairs"])
def test_inside_a_scan_over_stacked_layers(form, in_place):
    """Under lax.scan each iteration's weight is a slice of the stacks (the packed forms
    packed with the layer axis as a batch axis, as the runner packs a scanned model's), or,
    in place, the stacks whole with the layer's index: the same numbers, and the program
    slices (copies) nothing."""
    rng = np.random.default_rng(3)
    ws = [make_weight(rng, (64, 64), 0, "Q8_0" if form == "pairs" else "Q4_1")
          for _ in range(3)]
    stacked = jax.tree.map(lambda *a: np.stack([np.asarray(b) for b in a]), *ws)
    if form != "int8":
        stacked = pack(stacked, batch_dims=1)
        assert (quant.is_nibbles if form == "nibbles" else quant.is_pairs)(stacked)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    if in_place:  # the index rides in the carry, so nothing at all is sliced per iteration
        run = jax.jit(lambda x, s: jax.lax.scan(
            lambda c, _: ((block_matmul(c[0], s, 1, (64, 64), c[1]), c[1] + 1), None),
            (x, jnp.int32(0)), None, length=3)[0][0])
        assert "dynamic-slice" not in run.lower(x, stacked).compile().as_text()
    else:
        run = jax.jit(lambda x, s: jax.lax.scan(
            lambda x, w: (block_matmul(x, w, 1, (64, 64)), None), x, s)[0])
    got = run(x, stacked)
    want = np.asarray(x, np.float64)
    for w in ws:
        want = want @ expanded(w, 1)
    # Three products, each moved by int16 scaling (see assert_within_scaling; Q4_1's sums
    # cancel, so the bound is ~1e-4 of the result per product). The test is of the slicing: a
    # layer's product on another layer's weights would be off by the result's own size.
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-3 * np.abs(want).max())
    if not in_place:
        return
    for i, w in enumerate(ws):  # each layer of the stack alone, as the single weight gives it
        one = in_form(w, form)[0]
        np.testing.assert_array_equal(np.asarray(block_matmul(x, stacked, 1, (64, 64), i)),
                                      np.asarray(block_matmul(x, one, 1, (64, 64))))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(block_matmul(x, stacked, 1, (64, 64), jnp.int32(3)))
    with pytest.raises(ValueError, match="cannot read a weight"):  # not a stack
        block_matmul(x, in_form(ws[0], form)[0], 1, (64, 64), 0)


@pytest.mark.parametrize("form", ["int8", "nibbles", "pairs"])
def test_a_group_gives_each_weight_its_own_product(form):
    """One call for several weights that multiply the same x (a layer's q, k and v): each y,
    bit for bit, what the weight's own call gives, at rows taken either way, for weights alone
    and for stacks read in place at a layer."""
    rng = np.random.default_rng(12)
    kind = "Q8_0" if form == "pairs" else "Q4_1"
    shapes = ((128, 96), (128, 32), (128, 64))
    ws = [in_form(make_weight(rng, s, 0, kind), form)[0] for s in shapes]
    layers = [[make_weight(rng, s, 0, kind) for _ in range(2)] for s in shapes]
    stacks = [jax.tree.map(lambda *a: np.stack([np.asarray(b) for b in a]), *ls)
              for ls in layers]
    if form != "int8":
        stacks = [pack(st, batch_dims=1) for st in stacks]
    run = jax.jit(block_matmul_group, static_argnums=(2, 3))
    for rows in (1, 5, 16):
        x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
        for y, w, s in zip(run(x, ws, 1, shapes), ws, shapes, strict=True):
            assert y.shape == (rows, s[1])
            np.testing.assert_array_equal(np.asarray(y), np.asarray(block_matmul(x, w, 1, s)))
        got = run(x, stacks, 1, shapes, jnp.int32(1))
        for y, ls, s in zip(got, layers, shapes, strict=True):
            np.testing.assert_array_equal(
                np.asarray(y), np.asarray(block_matmul(x, in_form(ls[1], form)[0], 1, s)))


def test_what_a_group_does_not_read():
    """A group's weights must be in one form and contract the same K, one shape each; the
    model's fallback (block_matmul_or_none) declines such a group instead."""
    rng = np.random.default_rng(13)
    nibbles = in_form(make_weight(rng, (64, 64), 0), "nibbles")[0]
    pairs = in_form(make_weight(rng, (64, 64), 0, "Q8_0"), "pairs")[0]
    wide = in_form(make_weight(rng, (128, 64), 0), "nibbles")[0]
    x = jnp.ones((2, 64), jnp.float32)
    k_nibbles = in_form(make_weight(rng, (64, 64), 0, "Q4_K"), "nibbles")[0]  # float32 scales
    for other in (pairs, k_nibbles):
        with pytest.raises(ValueError, match="in one form"):
            block_matmul_group(x, [nibbles, other], 1, [(64, 64), (64, 64)])
    assert block_matmul_or_none(x, [nibbles, pairs], 1, [(64, 64), (64, 64)]) is None
    with pytest.raises(ValueError, match="contract different sizes"):
        block_matmul_group(x, [nibbles, wide], 1, [(64, 64), (128, 64)])
    with pytest.raises(ValueError, match="one shape per weight"):
        block_matmul_group(x, [nibbles, nibbles], 1, [(64, 64)])
    with pytest.raises(ValueError, match="one shape per weight"):
        block_matmul_group(x, [], 1, [])


def test_zero_rows():
    w = make_weight(np.random.default_rng(0), (32, 32), 0)
    assert block_matmul(jnp.zeros((0, 32), jnp.float32), w).shape == (0, 32)


def test_what_it_does_not_read():
    """Weights the kernel cannot read are declined (the step expands them instead), and a
    direct call says what is wrong."""
    rng = np.random.default_rng(1)
    odd = make_weight(rng, (64, 48), 0)  # 48 outputs: not whole panels of 32
    across = make_weight(rng, (64, 3, 32), 2)  # blocks along an output axis
    x = jnp.ones((2, 64), jnp.float32)
    assert not fits(odd, 1) and not fits(across, 1)
    assert fits(make_weight(rng, (64, 64), 0), 1)
    assert block_matmul_or_none(x, [odd]) is None
    assert block_matmul_or_none(x, [make_weight(rng, (64, 64), 0), odd]) is None
    assert block_matmul_or_none(x.astype(jnp.bfloat16), [make_weight(rng, (64, 64), 0)]) is None
    with pytest.raises(ValueError, match="cannot read a weight"):
        block_matmul(x, odd)
    with pytest.raises(ValueError, match=r"x of shape \(M, 64\)"):
        block_matmul(jnp.ones((2, 32), jnp.float32), make_weight(rng, (64, 64), 0))
    nibbles = in_form(make_weight(rng, (64, 64), 0), "nibbles")[0]
    assert fits(nibbles, 1, (64, 64)) and not fits(nibbles, 1)  # its shape is needed
    assert not fits(nibbles, 1, (32, 128))  # nor a weight of another K
    assert not fits({**nibbles, "scale": nibbles["scale"].astype(jnp.float32)}, 1, (64, 64))
    assert not fits({**nibbles, "q4": nibbles["q4"][:, :16]}, 1, (64, 64))
    pairs = in_form(make_weight(rng, (64, 64), 0, "Q8_0"), "pairs")[0]
    assert fits(pairs, 1, (64, 64)) and not fits(pairs, 1) and not fits(pairs, 1, (32, 128))
    assert not fits({**pairs, "scale": pairs["scale"].astype(jnp.float16)}, 1, (64, 64))
    for packed in (nibbles, pairs):
        with pytest.raises(ValueError, match="with its shape"):
            quant.dequantize(packed, jnp.float32)


def test_pack_turns_what_it_can_into_panels():
    """pack() gives every quantized weight with a nibble form that form, the others of whole
    panels the pair form (Q8_0 codes), all of the same weights, and leaves the rest (outputs
    that are not whole panels, plain arrays) as they were."""
    rng = np.random.default_rng(5)
    tree = {"a": make_weight(rng, (64, 32), 0), "b": make_weight(rng, (64, 32), 0, "Q4_0"),
            "c": make_weight(rng, (64, 32), 0, "Q8_0"), "d": np.ones(3, np.float32),
            "k": make_weight(rng, (64, 32), 0, "Q4_K")}
    tree = jax.tree.map(np.asarray, tree)
    out = pack(tree)
    assert all(quant.is_nibbles(out[k]) for k in "abk")
    assert out["k"]["scale"].dtype == np.float32  # d * sc: float16 does not hold it
    assert quant.is_pairs(out["c"]) and out["d"] is tree["d"]
    assert out["c"]["q8"].nbytes == tree["c"]["q"].nbytes
    back = quant.unpack_pairs(out["c"], (64, 32))
    np.testing.assert_array_equal(quant.dequantize_np(back), quant.dequantize_np(tree["c"]))
    odd = jax.tree.map(np.asarray, make_weight(rng, (64, 48), 0, "Q8_0"))
    assert pack({"e": odd})["e"] is odd
    for k in "abk":
        assert out[k]["q4"].nbytes * 2 == tree[k]["q"].nbytes
        back = quant.unpack_nibbles(out[k], (64, 32))
        np.testing.assert_array_equal(quant.dequantize_np(back), quant.dequantize_np(tree[k]))
    assert quant.pack_nibbles(make_weight(rng, (64, 48), 0)) is None  # not whole panels


@pytest.mark.parametrize("tied", [True, False])
def test_head_from_exact_q8_blocks(tied):
    """A head whose float weights are exact Q8 blocks gets HEAD_BLOCKS, and its logits through
    the kernel match the float head's; float weights that are not get none."""
    rng = np.random.default_rng(4)
    cfg = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64,
                      intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=32, tie_word_embeddings=tied)
    blocks = make_weight(rng, (320, 64), 1, "Q8_0")  # (V, D), blocks along D, as GGUF's
    table = quant.dequantize_np({k: np.asarray(a) for k, a in blocks.items()})
    params = {"embed": table} if tied else {"embed": table + 1, "lm_head": table.T.copy()}
    hb = head_blocks(cfg, params)
    assert hb is not None and hb["q"].shape == (64, 320) and hb["scale"].shape == (2, 320)
    np.testing.assert_array_equal(hb["q"], np.asarray(blocks["q"]).T)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    want = lm_logits(cfg, x, params)
    got = lm_logits(cfg, x, {**params, HEAD_BLOCKS: hb}, block_matmul_or_none)
    assert_within_scaling(got, x, table.T.astype(np.float64))
    # as the runner keeps them: in the pair form, the same numbers
    packed = pack(hb)
    assert quant.is_pairs(packed)
    np.testing.assert_array_equal(
        np.asarray(lm_logits(cfg, x, {**params, HEAD_BLOCKS: packed}, block_matmul_or_none)),
        np.asarray(got))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.abs(want).max()))
    noisy = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 1e-3
             for k, v in params.items()}
    assert head_blocks(cfg, noisy) is None


@x86
@pytest.mark.parametrize("name", sorted(FEWER))
def test_the_paths_of_cpus_with_fewer_instructions(name, monkeypatch):
    """Every form on the path of a CPU without AVX-512 (and without AVX2) matches float64 as
    this CPU's does, rows around each path's tiles, and keeps a row's numbers whatever the
    other rows are (CI's CPU may have AVX-512, so its own path never runs them)."""
    names = fewer_targets(name)
    for attr in ("TARGET", "TARGET_NIBBLES", "TARGET_NIBBLES_F32", "TARGET_NIBBLES_SUPER",
                 "TARGET_PAIRS", "TARGET_PAIRS_HALF", "TARGET_SIX", "TARGET_SIX_HALF"):
        monkeypatch.setattr(cpu_matmul, attr, names[getattr(cpu_matmul, attr)])
    rng = np.random.default_rng(11)
    # (K 256: Q4_K's nibbles with their super-block scales)
    for (kind, form), k in [*((case, 160) for case in CASES), (("Q4_K", "nibbles"), 256)]:
        w, held = in_form(make_weight(rng, (k, 96), 0, kind), form)
        x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32)
        full = block_matmul(x, w, 1, (k, 96))  # eager: the monkeypatched targets
        assert_close(full, expected(x, held, 1))
        assert_within_scaling(full, x, expanded(held, 1), codes_part(held, 1))
        for lo, hi in [(0, 1), (3, 5), (2, 9), (0, 13)]:
            np.testing.assert_array_equal(np.asarray(block_matmul(x[lo:hi], w, 1, (k, 96))),
                                          np.asarray(full)[lo:hi])


@pytest.mark.parametrize("kind, form", CASES)
def test_grouped_experts_each_row_times_its_experts_weight(kind, form):
    """The grouped kernel (a mixture's experts): rows sorted by expert, sizes per expert (one
    of them empty), stacks of two layers' experts read from entry `first`: each row equals
    the single-weight kernel's product with its expert's weight, bit for bit, rows past the
    groups are zeros, and the maths is the kernel's own (float64 within float32 rounding)."""
    rng = np.random.default_rng(11)
    layers, e, k, n, m = 2, 4, 64, 96, 14
    ws = [make_weight(rng, (k, n), 0, kind) for _ in range(layers * e)]
    held = [in_form(w, form) for w in ws]  # (the kernel's form, its int8-form planes)
    stack = jax.tree.map(lambda *a: np.stack(a).reshape(layers, e, *a[0].shape),
                         *[np.asarray(h[0]) if not isinstance(h[0], dict) else
                           {p: np.asarray(a) for p, a in h[0].items()} for h in held])
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = np.array([3, 0, 6, 2], np.int32)  # 11 rows in groups, 3 past them
    run = jax.jit(lambda x, s, first: cpu_matmul.grouped_block_matmul(x, [stack, stack], s,
                                                                      first))
    y, y2 = (np.asarray(a) for a in run(x, sizes, np.int32(e)))  # the second layer's experts
    np.testing.assert_array_equal(y, y2)
    r = 0
    for j, size in enumerate(sizes):
        rows = x[r:r + size]
        if size:
            one = np.asarray(block_matmul(rows, held[e + j][0], 1, (k, n)))
            np.testing.assert_array_equal(y[r:r + size], one)
            assert_close(y[r:r + size], expected(rows, held[e + j][1], 1))
        r += size
    assert not y[r:].any()
    with pytest.raises(Exception, match="experts out of the stack"):
        np.asarray(run(x, sizes, np.int32(e + 1)))
    assert cpu_matmul.grouped_block_matmul_or_none(x, [ws[0]["q"]], jnp.asarray(sizes)) is None
