"""Ragged paged attention in plain jnp, shaped for XLA:CPU: the default CPU backend.

On a CPU the cost of paged attention is the gather of K/V through the block table (XLA:CPU
gathers at ~5-10 GB/s), not its arithmetic. The reference gathers a sequence's padded context
once per query token, which is right for decode rows (one token per sequence) and wasteful for
prefill rows, where hundreds of tokens share one context. So the step's rows are split:

- rows [0, S) (S = the step's sequence bucket; the scheduler puts decodes first, so every decode
  row is here): one gather per row, as the reference does;
- rows [S, T): tiles of `block_q` rows that never straddle two sequences (the same tiling as the
  Pallas kernel), one gather per tile, so a long prompt chunk reads its context T / block_q
  times instead of T times.

A step of T padded rows and C padded context gathers (S + (T - S) / block_q + S) * C keys
instead of T * C: at T = 512, S = 64 that is 3.3x less, and such a step (a long prompt chunk
next to the running decodes) runs ~1.4x faster. Any mix of rows is handled exactly; the
split only decides which path a row takes. Checked against the reference in the kernel tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels.metadata import AttentionMetadata, query_tiles
from kernels.reference import ragged_paged_attention_reference


def _attend(q, k, v, q_pos, scale):
    """q (R, Q, K, G, H) against k, v (R, C, K, H); q_pos (R, Q) -> (R, Q, K, G, H) float32."""
    scores = jnp.einsum("rqkgh,rckh->rqkgc", q, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # (R, Q, C)
    scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("rqkgc,rckh->rqkgh", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)


def ragged_paged_attention_xla(
    q: jax.Array,  # (T, N, H)
    k_pool: jax.Array,  # (L, P, B, K, H)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array | int,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    block_q: int = 16,
    min_rows_per_seq: int = 8,
) -> jax.Array:  # (T, N, H)
    """Tiles only in steps of at least `min_rows_per_seq` * S rows: the tile count is bounded
    by (T - S) / block_q + S, all computed whatever the step holds, so in smaller steps the
    padding tiles cost more than the gathers they save (measured: a 256-row step with S = 64
    was 1.2x slower tiled, a 512-row one 1.4x faster)."""
    t, n, h = q.shape
    s = md.context_lens.shape[0]
    if t < min_rows_per_seq * s or t <= s:  # every row on the per-row path
        return ragged_paged_attention_reference(q, k_pool, v_pool, layer, md, scale=scale)
    _, _, b, kh, _ = k_pool.shape
    g = n // kh
    mb = md.block_tables.shape[1]
    scale = h**-0.5 if scale is None else scale

    first = dataclasses.replace(md, positions=md.positions[:s], token_seq=md.token_seq[:s])
    head = ragged_paged_attention_reference(q[:s], k_pool, v_pool, layer, first, scale=scale)

    # Rows [S, T) as tiles: each sequence's share of those rows, shifted to start at 0.
    qsl = jnp.clip(md.query_start_loc, s, t) - s  # (S + 1,)
    num_tiles = (t - s) // block_q + s
    tile_seq, tile_row = query_tiles(qsl, num_tiles, block_q)  # (NT,), row within its sequence
    offs = jnp.arange(block_q, dtype=jnp.int32)
    local = tile_row[:, None] + offs[None, :]  # (NT, BQ)
    q_len = (qsl[1:] - qsl[:-1])[tile_seq]  # (NT,)
    valid = local < q_len[:, None]
    rows = s + qsl[tile_seq][:, None] + local  # (NT, BQ) rows of the step
    rows = jnp.where(valid, rows, t)  # invalid rows: out of range (dropped on the way back)
    safe = jnp.minimum(rows, t - 1)
    q_tiles = q[safe].reshape(num_tiles, block_q, kh, g, h)
    q_pos = jnp.where(valid, md.positions[safe], 0)  # (NT, BQ); invalid rows are dropped
    tables = md.block_tables[tile_seq]  # (NT, MB)
    k = k_pool[layer, tables].reshape(num_tiles, mb * b, kh, h)
    v = v_pool[layer, tables].reshape(num_tiles, mb * b, kh, h)
    tail = _attend(q_tiles, k, v, q_pos, scale).reshape(num_tiles * block_q, n, h)
    out = jnp.zeros((t, n, h), jnp.float32).at[:s].set(head.astype(jnp.float32))
    out = out.at[rows.reshape(-1)].set(tail, mode="drop")
    return out.astype(q.dtype)
