"""AttentionMetadata: what a ragged paged-attention call needs to know about one step's tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Describes T query tokens (prefill chunks and decodes mixed) belonging to S sequences.

    Tokens of one sequence are contiguous: sequence s owns rows
    query_start_loc[s] : query_start_loc[s + 1]. Padding rows (past query_start_loc[num_seqs])
    belong to no real sequence; their slot is out of range so their K/V writes are dropped.
    """

    positions: jax.Array  # (T,) int32: position of each token in its sequence
    token_seq: jax.Array  # (T,) int32: index in [0, S) of the sequence a token belongs to
    slot_mapping: jax.Array  # (T,) int32: flat slot (block * B + offset) its K/V is written to
    block_tables: jax.Array  # (S, MB) int32: physical block ids of each sequence
    context_lens: jax.Array  # (S,) int32: tokens in the cache after this step (0 for padding)
    query_start_loc: jax.Array  # (S + 1,) int32: first token row of each sequence


_SKIP_ROW = 1 << 30  # first row of a padding tile: past any sequence, so the tile does nothing


def check_attention_inputs(q, k_pages, v_pages, md: AttentionMetadata) -> None:
    """Raise ValueError naming what is wrong with a paged-attention call's inputs."""
    t, n, h = q.shape
    if k_pages.ndim != 5:
        raise ValueError(f"k_pages must be (L, P, B, K, H), got shape {k_pages.shape}")
    kv_heads, h_kv = k_pages.shape[3:]
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    if h_kv != h:
        raise ValueError(f"head dim of q ({h}) and of the pages ({h_kv}) differ")
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kv_heads})")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"page dtype {k_pages.dtype} must match q dtype {q.dtype}")
    s = md.context_lens.shape[0]
    if md.query_start_loc.shape != (s + 1,) or md.block_tables.shape[0] != s:
        raise ValueError("metadata: query_start_loc must be (S + 1,) and block_tables (S, MB) "
                         f"for S = {s}, got {md.query_start_loc.shape}, {md.block_tables.shape}")


def query_tiles(query_start_loc: jax.Array, num_tiles: int, block_q: int):
    """Map tile index -> (sequence, first row), tiles of `block_q` rows never straddling two
    sequences. (num_tiles,) int32 each; unused tiles get a first row past every sequence."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # (S,)
    per_seq = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(per_seq)  # (S,) inclusive
    idx = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(cum, idx, side="right").astype(jnp.int32)
    valid = idx < cum[-1]
    seq = jnp.where(valid, seq, 0)
    row = (idx - (cum[seq] - per_seq[seq])) * block_q
    return seq, jnp.where(valid, row, _SKIP_ROW).astype(jnp.int32)
