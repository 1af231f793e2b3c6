"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, seeded per request.

Each row draws from its own key, derived from (request seed, number of tokens it has generated),
so a request's samples do not depend on which other requests share the batch or on its row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.models import ordered


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


_CANDIDATES = 256  # top-k/top-p cut from the best this many tokens when they hold it


def _threshold(desc: jax.Array, k: jax.Array, log_norm: jax.Array, top_p: jax.Array):
    """desc (S, W) values sorted descending, k (S,) top-k (V: off), log_norm (S, 1) the log of
    the normalizer -> (threshold (S, 1), probs (S, W)): the smallest value that top-k and top-p
    keep. top-p keeps the smallest prefix whose mass reaches top_p: token i stays if the mass
    before it is still below top_p (so the first token always stays)."""
    w = desc.shape[-1]
    kth = jnp.take_along_axis(desc, jnp.minimum(k - 1, w - 1)[:, None], axis=-1)
    desc = jnp.where(jnp.arange(w)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jnp.exp(desc - log_norm)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]
    p_min = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.maximum(kth, p_min), probs


def _scaled(logits: jax.Array, si: SamplingInputs) -> jax.Array:  # (S, V)
    return logits / jnp.maximum(si.temperature, 1e-6)[:, None]


def _filtered_logits(logits: jax.Array, si: SamplingInputs) -> jax.Array:  # (S, V) -> (S, V)
    """Temperature-scaled logits with everything outside top-k and top-p set to -inf.

    The cut is found among the best `_CANDIDATES` tokens (`lax.top_k`) when, for every row, it
    provably lies there: top-k within them, or their mass already reaching top_p. Otherwise
    the whole vocabulary is sorted, which on a CPU is slow at a large vocabulary."""
    v = logits.shape[-1]
    scaled = _scaled(logits, si)
    k = jnp.where(si.top_k > 0, jnp.minimum(si.top_k, v), v)
    c = min(v, _CANDIDATES)

    def from_candidates():
        cand, _ = jax.lax.top_k(scaled, c)  # (S, C), descending
        in_cand = (si.top_k > 0) & (si.top_k <= c)
        top_k_norm = ordered.logsumexp(jnp.where(jnp.arange(c)[None, :] < k[:, None], cand,
                                                -jnp.inf), axis=-1)
        log_norm = jnp.where(in_cand, top_k_norm, ordered.logsumexp(scaled, axis=-1))
        threshold, probs = _threshold(cand, k, log_norm[:, None], si.top_p)
        no_filter = (si.top_k == 0) & (si.top_p >= 1)
        # With top-k off, the next token after the candidates has all their mass before it,
        # so once that mass reaches top_p the kept prefix ends among them.
        ok = ((si.temperature <= 0) | no_filter | in_cand
              | ((si.top_k == 0) & (jnp.sum(probs, axis=-1) >= si.top_p)))
        return jnp.where(no_filter[:, None], -jnp.inf, threshold), jnp.all(ok)

    def from_sort():
        desc = -jnp.sort(-scaled, axis=-1)  # (S, V)
        masked = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, -jnp.inf)
        return _threshold(desc, k, ordered.logsumexp(masked, axis=-1, keepdims=True),
                          si.top_p)[0]

    threshold, ok = from_candidates()
    threshold = jax.lax.cond(ok, lambda: threshold, from_sort)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def greedy_tokens(logits: jax.Array) -> jax.Array:  # (..., V) -> (...) int32
    """jnp.argmax over the last axis (the first of equal maxima). On a CPU as two plain
    reductions, a max, then the least index holding it: XLA:CPU runs argmax's (value, index)
    reduction one element at a time, where these two vectorize (a row whose max is NaN gets
    the last id). Elsewhere argmax itself, one pass over the logits instead of two."""
    def two_passes(x):
        v = x.shape[-1]
        best = jnp.max(x, axis=-1, keepdims=True)
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.minimum(jnp.min(jnp.where(x == best, ids, v), axis=-1), v - 1)

    return jax.lax.platform_dependent(
        logits, cpu=two_passes, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def row_keys(si: SamplingInputs) -> jax.Array:
    """Each row's key: its request's seed and the index of the draw in its stream."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(si.seeds, si.steps)


def sampling_logits(logits: jax.Array, si: SamplingInputs,
                    min_p: jax.Array | None) -> jax.Array:  # (S, V) -> (S, V)
    """What a sampled row draws from: temperature-scaled logits with the tokens top-k, top-p
    and min_p drop set to -inf."""
    filters = jnp.any((si.temperature > 0) & ((si.top_k > 0) | (si.top_p < 1)))
    filtered = jax.lax.cond(
        filters, lambda: _filtered_logits(logits, si), lambda: _scaled(logits, si))
    if min_p is not None:
        cut = jnp.max(filtered, axis=-1, keepdims=True) + jnp.log(
            jnp.maximum(min_p, 1e-30))[:, None]
        filtered = jnp.where((min_p[:, None] > 0) & (filtered < cut), -jnp.inf, filtered)
    return filtered


def logprobs_of(raw: jax.Array | Callable[[], jax.Array], tokens: jax.Array, want: jax.Array,
                max_logprobs: int):
    """raw (N, V) logits (or a function that makes them, called only when wanted), tokens
    (N,) -> (the tokens' logprobs (N,), top ids (N, k), top logprobs (N, k)), computed only
    when `want` (else zeros)."""
    n = tokens.shape[0]

    def compute():
        logp = ordered.log_softmax(raw() if callable(raw) else raw, axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, max_logprobs)
        return chosen, top_ids.astype(jnp.int32), top_lp

    def skip():
        return (jnp.zeros(n, jnp.float32), jnp.zeros((n, max_logprobs), jnp.int32),
                jnp.zeros((n, max_logprobs), jnp.float32))

    return jax.lax.cond(want, compute, skip)


def sample(logits: jax.Array, si: SamplingInputs, max_logprobs: int,
           min_p: jax.Array | None = None, raw_logits: jax.Array | None = None) -> SamplerOutput:
    """logits (S, V) float32 -> sampled tokens and logprobs (of the unscaled distribution).

    `logits` are what the tokens are picked from (processed: penalties, bias, masks);
    `raw_logits` (default: the same), the model's own, are what logprobs report, as vLLM's
    default does. `min_p` (S,): a sampled row keeps the tokens whose probability after
    temperature is at least min_p x the most likely one's.

    Work is skipped by runtime conditions, not by separate programs: the top-k/top-p cut runs
    only when a sampled row filters (and sorts the vocabulary only when the best candidates do
    not hold it), the random draw only when a row samples, and the log-softmax and top-k
    logprobs only when a row asked for them (on a CPU each of these costs as much as a layer or
    more at 64 rows)."""
    greedy = greedy_tokens(logits)
    sampled_rows = si.temperature > 0

    def draw(_):
        filtered = sampling_logits(logits, si, min_p)
        return jax.vmap(jax.random.categorical)(row_keys(si), filtered).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(sampled_rows), draw, lambda _: greedy, None)
    tokens = jnp.where(sampled_rows, sampled, greedy)

    raw = logits if raw_logits is None else raw_logits
    chosen, top_ids, top_lp = logprobs_of(raw, tokens, si.want_logprobs, max_logprobs)
    return SamplerOutput(tokens[:, None], si.samples.astype(jnp.int32), chosen[:, None],
                         top_ids[:, None], top_lp[:, None])


def sample_plain(logits: jax.Array, si: SamplingInputs, max_logprobs: int) -> SamplerOutput:
    """sample() for rows that are greedy or draw from the temperature alone (no top-k, top-p,
    min_p or logprobs), with no runtime branch: the draw is made for every row. Its tokens
    are sample()'s for such rows."""
    s = logits.shape[0]
    greedy = greedy_tokens(logits)
    drawn = jax.vmap(jax.random.categorical)(row_keys(si), _scaled(logits, si))
    tokens = jnp.where(si.temperature > 0, drawn.astype(jnp.int32), greedy)
    return SamplerOutput(tokens[:, None], si.samples.astype(jnp.int32),
                         jnp.zeros((s, 1), jnp.float32),
                         jnp.zeros((s, 1, max_logprobs), jnp.int32),
                         jnp.zeros((s, 1, max_logprobs), jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per query row t: the logprob of the prompt token that follows it (`targets[t]`)."""

    logprobs: jax.Array  # (T,) float32
    ranks: jax.Array  # (T,) int32: 1 + how many tokens are more likely than it
    top_ids: jax.Array  # (T, max_logprobs) int32
    top_logprobs: jax.Array  # (T, max_logprobs) float32

    @staticmethod
    def empty(t: int, max_logprobs: int) -> PromptLogprobs:
        """The zeros of a step whose rows have no prompt token to score."""
        return PromptLogprobs(jnp.zeros(t, jnp.float32), jnp.zeros(t, jnp.int32),
                              jnp.zeros((t, max_logprobs), jnp.int32),
                              jnp.zeros((t, max_logprobs), jnp.float32))


def prompt_logprobs(logits_fn, hidden: jax.Array, targets: jax.Array,
                    max_logprobs: int) -> PromptLogprobs:
    """hidden (T, D) the final hidden rows, targets (T,) int32 the next prompt token of each
    row that a request wants (-1: none) -> their logprobs.

    The (T, V) logits of every row cost as much as a layer per 100 rows, so they are computed
    only in a step where some row has a target (`logits_fn`: hidden rows -> their logits)."""
    t = targets.shape[0]

    def compute():
        logp = ordered.log_softmax(logits_fn(hidden), axis=-1)  # (T, V)
        target = jnp.maximum(targets, 0)[:, None]
        chosen = jnp.take_along_axis(logp, target, axis=-1)  # (T, 1)
        ranks = 1 + jnp.sum(logp > chosen, axis=-1, dtype=jnp.int32)
        top_lp, top_ids = jax.lax.top_k(logp, max_logprobs)
        return PromptLogprobs(chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_lp)

    return jax.lax.cond(jnp.any(targets >= 0), compute,
                        lambda: PromptLogprobs.empty(t, max_logprobs))
