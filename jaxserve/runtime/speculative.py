"""Verifying proposed tokens inside the compiled step (the host side is core/speculative.py).

A sequence with k proposed tokens d_1..d_k runs k + 1 query rows: its last token, then the
proposals. Row j's logits give the target's distribution p_j for position j + 1, so one step
checks every proposal and adds one token of the target's own:

- greedy rows accept d_(j+1) while it equals argmax p_j;
- sampled rows accept it with probability p_j(d_(j+1)), the rule of speculative sampling for a
  proposal that is a single token (an n-gram's: its proposal distribution is a point mass), and
  at the first rejection draw from p_j with d_(j+1) taken out, renormalized. The tokens then
  follow the target's distribution exactly, whatever was proposed.

After a_s accepted proposals row s yields a_s + 1 tokens. p_j is what plain sampling draws
from (temperature, top-k, top-p, min_p), and each position draws from its own key (the
request's seed and the token's index in its output), as plain sampling does.

**Draft model.** With `speculative_method="draft_model"` the host only says how many tokens each
row proposes; `draft_proposals` makes them in the same program, before the target's forward:
the draft model runs k times over one row per sequence (its last token, then each proposal in
turn) and proposes its argmax, so the proposal is again a single token per position and the
rule above keeps the target's distribution. The draft has its own KV pool with the target's
block ids: in every step (with proposals or not) it also runs once over the step's rows with
their final tokens, so its cache holds K/V for every position the target's does, from the same
tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.models import ordered
from jaxserve.runtime import logits_processing
from jaxserve.runtime.kv_cache import KVCache
from jaxserve.runtime.sampling import (
    SamplerOutput,
    SamplingInputs,
    greedy_tokens,
    logprobs_of,
    row_keys,
    sampling_logits,
)

# (draft kv, input ids (R,), metadata of R rows, want logits) -> (draft kv, logits (R, V)
# float32, or None when not wanted)
DraftFn = Callable[[KVCache, jax.Array, AttentionMetadata, bool],
                   tuple[KVCache, jax.Array | None]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    draft_tokens: jax.Array  # (S, K) int32: each row's proposal (padding: 0)
    num_drafts: jax.Array  # (S,) int32: how many of its K are real (0: a plain row)
    verify_rows: jax.Array  # (S, K + 1) int32: its query rows, the last one repeated
    # (S, K, W) int32: a grammar's token mask at positions 1..K, after the proposals before
    # them (structured output; all bits set for other rows), and () bool: some row has one
    mask: jax.Array
    masked: jax.Array


def verify(x: jax.Array, idx: jax.Array, first: jax.Array, spec: SpecInputs,
           si: SamplingInputs, max_logprobs: int,
           min_p: jax.Array | None = None) -> SamplerOutput:
    """x (N, V): the model's logits for the step's rows; idx (S, K + 1): position j of row s
    is x[idx[s, j]]; first (S, V): position 0's logits, processed as a plain step's are ->
    up to K + 1 tokens per row.

    A greedy step without a grammar needs only each position's argmax, taken over x's rows and
    then gathered as ids. The (S, K + 1, V) logits are gathered only in the branches that need
    them (a grammar's masks, a sampled row, logprobs): on a CPU those copies, mostly padding
    slots, would cost a greedy verifying step more than the rest of its work."""
    s, k1 = idx.shape
    v = x.shape[-1]
    pos = jnp.arange(k1)

    def processed():  # (S, K1, V): what each position samples from
        # a row that proposes processes none of its later positions' logits but a grammar's
        # mask, which the host made for every position of its proposal
        rest = jax.lax.cond(spec.masked, logits_processing.masked, lambda rows, _: rows,
                            x[idx[:, 1:]], spec.mask)
        return jnp.concatenate([first[:, None], rest], axis=1)

    def argmax_gathered():
        return jnp.concatenate([greedy_tokens(first)[:, None],
                                greedy_tokens(x)[idx[:, 1:]]], axis=1)

    greedy = jax.lax.cond(spec.masked, lambda: greedy_tokens(processed()),
                          argmax_gathered)  # (S, K1)
    # the proposal each position checks (the last position has none: its token is a bonus)
    drafts = jnp.concatenate([spec.draft_tokens, jnp.zeros((s, 1), jnp.int32)], axis=1)
    has_draft = pos[None, :] < spec.num_drafts[:, None]  # (S, K1)
    sampled_rows = si.temperature > 0

    def draw():
        per_pos = lambda a: jnp.repeat(a, k1)  # (S,) -> (S * K1,), position-major in a row
        flat_si = SamplingInputs(
            temperature=per_pos(si.temperature), top_p=per_pos(si.top_p),
            top_k=per_pos(si.top_k), seeds=per_pos(si.seeds),
            steps=(si.steps[:, None] + pos[None, :]).reshape(-1), samples=per_pos(si.samples),
            want_logprobs=si.want_logprobs)
        filtered = sampling_logits(processed().reshape(s * k1, v), flat_si,
                                   None if min_p is None else per_pos(min_p))
        logp = ordered.log_softmax(filtered, axis=-1)  # (S*K1, V)
        d = drafts.reshape(-1)
        p_draft = jnp.exp(jnp.take_along_axis(logp, d[:, None], axis=-1)[:, 0])
        keys = jax.vmap(jax.random.split)(row_keys(flat_si))  # (S*K1, 2)
        u = jax.vmap(jax.random.uniform)(keys[:, 0])
        residual = jnp.where(has_draft.reshape(-1, 1) & (jnp.arange(v)[None, :] == d[:, None]),
                             -jnp.inf, filtered)
        cand = jax.vmap(jax.random.categorical)(keys[:, 1], residual).astype(jnp.int32)
        return (u < p_draft).reshape(s, k1), cand.reshape(s, k1)

    def no_draw():
        return jnp.zeros((s, k1), bool), greedy

    accept_sampled, cand = jax.lax.cond(jnp.any(sampled_rows), draw, no_draw)
    accept = has_draft & jnp.where(sampled_rows[:, None], accept_sampled, drafts == greedy)
    own = jnp.where(sampled_rows[:, None], cand, greedy)
    tokens = jnp.where(accept, drafts, own)  # (S, K1): position j's token if it is reached
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
    num_tokens = jnp.where(si.samples, num_accepted + 1, 0).astype(jnp.int32)
    chosen, top_ids, top_lp = logprobs_of(lambda: x[idx.reshape(-1)], tokens.reshape(-1),
                                          si.want_logprobs, max_logprobs)
    return SamplerOutput(tokens, num_tokens, chosen.reshape(s, k1),
                         top_ids.reshape(s, k1, max_logprobs),
                         top_lp.reshape(s, k1, max_logprobs))


def draft_proposals(run_draft: DraftFn, kv: KVCache, ids: jax.Array, md: AttentionMetadata,
                    spec: SpecInputs) -> tuple[KVCache, jax.Array]:
    """The draft model's greedy proposals for the step's rows: (draft kv, (S, K) int32).

    `ids` (T,): the step's input tokens (proposal rows not yet filled); `md`: the target's
    metadata. Pass j feeds each sequence's query row j (its last token when j = 0, else the
    draft's previous proposal) at that row's position and slot, and proposes from its logits.
    Rows of sequences that propose fewer than j + 1 tokens write nothing (their slot is out
    of range), and what they propose is dropped."""
    s, k1 = spec.verify_rows.shape
    drop_slot = kv.k.shape[1] * kv.k.shape[2]  # past the pool: the write is dropped

    def one_pass(j, carry):
        kv, tokens, drafts = carry
        rows = spec.verify_rows[:, j]
        active = j < spec.num_drafts
        positions = md.positions[rows]
        row_md = AttentionMetadata(
            positions=positions, token_seq=jnp.arange(s, dtype=jnp.int32),
            slot_mapping=jnp.where(active, md.slot_mapping[rows], drop_slot),
            block_tables=md.block_tables, context_lens=jnp.where(active, positions + 1, 0),
            query_start_loc=jnp.arange(s + 1, dtype=jnp.int32))
        kv, logits = run_draft(kv, tokens, row_md, True)
        tokens = greedy_tokens(logits)
        return kv, tokens, drafts.at[:, j].set(jnp.where(active, tokens, 0))

    first = ids[spec.verify_rows[:, 0]]
    kv, _, drafts = jax.lax.fori_loop(0, k1 - 1, one_pass,
                                      (kv, first, jnp.zeros((s, k1 - 1), jnp.int32)))
    return kv, drafts


def fill_proposals(ids: jax.Array, drafts: jax.Array, spec: SpecInputs) -> jax.Array:
    """The step's input tokens with each proposal row holding its proposed token."""
    k = drafts.shape[1]
    real = jnp.arange(k)[None, :] < spec.num_drafts[:, None]  # (S, K)
    rows = jnp.where(real, spec.verify_rows[:, 1:], ids.shape[0])  # padding: past the end
    return ids.at[rows.reshape(-1)].set(drafts.reshape(-1), mode="drop")
