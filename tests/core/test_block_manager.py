"""BlockManager: allocation, reference counts and the prefix cache (host only)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.block_hash import extend_hashes
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), 0, 0, cache_salt=salt)


def compute(bm: BlockManager, s: Sequence, device: dict | None = None) -> None:
    """Give `s` blocks for all its tokens, 'write' them (into `device`: block -> slot tokens),
    mark them computed and register the full blocks."""
    bm.allocate(s, s.num_tokens)
    if device is not None:
        for pos in range(s.num_computed_tokens, s.num_tokens):
            device.setdefault(s.block_table[pos // BS], [None] * BS)[pos % BS] = s.token_at(pos)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    blocks = bm.match_prefix(s)
    bm.take_prefix(s, blocks, s.num_tokens)
    return blocks


def test_without_caching_nothing_is_matched_and_blocks_recycle():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(10)))
    compute(bm, a)
    assert bm.num_used_blocks == 3 and bm.num_cached_blocks == 0
    bm.free(a)
    b = seq("b", list(range(10)))
    assert bm.match_prefix(b) == []
    bm.check_integrity([])


def test_a_shared_prefix_is_taken_not_computed():
    bm = BlockManager(16, BS, enable_caching=True)
    a = seq("a", list(range(13)))  # 3 full blocks + 1 token
    compute(bm, a)
    assert bm.num_cached_blocks == 3
    b = seq("b", list(range(12)) + [99, 98])
    blocks = admit(bm, b)
    assert blocks == a.block_table[:3] and b.num_computed_tokens == 12
    assert all(bm.ref_count[x] == 2 for x in blocks)
    bm.check_integrity([a, b])
    bm.free(a)  # still held by b
    assert all(bm.ref_count[x] == 1 for x in blocks)
    bm.check_integrity([b])
    assert bm.stats.hits == 12 and bm.stats.queries == 14


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(16, BS, enable_caching=True)
    a = seq("a", list(range(8)))  # exactly 2 full blocks
    compute(bm, a)
    b = seq("b", list(range(8)))
    assert len(admit(bm, b)) == 1 and b.num_computed_tokens == 4  # the last block recomputed


def test_salts_keep_tenants_apart():
    bm = BlockManager(16, BS, enable_caching=True)
    compute(bm, seq("a", list(range(9)), salt="tenant-1"))
    assert bm.match_prefix(seq("b", list(range(9)), salt="tenant-2")) == []
    assert bm.match_prefix(seq("c", list(range(9)))) == []
    assert len(bm.match_prefix(seq("d", list(range(9)), salt="tenant-1"))) == 2


def test_freed_cached_blocks_are_evicted_last_block_first_and_unnamed_ones_before():
    bm = BlockManager(5, BS, enable_caching=True)
    a = seq("a", list(range(17)))  # 4 full blocks + 1 partial (unregistered)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    c = seq("c", [50, 51, 52, 53, 54])
    bm.allocate(c, 8)  # two blocks: the unnamed partial one, then a's last full block
    assert c.block_table == [table[4], table[3]] and bm.stats.evictions == 1
    assert bm.match_prefix(seq("b", list(range(17)))) == table[:3]
    bm.check_integrity([c])


def test_forget_drops_the_names_of_blocks_no_one_else_holds():
    bm = BlockManager(16, BS, enable_caching=True)
    a = seq("a", list(range(9)))
    compute(bm, a)
    b = seq("b", list(range(4)) + [7, 7, 7, 7, 7])
    admit(bm, b)
    compute(bm, b)
    bm.forget(b)  # b's own second block goes; the first, shared with a, stays named
    assert bm.hash_of[b.block_table[0]] is not None and bm.hash_of[b.block_table[1]] is None
    bm.check_integrity([a, b])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "free", "grow"]), st.integers(0, 5),
                          st.integers(1, 14)), max_size=40))
def test_random_traffic_keeps_counts_exact_and_cached_contents_true(ops):
    """Prompts drawn from a few shared prefixes; after every operation the integrity check holds
    with the live sequences, and every block a new sequence takes from the cache holds, slot by
    slot, exactly the tokens it names (the 'device' records what was written where)."""
    bm = BlockManager(24, BS, enable_caching=True)
    device: dict[int, list] = {}
    live: dict[str, Sequence] = {}
    prefixes = [list(range(100, 120)), list(range(200, 220)), [5] * 20]
    for i, (op, k, n) in enumerate(ops):
        if op == "add":
            s = seq(f"s{i}", prefixes[k % 3][:n] + [k] * (k % 3))
            blocks = bm.match_prefix(s)
            need = bm.blocks_needed(s.num_tokens) - len(blocks)
            if need + bm.num_blocks_taken_from_free(blocks) > bm.num_free_blocks:
                continue
            bm.take_prefix(s, blocks, s.num_tokens)
            for pos in range(s.num_computed_tokens):
                assert device[s.block_table[pos // BS]][pos % BS] == s.token_at(pos)
            compute(bm, s, device)
            live[s.request_id] = s
        elif op == "grow" and live:
            s = list(live.values())[k % len(live)]
            if bm.num_new_blocks(s, s.num_tokens + n) <= bm.num_free_blocks:
                s.output_token_ids.extend([300 + n] * n)
                s.num_tokens += n
                compute(bm, s, device)
        elif op == "free" and live:
            bm.free(live.pop(sorted(live)[k % len(live)]))
        bm.check_integrity(list(live.values()))


def test_block_names_extended_from_an_offset_equal_those_named_at_once():
    tokens = list(range(100, 171))  # four full blocks of 16 and a partial one
    whole = extend_hashes([], tokens, 16, "salt")
    assert len(whole) == 4
    part = extend_hashes([], tokens[:40], 16, "salt")  # two blocks
    assert extend_hashes(part, tokens[32:], 16, "salt", first=2) == whole
    assert extend_hashes(whole[:1], tokens[16:], 16, "salt", first=1) == whole
    assert extend_hashes([], tokens, 16) != whole  # the salt is part of every name


# ----------------------------------------------------------------------- layer groups

def test_groups_take_a_page_each_and_drop_the_local_pages_out_of_the_window():
    """Groups (global, local, local), window 6 of blocks of 4: a block costs three pages;
    before a step at position p the local groups give back the blocks wholly older than
    p - 5; free() returns the rest. Counts are in blocks of three pages."""
    bm = BlockManager(30, BS, group_windows=(None, 6, 6))
    assert bm.num_free_blocks == 10
    s = seq("a", list(range(30)))
    bm.allocate(s, 30)  # 8 blocks of 3 pages
    assert len(bm.free_queue) == 6 and bm.num_free_blocks == 2
    assert [len(t) for t in bm.tables(s)] == [8, 8, 8]
    assert not bm.can_allocate(s, 41) and bm.can_allocate(s, 40)
    bm.drop(s, 5)  # sees keys 0.. : nothing to drop
    assert s.num_dropped == 0
    bm.drop(s, 14)  # keys 9..14: blocks 0 and 1 leave both local groups
    assert s.num_dropped == 2 and len(bm.free_queue) == 10
    bm.drop(s, 13)  # never back
    assert s.num_dropped == 2
    bm.check_integrity([s])
    assert len(list(bm.held_pages(s))) == 8 + 2 * 6
    bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10 and not s.group_tables
    bm.check_integrity([s])


def test_a_sequence_holds_its_windows_pages_only():
    """A long sequence decoded token by token, window 8 of blocks of 4: each local group
    never holds more than window / block + 2 pages at a step; the global group holds all."""
    bm = BlockManager(200, BS, group_windows=(None, 8))
    s = seq("a", list(range(3)))
    most = 0
    for pos in range(3, 300):
        bm.drop(s, s.num_computed_tokens)
        bm.allocate(s, pos + 1)
        s.num_computed_tokens = pos + 1
        local = sum(g == 1 for g, _, _ in bm.held_pages(s))
        most = max(most, local)
    assert most <= 8 // BS + 2 and len(s.block_table) == 75
    bm.check_integrity([s])


def test_groups_prefix_match_needs_the_last_window_of_local_pages():
    """With caching, each group's full pages are cached under their group's name; a match
    takes every global page of the prefix and the local pages of its last window only, and
    is cut where the local pages are gone."""
    bm = BlockManager(60, BS, enable_caching=True, group_windows=(None, 6))
    a = seq("a", list(range(25)))  # 6 full blocks
    compute(bm, a)
    bm.free(a)
    b = seq("b", list(range(25)) + [99])
    m = admit(bm, b)
    assert len(m) == 6 and b.num_computed_tokens == 24
    # a query at 24 sees keys 19..: local blocks 4 and 5 only
    assert b.num_dropped == 4 and [len(t) for t in bm.tables(b)] == [6, 6]
    assert len(list(bm.held_pages(b))) == 6 + 2
    bm.check_integrity([b])
    bm.free(b)
    # evict a's local pages of blocks 4, 5: the match falls back to where a window is whole
    for blk in (4, 5):
        page = bm.cached.pop((1, a.block_hashes[blk]))
        bm.hash_of[page] = None
    c = seq("c", list(range(25)) + [7])
    assert len(admit(bm, c)) == 4  # a query at 16 sees keys 11..: local blocks 2, 3 cached
    bm.check_integrity([c])


def test_all_local_groups_fit_any_length():
    bm = BlockManager(10, BS, group_windows=(8,))
    assert bm.most_tokens_held(4) is None and bm.most_pages_held(1000, 4) == 4
    mixed = BlockManager(30, BS, group_windows=(None, 8))
    assert mixed.most_pages_held(40, 4) == 10 + 4
    assert mixed.most_tokens_held(4) == (30 - 4) * BS
