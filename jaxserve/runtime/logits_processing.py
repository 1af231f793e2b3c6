"""Per-request logit processing inside the compiled step: penalties, logit_bias, a token mask
(allowed_token_ids, bad_words, min_tokens, structured output) and min_p.

Every row's processing is data in fixed-shape arrays, so one program serves every mix of
options (no program per combination; `strict_compile` holds), and a step where no row asks for
anything skips it all under a `lax.cond`. The host fills the arrays for the rows that ask
(`build`); everything else keeps the neutral value.

Shapes, for S sequence rows, vocabulary V, W = ceil(V / 32) mask words, H history slots (the
longest context: a row's distinct prompt and output tokens all fit) and MAX_LOGIT_BIAS bias
slots. Unused id slots hold V, which gathers clamp and scatters drop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import MAX_LOGIT_BIAS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsInputs:
    active: np.ndarray  # () bool: some row is processed (else the step skips all of this)
    mask: np.ndarray  # (S, W) int32: bit t % 32 of word t // 32 set = token t allowed
    bias_ids: np.ndarray  # (S, MAX_LOGIT_BIAS) int32
    bias: np.ndarray  # (S, MAX_LOGIT_BIAS) float32: added to those tokens' logits
    penalties: np.ndarray  # (S, 3) float32: presence, frequency, repetition
    hist_ids: np.ndarray  # (S, H) int32: distinct tokens of the prompt and the output
    hist_counts: np.ndarray  # (S, H) int32: how often each is in the output
    hist_in_prompt: np.ndarray  # (S, H) bool
    min_p: np.ndarray  # (S,) float32


@dataclasses.dataclass(frozen=True)
class LogitsShape:
    vocab_size: int
    history: int  # H

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    @functools.cache  # noqa: B019 - a handful of shapes per engine, kept for its life
    def unused(self, s: int) -> LogitsInputs:
        """The inputs of a step where no row processes its logits (shared: never written)."""
        return self.neutral(s)

    def neutral(self, s: int) -> LogitsInputs:
        """Fresh inputs with every row neutral, for `build` to fill."""
        v, h = self.vocab_size, self.history
        return LogitsInputs(
            active=np.bool_(False), mask=np.full((s, self.mask_words), -1, np.int32),
            bias_ids=np.full((s, MAX_LOGIT_BIAS), v, np.int32),
            bias=np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            penalties=np.tile(np.asarray([0.0, 0.0, 1.0], np.float32), (s, 1)),
            hist_ids=np.full((s, h), v, np.int32), hist_counts=np.zeros((s, h), np.int32),
            hist_in_prompt=np.zeros((s, h), bool), min_p=np.zeros(s, np.float32))


def build(rows, shape: LogitsShape, s_pad: int) -> LogitsInputs:
    """`rows`: (row index, Sequence) for the rows this step samples whose requests process
    their logits; each sequence's `logits_state` (engine/logits_state.py) fills its row."""
    if not rows:
        return shape.unused(s_pad)
    li = shape.neutral(s_pad)
    constrained = [(i, seq) for i, seq in rows if seq.logits_state.matcher is not None]
    if constrained:  # the host state's class knows how (runtime does not import engine)
        constrained[0][1].logits_state.fill_grammar_masks(constrained, li.mask)
    for i, seq in rows:
        p = seq.params
        li.min_p[i] = p.min_p
        if p.logit_bias:
            ids = list(p.logit_bias)
            li.bias_ids[i, :len(ids)] = ids
            li.bias[i, :len(ids)] = [p.logit_bias[t] for t in ids]
        if p.penalized:
            li.penalties[i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            ids, counts, in_prompt = seq.logits_state.history()
            li.hist_ids[i, :len(ids)] = ids
            li.hist_counts[i, :len(ids)] = counts
            li.hist_in_prompt[i, :len(ids)] = in_prompt
        seq.logits_state.fill_mask(seq, li.mask[i])
    return dataclasses.replace(li, active=np.bool_(True))


def apply(logits: jax.Array, li: LogitsInputs) -> jax.Array:
    """(S, V) logits -> processed logits, in vLLM's order: penalties, then logit_bias, then
    the token mask (min_p is the sampler's: it needs the temperature)."""
    s, v = logits.shape
    li = jax.tree.map(jnp.asarray, li)

    def process(logits):
        rows = jnp.arange(s)[:, None]
        valid = li.hist_ids < v
        got = jnp.take_along_axis(logits, jnp.minimum(li.hist_ids, v - 1), axis=-1)  # (S, H)
        presence, frequency, repetition = (li.penalties[:, j:j + 1] for j in range(3))
        seen = valid & ((li.hist_counts > 0) | li.hist_in_prompt)
        pen = jnp.where(seen, jnp.where(got > 0, got / repetition, got * repetition), got)
        pen = pen - frequency * li.hist_counts - presence * (li.hist_counts > 0)
        logits = logits.at[rows, li.hist_ids].set(pen, mode="drop")
        logits = logits.at[rows, li.bias_ids].add(li.bias, mode="drop")
        return masked(logits, li.mask)

    return jax.lax.cond(li.active, process, lambda x: x, logits)


def count(li: LogitsInputs, tokens: jax.Array, counted: jax.Array,
          vocab_size: int) -> LogitsInputs:
    """The history once the rows `counted` (S,) bool have sampled `tokens` (S,): each token's
    output count goes up by one, a token new to its row taking the row's first unused slot
    (as the host's LogitsState.consume does). Skipped when no row is processed."""
    def update(li):
        s, h = li.hist_ids.shape
        new = counted & ~jnp.any(li.hist_ids == tokens[:, None], axis=1)
        free = jnp.sum(li.hist_ids < vocab_size, axis=1)  # unused slots follow the used ones
        ids = li.hist_ids.at[jnp.arange(s), jnp.where(new, free, h)].set(tokens, mode="drop")
        hits = (ids == tokens[:, None]) & counted[:, None]
        return dataclasses.replace(li, hist_ids=ids, hist_counts=li.hist_counts + hits)

    return jax.lax.cond(li.active, update, lambda li: li, li)


def masked(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """(..., V) logits with the tokens a (..., W) bit mask disallows set to -inf."""
    ids = jnp.arange(logits.shape[-1])
    allowed = (mask[..., ids // 32] >> (ids % 32)) & 1
    return jnp.where(allowed.astype(bool), logits, -jnp.inf)
