"""Scheduling policies: the order in which sequences are admitted, run and preempted. Host only.

The scheduler holds one policy and asks it five things:
- `key(seq, now)`: a sequence's standing, smaller first: it decodes and is admitted first, and
  is preempted last (`sort` orders a queue by it);
- `admission_order(waiting, swapped, now)`: who may enter the running set next, best first;
- `victim(candidates, now)`: whom to preempt when a running sequence is short of a block;
- `outranks(seq, other, now)`: whether waiting `seq` may preempt running `other` for its slot
  or blocks (never, unless a policy says so);
- `batch(waiting, num_active, now)`: waiting sequences to admit together before anything else
  this step, whatever its token budget (static batching; none otherwise).

A new policy is a subclass and one line in POLICIES, the table `scheduling_policy` names.

Aging rule ("priority"): a request's effective priority is `priority - floor(age_s /
priority_aging_s)`, with age counted from arrival: every `priority_aging_s` seconds in the
system are worth one priority level. A request that waits long enough outranks any newly
arrived one, which bounds starvation, and preemption needs a strictly better effective
priority, so requests of equal standing never evict each other back and forth.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import ClassVar

from jaxserve.core.sequence import Sequence

_BY_ARRIVAL = attrgetter("arrival_index")


class SchedulingPolicy:
    """The interface, answering as a policy that only knows arrival order would."""

    # Whether requests may be admitted beyond the decode slots (held prefills; config.py)
    holds_prefills: ClassVar[bool] = True

    def __init__(self, aging_s: float | None = None):
        self.aging_s = aging_s  # priority_aging_s

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_index,)

    def sort(self, seqs: list[Sequence], now: float) -> None:
        seqs.sort(key=lambda s: self.key(s, now))

    def admission_order(self, waiting: list[Sequence], swapped: list[Sequence],
                        now: float) -> list[Sequence]:
        """A new list; `waiting` may be sorted in place."""
        return sorted(swapped + waiting, key=lambda s: self.key(s, now))

    def victim(self, candidates: list[Sequence], now: float) -> Sequence:
        return max(candidates, key=lambda s: self.key(s, now))

    def outranks(self, seq: Sequence, other: Sequence, now: float) -> bool:
        return False

    def batch(self, waiting: list[Sequence], num_active: int, now: float) -> list[Sequence]:
        """`num_active`: the sequences running or swapped out."""
        return []


class FirstComeFirstServed(SchedulingPolicy):
    def sort(self, seqs: list[Sequence], now: float) -> None:
        seqs.sort(key=_BY_ARRIVAL)  # C-level key: this runs every step over every request

    def admission_order(self, waiting: list[Sequence], swapped: list[Sequence],
                        now: float) -> list[Sequence]:
        self.sort(waiting, now)
        return swapped + waiting  # they were running before anything now waiting was admitted

    def victim(self, candidates: list[Sequence], now: float) -> Sequence:
        return max(candidates, key=_BY_ARRIVAL)


class Priority(SchedulingPolicy):
    """Smaller `priority` first, ties by arrival, with aging (the module docstring)."""

    def key(self, seq: Sequence, now: float) -> tuple:
        prio = seq.priority
        if self.aging_s:
            # Age counts from arrival for running requests too, so an aged request that got in
            # is not thrown out again by the next arrival it outranked.
            prio -= math.floor((now - seq.arrival_time) / self.aging_s)
        return (prio, seq.arrival_index)

    def outranks(self, seq: Sequence, other: Sequence, now: float) -> bool:
        return self.key(seq, now)[0] < self.key(other, now)[0]


class Static(FirstComeFirstServed):
    """A baseline: the next max_num_seqs requests form a batch, which runs until its last
    member finishes; only then is the next one admitted."""

    holds_prefills = False

    def admission_order(self, waiting: list[Sequence], swapped: list[Sequence],
                        now: float) -> list[Sequence]:
        return list(swapped)  # members of the batch that were preempted

    def batch(self, waiting: list[Sequence], num_active: int, now: float) -> list[Sequence]:
        if num_active:
            return []
        self.sort(waiting, now)
        return waiting


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FirstComeFirstServed,
    "priority": Priority,
    "static": Static,
}


def policy_class(name: str, field: str = "scheduling_policy") -> type[SchedulingPolicy]:
    """The policy registered as `name`; `field` names it in the error."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{field} must be one of {', '.join(POLICIES)}, got {name!r}")
    return cls
