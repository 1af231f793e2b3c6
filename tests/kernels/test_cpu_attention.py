"""The C++ CPU attention kernel (kernels/attention/cpu.py) against the jnp reference, and
`auto` without a compiler."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention import cpu as cpu_attention
from jaxserve.kernels.attention.cpu import ragged_paged_attention_cpu
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from tests.kernels.test_attention import LAYER, MIXED, assert_close, make_case
from tests.kernels.test_cpu_library import FEWER, fewer_targets, x86

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def run(q, k, v, md, **kw):
    return jax.jit(lambda q, k, v, md: ragged_paged_attention_cpu(q, k, v, LAYER, md, **kw))(
        q, k, v, md)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("block_q", [1, 16])
def test_matches_reference(groups, head_dim, block_q):
    q, k, v, md, t = make_case(groups, MIXED, kv_heads=2, groups=groups, dtype="float32",
                               head_dim=head_dim)
    got = run(q, k, v, md, block_q=block_q)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, ragged_paged_attention_reference(q, k, v, LAYER, md), t, "float32")
    assert not np.asarray(got[t:]).any()  # padding rows are zeros


@pytest.mark.parametrize("pool_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("block_q", [1, 16])
def test_half_precision_pools_give_their_float32_values_results(pool_dtype, block_q):
    """A float16 or bfloat16 pool is widened to float32 as it loads, exactly, and the rest is
    the same arithmetic: the output equals, bit for bit, that of a float32 pool holding the
    same (rounded) values, and it matches the reference on those values."""
    q, k, v, md, t = make_case(11, MIXED, kv_heads=3, groups=3, dtype="float32", head_dim=64)
    kh, vh = k.astype(pool_dtype), v.astype(pool_dtype)
    got = run(q, kh, vh, md, block_q=block_q)
    want = run(q, kh.astype(jnp.float32), vh.astype(jnp.float32), md, block_q=block_q)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_close(got, ragged_paged_attention_reference(q, kh.astype(jnp.float32),
                                                       vh.astype(jnp.float32), LAYER, md),
                 t, "float32")
    # Rounding the pool is what changes the result, and only by its precision.
    assert not np.array_equal(np.asarray(got), np.asarray(run(q, k, v, md, block_q=block_q)))


@pytest.mark.parametrize("pool_dtype", ["float32", "float16"])
def test_a_rows_output_does_not_depend_on_its_tile(pool_dtype):
    """Batch invariance: a row's output is the same floats in a tile of its own (block_q 1)
    as in tiles of 3, 16 or 64 rows, whose other rows see more or fewer keys; a query row
    sees keys up to its position, so the rows of a prompt chunk reach different lengths."""
    q, k, v, md, t = make_case(5, MIXED + [(40, 45), (23, 23)], kv_heads=3, groups=3,
                               dtype="float32", head_dim=64)
    k, v = k.astype(pool_dtype), v.astype(pool_dtype)
    alone = np.asarray(run(q, k, v, md, block_q=1))
    for block_q in (3, 16, 64):
        np.testing.assert_array_equal(np.asarray(run(q, k, v, md, block_q=block_q)), alone)


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    """Many sequences (more tiles than threads), tiles of 1 to 64 rows, block sizes 8 and 16
    and ones that are not whole vectors of keys (5, 12: a vector of keys spans two pages)."""
    rng = np.random.default_rng(300 + seed)
    seqs = []
    for _ in range(int(rng.integers(1, 40))):
        ql = int(rng.choice([1, 1, 1, int(rng.integers(1, 90))]))
        seqs.append((ql, ql + int(rng.integers(0, 200))))
    q, k, v, md, t = make_case(seed, seqs, kv_heads=int(rng.choice([1, 3])), groups=3,
                               dtype="float32", block_size=int(rng.choice([5, 8, 12, 16])),
                               head_dim=64)
    got = run(q, k, v, md, block_q=int(rng.choice([1, 7, 16, 64])))
    assert_close(got, ragged_paged_attention_reference(q, k, v, LAYER, md), t, "float32")


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("block_q", [1, 16])
def test_sliding_window_matches_reference(window, block_q):
    """A tile reads from its first row's window on; each row masks the keys that left its
    own, including those its tile's first row still sees."""
    q, k, v, md, t = make_case(8, MIXED, kv_heads=2, groups=3, dtype="float32", block_size=8)
    got = jax.jit(lambda q, k, v, md, w: ragged_paged_attention_cpu(
        q, k, v, LAYER, md, window=w, block_q=block_q))(q, k, v, md, jnp.int32(window))
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, window=window)
    assert_close(got, want, t, "float32")


def test_reads_only_the_blocks_each_row_reaches():
    """Tables widened to 12 blocks whose extra entries point at a page of NaNs: a key read
    past a row's position, or a block past its context, would bring them in."""
    q, k, v, md, t = make_case(7, [(1, 9), (6, 21), (17, 17), (1, 2)], kv_heads=2, groups=3,
                               dtype="float32", block_size=8)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    poison = k.shape[1]
    k, v = (jnp.concatenate([x, jnp.full_like(x[:, :1], jnp.nan)], axis=1) for x in (k, v))
    s, mb = md.block_tables.shape
    md = dataclasses.replace(
        md, block_tables=jnp.full((s, 12), poison, jnp.int32).at[:, :mb].set(md.block_tables))
    got = run(q, k, v, md, block_q=4)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert_close(got, want, t, "float32")


def test_layer_inside_a_scan_reads_its_own_pages():
    """As the model calls it: the layer index is a traced loop counter."""
    q, k, v, md, t = make_case(2, MIXED, kv_heads=2, groups=3, dtype="float32")

    def layers(fn):
        def body(carry, layer):
            return carry, fn(q, k, v, layer, md)
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(2))[1])()

    got = layers(ragged_paged_attention_cpu)
    want = layers(ragged_paged_attention_reference)
    for layer in range(2):
        assert_close(got[layer], want[layer], t, "float32")
    assert not np.allclose(np.asarray(got[0, :t]), np.asarray(got[1, :t]))


def test_unsupported_inputs_name_what_is_wrong():
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="float32", head_dim=40)
    with pytest.raises(ValueError, match="head_dim 40"):
        ragged_paged_attention_cpu(q, k, v, LAYER, md)
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 pages.*bfloat16"):
        ragged_paged_attention_cpu(q, k, v, LAYER, md)
    q, k, v, md, _ = make_case(0, [(3, 5)], kv_heads=2, groups=2, dtype="float32")
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_cpu(q, k, v, LAYER, md, block_q=65)


def test_without_a_compiler_auto_takes_xla_and_says_why(tmp_path):
    """A machine with no C++ compiler (none on PATH, no built library cached) still serves:
    auto warns and picks the jnp backend; asking for 'cpu' fails at once, naming the reason."""
    code = """if True:
        import warnings
        import jax
        from jaxserve.kernels.attention.choose import select_attention
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend, _ = select_attention("auto", dtype=jax.numpy.float32, head_dim=64,
                                          groups=3, block_size=16)
        print(backend.value, "|", [str(w.message) for w in caught])
        try:
            select_attention("cpu")
        except ValueError as e:
            print("error |", e)
    """
    env = {**os.environ, "PATH": os.path.dirname(sys.executable),
           "JAXSERVE_CACHE_DIR": str(tmp_path), "CXX": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    chosen, error = out.stdout.strip().splitlines()
    assert chosen.startswith("xla |") and "no C++ compiler" in chosen
    assert error.startswith("error |") and "'cpu' cannot run here" in error


@x86
@pytest.mark.parametrize("name", sorted(FEWER))
def test_the_paths_of_cpus_with_fewer_instructions(name, monkeypatch):
    """The kernel built for a CPU without AVX-512 (and without AVX2) matches the reference on
    every pool dtype, and its half-precision loads stay exact (CI's CPU may have AVX-512, so
    its own path never runs these)."""
    monkeypatch.setattr(cpu_attention, "TARGET", fewer_targets(name)[cpu_attention.TARGET])
    q, k, v, md, t = make_case(5, MIXED, kv_heads=3, groups=3, dtype="float32", head_dim=64)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md)
    for block_q in (1, 16):
        assert_close(run(q, k, v, md, block_q=block_q), want, t, "float32")
        for pool_dtype in ("float16", "bfloat16"):
            kh, vh = k.astype(pool_dtype), v.astype(pool_dtype)
            np.testing.assert_array_equal(
                np.asarray(run(q, kh, vh, md, block_q=block_q)),
                np.asarray(run(q, kh.astype(jnp.float32), vh.astype(jnp.float32), md,
                               block_q=block_q)))
