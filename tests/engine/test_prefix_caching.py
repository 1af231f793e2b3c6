"""Prefix caching in the engine: the same tokens with it on as off, fewer prefill tokens."""

from __future__ import annotations

import pytest

from jaxserve import SamplingParams
from tests.helpers import make_engine, run_all

SYSTEM = [(7 * i) % 400 + 3 for i in range(45)]  # a shared "system prompt" of ~3 blocks


def _prompts() -> dict[str, list[int]]:
    out = {f"u{i}": SYSTEM + [10 + i, 20 + i, 30 + i] for i in range(6)}
    out["dup"] = list(out["u0"])  # a whole prompt seen before
    out["other"] = [9, 8, 7, 6, 5]
    return out


def _run(path, caching: bool, waves: int = 2, **kw):
    engine = make_engine(path, enable_prefix_caching=caching, **kw)
    done = {}
    prefill = 0
    for w in range(waves):  # a second wave finds the first wave's blocks freed but cached
        for rid, ids in _prompts().items():
            engine.add_request(f"{w}-{rid}", prompt_token_ids=ids,
                               params=SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))
        done.update(run_all(engine))
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0
    prefill = sum(r.num_prefill_tokens for r in engine.step_trace)
    return {r: o.outputs[0].token_ids for r, o in done.items()}, prefill, engine


TIGHT = {"num_kv_blocks": 12, "max_num_batched_tokens": 16}  # preemption and small chunks


@pytest.mark.parametrize("kw", [
    {},  # plenty of room
    {**TIGHT, "swap_space_bytes": 0},  # no host tier: evicted prefixes are computed again
    TIGHT,  # evicted prefixes come back from the host tier
    {**TIGHT, "preemption_mode": "swap"},
])
def test_same_tokens_with_caching_and_fewer_prefill_tokens(tiny_llama_dir, kw):
    off, prefill_off, _ = _run(tiny_llama_dir, False, **kw)
    on, prefill_on, engine = _run(tiny_llama_dir, True, **kw)
    assert on == off
    assert prefill_on < prefill_off
    stats = engine.block_manager.stats
    assert stats.hits > 0 and stats.hits <= stats.queries
    if engine.scheduler.swap_space is None:
        assert stats.host_hits == 0
    else:
        engine.scheduler.swap_space.check_integrity()
        assert engine.scheduler.swap_space.num_used == 0


def test_an_evicted_prefix_comes_back_from_the_host_tier(tiny_llama_dir):
    """A prompt, then enough other prompts to push its blocks out of a small device pool, then
    the prompt again: its prefix is copied back from the host tier (not computed), and every
    token equals a run without caching."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fillers = [[(100 + 13 * i + 7 * j) % 500 for j in range(60)] for i in range(4)]
    results = {}
    for caching in (False, True):
        engine = make_engine(tiny_llama_dir, enable_prefix_caching=caching, num_kv_blocks=8)
        outs = []
        for i, ids in enumerate([SYSTEM + [1, 2]] + fillers + [SYSTEM + [3, 4]]):
            engine.add_request(str(i), prompt_token_ids=ids, params=params)
            outs.append(run_all(engine)[str(i)].outputs[0].token_ids)
        results[caching] = outs
    assert results[True] == results[False]
    stats, host = engine.block_manager.stats, engine.scheduler.swap_space
    bs = engine.config.block_size
    assert stats.host_hits == len(SYSTEM) // bs * bs  # the whole shared prefix, from the host
    last_prefill = sum(p for r in engine.step_trace for rid, p, _ in r.requests if rid == "5")
    assert last_prefill == len(SYSTEM) + 2 - stats.host_hits
    host.check_integrity()
    assert host.num_cached > 0 and host.num_used == 0
    assert engine.block_manager.num_used_blocks == 0


def test_metrics_snapshot_reports_the_prefix_cache(tiny_llama_dir):
    _, _, engine = _run(tiny_llama_dir, True)
    snap = engine.metrics_snapshot()
    stats = engine.block_manager.stats
    assert snap["prefix_cache_queries"] == stats.queries > 0
    assert snap["prefix_cache_hits"] == stats.hits > 0
    assert snap["prefix_cache_hit_rate"] == pytest.approx(stats.hits / stats.queries)
    assert snap["prefix_cache_blocks"] == engine.block_manager.num_cached_blocks > 0
    assert snap["prefix_cache_host_hits"] == stats.host_hits
    host = engine.scheduler.swap_space
    assert snap["prefix_cache_host_blocks"] == host.num_cached
    assert snap["prefix_cache_host_evictions"] == host.num_evictions
    from jaxserve.engine.data_parallel import make_router
    from jaxserve.serving.prometheus import PrometheusExporter

    exporter = PrometheusExporter(make_router([engine]))
    exporter.update(engine)
    text = exporter.render().decode()
    assert f"jaxserve_prefix_cache_hits_total {float(stats.hits)}" in text
    assert f"jaxserve_prefix_cache_host_hits_total {float(stats.host_hits)}" in text


def test_the_engine_logs_the_hit_rate_as_vllm_does(tiny_llama_dir, caplog):
    """Every log_stats_interval_s while requests run: throughput, queues, KV usage and the
    prefix cache hit rate of the lookups in the interval."""
    import logging

    caplog.set_level(logging.INFO, logger="jaxserve.engine.llm_engine")
    engine = make_engine(tiny_llama_dir, log_stats_interval_s=1e-9)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for rid in ("a", "b"):  # b finds a's two full blocks
        engine.add_request(rid, prompt_token_ids=SYSTEM[:32] + [5], params=params)
        run_all(engine)
    lines = [r.getMessage() for r in caplog.records if "Prefix cache hit rate" in r.getMessage()]
    assert lines and all("Avg generation throughput" in x for x in lines)
    rate = 100 * 32 / 33
    assert any(f"Prefix cache hit rate: {rate:.1f}% (device {rate:.1f}%, host 0.0%)" in x
               for x in lines), lines
    caplog.clear()
    quiet = make_engine(tiny_llama_dir, log_stats_interval_s=0)
    quiet.add_request("c", prompt_token_ids=[1, 2, 3], params=params)
    run_all(quiet)
    assert not [r for r in caplog.records if "Prefix cache" in r.getMessage()]


def test_requests_share_cached_blocks_only_under_the_same_salt(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    hits = []
    for rid, salt in (("a", "x"), ("b", "y"), ("c", None), ("d", "x")):
        engine.add_request(rid, prompt_token_ids=SYSTEM + [1], params=params, cache_salt=salt)
        run_all(engine)
        hits.append(engine.block_manager.stats.hits)
    assert hits[0] == hits[1] == hits[2] == 0  # the first of each salt computes everything
    assert hits[3] == len(SYSTEM) // engine.config.block_size * engine.config.block_size
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("e", prompt_token_ids=[1], params=params, cache_salt=5)
