"""Verification of proposed tokens in the compiled step, against the definitions: greedy
keeps the longest prefix equal to the argmaxes, sampling keeps the target's distribution."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.runtime.sampling import SamplingInputs
from jaxserve.runtime.speculative import SpecInputs, verify

V = 6


def _inputs(n: int, temperature: float, seeds, drafts, num_drafts, k: int):
    si = SamplingInputs(temperature=np.full(n, temperature, np.float32),
                        top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                        seeds=np.asarray(seeds, np.uint32), steps=np.zeros(n, np.int32),
                        samples=np.ones(n, bool), want_logprobs=np.bool_(True))
    spec = SpecInputs(draft_tokens=np.asarray(drafts, np.int32).reshape(n, k),
                      num_drafts=np.asarray(num_drafts, np.int32),
                      verify_rows=np.zeros((n, k + 1), np.int32),
                      mask=np.full((n, k, 1), -1, np.int32), masked=np.bool_(False))
    return si, spec


def _packed(logits, num_drafts):
    """(S, K + 1, V) logits -> the step's rows as the runner holds them: each sequence's
    1 + num_drafts rows one after another, and the (S, K + 1) map into them that repeats a
    sequence's last row in its unused slots."""
    rows, idx = [], []
    for s, n in enumerate(num_drafts):
        idx.append([len(rows) + min(j, n) for j in range(logits.shape[1])])
        rows += [logits[s, j] for j in range(n + 1)]
    return np.stack(rows), np.asarray(idx, np.int32)


def _verify(logits, num_drafts, spec, si, max_logprobs):
    x, idx = _packed(logits, num_drafts)
    return jax.jit(verify, static_argnums=5)(x, idx, x[idx[:, 0]], spec, si, max_logprobs)


def test_greedy_keeps_the_prefix_that_matches_the_argmaxes():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 4, V)).astype(np.float32)
    best = logits.argmax(-1)  # (S, K + 1)
    drafts = best[:, :3].copy()
    drafts[1, 1] = (best[1, 1] + 1) % V  # row 1: the second proposal is wrong
    drafts[2, 0] = (best[2, 0] + 1) % V  # row 2: the first is
    si, spec = _inputs(4, 0.0, range(4), drafts, [3, 3, 3, 2], 3)
    out = _verify(logits, [3, 3, 3, 2], spec, si, 2)
    tokens, n = np.asarray(out.tokens), np.asarray(out.num_tokens)
    assert n.tolist() == [4, 2, 1, 3]
    for row in range(4):  # each kept token is the target's argmax at its position
        assert tokens[row, :n[row]].tolist() == best[row, :n[row]].tolist()
    lp = jax.nn.log_softmax(logits, -1)
    for row, k in enumerate([3, 3, 3, 2]):  # logprobs of each real position's token
        np.testing.assert_allclose(
            np.asarray(out.logprobs)[row, :k + 1],
            np.take_along_axis(lp[row, :k + 1], tokens[row, :k + 1, None], -1)[:, 0],
            atol=1e-5)


@pytest.mark.parametrize("draft", [0, 3])
def test_sampling_keeps_the_target_distribution(draft):
    """20,000 rows with their own seeds and the same logits: the first token follows p_0
    whatever the proposal (a likely one or an unlikely one), and the second, reached when the
    proposal was accepted, follows p_1."""
    n = 20_000
    logits = np.log(np.array([[0.05, 0.1, 0.15, 0.02, 0.28, 0.4],
                              [0.3, 0.05, 0.05, 0.1, 0.2, 0.3]], np.float32))
    si, spec = _inputs(n, 1.0, np.arange(n), [draft] * n, [1] * n, 1)
    batch = np.broadcast_to(logits, (n, 2, V))
    out = _verify(batch, [1] * n, spec, si, 2)
    tokens, num = np.asarray(out.tokens), np.asarray(out.num_tokens)
    p = np.exp(logits.astype(np.float64))
    first = np.bincount(tokens[:, 0], minlength=V)
    assert stats.chisquare(first, p[0] / p[0].sum() * first.sum()).pvalue > 1e-3
    accepted = num == 2
    assert (tokens[accepted, 0] == draft).all() and accepted.sum() == pytest.approx(
        p[0, draft] / p[0].sum() * n, rel=0.1)
    second = np.bincount(tokens[accepted, 1], minlength=V)
    assert stats.chisquare(second, p[1] / p[1].sum() * second.sum()).pvalue > 1e-3
