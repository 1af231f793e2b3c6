"""The process's memory-map budget, checked before compiling step programs.

XLA:CPU maps each kernel of a compiled program into memory apart (code, data and constants:
about 3 maps a kernel, 300-350 a step program here), and Linux caps a process's maps at
vm.max_map_count (65,530 by default). Past it LLVM's allocations fail and the process crashes,
so warmup estimates what its remaining programs need from the first one it builds and refuses,
naming the limit, when they would not fit.
"""

from __future__ import annotations

LIMIT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"
RESERVE = 4096  # left for everything else the process maps


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
    """Raise if `num_programs` more programs of `per_program` maps each would take the process
    past `limit` (less RESERVE) from `used`."""
    need = int(per_program * num_programs)
    if used + need <= limit - RESERVE:
        return
    raise RuntimeError(
        f"compiling {num_programs} more step programs needs about {need} memory maps (about "
        f"{per_program:.0f} each), and this process has {max(0, limit - used)} left under "
        f"vm.max_map_count={limit}; raise it (e.g. sysctl -w vm.max_map_count=262144) or "
        f"compile fewer programs (fewer token, sequence or block buckets, max_held_seqs=0, "
        f"or fewer data-parallel replicas in one process)")


def check_before(num_programs: int, used_before: int | None, built: int) -> None:
    """After `built` programs were built from `used_before` maps: check the next
    `num_programs` fit, if the system says how many maps there are."""
    used, limit = maps_in_use(), map_limit()
    if None in (used, limit, used_before) or built < 1 or num_programs < 1:
        return
    check_headroom(used, limit, max(0, used - used_before) / built, num_programs)
