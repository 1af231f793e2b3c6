"""AttentionMetadata: what a ragged paged-attention call needs to know about one step's tokens."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

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


def page_dtypes(dtype) -> tuple:
    """The pool dtypes a kernel that widens fp8 pages reads under q's `dtype`."""
    return (jnp.dtype(dtype), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_attention_inputs(q, k_pages, v_pages, md: AttentionMetadata,
                           page_dtypes: tuple | None = None) -> None:
    """Raise ValueError naming what is wrong with a paged-attention call's inputs.
    `page_dtypes`: the pool dtypes a backend reads whatever q's (default: q's own only)."""
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
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k page dtype {k_pages.dtype} != v page dtype {v_pages.dtype}")
    if page_dtypes is None and k_pages.dtype != q.dtype:
        raise ValueError(f"page dtype {k_pages.dtype} must match q dtype {q.dtype}")
    if page_dtypes is not None and k_pages.dtype not in page_dtypes:
        raise ValueError(f"page dtype {k_pages.dtype} is not one of "
                         f"{[jnp.dtype(d).name for d in page_dtypes]}")
    s = md.context_lens.shape[0]
    if md.query_start_loc.shape != (s + 1,) or md.block_tables.shape[0] != s:
        raise ValueError("metadata: query_start_loc must be (S + 1,) and block_tables (S, MB) "
                         f"for S = {s}, got {md.query_start_loc.shape}, {md.block_tables.shape}")


def _tiles_per_seq(query_start_loc: jax.Array, block_q: int):
    """(tiles of each sequence, inclusive cumulative sum), both (S,) int32."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # (S,)
    per_seq = (q_lens + block_q - 1) // block_q
    return per_seq, jnp.cumsum(per_seq)


def query_tiles(query_start_loc: jax.Array, num_tiles: int, block_q: int):
    """Map tile index -> (sequence, first row), tiles of `block_q` rows never straddling two
    sequences. (num_tiles,) int32 each; unused tiles get a first row past every sequence."""
    per_seq, cum = _tiles_per_seq(query_start_loc, block_q)
    idx = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all is one fused op; the default binary search is a while loop, whose condition
    # a GPU reads back on the host at every iteration (a sync per layer)
    seq = jnp.searchsorted(cum, idx, side="right", method="compare_all").astype(jnp.int32)
    valid = idx < cum[-1]
    seq = jnp.where(valid, seq, 0)
    row = (idx - (cum[seq] - per_seq[seq])) * block_q
    return seq, jnp.where(valid, row, _SKIP_ROW).astype(jnp.int32)


def row_tiles(md: AttentionMetadata, num_tiles: int, block_q: int):
    """The inverse map, row -> (tile, row within the tile), for the query tiles above.
    (T,) int32 each; padding rows get some tile in range (their output is unspecified)."""
    per_seq, cum = _tiles_per_seq(md.query_start_loc, block_q)
    seq = md.token_seq
    local = jnp.arange(seq.shape[0], dtype=jnp.int32) - md.query_start_loc[seq]
    local = jnp.maximum(local, 0)
    tile = cum[seq] - per_seq[seq] + local // block_q
    return jnp.clip(tile, 0, num_tiles - 1).astype(jnp.int32), (local % block_q).astype(jnp.int32)


# ------------------------------------------------------------------ GQA folding (the GPU kernels)
# A GPU kernel's program owns one (query tile, kv head); its tile's rows are `tokens` query
# tokens of one sequence times the G query heads that share the kv head (row r: token r // G,
# head r % G), so a decode fills G rows of the MMA and a page is read once per kv head. The
# queries go in as (K, T * G, H), where a tile's rows are contiguous, and each tile's output
# comes back in its own slot, (K, tiles, rows, H): no program stores a row another owns.


ALIGN = 8  # rows of a shared-memory tile: a bulk copy into it starts on a multiple of this


class TileExtent(NamedTuple):
    """A GPU kernel program's query tile, read from the tile map and metadata refs."""

    seq: jax.Array  # () sequence it belongs to
    row0: jax.Array  # () its first token, within the sequence's query rows
    start: jax.Array  # () the sequence's first query row in the step
    active: jax.Array  # () bool: the tile holds rows (unused tiles do nothing)
    first_pos: jax.Array  # () position of its first token
    last_pos: jax.Array  # () position of its last token (causal: the last key it sees)


def tile_extent(tile, tokens: int, tile_seq_ref, tile_row_ref, qsl_ref, ctx_ref) -> TileExtent:
    """Inside a kernel: the extent of tile `tile` of `tokens` tokens."""
    seq = tile_seq_ref[tile]
    row0 = tile_row_ref[tile]
    start = qsl_ref[seq]
    q_len = qsl_ref[seq + 1] - start
    first_pos = ctx_ref[seq] - q_len + row0
    return TileExtent(seq, row0, start, row0 < q_len, first_pos,
                      first_pos + jnp.minimum(tokens, q_len - row0) - 1)


def fold_queries(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """(T, K * G, H) -> (K, R, H): a kv head's query rows, token-major, padded by at least one
    tile (a tile starting near the end reads in bounds) to R, a multiple of 8 (ALIGN:
    a bulk copy's tiled view of the rows needs whole tiles)."""
    t, n, h = q.shape
    folded = q.reshape(t, kv_heads, n // kv_heads, h).transpose(1, 0, 2, 3)
    pad = rows + (-(t * (n // kv_heads) + rows)) % ALIGN
    return jnp.pad(folded.reshape(kv_heads, t * (n // kv_heads), h), ((0, 0), (0, pad), (0, 0)))


def tile_rows(groups: int, least: int) -> int:
    """Rows of a folded tile: a power of two, at least `least`, that holds the G heads."""
    return max(least, 1 << (groups - 1).bit_length())


def folded_tiles(md: AttentionMetadata, num_rows: int, tokens: int):
    """(number of tiles, tile -> sequence, tile -> first token) for `num_rows` query rows cut
    into tiles of `tokens` tokens; a sequence adds at most one partial tile."""
    num_tiles = num_rows // tokens + md.context_lens.shape[0]
    return (num_tiles, *query_tiles(md.query_start_loc, num_tiles, tokens))


def aligned_tokens(groups: int, rows: int) -> int:
    """Tokens of a tile whose `rows` folded rows are read from the 8-aligned row at or before
    its first: the first lies up to 8 - gcd(G, 8) rows in, and its tokens fill the rest."""
    return (rows - (ALIGN - math.gcd(groups, ALIGN))) // groups


def tile_offsets(md: AttentionMetadata, tile_seq: jax.Array, tile_row: jax.Array,
                 groups: int) -> jax.Array:
    """(NT,) int32: each tile's first folded row less the 8-aligned row its read starts at."""
    row0 = jnp.where(tile_row == _SKIP_ROW, 0, tile_row)  # unused tiles: any offset
    first = (md.query_start_loc[tile_seq] + row0) * groups
    return (first % ALIGN).astype(jnp.int32)


def unfold_tiles(out: jax.Array, md: AttentionMetadata, tokens: int, groups: int,
                 offsets: jax.Array | None = None) -> jax.Array:
    """(K, tiles, rows, H) per-tile outputs -> (T, K * G, H), each row from its own tile;
    a tile's rows start at its `offsets` entry (NT,) (default 0)."""
    kv_heads, num_tiles, _, h = out.shape
    tile, row = row_tiles(md, num_tiles, tokens)  # (T,) each
    rows = row[:, None] * groups + jnp.arange(groups, dtype=jnp.int32)  # (T, G)
    if offsets is not None:
        rows = rows + offsets[tile][:, None]
    out = out[:, tile[:, None], rows]  # (K, T, G, H)
    return out.transpose(1, 0, 2, 3).reshape(tile.shape[0], kv_heads * groups, h)
