"""On-device sampling: greedy, temperature with top-k and top-p, seeds, logprobs, (S, K) rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.sampling import SamplingInputs, _filtered_logits, greedy_tokens, sample


def inputs(s, temperature=0.0, top_p=1.0, top_k=0, seeds=None, steps=None, samples=None,
           want_logprobs=True):
    full = lambda v, dt: jnp.full((s,), v, dt)  # noqa: E731
    return SamplingInputs(
        temperature=full(temperature, jnp.float32), top_p=full(top_p, jnp.float32),
        top_k=full(top_k, jnp.int32),
        seeds=jnp.asarray(seeds if seeds is not None else np.arange(s), jnp.uint32),
        steps=jnp.asarray(steps if steps is not None else np.zeros(s), jnp.int32),
        samples=jnp.asarray(samples if samples is not None else np.ones(s, bool)),
        want_logprobs=jnp.asarray(want_logprobs))


LOGITS = jnp.log(jnp.array([[0.1, 0.6, 0.2, 0.1], [0.4, 0.05, 0.05, 0.5]], jnp.float32))


def test_greedy_tokens_logprobs_and_layout():
    out = sample(LOGITS, inputs(2, samples=[True, False]), max_logprobs=3)
    assert out.tokens.shape == (2, 1) and out.top_ids.shape == (2, 1, 3)
    np.testing.assert_array_equal(out.tokens[:, 0], [1, 3])
    np.testing.assert_array_equal(out.num_tokens, [1, 0])  # row 1 samples nothing this step
    np.testing.assert_allclose(out.logprobs[:, 0], np.log([0.6, 0.5]), rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids[0, 0], [1, 2, 0])
    np.testing.assert_allclose(out.top_logprobs[0, 0], np.log([0.6, 0.2, 0.1]), rtol=1e-5)


def test_greedy_tokens_equal_argmax_with_ties_and_infinities():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (64, 3, 50)).astype(np.float32)  # many ties: the first one wins
    x[0] = -np.inf  # a row with nothing allowed
    x[1, 0, 7] = np.inf
    x[2, 1, :] = np.float32(3.5)
    want = np.argmax(x, axis=-1)
    got = jax.jit(greedy_tokens)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    wide = rng.standard_normal((5, 49152)).astype(np.float32)  # a real vocabulary's width
    np.testing.assert_array_equal(greedy_tokens(jnp.asarray(wide)), np.argmax(wide, axis=-1))
    nan = np.zeros((1, 8), np.float32)
    nan[0, 3] = np.nan
    assert 0 <= int(greedy_tokens(jnp.asarray(nan))[0]) < 8  # an id, whatever the model did


def draws(n, **kw):
    logits = jnp.broadcast_to(LOGITS[0], (n, 4))
    out = sample(logits, inputs(n, temperature=1.0, seeds=np.arange(n), **kw), 1)
    return np.asarray(out.tokens[:, 0])


def test_top_k_and_top_p_cut_the_tail():
    assert set(draws(400, top_k=1)) == {1}
    assert set(draws(400, top_k=2)) == {1, 2}
    # top_p 0.7 keeps the smallest prefix reaching 0.7: tokens 1 (0.6) and 2 (0.2)
    assert set(draws(400, top_p=0.7)) == {1, 2}
    counts = np.bincount(draws(4000), minlength=4) / 4000  # plain temperature 1: the softmax
    np.testing.assert_allclose(counts, [0.1, 0.6, 0.2, 0.1], atol=0.03)


def test_a_seeded_row_draws_the_same_token_whatever_its_row():
    logits = jnp.broadcast_to(LOGITS[0], (6, 4))
    a = sample(logits, inputs(6, temperature=1.0, seeds=[9] * 6, steps=np.arange(6)), 1)
    b = sample(logits[:1], inputs(1, temperature=1.0, seeds=[9], steps=[3]), 1)
    assert int(a.tokens[3, 0]) == int(b.tokens[0, 0])


def test_sample_compiles_under_jit():
    out = jax.jit(sample, static_argnums=2)(LOGITS, inputs(2), 2)
    np.testing.assert_array_equal(out.tokens[:, 0], [1, 3])


def _kept_numpy(logits, temperature, top_p, top_k):
    """The token set top-k then top-p keep, by a full sort in numpy (the definition)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    k = top_k if top_k > 0 else len(x)
    top = order[:k]
    p = np.exp(x[top] - x[top].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    return set(top[before < top_p].tolist())


@pytest.mark.parametrize("flat_row", [False, True])
def test_top_p_top_k_cut_equals_a_full_sort(flat_row):
    """1,000 tokens: the cut comes from the best 256 when they hold it; a flat row with
    top_p = 0.95 does not (its 256 best hold ~30% of the mass) and the whole vocabulary is
    sorted. Either way the kept sets are the definition's."""
    rng = np.random.default_rng(4)
    peaked = rng.standard_normal((3, 1000)) * 4.0
    rows = [peaked[0], peaked[1], rng.standard_normal(1000) * 0.1 if flat_row else peaked[2]]
    logits = jnp.asarray(np.stack(rows), jnp.float32)
    si = inputs(3, temperature=0.7)
    si = dataclasses.replace(si, top_p=jnp.asarray([0.9, 1.0, 0.95], jnp.float32),
                             top_k=jnp.asarray([0, 5, 0], jnp.int32))
    got = np.isfinite(np.asarray(_filtered_logits(logits, si)))
    for i, (tp, tk) in enumerate([(0.9, 0), (1.0, 5), (0.95, 0)]):
        assert set(np.flatnonzero(got[i]).tolist()) == _kept_numpy(rows[i], 0.7, tp, tk), i
    assert got[2].sum() > 256 if flat_row else got[2].sum() < 256
