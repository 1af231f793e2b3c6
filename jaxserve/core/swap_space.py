"""SwapSpace: the bookkeeping of the host block pool that swap preemption copies into (ids only;
the runtime owns the host arrays)."""

from __future__ import annotations

from jaxserve.core.sequence import Sequence


class SwapSpace:
    """Bookkeeping of the host block pool used by swap preemption (ids only)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids: list[int] = list(range(num_blocks))
        self.held: dict[str, list[int]] = {}

    def can_hold(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def reserve(self, seq: Sequence) -> list[int]:
        n = len(seq.block_table)
        ids, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        self.held[seq.request_id] = ids
        seq.num_swapped_blocks = n
        return ids

    def release(self, seq: Sequence) -> list[int]:
        ids = self.held.pop(seq.request_id, [])
        self.free_ids.extend(ids)
        seq.num_swapped_blocks = 0
        return ids

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)
