"""SwapSpace: the bookkeeping of the host block pool (ids only; the runtime owns the arrays).

The pool serves two users. Swap preemption holds a swapped-out sequence's blocks there until it
runs again. With prefix caching it is also the cache's host tier: a registered device block whose
slot is taken for other contents spills here under its name, and a later prompt that finds the
name copies the block back instead of computing it again. Cached host blocks are evictable (least
recently used first); held ones are not, so swapped sequences always keep their K/V.

Copies are recorded in schedule order and run in that order, so a block read by an earlier copy
may be overwritten by a later one in the same step. While a copy out of the cache is being
planned its blocks are pinned, so the planning itself cannot give them away.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.core.block_hash import BlockHash
from jaxserve.core.sequence import Sequence


class SwapSpace:
    """The host block pool: swapped-out sequences' blocks and the prefix cache's host tier."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids: list[int] = list(range(num_blocks))
        self.held: dict[str, list[int]] = {}
        self.cached: dict[BlockHash, int] = {}  # host tier: block name -> host id
        self.lru: OrderedDict[int, BlockHash] = OrderedDict()  # evictable ones, oldest first
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        """Blocks held by swapped-out sequences."""
        return sum(map(len, self.held.values()))

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def can_hold(self, n: int) -> bool:
        return n <= len(self.free_ids) + len(self.lru)

    def _take(self, n: int) -> list[int]:
        """`n` ids: free ones first, then the least recently used cached ones."""
        ids, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        while len(ids) < n:
            hid, name = self.lru.popitem(last=False)
            del self.cached[name]
            self.num_evictions += 1
            ids.append(hid)
        return ids

    # -------------------------------------------------------------------------- swap preemption

    def reserve(self, seq: Sequence) -> list[int]:
        ids = self._take(len(seq.block_table))
        self.held[seq.request_id] = ids
        seq.num_swapped_blocks = len(ids)
        return ids

    def held_ids(self, seq: Sequence) -> list[int]:
        return self.held.get(seq.request_id, [])

    def release(self, seq: Sequence) -> list[int]:
        ids = self.held.pop(seq.request_id, [])
        self.free_ids.extend(ids)
        seq.num_swapped_blocks = 0
        return ids

    # --------------------------------------------------------------------------- host tier

    def match(self, names: list[BlockHash]) -> list[int]:
        """Host ids of the cached blocks named by `names`' longest prefix (marked recently
        used)."""
        ids = []
        for name in names:
            hid = self.cached.get(name)
            if hid is None:
                break
            self._touch(hid)
            ids.append(hid)
        return ids

    def spill(self, name: BlockHash) -> int | None:
        """A host id to copy the evicted device block `name` into, or None: the host tier holds
        it already, or has no room (every block is held or pinned)."""
        hid = self.cached.get(name)
        if hid is not None:
            self._touch(hid)
            return None
        if not self.can_hold(1):
            return None
        hid = self._take(1)[0]
        self.cached[name] = hid
        self.lru[hid] = name
        return hid

    def _touch(self, hid: int) -> None:
        """Mark a cached block most recently used (a pinned one is not in the LRU)."""
        if hid in self.lru:
            self.lru.move_to_end(hid)

    def pin(self, ids: list[int]) -> list[BlockHash]:
        """Make cached blocks unevictable (a copy out of them is being planned)."""
        return [self.lru.pop(hid) for hid in ids]

    def unpin(self, ids: list[int], names: list[BlockHash]) -> None:
        for hid, name in zip(ids, names, strict=True):
            self.lru[hid] = name  # most recently used

    def check_integrity(self) -> None:
        """Raise unless free, held and cached ids split the pool and every cached block is
        evictable (nothing stays pinned after a schedule)."""
        held = [hid for ids in self.held.values() for hid in ids]
        parts = self.free_ids + held + list(self.cached.values())
        if sorted(parts) != list(range(self.num_blocks)):
            raise AssertionError(f"host pool ids do not split into free {len(self.free_ids)} + "
                                 f"held {len(held)} + cached {len(self.cached)}")
        if {hid: name for name, hid in self.cached.items()} != dict(self.lru):
            raise AssertionError("host cache and its LRU disagree")
