"""The process's memory-map budget, checked before each step program is compiled or loaded.

XLA:CPU maps each kernel of a compiled program into memory apart (code, data and constants:
about 3 maps a kernel, 300-350 a step program here), and Linux caps a process's maps at
vm.max_map_count (65,530 by default). Past it LLVM's allocations fail and the process crashes.
So a runner counts what its programs take, and refuses the next one, naming the limit, when it
would not fit (and warmup refuses early when all it has left would not).
"""

from __future__ import annotations

import threading

LIMIT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"
RESERVE = 4096  # left for everything else the process maps (and for a program bigger than seen)
FIRST_GUESS = 400  # maps of a program before one was counted


class MapLimitError(RuntimeError):
    """The next programs would take the process past vm.max_map_count."""


def maps_in_use() -> int | None:
    """This process's memory maps now, or None where the system does not say."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    try:
        with open(LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def check_headroom(used: int, limit: int, per_program: float, num_programs: int) -> None:
    """Raise MapLimitError if `num_programs` more programs of `per_program` maps each would
    take the process past `limit` (less RESERVE) from `used`."""
    need = int(per_program * num_programs)
    if used + need <= limit - RESERVE:
        return
    raise MapLimitError(
        f"compiling {num_programs} more step programs needs about {need} memory maps (about "
        f"{per_program:.0f} each), and this process has {max(0, limit - used)} left under "
        f"vm.max_map_count={limit}; raise it (e.g. sysctl -w vm.max_map_count=262144) or "
        f"compile fewer programs (fewer token, sequence or block buckets, max_held_seqs=0, "
        f"or fewer data-parallel replicas in one process)")


class MapBudget:
    """What one runner's programs took: the most one took (a build on another thread at the
    same time counts in it too, so it errs high) and the mean."""

    def __init__(self):
        self.limit = map_limit()
        self.most = 0
        self.total = 0
        self.count = 0
        self._lock = threading.Lock()

    def run(self, fn, *args):
        """fn(*args), which compiles or loads one program, after checking it fits."""
        used = maps_in_use() if self.limit is not None else None
        if used is None:
            return fn(*args)
        check_headroom(used, self.limit, self.most or FIRST_GUESS, 1)
        out = fn(*args)
        after = maps_in_use()
        if out is not None and after is not None:
            with self._lock:
                self.most = max(self.most, after - used)
                self.total += max(0, after - used)
                self.count += 1
        return out

    def check_remaining(self, num_programs: int) -> None:
        """Raise MapLimitError if `num_programs` more programs of the mean size would not fit."""
        used = maps_in_use() if self.limit is not None else None
        if used is None or not self.count or num_programs < 1:
            return
        check_headroom(used, self.limit, self.total / self.count, num_programs)
