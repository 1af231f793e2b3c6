"""Block tables kept on the host between steps, so a step copies only the blocks that are new.

A sequence keeps one numpy row while it is scheduled step after step. A block table changes in
place only by appends (core/block_manager.py; anything else gives the sequence a new list), so
while a row's list is the same object, its first `copied` entries still hold and only the tail
is copied. A step's (S, MB) table is then one gather of its sequences' rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler import ScheduledSeq


class BlockTableRows:
    def __init__(self, num_rows: int, max_blocks: int):
        self.rows = np.zeros((num_rows, max_blocks), np.int32)  # (rows, MB): zeros past a table
        # request id -> (its block table list, entries copied, its row)
        self._held: dict[str, tuple[list[int], int, int]] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def fill(self, scheduled: list[ScheduledSeq], out: np.ndarray) -> None:
        """out[i] = the block table of scheduled[i], zero past its end (out is (S, MB), zeros,
        S >= len(scheduled))."""
        held, rows = self._held, self.rows
        ids = {s.seq.request_id for s in scheduled}
        for rid in [r for r in held if r not in ids]:  # not in this step: their rows go back
            _, copied, row = held.pop(rid)
            rows[row, :copied] = 0
            self._free.append(row)
        index = []
        for s in scheduled:
            table, rid = s.seq.block_table, s.seq.request_id
            entry = held.get(rid)
            if entry is None:
                row, copied = self._free.pop(), 0
            else:
                old, copied, row = entry
                if old is not table or copied > len(table):
                    rows[row, :copied] = 0
                    copied = 0
            n = len(table)
            if n > copied:
                rows[row, copied:n] = table[copied:]
            held[rid] = (table, n, row)
            index.append(row)
        out[:len(index)] = rows[index, :out.shape[1]]
