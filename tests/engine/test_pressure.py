"""The engine under pressure: preemption (recompute, swap), priority, static mode, admission."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.core.sequence import SequenceStatus
from jaxserve.engine.llm_engine import QueueFullError
from tests.helpers import make_engine, run_all

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _workload(engine, n=6):
    rng = np.random.default_rng(5)
    for i in range(n):
        engine.add_request(f"r{i}", prompt_token_ids=rng.integers(3, 500, 20 + 7 * i).tolist(),
                           params=GREEDY)
    done = run_all(engine)
    return {k: v.outputs[0].token_ids for k, v in done.items()}, done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_outputs_equal_unpreempted(tiny_llama_dir, mode):
    roomy = make_engine(tiny_llama_dir, max_num_seqs=6, num_kv_blocks=128)
    want, _ = _workload(roomy)
    assert roomy.scheduler.num_preemptions == 0
    # 6 requests need up to 6 * ceil((55 + 40) / 16) = 36 blocks at the end; give them 16.
    tight = make_engine(tiny_llama_dir, max_num_seqs=6, num_kv_blocks=16, preemption_mode=mode)
    got, done = _workload(tight)
    assert got == want
    assert tight.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in done.values()) == tight.scheduler.num_preemptions
    tight.block_manager.check_integrity()
    assert tight.block_manager.num_free_blocks == 16
    if mode == "swap":
        assert tight.scheduler.swap_space is not None
        assert tight.scheduler.swap_space.num_used == 0


def test_swap_falls_back_to_recompute_when_host_pool_is_full(tiny_llama_dir):
    roomy = make_engine(tiny_llama_dir, max_num_seqs=6, num_kv_blocks=128)
    want, _ = _workload(roomy)
    from jaxserve.runtime.kv_cache import bytes_per_block

    per_block = bytes_per_block(roomy.model_config, 16, np.float32)
    tight = make_engine(tiny_llama_dir, max_num_seqs=6, num_kv_blocks=16, preemption_mode="swap",
                        swap_space_bytes=2 * per_block)  # room for 2 blocks only
    got, _ = _workload(tight)
    assert got == want and tight.scheduler.num_preemptions > 0


def test_abort_while_swapped_returns_device_and_host_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=6, num_kv_blocks=16,
                         preemption_mode="swap")
    rng = np.random.default_rng(5)
    for i in range(6):
        engine.add_request(f"r{i}", prompt_token_ids=rng.integers(3, 500, 20 + 7 * i).tolist(),
                           params=GREEDY)
    swapped = None
    for _ in range(200):
        engine.step()
        swapped = next((s for s in engine.scheduler.swapped), None)
        if swapped:
            break
    assert swapped is not None and swapped.status is SequenceStatus.SWAPPED
    used, held = engine.scheduler.swap_space.num_used, swapped.num_swapped_blocks
    assert held > 0
    engine.abort(swapped.request_id)
    assert engine.scheduler.swap_space.num_used == used - held
    engine.block_manager.check_integrity()
    done = run_all(engine)
    assert done[swapped.request_id].outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == 16
    assert engine.scheduler.swap_space.num_used == 0


def test_priority_late_request_gets_first_token_first(tiny_llama_dir):
    # Counted in step() calls: synchronous, so a step's tokens come back from the call that ran it
    engine = make_engine(tiny_llama_dir, max_num_seqs=2, scheduling_policy="priority",
                         async_scheduling=False)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"low{i}", prompt_token_ids=[5, 6, 7, 8], params=p, priority=5)
    engine.step()
    engine.add_request("high", prompt_token_ids=[9, 10, 11], params=p, priority=0)
    first_token_step = {}
    step = 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
        step += 1
    assert first_token_step["high"] == 1
    assert first_token_step["high"] < first_token_step["low2"]
    assert first_token_step["high"] < first_token_step["low3"]


def test_static_takes_more_steps_with_idle_slots(tiny_llama_dir):
    def run(policy):
        engine = make_engine(tiny_llama_dir, max_num_seqs=4, scheduling_policy=policy)
        for i, n in enumerate([2, 20, 3, 20, 2, 2, 3, 20]):
            engine.add_request(f"r{i}", prompt_token_ids=[5, 6, 7],
                               params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out = run_all(engine)
        return engine.step_trace, {k: v.outputs[0].token_ids for k, v in out.items()}

    static, s_tokens = run("static")
    cont, c_tokens = run("fcfs")
    assert s_tokens == c_tokens
    assert len(static) > len(cont)
    idle = sum(4 - len(r.requests) for r in static)
    assert idle > sum(4 - len(r.requests) for r in cont)


def test_admission_control(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4, max_waiting_requests=2)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="num_kv_blocks"):  # 60 + 10 tokens > 4 blocks of 16
        engine.add_request("huge", prompt_token_ids=[5] * 60, params=p)
    engine.add_request("a", prompt_token_ids=[5, 6], params=p)
    engine.add_request("b", prompt_token_ids=[5, 6], params=p)
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        engine.add_request("c", prompt_token_ids=[5, 6], params=p)
    engine.step()  # a and b leave the waiting queue
    engine.add_request("c", prompt_token_ids=[5, 6], params=p)
    assert set(run_all(engine)) == {"a", "b", "c"}
