"""Block tables kept between steps: each step's table equals its sequences' tables copied whole."""

from __future__ import annotations

import numpy as np

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence
from jaxserve.runtime.block_tables import BlockTableRows

B, MB = 4, 16


def test_rows_follow_appends_trims_frees_and_shared_prefixes():
    rng = np.random.default_rng(0)
    bm = BlockManager(400, B, enable_caching=True)
    seqs = [Sequence(f"r{i}", [i % 3] * 9 + [i], SamplingParams(max_tokens=40), i, 0)
            for i in range(12)]
    tables = BlockTableRows(8, MB)
    for step in range(300):
        changes = [s for s in seqs for _ in range(rng.integers(1, 3))]  # one or two each
        rng.shuffle(changes)  # interleaved: a block one returns, another may take
        for seq in changes:
            op = rng.integers(6)
            n = len(seq.block_table)
            if op <= 2 and n < MB:  # grow by one or more blocks
                bm.allocate(seq, min(MB, n + int(rng.integers(1, 3))) * B)
            elif op == 3 and n > 1:  # rejected proposals: blocks past some tokens go back
                bm.trim(seq, int(rng.integers(1, n)) * B)
            elif op == 4 and n:  # finished or preempted: all of it goes
                bm.free(seq)
            elif op == 5 and not n:  # admitted again, its prompt's blocks from the cache
                seq.num_computed_tokens = 0
                bm.take_prefix(seq, bm.match_prefix(seq), 10)
                bm.allocate(seq, 12)
                seq.num_computed_tokens = 12
                bm.commit(seq)
        picked = [s for s in seqs if s.block_table and rng.random() < 0.8][:8]
        scheduled = [ScheduledSeq(s, 0, 1) for s in rng.permutation(picked)]
        got = np.zeros((8, MB), np.int32)
        tables.fill(scheduled, got)
        want = np.zeros((8, MB), np.int32)
        for i, s in enumerate(scheduled):
            want[i, :len(s.seq.block_table)] = s.seq.block_table
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
