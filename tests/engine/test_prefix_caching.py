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


@pytest.mark.parametrize("kw", [
    {},  # plenty of room
    {"num_kv_blocks": 12, "max_num_batched_tokens": 16},  # preemption and small chunks
    {"num_kv_blocks": 12, "max_num_batched_tokens": 16, "preemption_mode": "swap"},
])
def test_same_tokens_with_caching_and_fewer_prefill_tokens(tiny_llama_dir, kw):
    off, prefill_off, _ = _run(tiny_llama_dir, False, **kw)
    on, prefill_on, engine = _run(tiny_llama_dir, True, **kw)
    assert on == off
    assert prefill_on < prefill_off
    stats = engine.block_manager.stats
    assert stats.hits > 0 and stats.hits <= stats.queries


def test_metrics_snapshot_reports_the_prefix_cache(tiny_llama_dir):
    _, _, engine = _run(tiny_llama_dir, True)
    snap = engine.metrics_snapshot()
    stats = engine.block_manager.stats
    assert snap["prefix_cache_queries"] == stats.queries > 0
    assert snap["prefix_cache_hits"] == stats.hits > 0
    assert snap["prefix_cache_hit_rate"] == pytest.approx(stats.hits / stats.queries)
    assert snap["prefix_cache_blocks"] == engine.block_manager.num_cached_blocks > 0
    from jaxserve.serving.prometheus import PrometheusExporter

    exporter = PrometheusExporter()
    exporter.update(engine)
    text = exporter.render().decode()
    assert f"jaxserve_prefix_cache_hits_total {float(stats.hits)}" in text


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
