"""n > 1: parallel samples of one prompt, computed once, reported as one request."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, run_all


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1200,
                num_kv_blocks=512, log_stats_interval_s=0)
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)))


def test_n4_on_a_1000_token_prompt_computes_the_prompt_once(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = np.random.default_rng(0).integers(3, 500, 1000).tolist()
    engine.add_request("r", prompt_token_ids=prompt,
                       params=SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"r"}  # one request, whatever its samples do
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    computed = engine.metrics_snapshot()["prompt_tokens"]
    # The first sample computes the 1,000 tokens; the others only the last, partial block.
    assert 1000 <= computed <= 1000 + 3 * engine.config.block_size, computed
    assert engine.block_manager.num_used_blocks == 0 and not engine._groups

    # Without the prefix cache each sample computes its own prompt: same tokens.
    plain = _engine(tiny_llama_dir, enable_prefix_caching=False)
    plain.add_request("r", prompt_token_ids=prompt,
                      params=SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8))
    again = run_all(plain)["r"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    assert plain.metrics_snapshot()["prompt_tokens"] == 4000


def test_samples_are_seeded_one_after_another_and_greedy_ones_agree(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = list(range(5, 60))
    engine.add_request("n3", prompt_token_ids=prompt,
                       params=SamplingParams(n=3, temperature=1.0, seed=20, max_tokens=6))
    for i in range(3):  # sample i draws like a single request seeded seed + i
        engine.add_request(f"one{i}", prompt_token_ids=prompt,
                           params=SamplingParams(temperature=1.0, seed=20 + i, max_tokens=6))
    engine.add_request("greedy", prompt_token_ids=prompt,
                       params=SamplingParams(n=2, temperature=0, max_tokens=6))
    done = run_all(engine)
    assert [c.token_ids for c in done["n3"].outputs] == [
        done[f"one{i}"].outputs[0].token_ids for i in range(3)]
    a, b = done["greedy"].outputs
    assert a.token_ids == b.token_ids and a.index == 0 and b.index == 1


def test_aborting_an_n_request_ends_every_sample(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.add_request("r", prompt_token_ids=list(range(5, 300)),
                       params=SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("r")
    outs = run_all(engine)
    assert outs["r"].finished
    assert [c.finish_reason for c in outs["r"].outputs] == ["abort"] * 3
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    with pytest.raises(ValueError, match="n must be"):
        engine.add_request("x", prompt_token_ids=[5], params=SamplingParams(n=0))
