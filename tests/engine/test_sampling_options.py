"""Sampling options users bring from vLLM and OpenAI, end to end through the engine: penalties
against a reference of their definitions on the HF oracle, logit_bias, allowed_token_ids,
bad_words, min_tokens, min_p, stop strings kept in the output; one program for every mix."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, run_all

NEW = 12


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                num_kv_blocks=128, log_stats_interval_s=0)
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)))


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=sp)
    done = run_all(engine)
    return [done[f"r{i}"].outputs[0] for i in range(len(prompts))]


def _reference_greedy(hf_model, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding on the HF model with the penalties applied as vLLM defines them."""
    import torch

    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = hf_model(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(out):
            x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        out.append(int(np.argmax(x)))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_their_definitions_token_for_token(tiny_models, async_scheduling):
    """Rows with different penalties (and one with none) share every step; each row's tokens
    equal the reference's for its own penalties."""
    path, hf_model = tiny_models["llama"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in (9, 23, 14, 31, 6)]
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **kw) for kw in (
        dict(presence_penalty=1.5),
        dict(frequency_penalty=1.2),
        dict(repetition_penalty=1.8),
        dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3),
        dict(),
    )]
    engine = _engine(path, async_scheduling=async_scheduling)
    got = _run(engine, prompts, params)
    for prompt, p, out in zip(prompts, params, got, strict=True):
        assert out.token_ids == _reference_greedy(hf_model, prompt, p, NEW), p
    plain = _reference_greedy(hf_model, prompts[0], params[-1], NEW)
    assert got[0].token_ids != plain  # the penalty changed something
    assert engine.block_manager.num_used_blocks == 0


def test_logit_bias_allowed_and_bad_tokens_and_min_tokens(tiny_models):
    path, _ = tiny_models["llama"]
    rng = np.random.default_rng(6)
    prompt = rng.integers(3, 1000, size=17).tolist()
    # Every program warmed up (one block width: 4 token buckets), and none built after.
    engine = _engine(path, strict_compile=True, max_model_len=64)
    engine.warmup()
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    [base] = _run(engine, [prompt], [greedy])
    first = base.token_ids[0]
    banned, forced, allowed, bounded, sampled = _run(engine, [prompt] * 5, [
        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                       logit_bias={first: -100}),
        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias={77: 100}),
        SamplingParams(temperature=1.0, seed=1, max_tokens=NEW, ignore_eos=True,
                       allowed_token_ids=[5, 50, 500]),
        # EOS (2) pushed to the top: it may end the request only after min_tokens
        SamplingParams(temperature=0, max_tokens=NEW, logit_bias={2: 100}, min_tokens=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True, min_p=0.2,
                       presence_penalty=0.5),
    ])
    assert first not in banned.token_ids
    assert forced.token_ids == [77] * NEW
    assert set(allowed.token_ids) <= {5, 50, 500} and len(set(allowed.token_ids)) > 1
    assert bounded.token_ids[:5] != [2] * 5 and 2 not in bounded.token_ids[:5]
    assert len(bounded.token_ids) == 6 and bounded.token_ids[5] == 2
    assert bounded.finish_reason == "stop"
    assert len(sampled.token_ids) == NEW
    # min_p alone: at 1.0 only the most likely token stays, so sampling is greedy
    [top_only] = _run(engine, [prompt], [SamplingParams(temperature=1.5, seed=4, max_tokens=NEW,
                                                        ignore_eos=True, min_p=1.0)])
    assert top_only.token_ids == base.token_ids
    assert engine.runner.num_compiles == len(engine.runner.all_programs())  # no new program


@pytest.mark.slow
def test_bad_words_stop_strings_and_special_tokens_on_the_default_model(smollm):
    engine = LLMEngine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                    num_kv_blocks=64, log_stats_interval_s=0), smollm)
    prompt = "The capital of France is"

    def text(**kw):
        engine.add_request("x", prompt, SamplingParams(**(dict(temperature=0, max_tokens=10)
                                                           | kw)))
        return run_all(engine)["x"].outputs[0]

    base = text()
    assert "Paris" in base.text
    assert "Paris" not in text(bad_words=["Paris"]).text
    kept = text(stop=["Paris"], include_stop_str_in_output=True)
    assert kept.text.endswith("Paris") and kept.finish_reason == "stop"
    assert not text(stop=["Paris"]).text.endswith("Paris")
    eos = smollm.tokenizer.eos_token
    shown = text(logit_bias={smollm.tokenizer.eos_token_id: 100}, ignore_eos=True,
                 skip_special_tokens=False, max_tokens=3)
    assert shown.text == eos * 3


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("min_p", 1.5), ("logit_bias", {5: 101}),
    ("logit_bias", {-1: 1.0}), ("allowed_token_ids", []), ("min_tokens", -1),
    ("bad_words", [""]), ("structured_outputs", {"regex": "a", "choice": ["b"]}),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(20)


def test_token_ids_outside_the_vocabulary_are_refused(tiny_models):
    engine = _engine(tiny_models["llama"][0])
    for field, value in (("logit_bias", {1000: 1.0}), ("allowed_token_ids", [3, 1000])):
        with pytest.raises(ValueError, match=f"{field}: token id 1000"):
            engine.add_request("x", prompt_token_ids=[5, 6],
                               params=SamplingParams(**{field: value}))
    assert not engine.has_unfinished_requests()
