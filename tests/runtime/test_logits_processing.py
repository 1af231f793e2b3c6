"""The compiled step's logit processing against a plain numpy reference of its definitions
(vLLM's semantics), and the host's row building (bits, history, bans)."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve import SamplingParams
from jaxserve.core.sequence import Sequence
from jaxserve.engine.logits_state import LogitsState, clear_bits, token_bits
from jaxserve.runtime import logits_processing
from jaxserve.runtime.logits_processing import LogitsShape
from jaxserve.runtime.sampling import SamplingInputs, sample

V = 70  # not a multiple of 32: the last mask word is partial
SHAPE = LogitsShape(vocab_size=V, history=40)
EOS = (2,)


def reference(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams,
              banned: set[int], allowed: set[int] | None) -> np.ndarray:
    """vLLM's order and definitions, one token at a time."""
    x = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(V):
        if t in banned or (allowed is not None and t not in allowed):
            x[t] = -np.inf
    return x


def _seq(i: int, prompt, output, params) -> Sequence:
    s = Sequence(f"r{i}", prompt, params, i, seed=i)
    s.logits_state = LogitsState(params, prompt, V, EOS, bad_words=[[7], [9, 11]])
    for t in output:  # as the postprocess hands each token over
        s.append_token(t)
        s.logits_state.consume(t)
    return s


def test_processing_matches_the_reference_row_by_row():
    rng = np.random.default_rng(0)
    cases = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.4),
        SamplingParams(repetition_penalty=0.8, logit_bias={3: 5.0, 60: -100.0, 69: 2.5}),
        SamplingParams(allowed_token_ids=[1, 2, 9, 11, 40, 69], min_tokens=10),
        SamplingParams(frequency_penalty=-0.5, bad_words=["unused"]),
    ]
    seqs = []
    for i, p in enumerate(cases):
        prompt = rng.integers(0, V, 12).tolist()
        output = rng.integers(0, V, 8).tolist() + [9]  # ends in a bad word's first token
        seqs.append(_seq(i, prompt, output, p))
    s_pad = 6  # two padding rows stay untouched
    li = logits_processing.build(list(enumerate(seqs)), SHAPE, s_pad)
    logits = rng.normal(size=(s_pad, V)).astype(np.float32) * 3
    got = np.asarray(jax.jit(logits_processing.apply)(logits, li))
    for i, seq in enumerate(seqs):
        banned = {7, 11} | (set(EOS) if len(seq.output_token_ids) < seq.params.min_tokens
                            else set())
        allowed = (set(seq.params.allowed_token_ids)
                   if seq.params.allowed_token_ids is not None else None)
        want = reference(logits[i], seq.prompt_token_ids, seq.output_token_ids, seq.params,
                         banned, allowed)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[4:], logits[4:])


def test_a_step_without_processing_leaves_the_logits_alone():
    li = logits_processing.build([], SHAPE, 4)
    assert not li.active and li is SHAPE.unused(4)
    logits = np.random.default_rng(1).normal(size=(4, V)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(logits_processing.apply(logits, li)), logits)


def test_bits():
    row = token_bits([0, 31, 32, 69], V)
    assert row.shape == (3,)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 69]
    clear_bits(row, [31, 69])
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [0, 32]


def test_min_p_keeps_tokens_near_the_best_one():
    """Sampled rows never draw a token under min_p x the top probability; min_p 0 rows do."""
    logits = np.log(np.asarray([[0.5, 0.3, 0.15, 0.05]] * 2, np.float32))
    n = 400
    si = SamplingInputs(temperature=np.ones(2, np.float32), top_p=np.ones(2, np.float32),
                        top_k=np.zeros(2, np.int32), seeds=np.asarray([1, 2], np.uint32),
                        steps=np.zeros(2, np.int32), samples=np.ones(2, bool),
                        want_logprobs=np.bool_(False))
    draw = jax.jit(lambda step, min_p: sample(
        logits, SamplingInputs(**{**si.__dict__, "steps": step}), 1, min_p).tokens[:, 0])
    seen = np.stack([np.asarray(draw(np.full(2, k, np.int32),
                                     np.asarray([0.35, 0.0], np.float32))) for k in range(n)])
    assert set(seen[:, 0]) == {0, 1}  # 0.15 / 0.5 < 0.35: tokens 2 and 3 are cut
    assert set(seen[:, 1]) == {0, 1, 2, 3}


def test_history_grows_token_by_token_and_samples_keep_their_own():
    """The history the step reads equals a recount of prompt and output, past its first
    capacity; a sibling sample (n > 1) starts from the prompt and counts only its tokens."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, V, 10).tolist()
    p = SamplingParams(presence_penalty=1.0, max_tokens=3, allowed_token_ids=[1, 5])
    state = LogitsState(p, prompt, V, EOS, bad_words=[])
    twin = state.sibling()
    output = rng.integers(0, V, 120).tolist()
    for t in output:
        state.consume(t)
    twin.consume(output[0])
    for st, out in ((state, output), (twin, output[:1])):
        ids, counts, in_prompt = st.history()
        assert sorted(ids.tolist()) == sorted(set(prompt) | set(out))
        assert counts.tolist() == [out.count(t) for t in ids.tolist()]
        assert in_prompt.tolist() == [t in prompt for t in ids.tolist()]
    assert twin.allowed is state.allowed  # the request's own parts are shared


def test_the_step_counts_sampled_tokens_as_the_host_does():
    """A step of several decode steps counts each sampled token into the history on the
    device: the same slots, ids and counts as the host's consume, row by row."""
    rng = np.random.default_rng(2)
    p = SamplingParams(presence_penalty=0.5, repetition_penalty=1.2)
    seqs = [_seq(i, rng.integers(0, V, 10).tolist(), [], p) for i in range(2)]
    li = logits_processing.build(list(enumerate(seqs)), SHAPE, 3)  # one padding row
    count = jax.jit(logits_processing.count, static_argnums=3)
    for _ in range(12):
        tokens = rng.integers(0, V, 3).astype(np.int32)
        counted = np.asarray([True, rng.random() < 0.5, False])
        li = count(li, tokens, counted, V)
        for seq, t, c in zip(seqs, tokens.tolist(), counted, strict=False):
            if c:
                seq.logits_state.consume(t)
    for i, seq in enumerate(seqs):
        ids, counts, in_prompt = seq.logits_state.history()
        n = len(ids)
        assert np.asarray(li.hist_ids[i, :n]).tolist() == ids.tolist()
        assert np.asarray(li.hist_counts[i, :n]).tolist() == counts.tolist()
        assert np.asarray(li.hist_in_prompt[i, :n]).tolist() == in_prompt.tolist()
        assert (np.asarray(li.hist_ids[i, n:]) == V).all()
    assert (np.asarray(li.hist_ids[2]) == V).all()  # the padding row counts nothing
