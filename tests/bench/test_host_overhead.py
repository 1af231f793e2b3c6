"""The host-overhead benchmark: the real engine loop over a runner that computes nothing."""

from __future__ import annotations

from jaxserve.bench.host_overhead import PARTS, bench, bench_tiny, make_engine
from jaxserve.core.sampling_params import SamplingParams
from tests.helpers import run_all


def _run(loaded, async_scheduling: bool, decode_steps: int = 1) -> dict:
    engine = make_engine(16, loaded, async_scheduling, decode_steps=decode_steps)
    for i in range(40):
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5 + i % 7,
                                stop=["e"] if i % 3 == 0 else None)
        engine.add_request(f"r{i}", prompt_token_ids=list(range(100 + i, 140 + 3 * i)),
                           params=params)
    return {rid: (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason)
            for rid, out in run_all(engine).items()}


def test_zero_cost_runner_gives_the_same_outputs_sync_and_async(smollm):
    sync, asynchronous = _run(smollm, False), _run(smollm, True)
    assert sync == asynchronous and len(sync) == 40
    assert {reason for _, _, reason in sync.values()} == {"stop", "length"}


def test_bench_times_every_part(smollm):
    r = bench(8, 6, smollm, warm_steps=2)
    assert set(r["p50"]) == {*PARTS, "step", "idle"}
    assert r["tokens_per_step"] > 0 and r["p50"]["step"] > 0
    assert r["p50"]["build"] > 0  # the runner's step preparation, timed where it runs
    # detokenizing is part of postprocessing, step by step
    assert r["p50"]["detokenize"] <= r["p50"]["postprocess"]


def test_zero_cost_runner_runs_several_decode_steps_per_call(smollm):
    """A step of several decode steps stops each row where the host would, as the real
    runner's loop does: the same outputs as one decode step per call."""
    want = _run(smollm, False)
    assert _run(smollm, False, decode_steps=4) == want
    assert _run(smollm, True, decode_steps=4) == want
    r = bench(8, 4, smollm, warm_steps=2, decode_steps=4, workload="decode")
    assert r["tokens_per_step"] == 8 * 4 and r["us_per_token"] > 0


def test_tiny_model_runs_the_whole_engine(smollm):
    r = bench_tiny(num_requests=8, max_tokens=5, warm_runs=0, tokenizer=smollm.tokenizer)
    # 8 prompts in one step (under the budget), then a step per further token
    assert r["steps"] == 5 and r["tok_s"] > 0 and r["ms_per_step"] > 0
