"""A failure inside one request's part of a step fails that request only."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import SamplingParams
from tests.helpers import make_engine, run_all

PROMPTS = {f"r{i}": [5 + i, 6, 7, 8 + i] for i in range(4)}


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)


def _reference(path, **kw) -> dict[str, list[int]]:
    engine = make_engine(path, **kw)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, prompt_token_ids=ids, params=_params())
    return {r: o.outputs[0].token_ids for r, o in run_all(engine).items()}


def _corrupt_step_value(seq):  # a value that cannot go into the step's int32 arrays
    seq.params = dataclasses.replace(seq.params, top_k=2**40)


def _corrupt_postprocess(seq):  # a stop "string" that makes the stop check raise
    seq.params.stop = [123]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("corrupt", [_corrupt_step_value, _corrupt_postprocess])
def test_one_broken_request_fails_alone(tiny_llama_dir, corrupt, async_scheduling):
    want = _reference(tiny_llama_dir, async_scheduling=async_scheduling)
    engine = make_engine(tiny_llama_dir, async_scheduling=async_scheduling)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, prompt_token_ids=ids, params=_params())
    engine.step()  # every request is running
    corrupt(engine.requests["r1"])
    if corrupt is _corrupt_postprocess:
        engine.requests["r1"].detok = _TextSource()
    done = run_all(engine)
    assert done["r1"].outputs[0].finish_reason == "error"
    assert done["r1"].metrics.error
    for rid in ("r0", "r2", "r3"):
        assert done[rid].outputs[0].token_ids == want[rid], rid
        assert done[rid].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0
    # The engine goes on serving.
    engine.add_request("after", prompt_token_ids=PROMPTS["r2"], params=_params())
    assert run_all(engine)["after"].outputs[0].token_ids == want["r2"]
    assert engine.block_manager.num_used_blocks == 0


class _TextSource:
    """Stands in for a tokenizer's incremental detokenizer on this tokenizer-less model, so the
    stop-string check runs at all."""

    def add(self, token: int) -> str:
        return f"<{token}>"


def test_fail_all_empties_the_engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, prompt_token_ids=ids, params=_params())
    engine.step()
    assert engine.fail_all("boom") == len(PROMPTS)
    outs = engine.take_pending_outputs()
    assert {o.request_id for o in outs} == set(PROMPTS)
    assert all(o.outputs[0].finish_reason == "error" and o.metrics.error == "boom" for o in outs)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_seeds_up_to_2_64_run_and_small_seeds_keep_their_stream(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    for rid, seed in (("a", 7), ("b", 7), ("big", 2**64 - 1), ("edge", 2**32)):
        engine.add_request(rid, prompt_token_ids=[5, 6, 7],
                           params=SamplingParams(seed=seed, **sampled))
    done = run_all(engine)
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("neg", prompt_token_ids=[5], params=SamplingParams(seed=2**64))


def test_max_tokens_none_runs_to_the_context_end(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_model_len=64)
    engine.add_request("x", prompt_token_ids=[5, 6, 7, 8],
                       params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_all(engine)["x"].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_whose_launch_fails_fails_its_rows_only(tiny_llama_dir, async_scheduling):
    """A launch that raises (as a device error would; under asynchronous scheduling it is
    raised on the launch thread and seen when the step completes) fails the requests in that
    step; their blocks come back and the engine serves the next ones."""
    want = _reference(tiny_llama_dir, async_scheduling=async_scheduling)
    engine = make_engine(tiny_llama_dir, async_scheduling=async_scheduling)
    real, calls = engine.runner.dispatch, []

    def dispatch(inp):
        calls.append(inp)
        if len(calls) == 3:
            raise RuntimeError("the device step failed")
        return real(inp)

    engine.runner.dispatch = dispatch
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, prompt_token_ids=ids, params=_params())
    done = run_all(engine)
    assert {o.outputs[0].finish_reason for o in done.values()} == {"error"}
    assert all("the device step failed" in o.metrics.error for o in done.values())
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("after", prompt_token_ids=PROMPTS["r2"], params=_params())
    assert run_all(engine)["after"].outputs[0].token_ids == want["r2"]
    assert engine.block_manager.num_used_blocks == 0
