"""Scheduling policies as plug-ins: a policy registered from outside runs in the real Scheduler
(driven by SimExecutor) and is an option like the built-in ones."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.config import EngineConfig, add_options
from jaxserve.core.policies import POLICIES, SchedulingPolicy
from jaxserve.core.scheduler import SchedulerConfig
from jaxserve.testing.sim import SimExecutor

PROMPTS = {"a": 12, "b": 4, "c": 9, "d": 4, "e": 6}  # request id -> prompt tokens


class ShortestPromptFirst(SchedulingPolicy):
    def key(self, seq, now):
        return (seq.num_prompt_tokens, seq.arrival_index)


class ShortestPromptPreempts(ShortestPromptFirst):
    def outranks(self, seq, other, now):
        return seq.num_prompt_tokens < other.num_prompt_tokens


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(POLICIES, "shortest", ShortestPromptFirst)
    monkeypatch.setitem(POLICIES, "shortest-preempts", ShortestPromptPreempts)


def sim(policy: str, **kw) -> SimExecutor:
    cfg = dict(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64, policy=policy) | kw
    return SimExecutor(SchedulerConfig(**cfg), num_blocks=32, block_size=4)


def first_scheduled(s: SimExecutor) -> list[str]:
    """Request ids in the order they were first scheduled, running `s` to the end."""
    order = []
    while s.requests:
        order += [x.seq.request_id for x in s.step().scheduled
                  if x.seq.request_id not in order]
    return order


def test_a_registered_policy_orders_admissions_in_the_real_scheduler(registered):
    def run(policy):
        s = sim(policy)
        for rid, n in PROMPTS.items():
            s.add(rid, n, 3)
        order = first_scheduled(s)
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == 32  # every block came back
        return order

    assert run("shortest") == ["b", "d", "e", "c", "a"]
    assert run("fcfs") == ["a", "b", "c", "d", "e"]


def test_a_registered_policy_that_outranks_preempts_the_running_sequence(registered):
    s = sim("shortest-preempts")
    long = s.add("long", 12, 6)
    s.step()
    s.step()
    s.add("short", 4, 2)
    out = s.step()
    assert out.preempted == [long] and [x.seq.request_id for x in out.scheduled] == ["short"]
    s.run()
    assert long.metrics.num_preemptions == 1 and len(long.output_token_ids) == 6
    s.block_manager.check_integrity()
    assert s.block_manager.num_free_blocks == 32
    # the same arrivals under "shortest", whose policy never outranks: no preemption
    s = sim("shortest")
    long = s.add("long", 12, 6)
    s.step()
    s.step()
    s.add("short", 4, 2)
    assert not s.step().preempted
    assert first_scheduled(s) == ["long", "short"] and long.metrics.num_preemptions == 0


def test_a_registered_policy_is_an_engine_option(registered):
    cfg = EngineConfig(scheduling_policy="shortest").on_platform("cpu")
    assert cfg.scheduler_config().policy == "shortest"
    ap = argparse.ArgumentParser()
    add_options(ap, EngineConfig)
    choices = next(a.choices for a in ap._actions if a.dest == "scheduling_policy")
    assert choices == ["fcfs", "priority", "static", "shortest", "shortest-preempts"]


def test_an_unknown_policy_is_refused_naming_the_field_and_the_known_ones():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, "
                                         "static, got 'shortest'"):
        EngineConfig(scheduling_policy="shortest")
    with pytest.raises(ValueError, match=r"^policy must be one of fcfs, priority, static, "
                                         r"got \['fcfs'\]"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                        policy=["fcfs"])
