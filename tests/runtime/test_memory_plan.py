"""The memory plan (runtime/memory_plan.py): the pool gets what the device's share leaves after
the weights and the step's temporaries, and the temporaries are the compiled programs'."""

from __future__ import annotations

import pytest

from jaxserve.runtime import memory_plan
from tests.helpers import make_engine

GIB = 1 << 30


def test_the_pool_gets_what_the_share_leaves():
    plan = memory_plan.from_device(80 * GIB, 0.9, weights_bytes=16 * GIB,
                                   temporaries_bytes=2 * GIB, block_bytes=2 * 1024 * 1024,
                                   block_size=16, max_model_len=2048)
    free = int(80 * GIB * 0.9) - 18 * GIB
    assert plan.kv_bytes == free // (2 << 20) * (2 << 20) and plan.kv_bytes <= free
    assert plan.num_blocks == free // (2 << 20)
    assert plan.max_seqs_at_max_model_len == plan.num_blocks // 128
    d = plan.as_dict()
    assert d["weights_bytes_per_device"] == 16 * GIB
    assert d["temporaries_bytes_per_device"] == 2 * GIB
    assert d["kv_bytes_per_device"] == plan.kv_bytes
    assert d["max_seqs_at_max_model_len"] == plan.max_seqs_at_max_model_len
    assert "0.9 of 80.00 GiB" in plan.describe() and "sequences of max_model_len 2048" in \
        plan.describe()


def test_a_share_too_small_for_one_sequence_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=0.2.*max_model_len 2048"):
        memory_plan.from_device(80 * GIB, 0.2, 15 * GIB, GIB, 2 << 20, 16, 2048)


def test_step_temporaries_are_the_largest_compiled_programs(tiny_llama_dir):
    """The pool-free compile that sizes the pool on a GPU reads the same scratch as the
    programs the engine then runs (the pool's size is not scratch)."""
    e = make_engine(tiny_llama_dir)
    runner = e.runner
    runner.warmup()
    kv = runner.kv.k.sharding
    measured = runner.step_temporaries(kv)
    ran = max(runner._executables[p].memory_analysis().temp_size_in_bytes
              for p in runner.largest_programs())
    assert measured == ran > 0
    assert runner.num_blocks == runner.memory_plan.num_blocks  # the probe leaves it as it was
