"""Asynchronous scheduling chosen from measured step times (engine/overlap.py): the chooser picks
the cheaper mode at each load, keeps trying the other now and then, and an engine left to it
(async_scheduling unset) switches modes mid-run with the tokens of synchronous stepping."""

from __future__ import annotations

import time

import pytest

from jaxserve.bench.host_overhead import ZeroCostRunner
from jaxserve.bench.host_overhead import make_engine as zero_cost_engine
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.overlap import OverlapChooser, load_bucket
from tests.engine.test_async_scheduling import _run, _summary, _workload


def _drive(chooser: OverlapChooser, cost, rows: int, steps: int) -> list[bool]:
    """Run `steps` decode steps at `rows` on a clock where a step costs cost(rows, mode)."""
    clock, modes = 100.0, []
    for _ in range(steps):
        mode = chooser.choose(rows)
        clock += cost(rows, mode)
        chooser.completed(clock, rows, True, mode)
        modes.append(mode)
    return modes


def test_load_buckets_are_powers_of_two():
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 31, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]


@pytest.mark.parametrize("start", [False, True])
def test_the_cheaper_mode_wins_at_each_load(start):
    # asynchronous pays with few rows (host work hidden) and costs with many (shared cores)
    def cost(rows, mode):
        return (0.005 if mode else 0.008) if rows <= 2 else (0.050 if mode else 0.040)

    chooser = OverlapChooser(start=start, revisit=1000)
    few = _drive(chooser, cost, 1, 600)
    many = _drive(chooser, cost, 32, 600)
    assert sum(few[-300:]) / 300 > 0.9  # asynchronous nearly always
    assert sum(many[-300:]) / 300 < 0.1
    est = chooser.estimates()
    assert est[1]["async"] < est[1]["sync"] and est[32]["sync"] < est[32]["async"]
    # back at the first load, its answer is remembered: no new trial
    assert all(_drive(chooser, cost, 1, 20))


def test_the_losing_mode_is_tried_again_boundedly():
    chooser = OverlapChooser(start=False, trial=8, settle=2, revisit=100)
    modes = _drive(chooser, lambda rows, mode: 0.004 if mode else 0.006, 4, 2000)
    losing = modes[200:].count(False)
    assert 0 < losing <= (8 + 2 + 2) * (1800 // 100 + 1)  # a few percent of the steps


def test_a_change_in_costs_is_followed():
    chooser = OverlapChooser(start=False, trial=8, revisit=100)
    before = _drive(chooser, lambda rows, mode: 0.004 if mode else 0.006, 1, 300)
    after = _drive(chooser, lambda rows, mode: 0.009 if mode else 0.006, 1, 300)
    assert before[-150:].count(True) > 120 and after[-150:].count(False) > 120


def test_noise_does_not_decide():
    # a pause now and then in the cheaper mode; equal costs otherwise do not flap
    chooser = OverlapChooser(start=False, trial=12, revisit=10_000)
    modes, clock = [], 0.0
    for i in range(400):
        mode = chooser.choose(2)
        clock += (0.004 if mode else 0.006) + (0.5 if mode and i % 37 == 0 else 0.0)
        chooser.completed(clock, 2, True, mode)
        modes.append(mode)
    assert all(modes[100:])
    flat = OverlapChooser(start=False, trial=12, revisit=10_000)
    _drive(flat, lambda rows, mode: 0.005, 2, 400)
    assert flat.switches <= 2  # the trial of the other mode, and back


def test_idle_and_mixed_steps_are_not_timed():
    chooser = OverlapChooser(start=False)
    chooser.completed(1.0, 1, True, False)
    chooser.idle()
    chooser.completed(9.0, 1, True, False)  # after idling: no interval
    chooser.completed(9.5, 1, False, False)  # a prefill: not a decode step's cost
    chooser.completed(9.51, 1, True, False)
    assert chooser.estimates()[1] == {"async": None, "sync": pytest.approx(0.01)}


def _decode_workload(engine, n: int, max_tokens: int):
    for i in range(n):
        engine.add_request(f"r{i}", prompt_token_ids=list(range(100 + i, 120 + i)),
                           params=SamplingParams(temperature=0, ignore_eos=True,
                                                 max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_engine_overlaps_where_the_host_hides_under_a_sleeping_device(smollm):
    engine = zero_cost_engine(4, smollm, None, device_s=0.004)
    engine._overlap = OverlapChooser(start=False, trial=6, revisit=10_000)
    _decode_workload(engine, 4, 120)
    est = engine._overlap.estimates()[4]
    assert engine.async_scheduling and est["async"] < est["sync"]


class _SharedCoresRunner(ZeroCostRunner):
    """A device whose step takes longer when it is launched while the one before still runs,
    as a CPU's does when the host's work then shares its cores."""

    def dispatch(self, inp):
        queued = self._device_free > time.perf_counter()
        out, done = super().dispatch(inp)
        if queued:
            done = self._device_free = done + 0.01
        return out, done


def test_an_engine_stays_synchronous_where_overlapping_costs(smollm):
    config = zero_cost_engine(4, smollm, None).config
    engine = LLMEngine(config, smollm,
                       runner=_SharedCoresRunner(config, smollm.config.vocab_size,
                                                 smollm.config.num_layers, 0.004))
    engine._overlap = OverlapChooser(start=True, trial=6, revisit=10_000)
    _decode_workload(engine, 4, 120)
    est = engine._overlap.estimates()[4]
    assert not engine.async_scheduling and est["sync"] < est["async"], est


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "step_overlapped"])
def test_switching_modes_mid_run_keeps_the_tokens(tiny_llama_dir, overlapped):
    reqs = _workload(16)
    sync, _ = _run(tiny_llama_dir, False, reqs)
    chooser = OverlapChooser(start=False, trial=2, settle=1, revisit=3, margin=0.0)
    got, _ = _run(tiny_llama_dir, None, reqs, overlapped=overlapped, chooser=chooser)
    assert _summary(got) == _summary(sync)
    assert chooser.switches >= 4
