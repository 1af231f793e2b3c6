"""What a compiled step program launches: its optimized HLO's operations outside fusions.

    python scripts/step_ops.py [--model PATH] [--sequences 16]

Each operation of the entry computation (and of the while bodies and conditional branches it
runs) that is not pure bookkeeping becomes a kernel, or a library call, of its own on a GPU, and
one loop nest on a CPU; a while body counts once per known trip, a conditional as itself (on a
GPU the host reads its predicate back: a wait for the device) plus its largest branch. Fusions
are counted apart: fewer, fatter fusions mean fewer launches and round trips through memory.
"""

from __future__ import annotations

import collections
import re

# no kernel of their own: they name, slice or alias buffers
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "opt-barrier", "partition-id", "replica-id"})
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"(body|condition|true_computation|false_computation|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """name -> [(opcode, rest of line)], and the entry computation's name."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[0].isspace():  # headers start at the margin, instructions not
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        op = _INSTRUCTION.match(line)
        if op and current is not None:
            current.append((op.group(1), op.group(2)))
    return comps, entry


def count_ops(hlo: str) -> dict:
    """Launch counts of one compiled program's HLO text (`Compiled.as_text()`): `launches`
    per call (while bodies times their known trip counts), `fusions` among them, the
    `by_opcode` breakdown (with `conditional`s), and `distinct` (each operation once, loops
    not unrolled, every branch)."""
    comps, entry = _computations(hlo)
    distinct = 0

    def walk(name: str, times: int) -> collections.Counter:
        nonlocal distinct
        ops: collections.Counter = collections.Counter()
        for opcode, rest in comps.get(name, ()):
            if opcode == "conditional":  # one branch runs: count the largest
                names = [c for kind, c in _CALLS.findall(rest) if kind != "to_apply"]
                for group in _BRANCHES.findall(rest):
                    names += [c.strip().lstrip("%") for c in group.split(",")]
                branches = [walk(c, times) for c in names]
                ops += max(branches, key=lambda b: sum(b.values()), default=collections.Counter())
                ops["conditional"] += times
            elif opcode in ("while", "call"):
                trips = _TRIPS.search(rest)
                inner = times * (int(trips.group(1)) if trips and opcode == "while" else 1)
                for kind, c in _CALLS.findall(rest):
                    if kind != "to_apply" or opcode == "call":
                        ops += walk(c, inner)
            elif opcode not in FREE:
                ops[opcode] += times
                distinct += 1
        return ops

    by_opcode = walk(entry, 1)
    return {"launches": sum(by_opcode.values()), "fusions": by_opcode["fusion"],
            "distinct": distinct, "by_opcode": dict(by_opcode.most_common())}


def describe(counts: dict, top: int = 8) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in list(counts["by_opcode"].items())[:top])
    return (f"{counts['launches']} launches per call ({counts['fusions']} fusions; "
            f"{counts['distinct']} distinct): {parts}")
