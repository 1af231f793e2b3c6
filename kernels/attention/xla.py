"""Ragged paged attention in plain jnp, shaped for XLA: the backend that runs anywhere, auto's
choice where no kernel can (a CPU without the C++ kernel, a GPU where none passes the self-test,
other platforms).

On a CPU the cost of paged attention is moving K/V, not its arithmetic. Two things keep that
small:

- Rows share gathers where they share a context. Rows [0, S) (S = the step's sequence bucket;
  the scheduler puts decodes first, so every decode row is here) attend one row at a time;
  rows [S, T) go as tiles of `block_q` rows that never straddle two sequences (the tiling of
  the Pallas kernel), so a long prompt chunk reads its context T / block_q times, not T times.
- Query tiles over long tables walk their context `chunk_blocks` blocks at a time with an
  online softmax, as the GPU kernels do, instead of gathering the whole padded context at
  once: a chunk's K/V stays in cache between its gather and its two dots, and the walk stops
  after the chunk holding the step's longest real context, so the block bucket's padding
  costs nothing. Decode rows read their whole context at once (see `_chunks`).

Any mix of rows is handled exactly; the split only decides which path a row takes. Checked
against the reference in the kernel tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention.base import AttentionBackend, Backend
from jaxserve.kernels.attention.metadata import AttentionMetadata, query_tiles
from jaxserve.kernels.attention.reference import (
    ragged_paged_attention_reference,
    visible,
    widen,
)

_MASKED = -1e30  # a masked score: finite, so a row with nothing seen yet never makes NaNs


def _online_attention(q, q_pos, tables, k_pool, v_pool, layer, scale, chunk_blocks,
                      window=None, kv_scales=(1.0, 1.0)):
    """q (R, Q, K, G, H) queries of R rows (or tiles) of Q tokens, q_pos (R, Q) their positions,
    tables (R, MB) the blocks of each one's sequence -> (R, Q, K, G, H) float32.

    Walks the context `chunk_blocks` blocks at a time, up to the chunk holding the largest
    position: padding rows must have small positions (the step's have 0)."""
    r, nq, kh, g, h = q.shape
    b = k_pool.shape[2]
    mb = tables.shape[1]
    c = chunk_blocks
    tables = jnp.pad(tables, ((0, 0), (0, -mb % c))).reshape(r, -1, c)  # (R, chunks, c)
    num_chunks = jnp.minimum(jnp.max(q_pos) // (c * b) + 1, tables.shape[1])
    offs = jnp.arange(c * b, dtype=jnp.int32)

    def chunk(j, carry):
        m, norm, acc = carry  # running max (R, Q, K, G), normalizer (same), output (..., H)
        ids = tables[:, j]  # (R, c)
        # A pool of another dtype (kv_cache_dtype) computes in q's.
        k = widen(k_pool[layer, ids].reshape(r, c * b, kh, h), q.dtype, kv_scales[0])
        v = widen(v_pool[layer, ids].reshape(r, c * b, kh, h), q.dtype, kv_scales[1])
        s = jnp.einsum("rqkgh,rckh->rqkgc", q, k, preferred_element_type=jnp.float32) * scale
        seen = visible(j * c * b + offs[None, None, :], q_pos[:, :, None], window)  # (R, Q, cB)
        s = jnp.where(seen[:, :, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("rqkgc,rckh->rqkgh", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_new, norm * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    stats = jnp.full((r, nq, kh, g), _MASKED, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros((r, nq, kh, g, h), jnp.float32))
    _, norm, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    return acc / norm[..., None]


def _attend(q, k, v, q_pos, scale, window=None):
    """The whole context at once: q (R, Q, K, G, H) against k, v (R, C, K, H); q_pos (R, Q)
    -> (R, Q, K, G, H) float32."""
    scores = jnp.einsum("rqkgh,rckh->rqkgc", q, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = visible(key_pos[None, None, :], q_pos[:, :, None], window)  # (R, Q, C)
    scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("rqkgc,rckh->rqkgh", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)


def _chunks(tiles: bool, mb: int, chunk_blocks: int | None) -> int | None:
    """Blocks per chunk of the walk over MB-block tables, or None for the whole context at
    once. By default only query tiles (prompt chunks) walk, 4 blocks at a time, and only over
    tables of 16 blocks or more. Decode rows do not walk: one long context would set every
    row's trip count, and the loop and rescaling cost more than the cache misses they save;
    short tables have little padding to skip."""
    if chunk_blocks is None:
        chunk_blocks = 4 if tiles and mb >= 16 else mb
    return chunk_blocks if chunk_blocks < mb else None


def ragged_paged_attention_xla(
    q: jax.Array,  # (T, N, H)
    k_pool: jax.Array,  # (L, P, B, K, H)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array | int,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    block_q: int = 16,
    min_rows_per_seq: int = 8,
    chunk_blocks: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H)
    """Same contract as `ragged_paged_attention_reference`. Tiles only in steps of at least
    `min_rows_per_seq` * S rows: the tile count is bounded by (T - S) / block_q + S, all
    computed whatever the step holds, so in smaller steps the padding tiles cost more than the
    gathers they save."""
    t, n, h = q.shape
    s = md.context_lens.shape[0]
    _, _, b, kh, _ = k_pool.shape
    g = n // kh
    mb = md.block_tables.shape[1]
    scale = h**-0.5 if scale is None else scale

    def per_row(rows: int) -> jax.Array:  # rows [0, rows) one at a time -> (rows, N, H)
        c = _chunks(False, mb, chunk_blocks)
        if c is None:
            first = dataclasses.replace(md, positions=md.positions[:rows],
                                        token_seq=md.token_seq[:rows])
            out = ragged_paged_attention_reference(q[:rows], k_pool, v_pool, layer, first,
                                                   scale=scale, window=window,
                                                   k_scale=k_scale, v_scale=v_scale)
            return out.astype(jnp.float32)
        out = _online_attention(
            q[:rows].reshape(rows, 1, kh, g, h), md.positions[:rows, None],
            md.block_tables[md.token_seq[:rows]], k_pool, v_pool, layer, scale, c, window,
            (k_scale, v_scale))
        return out.reshape(rows, n, h)

    if t < min_rows_per_seq * s or t <= s:  # every row on the per-row path
        return per_row(t).astype(q.dtype)
    head = per_row(s)

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
    c = _chunks(True, mb, chunk_blocks)
    if c is None:
        k = widen(k_pool[layer, tables].reshape(num_tiles, mb * b, kh, h), q.dtype, k_scale)
        v = widen(v_pool[layer, tables].reshape(num_tiles, mb * b, kh, h), q.dtype, v_scale)
        tail = _attend(q_tiles, k, v, q_pos, scale, window)
    else:
        tail = _online_attention(q_tiles, q_pos, tables, k_pool, v_pool, layer, scale, c,
                                 window, (k_scale, v_scale))
    tail = tail.reshape(num_tiles * block_q, n, h)
    out = jnp.zeros((t, n, h), jnp.float32).at[:s].set(head)
    out = out.at[rows.reshape(-1)].set(tail, mode="drop")
    return out.astype(q.dtype)


class XlaBackend(Backend):
    name = AttentionBackend.XLA

    def fn(self):
        return ragged_paged_attention_xla


BACKEND = XlaBackend()
