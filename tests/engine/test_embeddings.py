"""Embedding requests: prompt-only requests whose output is the prompt's final hidden states
pooled (mean or last), scheduled with generation in the same steps; checked against the HF
oracle's last hidden states across chunked prefill, the prefix cache and async scheduling."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, run_all


def _engine(path, **kw) -> LLMEngine:
    # a float32 pool: the oracle is HF's float32 forward
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
                num_kv_blocks=128, log_stats_interval_s=0, enable_prefix_caching=True,
                kv_cache_dtype="float32", enable_step_trace=True)
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)))


def _reference(hf_model, prompt: list[int]) -> np.ndarray:
    """(len(prompt), D) float64: HF's final hidden states (after the final norm)."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pooled_states_equal_the_oracle_batched_with_generation(tiny_models, async_scheduling):
    """Prompts longer than a step's 16 tokens (so pooled chunk by chunk), in the same steps as
    a generating request whose tokens they do not change; every block back at the end."""
    path, hf_model = tiny_models["llama"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 37, 16)]
    gen = rng.integers(3, 1000, 12).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _engine(path)
    alone.add_request("g", prompt_token_ids=gen, params=params)
    want = run_all(alone)["g"].outputs[0].token_ids

    engine = _engine(path, async_scheduling=async_scheduling)
    engine.add_request("g", prompt_token_ids=gen, params=params)
    for i, p in enumerate(prompts):
        engine.add_embedding_request(f"m{i}", prompt_token_ids=p, pooling="mean")
        engine.add_embedding_request(f"l{i}", prompt_token_ids=p, pooling="last")
    done = run_all(engine)
    assert done["g"].outputs[0].token_ids == want
    for i, p in enumerate(prompts):
        ref = _reference(hf_model, p)
        np.testing.assert_allclose(done[f"m{i}"].embedding, ref.mean(0), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(done[f"l{i}"].embedding, ref[-1], atol=1e-4, rtol=1e-4)
    both = [r for r in engine.step_trace if "g" in r.request_ids
            and any(q.startswith(("m", "l")) for q in r.request_ids)]
    assert both, "no step ran generation and embeddings together"
    engine.block_manager.check_integrity([])
    assert engine.block_manager.num_used_blocks == 0


def test_last_pooling_reads_the_prefix_cache_and_mean_does_not(tiny_models):
    path, hf_model = tiny_models["llama"]
    prompt = np.random.default_rng(6).integers(3, 1000, 40).tolist()
    ref = _reference(hf_model, prompt)
    engine = _engine(path)
    engine.add_embedding_request("first", prompt_token_ids=prompt, pooling="last")
    run_all(engine)
    for pooling, want, hits in (("last", ref[-1], 32), ("mean", ref.mean(0), 0)):
        before = engine.metrics_snapshot()["prefix_cache_hits"]
        engine.add_embedding_request(pooling, prompt_token_ids=prompt, pooling=pooling)
        out = run_all(engine)[pooling]
        np.testing.assert_allclose(out.embedding, want, atol=1e-4, rtol=1e-4)
        assert engine.metrics_snapshot()["prefix_cache_hits"] - before == hits, pooling
    assert engine.block_manager.num_used_blocks == 0


def test_llm_embed_normalizes_and_checks_its_pooling(tiny_models):
    path, hf_model = tiny_models["llama"]
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
              num_kv_blocks=128, log_stats_interval_s=0, kv_cache_dtype="float32",
              pooling="last", token_buckets=(8, 16), block_buckets=(32,))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    vecs = llm.embed(prompts)
    for v, p in zip(vecs, prompts, strict=True):
        ref = _reference(hf_model, p)[-1]
        np.testing.assert_allclose(v, ref / np.linalg.norm(ref), atol=1e-5)
    raw = llm.embed(prompts[0], pooling="mean", normalize=False)[0]
    np.testing.assert_allclose(raw, _reference(hf_model, prompts[0]).mean(0), atol=1e-4)
    with pytest.raises(ValueError, match="pooling must be one of mean, last"):
        llm.embed([1, 2], pooling="cls")
    with pytest.raises(ValueError, match="pooling must be one of mean, last"):
        EngineConfig(pooling="max")
    assert llm.engine.block_manager.num_used_blocks == 0


def test_an_aborted_embedding_frees_its_blocks_and_the_others_go_on(tiny_models):
    path, hf_model = tiny_models["llama"]
    rng = np.random.default_rng(7)
    long, other = rng.integers(3, 1000, 60).tolist(), rng.integers(3, 1000, 30).tolist()
    engine = _engine(path)
    engine.add_embedding_request("a", prompt_token_ids=long, pooling="mean")
    engine.add_embedding_request("b", prompt_token_ids=other, pooling="mean")
    engine.step()  # a's first chunk
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("a")
    done = run_all(engine)
    assert done["a"].embedding is None and done["a"].outputs[0].finish_reason == "abort"
    np.testing.assert_allclose(done["b"].embedding, _reference(hf_model, other).mean(0),
                               atol=1e-4, rtol=1e-4)
    engine.block_manager.check_integrity([])
    assert engine.block_manager.num_used_blocks == 0


def test_a_preempted_mean_starts_again_and_stays_exact(tiny_models):
    """A long embedding preempted mid-prompt (recompute) by a request that outranks it: its
    sum restarts with the first chunk when it runs again."""
    path, hf_model = tiny_models["llama"]
    rng = np.random.default_rng(8)
    prompt = rng.integers(3, 1000, 60).tolist()
    engine = _engine(path, max_num_seqs=1, scheduling_policy="priority")
    engine.add_embedding_request("e", prompt_token_ids=prompt, pooling="mean", priority=5)
    engine.step()  # its first chunk
    engine.add_request("g", prompt_token_ids=[5, 6, 7], params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))
    done = run_all(engine)
    assert done["e"].metrics.num_preemptions > 0
    np.testing.assert_allclose(done["e"].embedding, _reference(hf_model, prompt).mean(0),
                               atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_used_blocks == 0


def test_tensor_parallel_gives_the_same_pooled_states(tiny_models):
    """The step's outputs are replicated: under tp 2 each row's pooled state is whole."""
    path, hf_model = tiny_models["llama"]
    prompt = np.random.default_rng(9).integers(3, 1000, 30).tolist()
    engine = _engine(path, tensor_parallel_size=2)
    engine.add_embedding_request("m", prompt_token_ids=prompt, pooling="mean")
    engine.add_embedding_request("l", prompt_token_ids=prompt, pooling="last")
    done = run_all(engine)
    ref = _reference(hf_model, prompt)
    np.testing.assert_allclose(done["m"].embedding, ref.mean(0), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(done["l"].embedding, ref[-1], atol=1e-4, rtol=1e-4)
