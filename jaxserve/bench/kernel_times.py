"""Device time per kernel from an XLA profiler trace (jax.profiler with a Perfetto trace)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os


def perfetto_file(log_dir: str) -> str | None:
    """The newest perfetto_trace.json.gz under a profiler log directory."""
    found = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    return max(found, key=os.path.getmtime) if found else None


def kernel_table(path: str, calls: int) -> dict:
    """Per kernel name on the device lanes: launches and microseconds per call of the traced
    program (`calls` of it ran), busiest first; and the device's busy time per call."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and "/device:" in str(e.get("args", {}).get("name", ""))}
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in lanes:
            s = stats[e["name"]]
            s[0] += 1
            s[1] += float(e.get("dur", 0.0))
    rows = sorted(((n, c / calls, us / calls) for n, (c, us) in stats.items()),
                  key=lambda r: -r[2])
    return {"busy_us": sum(r[2] for r in rows), "launches": sum(r[1] for r in rows),
            "kernels": [{"name": n, "launches": c, "us": us} for n, c, us in rows]}


def describe(table: dict, top: int = 25) -> list[str]:
    lines = [f"device busy {table['busy_us']:.1f} us per call over "
             f"{table['launches']:.0f} launches"]
    lines += [f"{k['us']:9.1f} us {k['launches']:6.1f}x  {k['name'][:90]}"
              for k in table["kernels"][:top]]
    return lines
