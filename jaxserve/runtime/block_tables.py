"""Rows kept on the host between steps: a sequence's block table and its sampling constants.

A sequence keeps one row while it is scheduled step after step (a persistent batch). A block
table changes in place only by appends (core/block_manager.py; anything else gives the sequence
a new list), so while a row's list is the same object, its first `copied` entries still hold and
only the tail is copied. The row's temperature, top-p, top-k and seed are written when the row
is taken, and again only if the sequence is given other params (SamplingParams are not changed
in place). A step's (S, MB) table and its per-row constants are then gathers of its rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence


class BlockTableRows:
    """`group`: the layer group (core/kv_layout.py) whose tables it keeps: 0's is
    `seq.block_table`, another's `seq.group_tables[group - 1]`."""

    def __init__(self, max_step_seqs: int, max_blocks: int, group: int = 0):
        self.group = group
        # Rows of the last step's sequences are freed after this step's are taken: twice the
        # most sequences of a step never run out.
        num_rows = 2 * max_step_seqs
        self.rows = np.zeros((num_rows, max_blocks), np.int32)  # (rows, MB): zeros past a table
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_p = np.ones(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int32)
        self.seeds = np.zeros(num_rows, np.uint32)
        # sequence -> [its block table list, entries copied, its row, the last fill it was in,
        # the params its constants came from]
        self._held: dict[Sequence, list] = {}
        self._free = list(range(num_rows - 1, -1, -1))
        self._fills = 0

    def fill(self, scheduled: list[ScheduledSeq], out: np.ndarray) -> np.ndarray:
        """out[i] = the block table of scheduled[i], zero past its end (out is (S, MB), zeros,
        S >= len(scheduled)); returns the sequences' rows, (len(scheduled),) int64, to gather
        their constants with (`temperature[rows]`...)."""
        held, rows, other = self._held, self.rows, self.group - 1
        self._fills += 1
        mark = self._fills
        index = []
        for s in scheduled:
            seq = s.seq
            table = seq.block_table if other < 0 else seq.group_tables[other]
            entry = held.get(seq)
            if entry is None:
                row = self._free.pop()
                entry = held[seq] = [table, 0, row, mark, None]
            else:
                entry[3] = mark
                if entry[0] is not table or entry[1] > len(table):
                    rows[entry[2], :entry[1]] = 0
                    entry[0], entry[1] = table, 0
            if entry[4] is not seq.params:  # new, or given other params
                self._write_constants(entry[2], seq)
                entry[4] = seq.params
            n = len(table)
            if n > entry[1]:
                rows[entry[2], entry[1]:n] = table[entry[1]:]
                entry[1] = n
            index.append(entry[2])
        if len(held) > len(scheduled):  # those not in this step: their rows go back
            for seq in [q for q, e in held.items() if e[3] != mark]:
                _, copied, row, _, _ = held.pop(seq)
                rows[row, :copied] = 0
                self._free.append(row)
        idx = np.array(index, np.int64)
        out[:len(index)] = rows[idx, :out.shape[1]]
        return idx

    def _write_constants(self, row: int, seq: Sequence) -> None:
        p = seq.params
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k  # a value past int32 raises here: the step fails its row
        self.seeds[row] = seq.seed


class GroupTableRows:
    """BlockTableRows for each of G layer groups: fill() writes a step's (G, S, MB) tables;
    the per-row constants are group 0's."""

    def __init__(self, max_step_seqs: int, max_blocks: int, num_groups: int):
        self.groups = [BlockTableRows(max_step_seqs, max_blocks, g) for g in range(num_groups)]
        first = self.groups[0]
        self.temperature, self.top_p, self.top_k, self.seeds = (
            first.temperature, first.top_p, first.top_k, first.seeds)

    def fill(self, scheduled: list[ScheduledSeq], out: np.ndarray) -> np.ndarray:
        """out (G, S, MB): each group's tables; returns group 0's rows (BlockTableRows.fill)."""
        for g in range(len(self.groups) - 1, 0, -1):
            self.groups[g].fill(scheduled, out[g])
        return self.groups[0].fill(scheduled, out[0])


def table_rows(max_step_seqs: int, max_blocks: int, num_groups: int = 1):
    """The rows kept for steps of a pool with `num_groups` layer groups."""
    if num_groups == 1:
        return BlockTableRows(max_step_seqs, max_blocks)
    return GroupTableRows(max_step_seqs, max_blocks, num_groups)
