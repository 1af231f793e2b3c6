"""BlockManager: the bookkeeping of the paged KV pool (block ids only; the pages live on device)."""

from __future__ import annotations

from collections import deque

from jaxserve.core.sequence import Sequence


class BlockManager:
    """Hands out fixed-size blocks of `block_size` token slots from a pool of `num_blocks`.

    A sequence holds exactly ceil(tokens_with_kv / block_size) blocks; they are appended as it
    grows and all returned the moment it finishes, is aborted or is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, str] = {}  # block id -> request id, for integrity checks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.owner)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that `num_tokens` of its tokens have a slot."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to cover `num_tokens` tokens."""
        n = self.num_new_blocks(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free_blocks}")
        for _ in range(n):
            b = self.free_block_ids.popleft()
            self.owner[b] = seq.request_id
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            del self.owner[b]
            self.free_block_ids.append(b)
        seq.block_table = []

    def check_integrity(self) -> None:
        """Raise if free + used != total, or a block is both free and owned, or listed twice."""
        free = set(self.free_block_ids)
        if len(free) != len(self.free_block_ids):
            raise AssertionError("a block id appears twice in the free list")
        if free & self.owner.keys():
            raise AssertionError(f"blocks both free and owned: {sorted(free & self.owner.keys())}")
        if len(free) + len(self.owner) != self.num_blocks:
            raise AssertionError(f"free ({len(free)}) + used ({len(self.owner)}) != total "
                                 f"({self.num_blocks})")
