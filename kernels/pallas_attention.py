"""Ragged paged attention as a Pallas kernel: prefill chunks and decodes of one step in one call.

Lowering: Pallas' Triton backend (`jax.experimental.pallas.triton`). We chose it over Mosaic GPU
because this kernel's work is a data-dependent walk over a block table (one scalar load per page,
masked loads and stores at ragged row offsets), which the Triton lowering expresses with plain
masked `load`/`store` and a `fori_loop`, and because the same kernel body runs unchanged under
`interpret=True` on a CPU, which is how it is tested in CI. Mosaic GPU would let a Hopper kernel
stage pages through shared memory with the bulk-copy engine and warpgroup MMAs, which is the
next step for long contexts; it needs explicit pipelining code that cannot run on a CPU.

Work split: query rows are cut into tiles of `block_q` rows that never straddle two sequences
(tile i -> (sequence, first row)); the grid is (tiles, kv heads). A program loads its tile's
queries for the G query heads of its kv head, walks the sequence's pages up to the last position
the tile can see (causal), reading K/V pages in place through the block table, and keeps an
online softmax in float32. Rows past the sequence's end are masked on store, so the kernel writes
nothing outside its own rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.metadata import AttentionMetadata, check_attention_inputs, query_tiles

# ----------------------------------------------------------------------------------- kernel body


def _kernel(
    tile_seq_ref,  # (NT,) int32: sequence of each tile
    tile_row_ref,  # (NT,) int32: tile's first row within its sequence's query rows
    qsl_ref,  # (S + 1,) int32: query_start_loc
    ctx_ref,  # (S,) int32: context length after this step
    bt_ref,  # (S, MB) int32: block tables
    layer_ref,  # (1,) int32: which layer of the pool to read
    q_ref,  # (T + block_q, N, H): queries, padded by one tile so slices stay in bounds
    k_ref,  # (L, P, B, K, H)
    v_ref,  # (L, P, B, K, H)
    o_ref,  # (T + block_q, N, H)
    *,
    block_q: int,
    groups: int,
    scale: float,
):
    tile, kh = pl.program_id(0), pl.program_id(1)
    page = k_ref.shape[2]
    layer = layer_ref[0]
    seq = tile_seq_ref[tile]
    row0 = tile_row_ref[tile]
    start = qsl_ref[seq]
    q_len = qsl_ref[seq + 1] - start

    @pl.when(row0 < q_len)
    def _():
        ctx = ctx_ref[seq]
        rows = row0 + jnp.arange(block_q, dtype=jnp.int32)  # (BQ,)
        row_ok = rows < q_len
        q_pos = ctx - q_len + rows  # (BQ,) position of each query row
        last_pos = ctx - q_len + jnp.minimum(row0 + block_q, q_len) - 1
        num_pages = last_pos // page + 1
        qs = [plgpu.load(q_ref.at[pl.ds(start + row0, block_q), kh * groups + g, :])  # (BQ, H)
              for g in range(groups)]

        def body(j, carry):
            blk = bt_ref[seq, j]
            k = plgpu.load(k_ref.at[layer, blk, :, kh, :])  # (B, H)
            v = plgpu.load(v_ref.at[layer, blk, :, kh, :])  # (B, H)
            key_pos = j * page + jnp.arange(page, dtype=jnp.int32)  # (B,)
            visible = key_pos[None, :] <= q_pos[:, None]  # (BQ, B)
            out = []
            for g in range(groups):
                m, denom, acc = carry[g]
                s = jnp.dot(qs[g], k.T, preferred_element_type=jnp.float32) * scale  # (BQ, B)
                s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=-1))  # (BQ,)
                # Rows that see no key yet keep m = -inf; guard the rescale against inf - inf.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe[:, None])  # (BQ, B)
                alpha = jnp.exp(m - m_safe)  # (BQ,)
                denom = alpha * denom + p.sum(axis=-1)
                acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                                     preferred_element_type=jnp.float32)
                out.append((m_new, denom, acc))
            return tuple(out)

        h = q_ref.shape[-1]
        init = tuple((jnp.full((block_q,), -jnp.inf, jnp.float32),
                      jnp.zeros((block_q,), jnp.float32),
                      jnp.zeros((block_q, h), jnp.float32)) for _ in range(groups))
        final = jax.lax.fori_loop(0, num_pages, body, init)
        for g in range(groups):
            _, denom, acc = final[g]
            out = acc / jnp.where(denom == 0, 1.0, denom)[:, None]
            plgpu.store(o_ref.at[pl.ds(start + row0, block_q), kh * groups + g, :],
                        out.astype(o_ref.dtype), mask=row_ok[:, None])


# ----------------------------------------------------------------------------- pallas_call build


def _build(t_pad: int, n: int, h: int, kv_heads: int, num_tiles: int, dtype, *, block_q: int,
           scale: float, interpret: bool, num_warps: int, num_stages: int):
    kernel = functools.partial(_kernel, block_q=block_q, groups=n // kv_heads, scale=scale)
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t_pad, n, h), dtype),
        grid=(num_tiles, kv_heads),
        interpret=interpret,
        compiler_params=params,
        name="ragged_paged_attention",
    )


# ---------------------------------------------------------------------------------- public entry


@functools.partial(jax.jit, static_argnames=("block_q", "interpret", "num_warps", "num_stages",
                                             "scale"))
def ragged_paged_attention(
    q: jax.Array,  # (T, N, H)
    k_pages: jax.Array,  # (L, P, B, K, H)
    v_pages: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    block_q: int = 16,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # (T, N, H)
    """Attention of one step's ragged query rows over the paged KV pool.

    The pools hold every layer; `layer` picks one, so the caller never slices a copy out.
    Rows of sequence s are q[query_start_loc[s]:query_start_loc[s + 1]], at positions ending at
    context_lens[s] - 1; each attends causally to its sequence's first (position + 1) keys,
    found through block_tables[s]. Rows past query_start_loc[-1] are padding and come back
    unspecified. float32 or bfloat16 inputs; float32 accumulation.
    """
    check_attention_inputs(q, k_pages, v_pages, md)
    t, n, h = q.shape
    kv_heads = k_pages.shape[3]
    scale = h**-0.5 if scale is None else scale
    num_tiles = t // block_q + md.context_lens.shape[0]  # a sequence adds <= 1 partial tile
    tile_seq, tile_row = query_tiles(md.query_start_loc, num_tiles, block_q)
    q_pad = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    call = _build(t + block_q, n, h, kv_heads, num_tiles, q.dtype, block_q=block_q, scale=scale,
                  interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    out = call(tile_seq, tile_row, md.query_start_loc, md.context_lens, md.block_tables, layer,
               q_pad, k_pages, v_pages)
    return out[:t]
