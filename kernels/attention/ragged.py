"""Ragged step metadata for auto's self-test, the kernel tests and the GPU check: a mixed batch
over shuffled pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.attention.metadata import AttentionMetadata


def ragged_metadata(seqs: list[tuple[int, int]], block_size: int = 16, seed: int = 0,
                    pad_tokens: int = 0, pad_seqs: int = 0,
                    spare_pages: int = 0) -> tuple[AttentionMetadata, int, int]:
    """seqs: (query rows this step, context length after the step) per sequence.

    Pages are a random permutation of the pool, so a sequence's pages are scattered. `pad_*`
    add padding token rows and padding sequences, as the engine's buckets do. Returns
    (metadata, real token count, pages in the pool)."""
    rng = np.random.default_rng(seed)
    num_tokens = sum(q for q, _ in seqs)
    t_pad = -(-num_tokens // 16) * 16 + pad_tokens
    s_pad = len(seqs) + pad_seqs
    mb = max(-(-c // block_size) for _, c in seqs) + (1 if pad_seqs else 0)
    pages = sum(-(-c // block_size) for _, c in seqs) + spare_pages
    perm = rng.permutation(pages).astype(np.int32)
    bt = np.zeros((s_pad, mb), np.int32)
    qsl = np.full(s_pad + 1, num_tokens, np.int32)
    ctx = np.zeros(s_pad, np.int32)
    pos = np.zeros(t_pad, np.int32)
    tseq = np.zeros(t_pad, np.int32)
    row = used = 0
    for i, (ql, c) in enumerate(seqs):
        nb = -(-c // block_size)
        bt[i, :nb] = perm[used:used + nb]
        used += nb
        qsl[i], ctx[i] = row, c
        pos[row:row + ql] = np.arange(c - ql, c)
        tseq[row:row + ql] = i
        row += ql
    md = AttentionMetadata(positions=jnp.asarray(pos), token_seq=jnp.asarray(tseq),
                           slot_mapping=jnp.zeros(t_pad, jnp.int32), block_tables=jnp.asarray(bt),
                           context_lens=jnp.asarray(ctx), query_start_loc=jnp.asarray(qsl))
    return md, num_tokens, pages
