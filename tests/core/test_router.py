"""The data-parallel router: least-loaded placement, prefix affinity, and its bounds."""

from __future__ import annotations

import pytest

from jaxserve.core.router import Router

B = 4  # block size


def prompt(prefix: int, n_blocks: int = 4, tail: int = 0) -> list[int]:
    """Blocks of tokens that start with `prefix`'s blocks, then `tail` distinct tokens."""
    return [prefix * 1000 + i for i in range(n_blocks * B)] + [7_000_000 + tail] * 3


def test_equal_replicas_take_turns_and_load_follows_finishes():
    r = Router(3, B, prefix_aware=False)
    assert [r.route(f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [x.in_flight for x in r.loads] == [2, 2, 2]
    r.finished("r1")
    r.finished("r4")
    assert r.route("a") == 1 and r.route("b") == 1  # the idle one first, whatever the turn
    r.finished("a")
    r.finished("a")  # again: nothing more
    assert [x.in_flight for x in r.loads] == [2, 1, 2]
    assert r.owner("b") == 1 and r.owner("a") is None
    with pytest.raises(ValueError, match="request_id"):
        r.route("b")


def test_a_prompt_goes_where_its_prefix_went():
    r = Router(2, B)
    first = r.route("x0", prompt(1, tail=0))
    other = r.route("y0", prompt(2, tail=0))
    assert first != other  # no prefix anywhere: least loaded
    for i in range(1, 6):  # later prompts with either prefix follow it, load or not
        assert r.route(f"x{i}", prompt(1, tail=i)) == first
        assert r.route(f"y{i}", prompt(2, tail=i)) == other
    assert r.loads[first].prefix_routed == r.loads[other].prefix_routed == 5


def test_the_longest_cached_prefix_wins():
    r = Router(2, B, balance_slack=100)
    short = r.route("a", prompt(1, n_blocks=1))
    long_ = r.route("b", prompt(5, n_blocks=4))  # unrelated: the other replica
    assert short != long_
    r.route("c", prompt(1, n_blocks=1) + prompt(9, n_blocks=3))  # joins `short`'s prefix
    # Shares 1 block with replica `short` and 0 with the other.
    assert r.route("d", prompt(1, n_blocks=1) + [3] * 9) == short
    # Shares all 4 blocks of "b" (and 1 block less of anything else): goes to `long_`.
    assert r.route("e", prompt(5, n_blocks=4, tail=3)) == long_


def test_a_busy_replica_loses_its_prefix_affinity_past_the_slack():
    r = Router(2, B, balance_slack=2)
    home = r.route("p0", prompt(1))
    placed = [r.route(f"p{i}", prompt(1, tail=i)) for i in range(1, 6)]
    # p1, p2 join home (in flight 2, 3 vs 0); p3 would leave it 3 ahead: least loaded instead.
    assert placed[:2] == [home, home]
    assert placed[2] == 1 - home
    assert r.loads[home].in_flight - r.loads[1 - home].in_flight <= 3


def test_salts_and_partial_blocks_do_not_match():
    r = Router(2, B)
    a = r.route("a", prompt(1), cache_salt="tenant-a")
    assert r.route("b", prompt(1), cache_salt="tenant-b") != a  # same tokens, other tenant
    c = r.route("c", [1, 2, 3])  # shorter than a block: no name, least loaded
    assert r.loads[c].prefix_routed == 0


def test_a_prefix_under_one_adapter_draws_no_other():
    r = Router(2, B)
    a = r.route("a", prompt(1), lora="1")
    assert r.loads[a].prefix_routed == 0
    assert r.route("b", prompt(1)) != a  # the base model's prefix is not adapter 1's
    assert r.route("c", prompt(1), lora="2") == a  # neither is adapter 2's: least loaded
    assert r.loads[a].prefix_routed == 0
    assert r.route("d", prompt(1), lora="1") == a  # adapter 1's own prefix draws it home
    assert r.loads[a].prefix_routed == 1


def test_the_memory_of_prefixes_is_bounded():
    r = Router(2, B, max_names=5)
    for i in range(10):
        r.route(f"r{i}", prompt(i, n_blocks=2))
    assert [len(names) for names in r._names] == [5, 5]
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, B)


def test_bad_salt_is_refused_and_bad_ids_route_by_load():
    router = Router(2, block_size=4)
    with pytest.raises(ValueError, match="cache_salt"):
        router.route("a", [1, 2, 3, 4, 5], True)
    assert router.route("b", [2**70] * 8) in (0, 1)  # no name: the replica refuses it
    assert router.route("c", [1.5] * 8) in (0, 1)


def test_one_replica_keeps_no_prefixes():
    r = Router(1, B)
    for i in range(4):
        assert r.route(f"r{i}", prompt(i % 2)) == 0
    assert not r._names[0] and r.loads[0].in_flight == 4 and r.loads[0].prefix_routed == 0
