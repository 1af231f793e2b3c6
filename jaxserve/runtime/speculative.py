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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.runtime.sampling import (
    SamplerOutput,
    SamplingInputs,
    logprobs_of,
    row_keys,
    sampling_logits,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    draft_tokens: jax.Array  # (S, K) int32: each row's proposal (padding: 0)
    num_drafts: jax.Array  # (S,) int32: how many of its K are real (0: a plain row)
    verify_rows: jax.Array  # (S, K + 1) int32: its query rows, the last one repeated


def verify(logits: jax.Array, raw: jax.Array, spec: SpecInputs, si: SamplingInputs,
           max_logprobs: int, min_p: jax.Array | None = None) -> SamplerOutput:
    """logits (S, K + 1, V): what rows sample from (processed), raw: the model's own (for
    logprobs) -> up to K + 1 tokens per row."""
    s, k1, v = logits.shape
    flat = logits.reshape(s * k1, v)
    per_pos = lambda a: jnp.repeat(a, k1)  # (S,) -> (S * K1,), position-major within a row
    pos = jnp.arange(k1)
    flat_si = SamplingInputs(
        temperature=per_pos(si.temperature), top_p=per_pos(si.top_p),
        top_k=per_pos(si.top_k), seeds=per_pos(si.seeds),
        steps=(si.steps[:, None] + pos[None, :]).reshape(-1), samples=per_pos(si.samples),
        want_logprobs=si.want_logprobs)
    greedy = jnp.argmax(flat, axis=-1).astype(jnp.int32).reshape(s, k1)
    # the proposal each position checks (the last position has none: its token is a bonus)
    drafts = jnp.concatenate([spec.draft_tokens, jnp.zeros((s, 1), jnp.int32)], axis=1)
    has_draft = pos[None, :] < spec.num_drafts[:, None]  # (S, K1)
    sampled_rows = si.temperature > 0

    def draw():
        filtered = sampling_logits(flat, flat_si, None if min_p is None else per_pos(min_p))
        logp = jax.nn.log_softmax(filtered, axis=-1)  # (S*K1, V)
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
    chosen, top_ids, top_lp = logprobs_of(raw.reshape(s * k1, v), tokens.reshape(-1),
                                          si.want_logprobs, max_logprobs)
    return SamplerOutput(tokens, num_tokens, chosen.reshape(s, k1),
                         top_ids.reshape(s, k1, max_logprobs),
                         top_lp.reshape(s, k1, max_logprobs))

