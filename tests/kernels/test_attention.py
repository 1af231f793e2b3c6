"""Attention kernels against the jnp reference: Pallas in interpret mode on the CPU (the Triton
lowering's kernel in Pallas' interpreter, the Mosaic GPU kernel in Pallas' GPU interpreter, which
simulates shared memory, bulk copies and barriers), Triton on GPUs; the Triton kernel compiled for
a CUDA target without a GPU (the Pallas kernels' lowering for CUDA: test_gpu_lowering.py).

Tolerances: float32 inputs, |error| <= 2e-5; bfloat16 inputs (both sides read the same bf16 pages
and queries and accumulate in float32; outputs are rounded to bf16, whose step is 2**-6 at
magnitudes 2..4), |error| <= 1e-2 + 1e-2 * |reference|.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention.base import NO_WINDOW
from jaxserve.kernels.attention.kv_write import quantize_kv, write_kv
from jaxserve.kernels.attention.metadata import (
    ALIGN,
    aligned_tokens,
    fold_queries,
    folded_tiles,
    query_tiles,
    row_tiles,
    tile_offsets,
    unfold_tiles,
)
from jaxserve.kernels.attention.mosaic import TILE_ROWS, ragged_paged_attention_mosaic
from jaxserve.kernels.attention.pallas import ragged_paged_attention
from jaxserve.kernels.attention.ragged import ragged_metadata
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla

TOL = {"float32": (2e-5, 0.0), "bfloat16": (1e-2, 1e-2),  # (atol, rtol)
       "float16": (2e-3, 2e-3)}


def assert_close(got, want, t: int, dtype: str):
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got[:t], np.float32), np.asarray(want[:t], np.float32),
                               atol=atol, rtol=rtol)
ON_GPU = jax.default_backend() == "gpu"
LAYER = jnp.int32(1)


def make_case(seed: int, seqs: list[tuple[int, int]], kv_heads: int, groups: int,
              dtype: str, block_size: int = 16, head_dim: int = 32):
    """A mixed batch with padding rows and sequences, over shuffled pages with spares."""
    md, num_tokens, pages = ragged_metadata(seqs, block_size, seed, pad_tokens=16, pad_seqs=2,
                                            spare_pages=5)
    rng = np.random.default_rng(seed)
    n, dt = kv_heads * groups, jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((md.positions.shape[0], n, head_dim)), dt)
    # Two layers in the pool; the kernels read layer 1, so indexing by layer is exercised too.
    k = jnp.asarray(rng.standard_normal((2, pages, block_size, kv_heads, head_dim)), dt)
    v = jnp.asarray(rng.standard_normal((2, pages, block_size, kv_heads, head_dim)), dt)
    return q, k, v, md, num_tokens


# Chunk lengths 1..65 (decodes, a full tile, tile + 1, several tiles), contexts that end inside
# a block, exactly on a boundary, and one past it.
MIXED = [(1, 1), (1, 17), (7, 40), (16, 16), (17, 33), (1, 32), (33, 64), (65, 65), (2, 81)]


@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_matches_reference(groups, dtype):
    q, k, v, md, t = make_case(groups, MIXED, kv_heads=2, groups=groups, dtype=dtype)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    got = ragged_paged_attention(q, k, v, LAYER, md, interpret=True)
    assert got.dtype == q.dtype
    assert_close(got, want, t, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_pallas_random_ragged_batches(seed):
    rng = np.random.default_rng(100 + seed)
    seqs = []
    for _ in range(int(rng.integers(1, 7))):
        ql = int(rng.integers(1, 66))
        seqs.append((ql, ql + int(rng.integers(0, 70))))
    block_size = int(rng.choice([8, 16]))
    q, k, v, md, t = make_case(seed, seqs, kv_heads=int(rng.choice([1, 2])), groups=3,
                               dtype="float32", block_size=block_size)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    got = ragged_paged_attention(q, k, v, LAYER, md, interpret=True)
    assert_close(got, want, t, "float32")


@pytest.mark.parametrize("block_q, chunk_blocks", [(4, 1), (16, 4)])
@pytest.mark.parametrize("seed", range(4))
def test_xla_backend_matches_reference(seed, block_q, chunk_blocks):
    """Rows [0, S) per row, the rest per query tile: MIXED has a sequence straddling row S, and
    the random batches put long prompt chunks past it."""
    rng = np.random.default_rng(200 + seed)
    seqs = MIXED if seed == 0 else [
        (ql, ql + int(rng.integers(0, 70))) for ql in rng.integers(1, 66, int(rng.integers(1, 7)))]
    q, k, v, md, t = make_case(seed, seqs, kv_heads=int(rng.choice([1, 2])), groups=3,
                               dtype="float32", block_size=int(rng.choice([8, 16])))
    assert t > md.context_lens.shape[0]  # the tiled path runs
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    got = jax.jit(lambda q, k, v, md: ragged_paged_attention_xla(
        q, k, v, LAYER, md, block_q=block_q, min_rows_per_seq=1,
        chunk_blocks=chunk_blocks))(q, k, v, md)
    assert_close(got, want, t, "float32")


@pytest.mark.parametrize("min_rows_per_seq", [1, 1000])  # tiles past row S / every row alone
@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_xla_backend_walks_only_the_chunks_a_context_reaches(chunk_blocks, min_rows_per_seq):
    """The block bucket's padding costs nothing: the walk over the context stops after the
    chunk holding the step's longest context. Here the tables are widened to 12 blocks whose
    extra entries point at a page of NaNs; a chunk read past the end would bring them in."""
    block = 8
    q, k, v, md, t = make_case(7, [(1, 9), (6, 21), (17, 17), (1, 2)], kv_heads=2, groups=3,
                               dtype="float32", block_size=block)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    poison = k.shape[1]  # one more page, past the pool's own
    k, v = (jnp.concatenate([x, jnp.full_like(x[:, :1], jnp.nan)], axis=1) for x in (k, v))
    s, mb = md.block_tables.shape
    wide = jnp.full((s, 12), poison, jnp.int32).at[:, :mb].set(md.block_tables)
    md = dataclasses.replace(md, block_tables=wide)
    got = jax.jit(lambda q, k, v, md: ragged_paged_attention_xla(
        q, k, v, LAYER, md, block_q=4, min_rows_per_seq=min_rows_per_seq,
        chunk_blocks=chunk_blocks))(q, k, v, md)
    assert bool(jnp.all(jnp.isfinite(got[:t])))
    assert_close(got, want, t, "float32")


@pytest.mark.parametrize("groups, dtype, head_dim, block_size", [
    (3, "bfloat16", 64, 16),  # SmolLM2's 9 / 3 heads: 19 tokens of 3 heads after a lead
    (1, "float16", 64, 8),
    (8, "bfloat16", 128, 16),
])
def test_mosaic_matches_reference(groups, dtype, head_dim, block_size):
    """The Hopper kernel in Pallas' GPU interpreter: ragged prefill chunks and decodes, tiles
    read from an 8-aligned row, pages through the ring of shared-memory slots (contexts of 1
    to 6 steps of the walk, so slots are refilled)."""
    q, k, v, md, t = make_case(groups, MIXED, kv_heads=2, groups=groups, dtype=dtype,
                               block_size=block_size, head_dim=head_dim)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    got = ragged_paged_attention_mosaic(q, k, v, LAYER, md, interpret=True)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, want, t, dtype)


@pytest.mark.parametrize("seed", range(3))
def test_mosaic_random_ragged_batches(seed):
    """G = 3 puts most tiles' first folded row off the 8-row tiling of shared memory (decode s
    starts at row 3 * s, read from 8 * (3 * s // 8)): seed 0 is decodes only, the others mix
    decodes with prompt chunks."""
    rng = np.random.default_rng(400 + seed)
    seqs = [(1, int(c)) for c in rng.integers(1, 90, int(rng.integers(5, 12)))]
    if seed:
        seqs += [(int(ql), int(ql) + int(rng.integers(0, 40))) for ql in rng.integers(2, 70, 2)]
        rng.shuffle(seqs)
    q, k, v, md, t = make_case(seed, seqs, kv_heads=2, groups=3, dtype="bfloat16", head_dim=64)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    got = ragged_paged_attention_mosaic(q, k, v, LAYER, md, interpret=True)
    assert_close(got, want, t, "bfloat16")


def dense_attention(q, k, v, layer: int, md, window: int | None) -> np.ndarray:
    """Each real row's attention over its sequence's keys in (position - window, position],
    gathered token by token in numpy: the sliding window's oracle for the reference."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tables, positions = np.asarray(md.block_tables), np.asarray(md.positions)
    qsl, b = np.asarray(md.query_start_loc), k.shape[2]
    out = np.zeros(q.shape)
    groups = q.shape[1] // k.shape[3]
    for s in range(len(qsl) - 1):
        for row in range(qsl[s], qsl[s + 1]):
            pos = positions[row]
            keys = range(0 if window is None else max(pos - window + 1, 0), pos + 1)
            kk = np.stack([k[layer, tables[s, c // b], c % b] for c in keys])  # (C, K, H)
            vv = np.stack([v[layer, tables[s, c // b], c % b] for c in keys])
            for head in range(q.shape[1]):
                scores = kk[:, head // groups] @ q[row, head] * q.shape[-1] ** -0.5
                p = np.exp(scores - scores.max())
                out[row, head] = p @ vv[:, head // groups] / p.sum()
    return out


WINDOWS = [1, 7, 16, 40]  # one key, inside a block, a block, several blocks (contexts to 81)


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_sliding_window_matches_dense_attention(window):
    q, k, v, md, t = make_case(3, MIXED, kv_heads=2, groups=3, dtype="float32")
    got = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    assert_close(got, dense_attention(q, k, v, 1, md, window), t, "float32")
    full = ragged_paged_attention_reference(q, k, v, LAYER, md)
    assert not np.allclose(np.asarray(got[:t]), np.asarray(full[:t]))
    wide = ragged_paged_attention_reference(q, k, v, LAYER, md, window=NO_WINDOW)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(full))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("min_rows_per_seq, chunk_blocks", [(1, 1), (1, None), (1000, 2)])
def test_xla_backend_sliding_window(window, min_rows_per_seq, chunk_blocks):
    """Per row and per tile, whole and walked in chunks; the window traced, as a scanned
    model of local and global layers passes it."""
    q, k, v, md, t = make_case(4, MIXED, kv_heads=2, groups=3, dtype="float32", block_size=8)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    got = jax.jit(lambda q, k, v, md, w: ragged_paged_attention_xla(
        q, k, v, LAYER, md, window=w, block_q=4, min_rows_per_seq=min_rows_per_seq,
        chunk_blocks=chunk_blocks))(q, k, v, md, jnp.int32(window))
    assert_close(got, want, t, "float32")


@pytest.mark.parametrize("window", WINDOWS)
def test_pallas_sliding_window(window):
    """The walk starts at the first page a tile's first token sees: tiles whose window begins
    inside a page, on a page boundary, and before the first page."""
    q, k, v, md, t = make_case(5, MIXED, kv_heads=2, groups=3, dtype="float32", block_size=8)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    got = ragged_paged_attention(q, k, v, LAYER, md, window=jnp.int32(window), interpret=True)
    assert_close(got, want, t, "float32")


@pytest.mark.parametrize("window", [7, 40])
def test_mosaic_sliding_window(window):
    """The ring of slots counts from the first step the tile's window reaches."""
    q, k, v, md, t = make_case(6, MIXED, kv_heads=2, groups=3, dtype="bfloat16", head_dim=64,
                               block_size=8)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    got = ragged_paged_attention_mosaic(q, k, v, LAYER, md, window=window, interpret=True)
    assert_close(got, want, t, "bfloat16")


@pytest.mark.parametrize("groups", [1, 3, 4, 8])
def test_aligned_tile_reads_hold_each_tile_and_unfold_back(groups):
    """The mosaic kernel reads a tile's TILE_ROWS folded rows from the multiple of 8 at or
    before its first row: every tile's own rows lie inside that read, `tile_offsets` rows in,
    and unfolding the reads (what an identity kernel would store) gives back every query row."""
    seqs = [(1, 5), (1, 17), (7, 40), (30, 30), (1, 9), (61, 70), (1, 3)]
    q, _, _, md, t = make_case(groups, seqs, kv_heads=2, groups=groups, dtype="float32")
    tokens = aligned_tokens(groups, TILE_ROWS)
    num_tiles, tile_seq, tile_row = folded_tiles(md, q.shape[0], tokens)
    lead = np.asarray(tile_offsets(md, tile_seq, tile_row, groups))
    folded = np.asarray(fold_queries(q, 2, TILE_ROWS))  # (K, R >= T * G + 64, H)
    qsl = np.asarray(md.query_start_loc)
    reads = np.zeros((2, num_tiles, TILE_ROWS, q.shape[2]), np.float32)
    used = 0
    for i, (seq, row0) in enumerate(zip(np.asarray(tile_seq), np.asarray(tile_row), strict=True)):
        if row0 >= qsl[seq + 1] - qsl[seq]:
            continue  # an unused tile
        first = (qsl[seq] + row0) * groups
        assert lead[i] == first % ALIGN
        own = min(tokens, qsl[seq + 1] - qsl[seq] - row0) * groups
        assert lead[i] + own <= TILE_ROWS
        reads[:, i] = folded[:, first - lead[i]:first - lead[i] + TILE_ROWS]
        used += 1
    assert used > len(seqs)  # some sequences span several tiles
    got = np.asarray(unfold_tiles(jnp.asarray(reads), md, tokens, groups, jnp.asarray(lead)))
    np.testing.assert_array_equal(got[:t], np.asarray(q)[:t])


def test_mosaic_refuses_what_it_cannot_run():
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="float32", head_dim=64)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16"):
        ragged_paged_attention_mosaic(q, k, v, LAYER, md, interpret=True)
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="bfloat16")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
        ragged_paged_attention_mosaic(q, k, v, LAYER, md, interpret=True)


@pytest.mark.parametrize("seed", range(6))
def test_query_tiles_and_row_tiles_are_inverse_on_ragged_batches(seed):
    """Tile arithmetic of the GQA-folded kernel: every real row lands in a tile of its own
    sequence at its own offset, the tiles of a sequence cover its rows once, and no tile is
    needed past the bound the kernels size their grids by."""
    rng = np.random.default_rng(300 + seed)
    seqs = [(int(ql), int(ql) + int(rng.integers(0, 50)))
            for ql in rng.integers(1, 90, int(rng.integers(1, 9)))]
    md, t, _ = ragged_metadata(seqs, 16, seed, pad_tokens=16, pad_seqs=2)
    for groups in (1, 3, 8):
        tokens = TILE_ROWS // groups
        num_tiles = md.positions.shape[0] // tokens + md.context_lens.shape[0]
        tile_seq, tile_row = map(np.asarray, query_tiles(md.query_start_loc, num_tiles, tokens))
        tile, row = map(np.asarray, row_tiles(md, num_tiles, tokens))
        qsl, tseq = np.asarray(md.query_start_loc), np.asarray(md.token_seq)
        for i in range(t):
            s = tseq[i]
            assert tile_seq[tile[i]] == s and tile_row[tile[i]] + row[i] == i - qsl[s]
            assert 0 <= row[i] < tokens
        used = tile_row < (1 << 30)
        assert used.sum() == sum(-(-ql // tokens) for ql, _ in seqs)
        pairs = set(zip(tile_seq[used], tile_row[used], strict=True))
        assert len(pairs) == used.sum()


def test_pallas_writes_nothing_outside_its_rows():
    """Rows of one sequence are computed by its own tiles only: perturbing another sequence's
    pages or queries leaves them unchanged, and the pages are never written."""
    q, k, v, md, t = make_case(0, [(5, 20), (9, 9), (1, 30)], kv_heads=2, groups=2,
                               dtype="float32")
    base = ragged_paged_attention(q, k, v, LAYER, md, interpret=True)
    other_pages = np.asarray(md.block_tables[1][:1])
    k2 = k.at[LAYER, other_pages].add(1.0)
    q2 = q.at[5:14].add(1.0)  # sequence 1's rows
    out = ragged_paged_attention(q2, k2, v, LAYER, md, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[:5]), np.asarray(base[:5]))
    np.testing.assert_array_equal(np.asarray(out[14:t]), np.asarray(base[14:t]))


def test_bad_shapes_raise_value_error():
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="float32")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ragged_paged_attention(q[:, :3], k, v, LAYER, md, interpret=True)
    with pytest.raises(ValueError, match="head dim"):
        ragged_paged_attention(q[..., :16], k, v, LAYER, md, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        ragged_paged_attention(q, k.astype(jnp.bfloat16), v, LAYER, md, interpret=True)


def test_reference_write_hits_one_layer_and_drops_padding_slots():
    k = jnp.zeros((3, 2, 4, 1, 2))  # (L, P, B, K, H)
    new = jnp.ones((3, 1, 2))
    out, _ = write_kv(k, k, jnp.int32(1), new, new, jnp.array([1, 6, 8], jnp.int32))  # 8: padding
    flat = np.asarray(out[1]).reshape(8, 2)
    assert flat[1].tolist() == [1, 1] and flat[6].tolist() == [1, 1]
    assert flat.sum() == 4 and float(out.sum()) == 4


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: Triton kernels have no CPU mode and the "
                                       "Pallas kernel is only compiled (not interpreted) there")
@pytest.mark.parametrize("backend, dtype", [
    (b, d) for b in ("pallas", "triton") for d in ("float32", "bfloat16")] + [
    ("mosaic", "bfloat16"), ("mosaic", "float16")])
@pytest.mark.parametrize("window", [None, 24])
def test_gpu_kernels_match_reference(backend, dtype, window):
    from jaxserve.kernels.attention.choose import select_attention

    _, fn = select_attention(backend)
    q, k, v, md, t = make_case(1, MIXED, kv_heads=2, groups=3, dtype=dtype, head_dim=64)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    got = fn(q, k, v, LAYER, md, window=window)
    assert_close(got, want, t, dtype)


def run_triton_interpreted(dtype: str, groups: int, window: int | None = None,
                           kv_dtype: str | None = None) -> None:
    """The jax-triton backend's kernel, launched as it plans, by Triton's interpreter on torch
    CPU tensors (a process with TRITON_INTERPRET=1 set before triton is imported).
    `kv_dtype`: an fp8 pool (as kv_write stores it, with scales) instead of one of `dtype`."""
    import torch

    from jaxserve.kernels.attention.triton import _kernel, plan_launch

    q, k, v, md, t = make_case(groups, MIXED, kv_heads=2, groups=groups, dtype=dtype)
    scales = {} if kv_dtype is None else dict(k_scale=2.0, v_scale=0.5)
    if kv_dtype is not None:
        k, v = quantize_kv(k, kv_dtype, 2.0), quantize_kv(v, kv_dtype, 0.5)
    plan = plan_launch(q, k, LAYER, md, window=window, **scales)
    as_torch = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    # numpy has no fp8: the pool's bytes, viewed as torch's fp8 dtype of the same name
    pool = (as_torch if kv_dtype is None else lambda a: torch.from_numpy(
        np.array(a).view(np.uint8)).view(getattr(torch, kv_dtype)))
    q_fold, *ints = map(as_torch, plan.args)
    out = torch.empty(plan.out_shape, dtype=q_fold.dtype)
    _kernel[plan.grid](q_fold, pool(k), pool(v), *ints, out, **plan.consts)
    got = plan.unfold(jnp.asarray(out.numpy()))
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window, **scales)
    assert_close(got, want, t, dtype)


@pytest.mark.parametrize("dtype, groups, window, kv_dtype", [
    ("float32", 3, None, None), ("float16", 8, None, None), ("float32", 3, 20, None),
    ("float32", 3, None, "float8_e4m3fn"), ("float16", 8, None, "float8_e5m2")])
def test_triton_kernel_matches_reference_in_tritons_interpreter(dtype, groups, window, kv_dtype):
    pytest.importorskip("triton", reason="the triton package is not installed")
    pytest.importorskip("torch", reason="torch is not installed")
    code = ("from tests.kernels.test_attention import run_triton_interpreted as run; "
            f"run({dtype!r}, {groups}, {window}, {kv_dtype!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("dtype, pool", [("fp32", "fp32"), ("bf16", "bf16"),
                                         ("bf16", "fp8e4nv"), ("bf16", "fp8e5")])
def test_triton_kernel_compiles_for_hopper_without_a_gpu(dtype, pool, monkeypatch):
    """The jax-triton kernel compiled by Triton itself down to a cubin for sm_90 (H100/H200),
    over pools of the queries' dtype and fp8 ones (float8_e4m3fn, float8_e5m2)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated explicitly
    triton = pytest.importorskip("triton", reason="the triton package is not installed")
    from triton.backends.compiler import GPUTarget

    from jaxserve.kernels.attention.triton import _kernel

    ptrs = ["q_ptr", "o_ptr"]
    ints = ["bt_ptr", "layer_ptr", "window_ptr", "qsl_ptr", "ctx_ptr", "tile_seq_ptr",
            "tile_row_ptr"]
    consts = {"scale": 0.125, "V_SCALE": 1.0, "MB": 32, "P": 1024, "KH": 8, "H": 128, "B": 16,
              "R": 16, "G": 4, "NT": 40, "QR": 528}
    sig = ({p: f"*{dtype}" for p in ptrs} | {p: f"*{pool}" for p in ("k_ptr", "v_ptr")}
           | {p: "*i32" for p in ints} | dict.fromkeys(consts, "constexpr"))
    src = triton.compiler.ASTSource(fn=_kernel, signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2})
    assert len(compiled.asm["cubin"]) > 1000 and ".target sm_90" in compiled.asm["ptx"]
