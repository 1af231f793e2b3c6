"""Which data-parallel replica runs a request (host only, no jax).

Each replica is an independent engine with its own KV pool and prefix cache, so a request is
cheapest where its prompt's prefix is already cached, and the batch is fullest where fewest
requests run. The router keeps, per replica, the requests it sent there and not yet finished
(its load) and an LRU of the block names (core/block_hash.py) of the prompts it sent there: an
approximation of that replica's prefix cache that needs nothing from the engine thread (as
SGLang's cache-aware router keeps an approximate tree).

The rule: the replica holding the longest cached prefix of the prompt, unless its load exceeds
the least-loaded replica's by more than `balance_slack` requests; otherwise (or with no prefix
anywhere) the least-loaded replica, ties broken by the fewest requests sent so far, so equal
replicas take turns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import OrderedDict

from jaxserve.core.block_hash import BlockHash, check_salt, extend_hashes


@dataclasses.dataclass
class ReplicaLoad:
    in_flight: int = 0  # routed here and not finished
    routed: int = 0  # every request ever routed here
    prefix_routed: int = 0  # of them, sent here for a cached prefix


class Router:
    def __init__(self, num_replicas: int, block_size: int, *, prefix_aware: bool = True,
                 balance_slack: int = 8, max_names: int = 1 << 16):
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.balance_slack = balance_slack
        self.max_names = max_names  # per replica: older names are forgotten first
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self._names: list[OrderedDict[BlockHash, None]] = [OrderedDict()
                                                           for _ in range(num_replicas)]
        self._owner: dict[str, int] = {}  # request id -> replica, until it finishes
        self.down: set[int] = set()  # replicas gone for good: never chosen again
        self._lock = threading.Lock()  # fronts route on one thread, replicas finish on others

    def route(self, request_id: str, prompt_token_ids: list[int] | None = None,
              cache_salt: str | None = None, lora: str | None = None) -> int:
        """Pick the replica for a new request and count it there. `lora`: a key of the
        request's adapter (a prefix cached under one adapter serves no other). Raises
        ValueError for a bad cache_salt; ids that are not token ids are routed by load alone
        (the replica then refuses them, naming the field)."""
        check_salt(cache_salt)
        names = []
        if self.prefix_aware and prompt_token_ids and len(self.loads) > 1:  # else no choice
            with contextlib.suppress(TypeError, OverflowError):
                names = extend_hashes([], prompt_token_ids, self.block_size, cache_salt,
                                      lora=lora)
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id {request_id!r} is already in use")
            up = [i for i in range(len(self.loads)) if i not in self.down]
            if not up:
                raise RuntimeError("every replica is down")
            least = min(up, key=lambda i: (self.loads[i].in_flight, self.loads[i].routed))
            best, hit = least, 0
            if names:
                hits = {i: self._matched(i, names) for i in up}
                best = max(up, key=lambda i: (hits[i], -self.loads[i].in_flight))
                hit = hits[best]
                too_busy = (self.loads[best].in_flight - self.loads[least].in_flight
                            > self.balance_slack)
                if not hit or too_busy:
                    best, hit = least, 0
            load = self.loads[best]
            load.in_flight += 1
            load.routed += 1
            load.prefix_routed += hit > 0
            self._owner[request_id] = best
            self._remember(best, names)
            return best

    def owner(self, request_id: str) -> int | None:
        with self._lock:
            return self._owner.get(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended (any reason) or was never queued: its replica's load drops."""
        with self._lock:
            i = self._owner.pop(request_id, None)
            if i is not None:
                self.loads[i].in_flight -= 1

    def _matched(self, replica: int, names: list[BlockHash]) -> int:
        held, n = self._names[replica], 0
        for name in names:
            if name not in held:
                break
            n += 1
        return n

    def _remember(self, replica: int, names: list[BlockHash]) -> None:
        held = self._names[replica]
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_names:
            held.popitem(last=False)
