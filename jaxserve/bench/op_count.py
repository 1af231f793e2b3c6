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
import dataclasses
import re

# no kernel of their own: they name, slice or alias buffers
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "opt-barrier", "partition-id", "replica-id"})
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-#]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)"
                   r"=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass
class Instr:
    """One HLO instruction: `%name = shape opcode(args), attrs`."""

    name: str
    shape: str
    opcode: str
    operands: list[str]  # the names its arguments refer to (`tuple#k`: element k of a tuple)
    args: str  # the text between the opcode's parentheses
    attrs: str
    root: bool


def _split_args(rest: str) -> tuple[str, str]:
    """An instruction's text after its opcode's '(' -> (its arguments, its attributes)."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[:i - 1], rest[i:]


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """HLO text -> ({computation: its instructions}, the entry computation's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[0].isspace():  # headers start at the margin, instructions not
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            args, attrs = _split_args(m.group(5))
            current.append(Instr(m.group(2), m.group(3), m.group(4),
                                 re.findall(r"%([\w.\-#]+)", args), args, attrs,
                                 bool(m.group(1))))
    return comps, entry


def count_ops(hlo: str) -> dict:
    """Launch counts of one compiled program's HLO text (`Compiled.as_text()`): `launches`
    per call (while bodies times their known trip counts), `fusions` among them, the
    `by_opcode` breakdown (with `conditional`s), and `distinct` (each operation once, loops
    not unrolled, every branch)."""
    comps, entry = parse_hlo(hlo)
    distinct = 0

    def walk(name: str, times: int) -> collections.Counter:
        nonlocal distinct
        ops: collections.Counter = collections.Counter()
        for ins in comps.get(name, ()):
            called = CALLS.findall(ins.attrs)
            if ins.opcode == "conditional":  # one branch runs: count the largest
                names = [c for kind, c in called if kind != "to_apply"]
                for group in BRANCHES.findall(ins.attrs):
                    names += [c.strip().lstrip("%") for c in group.split(",")]
                branches = [walk(c, times) for c in names]
                ops += max(branches, key=lambda b: sum(b.values()), default=collections.Counter())
                ops["conditional"] += times
            elif ins.opcode in ("while", "call"):
                trips = TRIPS.search(ins.attrs)
                inner = times * (int(trips.group(1)) if trips and ins.opcode == "while" else 1)
                for kind, c in called:
                    if kind != "to_apply" or ins.opcode == "call":
                        ops += walk(c, inner)
            elif ins.opcode not in FREE:
                ops[ins.opcode] += times
                distinct += 1
        return ops

    by_opcode = walk(entry, 1)
    return {"launches": sum(by_opcode.values()), "fusions": by_opcode["fusion"],
            "distinct": distinct, "by_opcode": dict(by_opcode.most_common())}


def describe(counts: dict, top: int = 8) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in list(counts["by_opcode"].items())[:top])
    return (f"{counts['launches']} launches per call ({counts['fusions']} fusions; "
            f"{counts['distinct']} distinct): {parts}")
