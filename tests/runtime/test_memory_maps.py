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
def test_a_budget_counts_what_programs_take_and_refuses_one_that_would_not_fit():
    budget = memory_maps.MapBudget()
    assert budget.limit and budget.limit > memory_maps.maps_in_use() + memory_maps.RESERVE

    def program(n):  # maps n regions of alternating protections (they cannot merge)
        return [mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0))
                for i in range(n)]

    kept = [budget.run(program, 40) for _ in range(3)]
    assert budget.count == 3 and budget.most >= 40 and budget.total >= 120
    budget.check_remaining(10)  # 10 more of these fit
    with pytest.raises(memory_maps.MapLimitError, match=f"vm.max_map_count={budget.limit};"):
        budget.check_remaining(budget.limit // 40)
    budget.most = budget.limit  # a program that big: refused before it runs
    with pytest.raises(memory_maps.MapLimitError, match="compiling 1 more step programs"):
        budget.run(program, 1)
    assert budget.count == 3
    for regions in kept:
        for r in regions:
            r.close()


def test_the_cpu_defaults_compile_few_programs(tiny_llama_dir):
    """Under the cpu attention kernel one block-table width serves every step, so the CPU
    defaults compile a program per token bucket (and one more where held prefills join),
    and n-gram speculation twice that: far below what vm.max_map_count holds."""
    from jaxserve import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    plain, spec = (LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, **kw))
                   for kw in ({}, {"speculative_method": "ngram"}))
    if plain.runner.attention_backend != "cpu":
        pytest.skip("the cpu attention kernel does not run here")
    tokens, _, blocks = plain.runner.buckets
    assert blocks == (plain.config.max_blocks_per_seq,)
    held = [t for t in tokens if t > plain.config.max_num_seqs]
    assert len(plain.runner.all_programs()) == len(tokens) + len(held) == 16
    assert len(spec.runner.all_programs()) == 32
