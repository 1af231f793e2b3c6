"""BlockManager: the bookkeeping of the paged KV pool (block ids only; the pages live on device).

With prefix caching, full blocks are also content-addressed (core/block_hash.py): a block whose
K/V has been computed is registered under its hash chain name, and a later sequence whose prompt
starts with the same blocks takes them instead of computing them again. Blocks carry reference
counts; a block is free when nothing references it, and a free block that is registered keeps its
contents until its slot is needed: the free queue is an LRU whose front is taken (and evicted)
first. Unregistered blocks go to the front, registered ones to the back, a sequence's blocks last
block first, so the end of a prompt is evicted before its shared beginning.

A shared block is never written: only full blocks are registered, and a sequence writes from its
first uncomputed token on, which lies past every block it took from the cache.

Layer groups (core/kv_layout.py): with G groups, a block of a sequence is a page of each group,
each group's in a table of its own; the counts this class shows the scheduler (free blocks,
blocks needed) are blocks of all G pages, so its sums hold unchanged. Before each step `drop`
returns a sequence's pages of the local (sliding-window) groups that no query of the step can
see. A group's pages are cached under (group, name); a prefix match needs every global group's
pages of the prefix and the local groups' of its last window only.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from jaxserve.core.block_hash import BlockHash, extend_hashes
from jaxserve.core.sequence import Sequence


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of them, found computed (on the device or in the host tier)
    host_hits: int = 0  # of the hits, copied back from the host tier
    evictions: int = 0  # registered blocks whose slot was taken for other contents

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Hands out fixed-size blocks of `block_size` token slots from a pool of `num_blocks`.

    A sequence holds exactly ceil(tokens_with_kv / block_size) blocks; they are appended as it
    grows and all released the moment it finishes, is aborted or is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 group_windows: tuple[int | None, ...] = (None,)):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_groups = len(group_windows)  # pages per block (KVLayout.windows)
        self.local_groups = [g for g, w in enumerate(group_windows) if w is not None]
        self.window = group_windows[self.local_groups[0]] if self.local_groups else None
        self.ref_count = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # registered blocks by name
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_used_blocks = 0
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be added to sequences (each a page of every group)."""
        return len(self.free_queue) // self.num_groups

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table of each group."""
        return [seq.block_table, *seq.group_tables] if self.num_groups > 1 else [seq.block_table]

    def held_pages(self, seq: Sequence):
        """Every page `seq` holds a reference to, by group: (group, index, page)."""
        return live_pages(self.tables(seq), seq.num_dropped, self.local_groups)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def most_pages_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most pages a sequence of `num_tokens` tokens holds at once, computed in steps
        of up to `step_tokens` tokens: a page of every group per block, but a local group's
        only for the blocks a step's queries see."""
        n = self.blocks_needed(num_tokens)
        local = min(n, self._window_pages(step_tokens))
        return (self.num_groups - len(self.local_groups)) * n + len(self.local_groups) * local

    def most_tokens_held(self, step_tokens: int) -> int | None:
        """The longest sequence the whole pool holds (most_pages_held), None if any length
        fits (every group local: a sequence holds no more than its window's pages)."""
        glob = self.num_groups - len(self.local_groups)
        pages = self.num_blocks - len(self.local_groups) * self._window_pages(step_tokens)
        if glob == 0:
            return None if pages >= 0 else 0
        return max(0, pages // glob) * self.block_size

    def _window_pages(self, step_tokens: int) -> int:
        """The most pages of one local group a step of `step_tokens` queries sees (0 without
        windows): its queries' windows, ending anywhere in a block."""
        return self.blocks_needed(self.window - 1 + step_tokens) + 1 if self.window else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that `num_tokens` of its tokens have a slot."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) * self.num_groups <= len(self.free_queue)

    def allocate(self, seq: Sequence, num_tokens: int,
                 evicted: list[tuple[int, BlockHash]] | None = None) -> None:
        """Grow `seq`'s block table to cover `num_tokens` tokens. A registered block taken for
        it loses its name; `evicted` (if given) receives (block, name) for each, so the host
        tier can keep a copy before the block is overwritten."""
        n = self.num_new_blocks(seq, num_tokens)
        if n * self.num_groups > len(self.free_queue):
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free_blocks}")
        if self.num_groups > 1 and len(seq.group_tables) < self.num_groups - 1:
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        for table in self.tables(seq):
            for _ in range(n):
                b, _ = self.free_queue.popitem(last=False)
                h = self.hash_of[b]
                if h is not None:  # its contents go: forget them
                    if evicted is not None:
                        evicted.append((b, h))
                    del self.cached[h]
                    self.hash_of[b] = None
                    self.stats.evictions += 1
                self._ref(b)
                table.append(b)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, last block first."""
        for _, _, b in reversed(list(self.held_pages(seq))):
            self._unref(b)
        seq.block_table = []
        seq.group_tables = []
        seq.num_dropped = 0
        seq.num_cached_blocks = 0

    def drop(self, seq: Sequence, start: int) -> None:
        """Before a step whose first query of `seq` is at position `start`: release its pages
        of the local groups that hold only keys older than that query's window (the step's
        later queries see less far back still)."""
        first = max(0, start - self.window + 1) // self.block_size
        if first <= seq.num_dropped:
            return
        tables = self.tables(seq)
        for g in self.local_groups:
            table = tables[g]
            for i in range(seq.num_dropped, min(first, len(table))):
                self._unref(table[i])
        seq.num_dropped = first

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return `seq`'s blocks past the first `num_tokens` tokens (taken for proposed
        tokens that were rejected; never named, so they go to the front of the queue)."""
        keep = max(self.blocks_needed(num_tokens), seq.num_cached_blocks, seq.num_dropped)
        if len(seq.block_table) > keep:
            tables = self.tables(seq)
            for table in tables:
                for b in reversed(table[keep:]):
                    self._unref(b)
            # new lists: tables only grow in place
            seq.block_table = tables[0][:keep]
            seq.group_tables = [t[:keep] for t in tables[1:]]

    def _unref(self, b: int) -> None:
        """Drop a reference to block `b`; unused, it joins the free queue."""
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            self.num_used_blocks -= 1
            self.free_queue[b] = None  # the back: evicted last
            if self.hash_of[b] is None:
                self.free_queue.move_to_end(b, last=False)  # nothing to keep: taken first

    def _ref(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self.num_used_blocks += 1
        self.ref_count[b] += 1

    # ------------------------------------------------------------------------ prefix caching

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks that hold `seq`'s first tokens, longest run first to last. The
        last token is never matched: computing it gives the logits to sample from."""
        if not self.enable_caching:
            return []
        if self.window is not None:
            return self._match_groups(seq)
        blocks = []
        for h in self.matchable_names(seq):
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def _name(self, group: int, h: BlockHash):
        """A page's name in the cache: its block's, and the group's past group 0."""
        return h if group == 0 else (group, h)

    def _first_seen(self, num_blocks: int) -> int:
        """The first block a query right after `num_blocks` full blocks sees in a local
        layer."""
        return max(0, num_blocks * self.block_size - self.window + 1) // self.block_size

    def _match_groups(self, seq: Sequence) -> PrefixMatch:
        """match_prefix with layer groups: the longest run of blocks whose pages every global
        group has cached, shortened until the local groups have theirs of its last window."""
        names = self.matchable_names(seq)
        global_groups = [g for g in range(self.num_groups) if g not in self.local_groups]
        k = 0
        while k < len(names) and all(self._name(g, names[k]) in self.cached
                                     for g in global_groups):
            k += 1
        while k > 0 and not all(self._name(g, names[i]) in self.cached
                                for g in self.local_groups
                                for i in range(self._first_seen(k), k)):
            k -= 1
        dropped = self._first_seen(k) if self.local_groups else 0
        pages = [[self.cached[self._name(g, names[i])]
                  if g not in self.local_groups or i >= dropped else 0 for i in range(k)]
                 for g in range(self.num_groups)]
        return PrefixMatch(pages, dropped, self.local_groups)

    def matchable_names(self, seq: Sequence) -> list[BlockHash]:
        """The names of the blocks of `seq` a cache may supply: every full block that ends
        before its last known token (none while its prompt logprobs are still to come, nor
        for a mean-pooled embedding)."""
        if seq.needs_prompt_logprobs or seq.pooling == "mean":
            return []  # every prompt row must run (a mean needs each one's hidden state)
        max_blocks = (self._num_known(seq) - 1) // self.block_size
        return self._hashes(seq, max_blocks)[:max_blocks]

    def num_blocks_taken_from_free(self, blocks: list[int]) -> int:
        """How many of `blocks` (a match) sit in the free queue: taking them uses free slots
        (with groups, their pages there, in blocks of all groups' pages, rounded up)."""
        if isinstance(blocks, PrefixMatch):
            pages = {b for _, b in blocks.held()}
            return -(-sum(self.ref_count[b] == 0 for b in pages) // self.num_groups)
        return sum(self.ref_count[b] == 0 for b in blocks)

    def take_prefix(self, seq: Sequence, blocks: list[int], num_prompt_tokens: int) -> None:
        """Give a sequence with no blocks the matched `blocks`: their tokens count as computed.
        `num_prompt_tokens`: the tokens it looked up (for the hit rate)."""
        assert not seq.block_table, seq
        held = blocks.held() if isinstance(blocks, PrefixMatch) else ((0, b) for b in blocks)
        for _, b in held:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self._ref(b)
        if isinstance(blocks, PrefixMatch):
            seq.group_tables = [list(t) for t in blocks.pages[1:]]
            seq.num_dropped = blocks.dropped
        seq.block_table = list(blocks)
        seq.num_cached_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        self.stats.queries += num_prompt_tokens
        self.stats.hits += seq.num_computed_tokens

    def register_loaded(self, seq: Sequence, start: int) -> None:
        """`seq`'s blocks from index `start` on are getting their K/V copied in from the host
        tier (before any step reads them): register them and count them computed."""
        names = self.matchable_names(seq)
        for i in range(start, len(seq.block_table)):
            self._register(seq.block_table[i], names[i])
        loaded = (len(seq.block_table) - start) * self.block_size
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens += loaded
        self.stats.hits += loaded
        self.stats.host_hits += loaded

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose K/V is computed (or being computed by a step
        already launched, which runs before any step that could read them)."""
        # (the first test alone ends most calls: a decode fills no block)
        if (not self.enable_caching
                or seq.num_computed_tokens // self.block_size <= seq.num_cached_blocks):
            return
        full = min(seq.num_computed_tokens, self._num_known(seq)) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        if self.window is not None:
            for g, table in enumerate(self.tables(seq)):
                first = seq.num_dropped if g in self.local_groups else 0
                for i in range(max(seq.num_cached_blocks, first), full):
                    self._register(table[i], self._name(g, hashes[i]))
        else:
            for i in range(seq.num_cached_blocks, full):
                self._register(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = full

    def _register(self, b: int, h: BlockHash) -> None:
        """Name block `b` `h`, unless it has a name or another block holds `h` (an equal block
        computed at the same time, or already on the device: this copy stays unnamed and is
        simply freed later)."""
        if self.hash_of[b] is None and h not in self.cached:
            self.hash_of[b] = h
            self.cached[h] = b

    def forget(self, seq: Sequence) -> None:
        """Unregister the blocks only `seq` holds (its step failed: their contents are not to
        be trusted)."""
        for _, _, b in self.held_pages(seq):
            h = self.hash_of[b]
            if h is not None and self.ref_count[b] == 1:
                del self.cached[h]
                self.hash_of[b] = None

    @staticmethod
    def _num_known(seq: Sequence) -> int:
        """Tokens on the host (a token the device is still sampling cannot be hashed yet)."""
        return seq.num_prompt_tokens + seq.num_output_tokens

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The names of `seq`'s first `num_blocks` full blocks (more if known), kept on the
        sequence so each is hashed once."""
        known = len(seq.block_hashes)
        if known < num_blocks:  # only the new blocks' tokens are read
            bs = self.block_size
            extend_hashes(seq.block_hashes, seq.tokens(known * bs, num_blocks * bs), bs,
                          seq.cache_salt, known, seq.lora_key)
        return seq.block_hashes

    # ---------------------------------------------------------------------------- integrity

    def check_integrity(self, seqs=None) -> None:
        """Raise unless: every block is either free (in the queue, ref 0) or used (ref > 0);
        the used count matches; registered names and blocks agree both ways. With `seqs` (every
        live sequence), each block's reference count equals the number of block tables that
        hold it."""
        for b in range(self.num_blocks):
            in_free = b in self.free_queue
            if in_free == (self.ref_count[b] > 0):
                raise AssertionError(f"block {b}: ref {self.ref_count[b]}, in free queue "
                                     f"{in_free}")
        used = sum(r > 0 for r in self.ref_count)
        if used != self.num_used_blocks or used + len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"used {used} (counted {self.num_used_blocks}) + free "
                                 f"{len(self.free_queue)} != {self.num_blocks}")
        for h, b in self.cached.items():
            if self.hash_of[b] != h:
                raise AssertionError(f"block {b} registered under a name it does not carry")
        if sum(h is not None for h in self.hash_of) != len(self.cached):
            raise AssertionError("a block carries a name that is not registered")
        if seqs is not None:
            refs = [0] * self.num_blocks
            for s in seqs:
                for _, _, b in self.held_pages(s):
                    refs[b] += 1
            if refs != self.ref_count:
                bad = [b for b in range(self.num_blocks) if refs[b] != self.ref_count[b]]
                raise AssertionError(f"reference counts differ from the block tables at {bad}")


class PrefixMatch(list):
    """A prefix match with layer groups: as a list, group 0's pages (the match's length in
    blocks); `pages` every group's (placeholders, page 0, in a local group before
    `dropped`)."""

    def __init__(self, pages: list[list[int]], dropped: int, local_groups: list[int]):
        super().__init__(pages[0])
        self.pages = pages
        self.dropped = dropped
        self.local_groups = local_groups

    def held(self):
        """(group, page) of every page the match takes a reference to."""
        return ((g, b) for g, _, b in live_pages(self.pages, self.dropped, self.local_groups))


def live_pages(tables: list[list[int]], num_dropped: int, local_groups: list[int]):
    """(group, index, page) of each group's table entry that holds a page of its own: all
    of a global group's, a local group's from `num_dropped` on."""
    for g, table in enumerate(tables):
        first = num_dropped if g in local_groups else 0
        for i in range(first, len(table)):
            yield g, i, table[i]
