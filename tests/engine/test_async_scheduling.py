"""Asynchronous scheduling: step N+1 is launched before step N's tokens are read back; and the
server's overlapped steps (step_overlapped: step N+1 launched after step N's tokens are read,
before they are handed on). The tokens, logprobs and finish reasons must equal synchronous
stepping's, also under preemption and aborts, and every KV block must come back."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.core.sequence import PENDING
from tests.helpers import make_engine, run_all


def _workload(n: int = 12):
    """Mixed prompts and parameters: greedy and seeded sampling, EOS-free and stop tokens,
    logprobs, different lengths."""
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(n):
        prompt = rng.integers(3, 500, int(rng.integers(2, 40))).tolist()
        params = SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.9, top_p=1.0 if i % 2 else 0.8, seed=i,
            max_tokens=int(rng.integers(1, 30)), ignore_eos=True,
            logprobs=2 if i % 4 == 1 else None, stop_token_ids=[7] if i % 5 == 2 else [])
        reqs.append((f"r{i}", prompt, params))
    return reqs


def _run(path, async_scheduling: bool | None, reqs, overlapped: bool = False, chooser=None,
         **kw) -> tuple[dict, object]:
    # A float32 pool: the tiny model's float weights go through XLA's own dots, whose last bit
    # may depend on the step's shape (a recomputed prefill chunk vs the decodes it replays); a
    # float16 pool (the CPU default) can round such a difference into the logprobs compared here.
    kw.setdefault("kv_cache_dtype", "float32")
    engine = make_engine(path, async_scheduling=async_scheduling, **kw)
    if chooser is not None:  # unset async_scheduling: the mode chosen step by step, by this
        engine._overlap = chooser
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt_token_ids=prompt, params=params)
    done = run_all(engine, engine.step_overlapped if overlapped else engine.step)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()
    return done, engine


def _summary(done: dict) -> dict:
    out = {}
    for rid, o in done.items():
        c = o.outputs[0]
        assert PENDING not in c.token_ids
        out[rid] = (c.token_ids, c.finish_reason, c.stop_reason,
                    [round(e["logprob"], 4) for e in c.logprobs] if c.logprobs else None)
    return out


def test_async_scheduling_gives_the_tokens_of_synchronous_stepping(tiny_llama_dir):
    reqs = _workload()
    sync, _ = _run(tiny_llama_dir, False, reqs)
    asyn, engine = _run(tiny_llama_dir, True, reqs)
    assert _summary(asyn) == _summary(sync)
    # the overlap really happened: a decode row took its input token from the device
    assert any(r.num_decode_tokens for r in engine.step_trace)
    for rid, _, params in reqs:
        assert len(asyn[rid].outputs[0].token_ids) <= params.max_tokens


def test_async_scheduling_under_preemption_loses_nothing(tiny_llama_dir):
    reqs = _workload(16)
    want = _summary(_run(tiny_llama_dir, False, reqs)[0])
    for mode in ("recompute", "swap"):
        # 12 blocks of 16 tokens cannot hold 16 running requests: preemption is forced
        got, engine = _run(tiny_llama_dir, True, reqs, num_kv_blocks=12, preemption_mode=mode)
        assert engine.scheduler.num_preemptions > 0, mode
        assert _summary(got) == want, mode


@pytest.mark.parametrize("abort_at", [1, 2, 5])
def test_an_abort_while_a_step_is_in_flight(tiny_llama_dir, abort_at):
    reqs = _workload(6)
    want = _summary(_run(tiny_llama_dir, False, reqs)[0])
    engine = make_engine(tiny_llama_dir, async_scheduling=True, kv_cache_dtype="float32")
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt_token_ids=prompt, params=params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if step == abort_at:
            assert engine.abort("r1")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    got = _summary(done)
    aborted = got.pop("r1")
    assert done["r1"].outputs[0].finish_reason == "abort"
    assert aborted[0] == want["r1"][0][:len(aborted[0])]  # what it got before the abort is right
    assert got == {k: v for k, v in want.items() if k != "r1"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_overlapped_steps_give_the_tokens_of_synchronous_stepping(tiny_llama_dir):
    reqs = _workload(16)
    want = _summary(_run(tiny_llama_dir, False, reqs)[0])
    assert _summary(_run(tiny_llama_dir, False, reqs, overlapped=True)[0]) == want
    for mode in ("recompute", "swap"):
        got, engine = _run(tiny_llama_dir, False, reqs, overlapped=True, num_kv_blocks=12,
                           preemption_mode=mode)
        assert engine.scheduler.num_preemptions > 0, mode
        assert _summary(got) == want, mode


def test_an_overlapped_step_launches_the_next_before_handing_outputs_on(tiny_llama_dir):
    """A call returns a decode step's tokens with the next step already launched, and what
    before_launch did (a new request, an abort) is in that launch; a step of prompts alone
    returns before any launch."""
    reqs = _workload(4)
    want = _summary(_run(tiny_llama_dir, False, reqs)[0])
    engine = make_engine(tiny_llama_dir, async_scheduling=False, kv_cache_dtype="float32",
                         enable_step_trace=True)
    rid, prompt, params = reqs[0]
    engine.add_request(rid, prompt_token_ids=prompt, params=params)
    assert engine.step_overlapped() == []  # the prompt's step is launched, not yet done
    first = engine.step_overlapped()  # prompts alone: returned, nothing launched after
    assert [o.request_id for o in first] == [rid] and len(engine.step_trace) == 1
    assert engine.step_overlapped() == []  # its first decode step is launched
    calls = {"n": 0}
    late_id, late_prompt, late_params = reqs[1]

    def before_launch():
        calls["n"] += 1
        if calls["n"] == 1:  # joins the step launched by this very call
            engine.add_request(late_id, prompt_token_ids=late_prompt, params=late_params)
        if calls["n"] == 3:
            assert engine.abort(late_id)

    traced = len(engine.step_trace)
    outs = engine.step_overlapped(before_launch)
    assert [o.request_id for o in outs] == [rid] and outs[0].outputs[0].token_ids
    # the decode step it completed is traced; the step it launched (with r1) is not yet
    assert len(engine.step_trace) == traced + 1
    assert late_id not in engine.step_trace[-1].request_ids
    engine.step_overlapped(before_launch)
    assert late_id in engine.step_trace[-1].request_ids  # launched in the call before
    aborted = engine.step_overlapped(before_launch)
    assert any(o.request_id == late_id and o.outputs[0].finish_reason == "abort"
               for o in aborted)
    done = run_all(engine, engine.step_overlapped)
    assert all(late_id not in r.request_ids for r in engine.step_trace[traced + 3:])
    assert _summary({rid: done[rid]})[rid] == want[rid]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
