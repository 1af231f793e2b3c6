"""prompt_logprobs: every prompt token's logprob given those before it, its rank and the top
ones, computed inside the step from the rows the step already runs; checked against the HF
oracle across chunked prefill, the prefix cache, preemption, async scheduling and n > 1."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, run_all

K = 4


def _engine(path, **kw) -> LLMEngine:
    # A float32 pool: the oracle is HF's float32 forward, compared to 1e-4 (a float16 pool, the
    # CPU default, rounds K/V to 11 bits).
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
                num_kv_blocks=128, log_stats_interval_s=0, enable_prefix_caching=True,
                kv_cache_dtype="float32")
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)))


def _reference(hf_model, prompt: list[int]) -> np.ndarray:
    """(len(prompt), V) float64: HF's log-softmax over the vocabulary after each prefix."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(entries, prompt: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row, token = entries[i], ref[i - 1], prompt[i]
        assert e["logprob"] == pytest.approx(row[token], abs=1e-4), i
        assert e["rank"] == 1 + int(np.sum(row > row[token] + 1e-6)), i
        top = np.argsort(-row)[:k]
        assert list(e["top"]) == top.tolist(), i
        assert list(e["top"].values()) == pytest.approx(row[top].tolist(), abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_the_oracle_across_chunks_and_the_cache(tiny_models,
                                                                      async_scheduling):
    """Prompts longer than a step's 16 tokens (so scored chunk by chunk), sharing a prefix
    with a request that filled the prefix cache first: the ones asking still score every
    token (they take nothing from the cache), the one that does not ask still hits it."""
    path, hf_model = tiny_models["llama"]
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 1000, 40).tolist()
    prompts = [shared + rng.integers(3, 1000, n).tolist() for n in (5, 17)]
    prompts.append(rng.integers(3, 1000, 9).tolist())
    engine = _engine(path, async_scheduling=async_scheduling)
    engine.add_request("warm", prompt_token_ids=shared + [7, 8],
                       params=SamplingParams(temperature=0, max_tokens=2))
    run_all(engine)
    hits = engine.metrics_snapshot()["prefix_cache_hits"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=SamplingParams(
            temperature=0, max_tokens=3, prompt_logprobs=K if i != 1 else 0))
    engine.add_request("plain", prompt_token_ids=shared + [9], params=SamplingParams(
        temperature=0, max_tokens=3))
    done = run_all(engine)
    for i, p in enumerate(prompts):
        _check(done[f"r{i}"].prompt_logprobs, p, _reference(hf_model, p), K if i != 1 else 0)
    assert done["plain"].prompt_logprobs is None
    # Only "plain" read the shared blocks: the others computed their prompts whole.
    assert engine.metrics_snapshot()["prefix_cache_hits"] - hits == 32
    assert engine.block_manager.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption_and_are_given_once(tiny_models):
    """A pool too small for all at once: requests are preempted (recompute) after their
    prompts were scored, and each list still holds exactly one entry per prompt token."""
    path, hf_model = tiny_models["qwen2"]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 1000, int(n)).tolist() for n in (30, 26, 33, 21)]
    engine = _engine(path, num_kv_blocks=12, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2))
    done = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        _check(done[f"r{i}"].prompt_logprobs, p, _reference(hf_model, p), 2)


def test_n_samples_score_the_prompt_once_and_no_program_is_added(tiny_models):
    path, hf_model = tiny_models["llama"]
    prompt = np.random.default_rng(5).integers(3, 1000, 50).tolist()
    engine = _engine(path, strict_compile=True)
    engine.warmup()
    engine.add_request("n3", prompt_token_ids=prompt, params=SamplingParams(
        n=3, temperature=1.0, seed=2, max_tokens=4, prompt_logprobs=1))
    engine.add_request("other", prompt_token_ids=prompt[:20], params=SamplingParams(
        temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=3))
    done = run_all(engine)  # strict_compile: a new program would raise
    _check(done["n3"].prompt_logprobs, prompt, _reference(hf_model, prompt), 1)
    _check(done["other"].prompt_logprobs, prompt[:20], _reference(hf_model, prompt[:20]), 3)
    assert len(done["other"].outputs[0].logprobs) == 4
    # The samples read the first one's prompt from the cache: 50 tokens computed, not 150.
    assert engine.metrics_snapshot()["prompt_tokens"] <= 50 + 20 + 2 * engine.config.block_size


def test_prompt_logprobs_is_checked():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate(20)
    SamplingParams(prompt_logprobs=0).validate(20)


def test_tensor_parallel_gives_the_same_prompt_logprobs(tiny_models):
    path, hf_model = tiny_models["llama"]
    prompt = np.random.default_rng(6).integers(3, 1000, 37).tolist()
    engine = _engine(path, tensor_parallel_size=2)
    engine.add_request("r", prompt_token_ids=prompt, params=SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=K))
    _check(run_all(engine)["r"].prompt_logprobs, prompt, _reference(hf_model, prompt), K)
