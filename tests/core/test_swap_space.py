"""SwapSpace: the host block pool shared by swap preemption and the prefix cache's host tier."""

from __future__ import annotations

import pytest

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.sequence import Sequence
from jaxserve.core.swap_space import SwapSpace


def seq(rid: str, n_blocks: int) -> Sequence:
    s = Sequence(rid, [1] * 4, SamplingParams(), 0, 0)
    s.block_table = list(range(n_blocks))
    return s


def test_spilled_blocks_are_found_in_order_and_evicted_least_recent_first():
    host = SwapSpace(3)
    ids = [host.spill(name) for name in (b"a", b"b", b"c")]
    assert sorted(ids) == [0, 1, 2] and host.num_cached == 3
    assert host.spill(b"b") is None  # held already: no copy
    assert host.match([b"a", b"b", b"x", b"c"]) == ids[:2]  # stops at the first miss
    host.check_integrity()
    # "c" is now the least recently used ("a" and "b" were matched): it goes first.
    new = host.spill(b"d")
    assert new == ids[2] and b"c" not in host.cached and host.num_evictions == 1
    host.check_integrity()


def test_swap_preemption_takes_cached_blocks_but_never_held_or_pinned_ones():
    host = SwapSpace(4)
    for name in (b"a", b"b"):
        host.spill(name)
    s = seq("s", 3)  # two free ids, then the oldest cached one
    assert host.can_hold(3)
    held = host.reserve(s)
    assert len(held) == 3 and host.num_used == 3 and host.cached == {b"b": host.cached[b"b"]}
    names = host.pin([host.cached[b"b"]])
    assert not host.can_hold(1) and host.spill(b"z") is None  # all held or pinned
    host.unpin([host.cached[b"b"]], names)
    host.check_integrity()
    host.release(s)
    assert host.num_used == 0 and host.can_hold(4)
    host.check_integrity()


def test_integrity_check_catches_a_lost_id():
    host = SwapSpace(2)
    host.spill(b"a")
    host.free_ids.clear()
    with pytest.raises(AssertionError, match="split"):
        host.check_integrity()


def test_an_evicted_block_is_copied_out_before_its_slot_is_reloaded():
    """One schedule evicts a device block to the host tier and reloads another prefix into the
    slot: the copies are recorded device->host first, then host->device."""
    bm = BlockManager(2, 4, enable_caching=True)
    host = SwapSpace(4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                      max_model_len=64), bm, host)
    params = SamplingParams(max_tokens=1)
    a = Sequence("a", [1, 2, 3, 4, 5], params, 0, 0)
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens = 5
    bm.commit(a)  # block 0 of a is named
    sched.finish(a, "stop")
    b = Sequence("b", [9] * 8, params, 1, 0)
    sched.add(b)
    out = sched.schedule()  # b's two blocks evict a's named block: it spills to the host
    assert [c.to_host for c in out.copies] == [True] and host.num_cached == 1
    b.num_computed_tokens = 8
    bm.commit(b)  # both of b's blocks are named; its last one is evicted first
    sched.finish(b, "stop")
    c = Sequence("c", [1, 2, 3, 4, 6], params, 2, 0)  # a's first block again
    sched.add(c)
    out = sched.schedule()
    # b's last block out, a's block into its slot, then b's first block out for c's last token
    assert [x.to_host for x in out.copies] == [True, False, True]
    spill, load, _ = out.copies
    assert load.device_ids[0] in spill.device_ids  # the slot read out first is then refilled
    assert c.num_computed_tokens == 4 and bm.stats.host_hits == 4
    bm.check_integrity([c])
    host.check_integrity()
