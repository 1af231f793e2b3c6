"""Data-parallel replicas on disjoint forced CPU devices, through the LLM library front."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.engine import data_parallel
from jaxserve.runtime import sharding

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced) devices")

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at",
           "The largest planet is", "import numpy as np\n", "My favourite colour is",
           "1, 2, 3, 4,", "Write a haiku about the sea.", "The speed of light is"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _config(**kw) -> EngineConfig:
    # Two token buckets and one block width: every bucket is a program per replica's devices
    # to compile, and the subject here is the replicas, not the buckets (tested elsewhere).
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=64,
                log_stats_interval_s=0, token_buckets=(16, 64), block_buckets=(8,))
    return EngineConfig(**(args | kw))


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_two_replicas_of_two_devices_give_the_tokens_of_one_engine(smollm):
    """DP 2 x TP 2 over the 4 devices: each replica's params and pool live only on its own
    pair; the prompts spread over both; the tokens equal one engine's; every block returns;
    the same prompts again go back to the replica that caches them."""
    one = _tokens(LLM.from_engines([LLMEngine(_config(), smollm)]))
    engines = data_parallel.build_replicas(
        _config(data_parallel_size=2, tensor_parallel_size=2), smollm)
    groups = [e.runner.devices for e in engines]
    assert groups == [jax.devices()[:2], jax.devices()[2:4]]
    for e, other in zip(engines, reversed(groups), strict=True):
        r = e.runner
        assert sharding.bytes_on_device(r.params, r.devices[0]) > 0
        assert all(sharding.bytes_on_device(r.params, d) == 0
                   and sharding.bytes_on_device(r.kv, d) == 0 for d in other)
    llm = LLM.from_engines(engines)
    assert _tokens(llm) == one
    routed = [load.routed for load in llm.router.loads]
    assert sum(routed) == len(PROMPTS) and min(routed) >= len(PROMPTS) // 2 - 1
    assert all(load.in_flight == 0 for load in llm.router.loads)
    for e in engines:
        assert e.block_manager.num_used_blocks == 0 and not e.has_unfinished_requests()
    long_prompts = [p * 8 for p in PROMPTS[:6]]  # several full blocks each
    first = _tokens(llm, long_prompts)
    hits = [e.metrics_snapshot()["prefix_cache_hits"] for e in engines]
    assert _tokens(llm, long_prompts) == first
    assert [load.prefix_routed for load in llm.router.loads] == [3, 3]
    assert all(e.metrics_snapshot()["prefix_cache_hits"] > h  # each prompt found its cache
               for e, h in zip(engines, hits, strict=True))


def test_a_bad_prompt_withdraws_the_batch_from_every_replica(smollm):
    llm = LLM.from_engines(data_parallel.build_replicas(_config(data_parallel_size=2), smollm))
    with pytest.raises(ValueError, match="prompt 3: prompt must not be empty"):
        llm.generate(PROMPTS[:3] + [""], PARAMS, use_tqdm=False)
    for e in llm.engines:
        assert not e.has_unfinished_requests() and e.block_manager.num_used_blocks == 0
    assert all(load.in_flight == 0 for load in llm.router.loads)
    assert len(llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)) == 4


def test_replicas_need_their_devices():
    with pytest.raises(ValueError, match="data_parallel_size=3 x tensor_parallel_size=2 needs 6"):
        data_parallel.device_groups(3, 2)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        EngineConfig(data_parallel_size=0)


def test_snapshots_merge_by_summing_counts_and_recomputing_ratios():
    spec = {"spec_accepted_tokens": 6, "spec_proposed_tokens": 8, "spec_acceptance_rate": 0.75,
            "spec_emitted_tokens": 9, "spec_verify_rows": 3, "spec_mean_accepted_length": 3.0}
    idle = dict.fromkeys(spec, 0)
    a = {"num_running": 2, "kv_blocks_used": 10, "kv_blocks_total": 40, "kv_usage": 0.25,
         "prefix_cache_hits": 3, "prefix_cache_queries": 4, "prefix_cache_hit_rate": 0.75} | spec
    b = {"num_running": 1, "kv_blocks_used": 0, "kv_blocks_total": 40, "kv_usage": 0.0,
         "prefix_cache_hits": 0, "prefix_cache_queries": 0, "prefix_cache_hit_rate": 0.0} | idle
    m = data_parallel.merge_snapshots([a, b])
    assert m["num_running"] == 3 and m["kv_usage"] == 10 / 80
    assert m["prefix_cache_hit_rate"] == 0.75 and m["replicas"] == [a, b]
    assert m["spec_acceptance_rate"] == 0.75 and m["spec_mean_accepted_length"] == 3.0
    assert data_parallel.merge_snapshots([a]) is a
