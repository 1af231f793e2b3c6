"""LoRA on the host: requests, the device slots' LRU, the scheduler waiting for a slot, and
prefix-cache names keyed by adapter (no model)."""

from __future__ import annotations

import pytest

from jaxserve.core.block_hash import extend_hashes
from jaxserve.core.lora import LoRARequest, LoRASlots
from jaxserve.core.scheduler import SchedulerConfig
from jaxserve.testing.sim import SimExecutor


def test_lora_request_spells_vllms_names():
    r = LoRARequest("sql", 3, "/adapters/sql")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 3, "/adapters/sql")
    assert (r.name, r.id, r.adapter_id, r.path) == ("sql", 3, 3, "/adapters/sql")
    for args, field in ((("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id"),
                        (("a", True, "/p"), "lora_int_id"), (("a", 1, ""), "lora_path")):
        with pytest.raises(ValueError, match=field):
            LoRARequest(*args)


def test_slots_are_reassigned_least_recently_used_first_among_idle_adapters():
    slots = LoRASlots(2)
    assert slots.acquire(1, set()) == (1, True)
    assert slots.acquire(2, set()) == (2, True)
    assert slots.acquire(1, set()) == (1, False)  # 1 is now the most recent
    assert slots.acquire(3, set()) == (2, True)  # 2 was the least recent
    assert slots.acquire(4, {1, 3}) is None  # both in use: 4 waits
    assert slots.acquire(4, {3}) == (1, True)
    slots.release(3)
    assert slots.acquire(5, {4}) == (2, True)  # the released slot
    assert slots.num_loads == 5 and slots.loaded == {4: 1, 5: 2}


def _sim(num_slots: int, **kw) -> SimExecutor:
    s = SimExecutor(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                    max_model_len=256), 64, 4, **kw)
    s.scheduler.lora_slots = LoRASlots(num_slots)
    return s


def test_a_request_whose_adapter_has_no_free_slot_waits_while_others_run():
    s = _sim(2)
    adapters = {"A": 1, "B": 2, "C": 3, "D": 0, "E": 1}
    for rid, lora in adapters.items():
        s.add(rid, prompt_len=6, max_tokens=4 if rid != "A" else 2).lora_id = lora
    first = s.step()
    assert [x.seq.request_id for x in first.scheduled] == ["A", "B", "D", "E"]  # C waits
    assert [(load.slot, load.lora_id) for load in first.lora_loads] == [(1, 1), (2, 2)]
    seen = []
    while s.requests:
        out = s.step()
        running = {x.seq.lora_id for x in out.scheduled} - {0}
        assert len(running) <= 2
        for x in out.scheduled:  # every row reads its own adapter's slot
            if x.seq.lora_id:
                assert s.scheduler.lora_slots.slot_of(x.seq.lora_id) == x.seq.lora_slot
        seen += [(load.slot, load.lora_id) for load in out.lora_loads]
    assert seen == [(2, 3)]  # C takes B's slot once B is done; A's stays for E
    assert sorted(s.finished) == sorted(adapters)
    s.block_manager.check_integrity()


def test_prefix_block_names_are_keyed_by_adapter():
    tokens = list(range(12))
    names = {key: extend_hashes([], tokens, 4, lora=key) for key in (None, "x", "y")}
    assert len({tuple(v) for v in names.values()}) == 3
    assert extend_hashes([], tokens, 4, lora="x") == names["x"]

    s = _sim(2, enable_caching=True)
    prompt = list(range(3, 15))
    for rid, key in (("x1", "x"), ("y1", "y"), ("base", None), ("x2", "x")):
        hits = s.block_manager.stats.hits
        seq = s.add(rid, 0, 2, prompt=prompt)
        seq.lora_id, seq.lora_key = (1 if key == "x" else 2 if key else 0), key
        s.run()
        assert (s.block_manager.stats.hits > hits) == (rid == "x2"), rid
    s.block_manager.check_integrity()
