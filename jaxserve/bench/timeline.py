"""The step timeline: which request ran in which step, prefill or decode, and who waited."""

from __future__ import annotations


def timeline_grid(trace, request_ids: list[str] | None = None,
                  arrivals: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """(request ids, rows): per request one char per step, P prefill, D decode, '.' waiting
    (arrived, or preempted, and not running), ' ' not in the system.

    `arrivals` maps request id -> the step it arrived at (default: step 0 for all)."""
    ids = request_ids or list(dict.fromkeys(r for rec in trace for r in rec.request_ids))
    arrivals = arrivals or {}
    cells: dict[str, list[str]] = {r: [" "] * len(trace) for r in ids}
    last: dict[str, int] = {}
    for i, rec in enumerate(trace):
        for rid, prefill, _decode in rec.requests:
            if rid in cells:
                cells[rid][i] = "P" if prefill else "D"
                last[rid] = i
    for rid in ids:
        for i in range(arrivals.get(rid, 0), last.get(rid, -1)):
            if cells[rid][i] == " ":
                cells[rid][i] = "."
    return ids, ["".join(cells[r]) for r in ids]


def timeline_text(trace, request_ids: list[str] | None = None,
                  arrivals: dict[str, int] | None = None) -> str:
    """The step timeline as text: one row per request, one column per step."""
    ids, rows = timeline_grid(trace, request_ids, arrivals)
    return "\n".join(f"{rid:>6} {row.rstrip()}" for rid, row in zip(ids, rows, strict=True))
