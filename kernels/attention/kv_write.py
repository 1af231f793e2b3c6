"""The K/V page write every attention backend shares: scatter one step's keys and values into
their slots of the paged pool. An fp8 pool stores K / k_scale and V / v_scale (vLLM's
semantics), saturated to the format's finite range: float8_e4m3fn has no infinity, and a cast
past +-448 gives NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention.base import is_fp8


def quantize_kv(x: jax.Array, dtype, scale: float = 1.0) -> jax.Array:
    """`x` as stored in a pool of `dtype`: divided by `scale` and saturated where that is an
    8-bit float, else cast."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    top = float(jnp.finfo(dtype).max)  # 448 (e4m3fn), 57344 (e5m2)
    x = x.astype(jnp.float32)
    if scale != 1.0:
        x = x / scale
    return jnp.clip(x, -top, top).astype(dtype)


def write_kv(
    k_pool: jax.Array,  # (L, P, B, K, H)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    k: jax.Array,  # (T, K, H)
    v: jax.Array,  # (T, K, H)
    slot_mapping: jax.Array,  # (T,) int32; out-of-range slots are dropped (padding rows)
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V of one layer into their slots; returns the updated pools.

    The scatter addresses the whole pool (layer, block, offset) rather than a sliced-out layer,
    so that inside the layer scan XLA updates the donated pool in place instead of copying a
    layer's pages out and back every layer.
    """
    b = k_pool.shape[2]
    blk, off = slot_mapping // b, slot_mapping % b
    k_pool = k_pool.at[layer, blk, off].set(quantize_kv(k, k_pool.dtype, k_scale), mode="drop")
    v_pool = v_pool.at[layer, blk, off].set(quantize_kv(v, v_pool.dtype, v_scale), mode="drop")
    return k_pool, v_pool
