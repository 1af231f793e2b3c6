"""AttentionMetadata: what a ragged paged-attention call needs to know about one step's tokens."""

from __future__ import annotations

import dataclasses

import jax


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
