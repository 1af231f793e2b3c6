"""The scheduler alone, driven by SimExecutor (no model): examples and property-based tests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.scheduler import SchedulerConfig
from jaxserve.testing.sim import SimExecutor, fake_token


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def sim(num_blocks=64, block_size=4, host=0, clock=None, enable_caching=False,
        **kw) -> SimExecutor:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    cfg.update(kw)
    return SimExecutor(SchedulerConfig(**cfg), num_blocks, block_size, host, clock=clock,
                       enable_caching=enable_caching)


def test_classic_example_trace():
    s = sim(max_num_seqs=3)
    for rid, n in zip("ABCD", [1, 3, 2, 3], strict=True):
        s.add(rid, prompt_len=4, max_tokens=n)
    trace = []
    while s.requests:
        trace.append([x.seq.request_id for x in s.step().scheduled])
    assert trace == [["A", "B", "C"], ["B", "C", "D"], ["B", "D"], ["D"]]


def test_600_token_prompt_beside_80_decodes():
    s = sim(num_blocks=2000, block_size=16, max_num_seqs=100, max_num_batched_tokens=512,
            max_model_len=2048)
    for i in range(80):
        s.add(f"d{i}", 3, 100)
    s.step()
    s.step()
    s.add("long", 600, 5)
    first, second = s.step(), s.step()
    chunk = {x.seq.request_id: x.num_tokens for x in first.scheduled}
    assert chunk["long"] == 432 and first.num_tokens == 512
    assert {x.seq.request_id: x.num_tokens for x in second.scheduled}["long"] == 168
    assert sum(1 for x in second.scheduled if not x.is_prefill) == 80


BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def running_decodes(n: int, **kw) -> SimExecutor:
    """A scheduler over BUCKETS with n sequences past their prompts, decoding."""
    s = sim(num_blocks=400, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
            max_model_len=512, **kw)
    for i in range(n):
        s.add(f"d{i}", 4, 60)
    while any(x.is_prefill for x in s.step().scheduled):
        pass
    return s


def test_a_step_with_prompt_tokens_to_spare_ends_on_a_token_bucket():
    s = running_decodes(20, token_buckets=BUCKETS)
    s.add("p", 140, 5)
    # 20 decodes + 140 prompt tokens would pad 160 rows to 256 (then 20 decodes pad to 24):
    # 128 rows now, then 20 + 28 = 48 and 20 + 4 = 24, every step on a bucket
    steps = [s.step() for _ in range(3)]
    assert [x.num_tokens for x in steps] == [128, 48, 24]
    chunks = [{x.seq.request_id: x.num_tokens for x in out.scheduled}["p"] for out in steps]
    assert chunks == [108, 28, 4]
    plain = running_decodes(20)  # without buckets, the prompt goes in at once
    plain.add("p", 140, 5)
    assert plain.step().num_tokens == 160


def test_a_short_remainder_is_not_dribbled_out():
    # 3 decodes + 11 prompt tokens: 8 rows now and 9 (padded to 12) next would not save the
    # second step's rows over 16 now and 4 next, so the step is not cut
    s = running_decodes(3, token_buckets=BUCKETS)
    s.add("p", 11, 2)
    assert s.step().num_tokens == 14
    # a lone prompt just past a bucket is cut when the two steps cost less than the padding
    s = running_decodes(0, token_buckets=BUCKETS)
    s.add("q", 130, 2)
    assert [s.step().num_tokens, s.step().num_tokens] == [128, 2]


def test_chunk_alignment_rounds_down_but_not_the_last_chunk():
    s = sim(num_blocks=200, block_size=16, max_num_seqs=8, max_num_batched_tokens=300,
            prefill_chunk_alignment=128)
    s.add("p", 700, 2)
    sizes = []
    while s.requests:
        sizes += [x.num_tokens for x in s.step().scheduled if x.is_prefill]
    assert sizes == [256, 256, 188]


def test_static_batching_waits_for_the_whole_batch():
    def run(policy):
        s = sim(max_num_seqs=4, policy=policy)
        for i, n in enumerate([2, 12, 3, 12, 2, 2, 3, 12]):
            s.add(f"r{i}", 4, n)
        busy = []
        while s.requests:
            busy.append(len(s.step().scheduled))
        return busy

    static, continuous = run("static"), run("fcfs")
    assert len(static) > len(continuous)
    assert min(static) < 4  # idle slots while the batch's long member finishes
    assert sum(static) == sum(continuous)


def test_static_and_continuous_build_one_schedule_when_all_fit_and_arrive_at_once():
    """With every request there at the start and no more than max_num_seqs of them, there is
    nothing for continuous batching to refill: static's one batch and FCFS give the very same
    steps (chunked prefills, decodes, finishes). Continuous batching differs, and wins, once
    requests arrive over time or outnumber the running set (the test above)."""
    def run(policy, late=None):
        s = sim(max_num_seqs=8, max_num_batched_tokens=16, policy=policy)
        steps = []
        for i, (p, n) in enumerate([(9, 2), (20, 12), (3, 3), (14, 7), (5, 2), (11, 9)]):
            s.add(f"r{i}", p, n)
        while s.requests:
            if late is not None and len(steps) == 2:
                s.add("late", 4, 2)
                late = None
            steps.append([(x.seq.request_id, x.start, x.num_tokens) for x in s.step().scheduled])
        return steps

    assert run("static") == run("fcfs")
    static, continuous = run("static", late=True), run("fcfs", late=True)
    assert len(static) > len(continuous)  # the late one waits for the whole batch under static
    first = lambda steps: next(i for i, st in enumerate(steps) if "late" in {x[0] for x in st})
    assert first(static) > first(continuous)


def test_preemption_recompute_and_swap_resume():
    for mode, host in (("recompute", 0), ("swap", 64)):
        s = sim(num_blocks=12, block_size=4, host=host, max_num_seqs=4, preemption_mode=mode)
        for i in range(4):
            s.add(f"r{i}", 6, 10)
        s.run()
        assert s.scheduler.num_preemptions > 0
        for rid, seq in s.finished.items():
            assert seq.output_token_ids == [fake_token(rid, i) for i in range(10)]
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == 12
        if host:
            assert s.scheduler.swap_space.num_used == 0


def test_held_prefills_send_first_tokens_beyond_the_decode_slots():
    def run(held):
        s = sim(max_num_seqs=2, max_held_seqs=held)
        for i in range(5):
            s.add(f"r{i}", 4, 3)
        steps = []
        while s.requests:
            out = s.step()
            steps.append([x.seq.request_id for x in out.scheduled])
            if len(steps) == 1:
                state = ([q.request_id for q in s.scheduler.running],
                         [q.request_id for q in s.scheduler.held])
        first = {r: next(i for i, st in enumerate(steps) if r in st) for r in s.finished}
        assert all(q.output_token_ids == [fake_token(r, k) for k in range(3)]
                   for r, q in s.finished.items())
        return steps, state, first

    steps, state, first = run(held=2)
    # r2 and r3 get their prompts (and first tokens) in the first step; r4 waits, held full
    assert steps[:4] == [["r0", "r1", "r2", "r3"], ["r0", "r1"], ["r0", "r1"],
                         ["r2", "r3", "r4"]]
    assert state == (["r0", "r1"], ["r2", "r3"])
    _, _, unheld = run(held=0)
    assert (first["r2"], first["r3"]) == (0, 0) and (unheld["r2"], unheld["r3"]) == (3, 3)


def test_a_held_sequence_is_preempted_before_a_running_one():
    s = sim(num_blocks=7, block_size=4, max_num_seqs=1, max_held_seqs=1)
    s.add("run", 4, 20)  # grows to 6 blocks
    s.add("held", 12, 2)  # 3 blocks: taken while one stays free for run's next token
    s.step()
    assert [q.request_id for q in s.scheduler.held] == ["held"]
    s.run()
    assert s.finished["run"].metrics.num_preemptions == 0
    assert s.finished["held"].metrics.num_preemptions == 1
    for rid, seq in s.finished.items():
        assert seq.output_token_ids == [fake_token(rid, k) for k in range(seq.params.max_tokens)]
    assert s.block_manager.num_free_blocks == 7


def test_a_request_past_the_ttft_target_is_prefilled_in_the_next_step():
    def first_step_of_late(target):
        clock = Clock()
        s = sim(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16, clock=clock,
                ttft_target_s=target)
        s.add("long", 200, 2)  # every step's budget for 12 steps, 8 tokens of the 13th
        s.step()
        s.add("late", 4, 2)
        for t in range(1, 20):
            clock.t = float(t)
            if "late" in [x.seq.request_id for x in s.step().scheduled]:
                return t
        raise AssertionError("late never ran")

    assert first_step_of_late(None) == 12  # beside the long prompt's last chunk
    assert first_step_of_late(2.0) == 2  # waited 2 s by then


def test_a_step_of_decodes_alone_runs_several_decode_steps():
    s = sim(block_size=4, decode_steps=4)
    s.add("a", 4, 10)
    s.add("b", 4, 3)
    assert s.step().decode_steps == 1  # the prompts
    out = s.step()
    assert out.decode_steps == 4
    # b's first token came with its prompt: 2 to go
    assert {x.seq.request_id: x.num_steps for x in out.scheduled} == {"a": 4, "b": 2}
    a = s.requests["a"]  # its blocks hold the K/V of positions 4..7, which its steps write
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2
    assert a.output_token_ids == [fake_token("a", i) for i in range(5)]
    assert s.finished["b"].output_token_ids == [fake_token("b", i) for i in range(3)]
    s.add("c", 4, 2)  # a request waits: one decode step, in the step that admits it
    assert s.step().decode_steps == 1
    assert s.step().decode_steps == 4


def test_several_decode_steps_take_free_blocks_only():
    s = sim(num_blocks=3, block_size=4, decode_steps=4)
    s.add("a", 3, 10)
    s.add("b", 3, 10)
    s.step()
    out = s.step()  # a takes the one free block for its steps; b's end at its block's end
    assert {x.seq.request_id: x.num_steps for x in out.scheduled} == {"a": 4, "b": 1}
    assert s.scheduler.num_preemptions == 0 and s.block_manager.num_free_blocks == 0


@pytest.mark.parametrize("option, value, steps", [
    ("min_tokens", 3, [1, 1, 1, 4]),  # its stop ids are banned until its third token
    ("bad_words", ["x"], [1, 1, 1, 1]),  # each token changes the next one's mask
    ("structured_outputs", {"regex": "a+"}, [1, 1, 1, 1]),
    ("stop_token_ids", list(range(9)), [1, 1, 1, 1]),  # more than the device checks
    ("stop_token_ids", list(range(8)), [1, 4, 4, 4]),
])
def test_requests_that_need_the_host_between_tokens_run_one_decode_step(option, value, steps):
    s = sim(block_size=4, decode_steps=4)
    seq = s.add("a", 4, 16)
    seq.params = dataclasses.replace(seq.params, **{option: value})
    seq.stop_ids = seq.params.stop_ids(())
    assert [s.step().decode_steps for _ in steps] == steps


def test_priority_late_high_priority_runs_first():
    clock = Clock()
    s = sim(max_num_seqs=2, policy="priority", clock=clock)
    for i in range(4):
        s.add(f"low{i}", 4, 20, priority=5)
    s.step()
    s.add("high", 4, 3, priority=0)
    out = s.step()
    assert "high" in [x.seq.request_id for x in out.scheduled]
    low = [s.requests[f"low{i}"].metrics.num_preemptions for i in (0, 1)]
    assert sum(low) == 1


def test_aging_bounds_the_wait_of_a_low_priority_request():
    for aging, should_finish in ((None, False), (2.0, True)):
        clock = Clock()
        s = sim(max_num_seqs=2, policy="priority", clock=clock, priority_aging_s=aging)
        s.add("low", 4, 3, priority=10)
        for t in range(200):
            clock.t = float(t)
            if len(s.requests) < 6:  # a steady stream of high-priority work
                s.add(f"h{t}", 4, 4, priority=0)
            s.step()
            if "low" in s.finished:
                break
        assert ("low" in s.finished) == should_finish
        if should_finish:
            assert t < 60  # waited ~ priority gap * aging_s steps, not forever


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 25))
    reqs = [dict(arrive=draw(st.integers(0, 30)), prompt=draw(st.integers(1, 60)),
                 out=draw(st.integers(1, 25)), prio=draw(st.integers(0, 3)),
                 abort_at=draw(st.one_of(st.none(), st.integers(0, 60))))
            for _ in range(n)]
    cfg = dict(max_num_seqs=draw(st.integers(1, 8)),
               max_num_batched_tokens=draw(st.sampled_from([8, 16, 33, 64])),
               policy=draw(st.sampled_from(["fcfs", "priority", "static"])),
               preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
               prefill_chunk_alignment=draw(st.sampled_from([1, 4])),
               priority_aging_s=draw(st.sampled_from([None, 3.0])),
               decode_steps=draw(st.sampled_from([1, 1, 3])),
               max_held_seqs=draw(st.sampled_from([0, 0, 1, 3])),
               ttft_target_s=draw(st.sampled_from([None, None, 2.0])))
    if draw(st.booleans()):  # steps end on these where that computes fewer padded rows
        budget = cfg["max_num_batched_tokens"]
        cfg["token_buckets"] = tuple(b for b in (1, 2, 4, 8, 12, 16, 32) if b < budget) + (budget,)
    block_size = draw(st.sampled_from([1, 4, 16]))
    # The pool always fits the largest request (admission control guarantees that in the engine).
    need = max(-(-(r["prompt"] + r["out"]) // block_size) for r in reqs)
    num_blocks = draw(st.integers(need, need * 4))
    host = draw(st.sampled_from([0, 2, 50]))
    caching = draw(st.booleans())
    return reqs, cfg, block_size, num_blocks, host, caching


# Prompts start with one of a few shared prefixes, so that prefix caching finds hits.
PREFIXES = [list(range(1000, 1060)), list(range(2000, 2060)), [7] * 60]


def prompt_of(i: int, n: int) -> list[int]:
    shared = PREFIXES[i % 3][:max(0, n - 2)]
    return shared + [3000 + i] * (n - len(shared))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants(w):
    reqs, cfg, block_size, num_blocks, host, caching = w
    cfg["max_num_seqs"] = min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    if cfg["policy"] == "static":  # the engine runs no held prefills under static batching
        cfg["max_held_seqs"] = 0
    clock = Clock()
    s = sim(num_blocks=num_blocks, block_size=block_size, host=host, clock=clock,
            max_model_len=512, enable_caching=caching, **cfg)
    bm = s.block_manager
    pending = sorted(enumerate(reqs), key=lambda x: x[1]["arrive"])
    aborted = set()
    step = 0
    while pending or s.requests:
        clock.t = float(step)
        while pending and pending[0][1]["arrive"] <= step:
            i, r = pending.pop(0)
            s.add(f"r{i}", r["prompt"], r["out"], priority=r["prio"],
                  prompt=prompt_of(i, r["prompt"]))
        for i, r in enumerate(reqs):
            if r["abort_at"] == step and f"r{i}" in s.requests:
                s.abort(f"r{i}")
                aborted.add(f"r{i}")
        finished_before = set(s.finished)
        out = s.step()
        # Limits hold every step.
        assert out.num_tokens <= cfg["max_num_batched_tokens"]
        assert len(out.scheduled) <= cfg["max_num_seqs"] + cfg["max_held_seqs"]
        assert len(s.scheduler.running) <= cfg["max_num_seqs"]
        assert len(s.scheduler.held) <= cfg["max_held_seqs"]
        assert all(x.num_tokens > 0 for x in out.scheduled)
        # Block accounting is exact; running sequences hold exactly the blocks they need.
        # With caching, reference counts equal the block tables that hold each block.
        check_integrity(s)
        live = s.scheduler.admitted
        for seq in live:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
        held = [b for q in live for b in q.block_table]
        assert len(set(held)) == bm.num_used_blocks
        if not caching:
            assert len(held) == bm.num_used_blocks
        # A finished request never runs again.
        assert not {x.seq.request_id for x in out.scheduled} & finished_before
        step += 1
        assert step < 5000, "no progress"
    assert bm.num_free_blocks == bm.num_blocks
    if s.scheduler.swap_space:
        assert s.scheduler.swap_space.num_used == 0
    for i, r in enumerate(reqs):
        rid = f"r{i}"
        seq = s.finished[rid]
        want = [fake_token(rid, k) for k in range(r["out"])]
        if rid in aborted:
            assert seq.output_token_ids == want[:len(seq.output_token_ids)]
        else:  # every request gets exactly its tokens, in order, preempted or not
            assert seq.output_token_ids == want


def test_static_batch_is_max_num_seqs_even_when_prompts_exceed_the_budget():
    s = sim(max_num_seqs=4, max_num_batched_tokens=8, policy="static")
    for i in range(6):
        s.add(f"r{i}", 6, 2 + i)
    seen_batches, steps = [], 0
    while s.requests:
        s.step()
        steps += 1
        batch = {q.request_id for q in s.scheduler.running}
        if batch and batch not in seen_batches and not (seen_batches and batch <= seen_batches[-1]):
            seen_batches.append(batch)
    assert seen_batches[0] == {"r0", "r1", "r2", "r3"}  # the whole batch, prefilled in chunks
    assert seen_batches[1] == {"r4", "r5"}
    assert all(seq.output_token_ids == [fake_token(r, k) for k in range(seq.params.max_tokens)]
               for r, seq in s.finished.items())


def check_integrity(s) -> None:
    """The device pool (reference counts equal the running and held block tables) and the
    host pool."""
    s.block_manager.check_integrity(s.scheduler.admitted)
    if s.scheduler.swap_space:
        s.scheduler.swap_space.check_integrity()


@pytest.mark.parametrize("mode, host, held", [("recompute", 0, 0), ("swap", 24, 0),
                                              ("recompute", 24, 0), ("recompute", 0, 4),
                                              ("swap", 24, 4)])
def test_prefix_caching_soak_2000_requests(mode, host, held):
    """2,000 requests, half sharing one of three prefixes, with aborts and a pool small enough
    to preempt (and, with a host pool, to spill cached blocks to the host tier): the integrity
    check holds after every step (reference counts equal the block tables), every slot read
    holds this sequence's own prefix (also after a trip through the host tier), outputs are
    exact, and every block comes back. With held prefills, requests also wait in the held
    state (prefilled, first token out) and are preempted and aborted there."""
    import random

    rng = random.Random(0)
    s = sim(num_blocks=64 if held else 48, block_size=4, host=host, max_num_seqs=8,
            max_num_batched_tokens=32, preemption_mode=mode, enable_caching=True,
            max_held_seqs=held)
    bm = s.block_manager
    in_held = {"seen": set(), "preempted": 0, "aborted": 0}  # what happened in the held state
    expected, aborted = {}, set()

    def step():
        before = {q.request_id for q in s.scheduler.held}
        preempted = {q.request_id for q in s.step().preempted}
        check_integrity(s)
        in_held["preempted"] += len(preempted & before)
        in_held["seen"] |= {q.request_id for q in s.scheduler.held}

    for i in range(2000):
        n = rng.randint(2, 50)
        prompt = prompt_of(i, n) if i % 2 else [4000 + i] * n  # shared prefix, or unique
        out = rng.randint(1, 12)
        s.add(f"r{i}", n, out, prompt=prompt)
        expected[f"r{i}"] = out
        if rng.random() < 0.05:
            held_ids = [q.request_id for q in s.scheduler.held]
            victim = rng.choice(held_ids if held_ids and rng.random() < 0.5 else list(s.requests))
            in_held["aborted"] += victim in held_ids
            s.abort(victim)
            aborted.add(victim)
        if i % 4 == 3:  # arrivals outpace the steps: a queue builds up
            step()
    while s.requests:
        step()
    for rid, n in expected.items():
        if rid not in aborted:
            assert s.finished[rid].output_token_ids == [fake_token(rid, k) for k in range(n)]
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert s.scheduler.num_preemptions > 0
    if held:
        assert len(in_held["seen"]) > 100 and in_held["preempted"] and in_held["aborted"], (
            len(in_held["seen"]), in_held["preempted"], in_held["aborted"])
    assert bm.stats.hit_rate > 0.1, bm.stats  # half the prompts share a prefix
    if host:  # the device pool is too small to keep every prefix: some come from the host
        assert bm.stats.host_hits > 0, bm.stats
        assert s.scheduler.swap_space.num_used == 0  # held blocks all returned
