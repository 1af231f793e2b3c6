"""Rows kept between steps: each step's table and constants equal its sequences' own."""

from __future__ import annotations

import dataclasses

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
    def make(i: int, version: int = 0) -> Sequence:
        params = SamplingParams(max_tokens=40, temperature=0.1 * (i % 5) + version,
                                top_p=0.5 + 0.04 * i, top_k=i + version)
        return Sequence(f"r{i}", [i % 3] * 9 + [i], params, i, seed=1000 * version + i)

    seqs = [make(i) for i in range(12)]
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
                if rng.random() < 0.3:  # finished: a new request takes its id
                    i = seqs.index(seq)
                    seqs[i] = make(i, step)
            elif op == 5 and not n:  # admitted again, its prompt's blocks from the cache
                seq.num_computed_tokens = 0
                bm.take_prefix(seq, bm.match_prefix(seq), 10)
                bm.allocate(seq, 12)
                seq.num_computed_tokens = 12
                bm.commit(seq)
        for seq in seqs:
            if rng.random() < 0.05:  # given other params: its row's constants follow
                seq.params = dataclasses.replace(seq.params, temperature=float(rng.random()))
        picked = [s for s in seqs if s.block_table and rng.random() < 0.8][:8]
        scheduled = [ScheduledSeq(s, 0, 1) for s in rng.permutation(picked)]
        got = np.zeros((8, MB), np.int32)
        rows = tables.fill(scheduled, got)
        want = np.zeros((8, MB), np.int32)
        for i, s in enumerate(scheduled):
            want[i, :len(s.seq.block_table)] = s.seq.block_table
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        # each row's sampling constants are its own sequence's, new ids included
        params = [s.seq.params for s in scheduled]
        np.testing.assert_array_equal(tables.temperature[rows],
                                      np.float32([p.temperature for p in params]))
        np.testing.assert_array_equal(tables.top_p[rows], np.float32([p.top_p for p in params]))
        np.testing.assert_array_equal(tables.top_k[rows], [p.top_k for p in params])
        np.testing.assert_array_equal(tables.seeds[rows], [s.seq.seed for s in scheduled])
