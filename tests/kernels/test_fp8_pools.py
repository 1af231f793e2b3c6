"""fp8 KV pools (kv_cache_dtype fp8 / fp8_e5m2): the write path's scaling and saturation, each
backend that runs here against the reference on the same fp8 pool, and the reference on an fp8
pool against the unquantized one.

Tolerances: a backend against the reference on the same pool, those of test_attention.py (both
widen the same fp8 values exactly and accumulate in float32). The reference on an fp8 pool
against the float32 pool it was quantized from (standard-normal q, K, V, head_dim 32; measured
over three seeds: e4m3 max 0.12, mean 0.009; e5m2 max 0.26, mean 0.017): |error| <= 0.2 max and
0.015 mean for e4m3, 0.4 and 0.03 for e5m2; a pool read with the wrong scale misses them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention import registry
from jaxserve.kernels.attention.kv_write import quantize_kv, write_kv
from jaxserve.kernels.attention.mosaic import ragged_paged_attention_mosaic
from jaxserve.kernels.attention.pallas import ragged_paged_attention
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla
from tests.kernels.test_attention import LAYER, MIXED, assert_close, make_case

FORMATS = ["float8_e4m3fn", "float8_e5m2"]
SCALES = dict(k_scale=2.0, v_scale=0.5)
LOOSE = {"float8_e4m3fn": (0.2, 0.015), "float8_e5m2": (0.4, 0.03)}  # (max, mean) |error|


def fp8_case(kv_dtype: str, dtype: str = "float32", seed: int = 1, **kw):
    """make_case's batch with its pools quantized as kv_write stores them under SCALES."""
    q, k, v, md, t = make_case(seed, MIXED, kv_heads=2, groups=3, dtype=dtype, **kw)
    return (q, quantize_kv(k, kv_dtype, SCALES["k_scale"]),
            quantize_kv(v, kv_dtype, SCALES["v_scale"]), md, t, (k, v))


@pytest.mark.parametrize("kv_dtype, top", [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
def test_write_divides_by_the_scale_and_saturates(kv_dtype, top):
    x = jnp.array([3.0, -1e9, 1e9, 0.0], jnp.float32)
    got = np.asarray(quantize_kv(x, kv_dtype, 2.0).astype(jnp.float32))
    assert got.tolist() == [1.5, -top, top, 0.0]  # no NaN (e4m3fn has no inf) nor inf

    pool = jnp.zeros((2, 2, 4, 1, 1), kv_dtype)  # (L, P, B, K, H)
    new = jnp.array([[[6.0]], [[1e9]]])  # (T, K, H)
    k, v = write_kv(pool, pool, jnp.int32(1), new, new, jnp.array([5, 2], jnp.int32),
                    k_scale=2.0, v_scale=4.0)
    assert k.dtype == jnp.dtype(kv_dtype)
    assert float(k[1, 1, 1, 0, 0]) == 3.0 and float(v[1, 1, 1, 0, 0]) == 1.5
    assert float(k[1, 0, 2, 0, 0]) == top and float(k.astype(jnp.float32).sum()) == 3.0 + top


def _backends():
    """(name, fn, q dtype) of each kernel that runs here, interpreted where it is a GPU's (the
    Triton kernel runs in Triton's interpreter: test_attention.py)."""
    cases = [("xla", ragged_paged_attention_xla, "float32"),
             ("pallas", lambda *a, **kw: ragged_paged_attention(*a, interpret=True, **kw),
              "float32"),
             ("mosaic", lambda *a, **kw: ragged_paged_attention_mosaic(*a, interpret=True, **kw),
              "bfloat16")]
    cpu = registry.backend("cpu")
    if cpu.unavailable(dtype="float32", head_dim=32, groups=3, kv_dtype=FORMATS[0]) is None:
        cases.append(("cpu", cpu.fn(), "float32"))
    return [pytest.param(*c, id=c[0]) for c in cases]


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("name, fn, dtype", _backends())
def test_backend_reads_fp8_pool_as_the_reference(name, fn, dtype, kv_dtype):
    q, k, v, md, t, _ = fp8_case(kv_dtype, dtype, head_dim=64 if name == "mosaic" else 32)
    want = ragged_paged_attention_reference(q, k, v, LAYER, md, **SCALES)
    got = fn(q, k, v, LAYER, md, **SCALES)
    assert got.dtype == q.dtype
    assert_close(got, want, t, dtype)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_reference_on_fp8_pool_stays_near_the_unquantized_pool(kv_dtype):
    q, k8, v8, md, t, (k, v) = fp8_case(kv_dtype)
    exact = ragged_paged_attention_reference(q, k, v, LAYER, md)[:t]
    err = jnp.abs(ragged_paged_attention_reference(q, k8, v8, LAYER, md, **SCALES)[:t] - exact)
    top, mean = LOOSE[kv_dtype]
    assert float(err.max()) <= top and float(err.mean()) <= mean
    unscaled = ragged_paged_attention_reference(q, k8, v8, LAYER, md)[:t]  # scales left out
    assert float(jnp.abs(unscaled - exact).mean()) > 4 * mean
