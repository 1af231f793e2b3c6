"""The adaptive speculation policy through the real engine loop, over a runner that sleeps a set
time per step (ZeroCostRunner): it speculates where verifying pays and stops where it does not,
after a bounded exploration, per sequence, and the tokens are those of speculation off."""

from __future__ import annotations

import numpy as np

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.bench.host_overhead import ZeroCostRunner

PERIOD = 7  # a copying request repeats a cycle of this many tokens
COPY_SEED = 1  # the request seed that makes the runner copy; others sample "open-ended" tokens


# the open-ended requests' tokens: one random row of 6 tokens per seed, a token per position
OPEN = 2000 + np.random.default_rng(0).integers(0, 6, (64, 1024))


def _tokens(seeds: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The token after each position: a copying request continues the cycle its prompt holds
    (prompt lookup proposes it right every time); any other draws from 6 tokens, so proposals
    are found often and mostly wrong."""
    return np.where(seeds == COPY_SEED, 1000 + (pos + 1) % PERIOD, OPEN[seeds % 64, pos + 1])


def _engine(loaded, device_s: float, verify_s: float, draft_s: float = 0.0,
            speculate: bool = True, async_scheduling: bool | None = False) -> LLMEngine:
    spec = dict(speculative_method="ngram", num_speculative_tokens=4) if speculate else {}
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                       block_size=16, num_kv_blocks=128, async_scheduling=async_scheduling,
                       log_stats_interval_s=0, enable_step_trace=True, **spec)
    runner = ZeroCostRunner(cfg, loaded.config.vocab_size, loaded.config.num_layers, device_s,
                            verify_s, draft_s, _tokens)
    return LLMEngine(cfg, loaded, runner=runner)


def _run(engine: LLMEngine, requests: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """request id -> (seed, max_tokens); returns each one's tokens."""
    for rid, (seed, max_tokens) in requests.items():
        if seed == COPY_SEED:
            prompt = [1000 + i % PERIOD for i in range(3 * PERIOD)]
        else:
            prompt = _tokens(np.full((1, 1), seed), np.arange(-1, 23)[None])[0].tolist()
        engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=max_tokens, seed=seed))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.block_manager.num_used_blocks == 0
    return done


def _verify_share(engine: LLMEngine, since: int = 0) -> dict[str, tuple[int, int]]:
    """request id -> (its decode steps from step `since` on, those that verified proposals)."""
    share: dict[str, list[int]] = {}
    for rec in engine.step_trace[since:]:
        for rid, _, decode in rec.requests:
            if decode:
                s = share.setdefault(rid, [0, 0])
                s[0] += 1
                s[1] += decode > 1
    return {rid: (n, v) for rid, (n, v) in share.items()}


def test_it_speculates_where_verifying_pays(smollm):
    """A request that copies its prompt, verifying costs a quarter of a step: nearly every
    step verifies, and the tokens are speculation off's."""
    requests = {"copy": (COPY_SEED, 160)}
    engine = _engine(smollm, 0.008, 0.002)
    got = _run(engine, requests)
    assert got == _run(_engine(smollm, 0.0, 0.0, speculate=False), requests)
    steps, verified = _verify_share(engine)["copy"]
    assert verified >= 0.8 * steps
    assert engine.metrics_snapshot()["spec_mean_accepted_length"] > 4


def test_it_stops_after_exploring_where_verifying_costs_more_than_it_gains(smollm):
    """The same copying request where a verifying step costs eleven plain ones, and an open-ended
    one whose proposals are mostly wrong: each verifies on a few steps (exploring) and then
    declines but for at most one step in 32, and the tokens are speculation off's."""
    costly, wrong = {"copy": (COPY_SEED, 100)}, {"open": (7, 100)}
    for engine, requests in ((_engine(smollm, 0.006, 0.060), costly),
                             (_engine(smollm, 0.010, 0.006), wrong)):
        got = _run(engine, requests)
        assert got == _run(_engine(smollm, 0.0, 0.0, speculate=False), requests)
        policy = engine.speculator.policy
        steps = len(engine.step_trace)
        assert 1 <= policy.num_explored <= 1 + steps // 32
        verified = engine.metrics_snapshot()["spec_steps"]
        assert policy.num_explored <= verified <= policy.num_explored + 3
        later, verified_later = next(iter(_verify_share(engine, steps // 2).values()))
        assert verified_later <= 1 + later // 32
    assert engine.speculator.stats.acceptance_rate < 0.4


def test_one_copying_request_speculates_among_open_ended_ones(smollm):
    """One request copies its prompt, three are open-ended, in the same steps; a proposed
    token costs an eighth of a plain step: the copying one verifies on most of its steps,
    the others on few, and every output is speculation off's."""
    requests = {"copy": (COPY_SEED, 240)} | {f"open{i}": (10 + i, 60) for i in range(3)}
    engine = _engine(smollm, 0.016, 0.002, 0.002)
    got = _run(engine, requests)
    assert got == _run(_engine(smollm, 0.0, 0.0, speculate=False), requests)
    share = _verify_share(engine)
    steps, verified = share["copy"]
    assert verified >= 0.7 * steps
    for i in range(3):
        steps, verified = share[f"open{i}"]
        assert verified <= 0.2 * steps


def test_steps_it_declines_to_verify_may_overlap(smollm):
    """With asynchronous scheduling left to the engine: a copying request still verifies on
    most steps (each synchronous, its proposals continuing its last token), an open-ended one
    whose proposals do not pay runs most of its later steps overlapped; the tokens are
    speculation off's either way."""
    copy, wrong = {"copy": (COPY_SEED, 160)}, {"open": (7, 200)}
    engine = _engine(smollm, 0.008, 0.002, async_scheduling=None)
    assert _run(engine, copy) == _run(_engine(smollm, 0.0, 0.0, speculate=False), copy)
    steps, verified = _verify_share(engine)["copy"]
    assert verified >= 0.7 * steps
    engine = _engine(smollm, 0.010, 0.006, async_scheduling=None)
    assert _run(engine, wrong) == _run(_engine(smollm, 0.0, 0.0, speculate=False), wrong)
    snap = engine.metrics_snapshot()
    assert snap["num_overlapped_steps"] >= 0.5 * snap["num_steps"]
    assert snap["spec_steps"] >= 1  # it explored
