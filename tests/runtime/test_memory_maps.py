"""The memory-map budget checked before step programs compile (runtime/memory_maps.py)."""

from __future__ import annotations

import mmap
import sys

import pytest

from jaxserve.runtime import memory_maps

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc maps")


def test_headroom_is_refused_naming_the_limit_and_what_to_change():
    memory_maps.check_headroom(used=1000, limit=65530, per_program=330, num_programs=96)
    with pytest.raises(RuntimeError) as e:
        memory_maps.check_headroom(used=33000, limit=65530, per_program=330, num_programs=96)
    msg = str(e.value)
    assert msg.startswith("compiling 96 more step programs needs about 31680 memory maps")
    assert "32530 left under vm.max_map_count=65530" in msg and "max_held_seqs=0" in msg


@linux
def test_maps_are_counted_and_a_program_too_big_for_them_is_refused():
    before = memory_maps.maps_in_use()
    regions = [mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0))
               for i in range(40)]  # alternating protections: maps that cannot merge
    assert memory_maps.maps_in_use() >= before + 20
    limit = memory_maps.map_limit()
    assert limit and limit > memory_maps.maps_in_use()
    memory_maps.check_before(1, before, 1)  # one more of these fits
    with pytest.raises(RuntimeError, match=f"vm.max_map_count={limit};"):
        memory_maps.check_before(limit // 20, before, 1)
    for r in regions:
        r.close()
