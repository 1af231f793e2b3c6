"""The K/V page write every attention backend shares: scatter one step's keys and values into
their slots of the paged pool."""

from __future__ import annotations

import jax


def write_kv(
    k_pool: jax.Array,  # (L, P, B, K, H)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    k: jax.Array,  # (T, K, H)
    v: jax.Array,  # (T, K, H)
    slot_mapping: jax.Array,  # (T,) int32; out-of-range slots are dropped (padding rows)
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V of one layer into their slots; returns the updated pools.

    The scatter addresses the whole pool (layer, block, offset) rather than a sliced-out layer,
    so that inside the layer scan XLA updates the donated pool in place instead of copying a
    layer's pages out and back every layer.
    """
    b = k_pool.shape[2]
    blk, off = slot_mapping // b, slot_mapping % b
    k_pool = k_pool.at[layer, blk, off].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, blk, off].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool
