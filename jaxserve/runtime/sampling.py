"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, seeded per request.

Each row draws from its own key, derived from (request seed, number of tokens it has generated),
so a request's samples do not depend on which other requests share the batch or on its row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    temperature: jax.Array  # (S,) float32; 0 = greedy
    top_p: jax.Array  # (S,) float32 in (0, 1]
    top_k: jax.Array  # (S,) int32; 0 = off
    seeds: jax.Array  # (S,) uint32
    steps: jax.Array  # (S,) int32: tokens the request has generated so far
    samples: jax.Array  # (S,) bool: the row's step reaches its sequence's end (padding: False)
    want_logprobs: jax.Array  # () bool: some row asked for logprobs (else they are not computed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Up to K new tokens per sequence (K = 1 until speculative decoding accepts more)."""

    tokens: jax.Array  # (S, K) int32
    num_tokens: jax.Array  # (S,) int32: how many of row s's K tokens are real
    logprobs: jax.Array  # (S, K) float32: logprob of each sampled token
    top_ids: jax.Array  # (S, K, max_logprobs) int32
    top_logprobs: jax.Array  # (S, K, max_logprobs) float32


def _filtered_logits(logits: jax.Array, si: SamplingInputs) -> jax.Array:  # (S, V) -> (S, V)
    """Temperature-scaled logits with everything outside top-k and top-p set to -inf."""
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(si.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # (S, V)
    k = jnp.where(si.top_k > 0, jnp.minimum(si.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # (S, 1)
    ranks = jnp.arange(v)[None, :]
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it is
    # still below top_p (so the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < si.top_p[:, None]
    p_min = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, p_min)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, si: SamplingInputs, max_logprobs: int) -> SamplerOutput:
    """logits (S, V) float32 -> sampled tokens and logprobs (of the unscaled distribution).

    Work is skipped by runtime conditions, not by separate programs: the sort behind top-k/top-p
    runs only when a sampled row filters, the random draw only when a row samples, and the
    log-softmax and top-k logprobs only when a row asked for them (on a CPU each of these costs
    as much as a layer or more at 64 rows)."""
    s = logits.shape[0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_rows = si.temperature > 0

    def draw(_):
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(si.seeds, si.steps)
        filters = jnp.any(sampled_rows & ((si.top_k > 0) | (si.top_p < 1)))
        filtered = jax.lax.cond(
            filters, lambda: _filtered_logits(logits, si),
            lambda: logits / jnp.maximum(si.temperature, 1e-6)[:, None])
        return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(sampled_rows), draw, lambda _: greedy, None)
    tokens = jnp.where(sampled_rows, sampled, greedy)

    def logprobs():
        logp = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, max_logprobs)
        return chosen, top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        return (jnp.zeros(s, jnp.float32), jnp.zeros((s, max_logprobs), jnp.int32),
                jnp.zeros((s, max_logprobs), jnp.float32))

    chosen, top_ids, top_lp = jax.lax.cond(si.want_logprobs, logprobs, no_logprobs)
    return SamplerOutput(tokens[:, None], si.samples.astype(jnp.int32), chosen[:, None],
                         top_ids[:, None], top_lp[:, None])
