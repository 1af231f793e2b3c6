"""PNG plots of a benchmark: the step timeline, latency distributions, sweep curves.

matplotlib is the `bench` extra (`pip install -e '.[bench]'`); the library and the server do not
need it, and without it the bench prints its figures and says the plots were skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.bench.timeline import timeline_grid
from jaxserve.core.outputs import RequestMetrics


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or PlotsUnavailable saying what to
    install."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install -e '.[bench]' "
                               "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(trace, path: str, max_num_seqs: int, request_ids: list[str] | None = None,
                  title: str = "step timeline") -> None:
    """PNG of the timeline for `request_ids` (default all); the bottom row counts, for every
    step, the sequence slots left idle (from the whole trace, not only the rows shown)."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    ids, rows = timeline_grid(trace, request_ids)
    code = {" ": 0, "D": 1, "P": 2, ".": 3}
    grid = np.array([[code[c] for c in row] for row in rows] + [[0] * len(trace)], float)
    idle = [max_num_seqs - len(rec.requests) for rec in trace]
    grid[-1] = [4 if n else 0 for n in idle]
    fig, ax = plt.subplots(figsize=(min(16, max(7, 2 + len(trace) * 0.25)), 1.5 + len(ids) * 0.25))
    ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=4,
              cmap=ListedColormap(["white", "tab:blue", "tab:orange", "gainsboro", "dimgray"]))
    if len(trace) <= 80:
        for j, n in enumerate(idle):
            if n:
                ax.text(j, len(ids), str(n), ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(len(ids) + 1), labels=ids + ["idle slots"])
    ax.set_xlabel("step (orange prefill, blue decode, light gray waiting; bottom: free seq slots)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [p["summary"]["tpot_p99_s"] * 1e3 for p in points]
    ys = [p["summary"]["output_tok_per_s"] for p in points]
    ax.plot(xs, ys, "o-")
    for x, y, p in zip(xs, ys, points, strict=True):
        ax.annotate(",".join(f"{k}={v}" for k, v in p["params"].items()), (x, y), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("TPOT p99 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs tail time per output token")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_distributions(results: dict[str, list[RequestMetrics]], path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        ttft = [r.ttft for r in res if r.ttft is not None]
        tpot = [r.tpot * 1e3 for r in res if r.tpot is not None]
        axes[0].hist(ttft, bins=30, alpha=0.5, label=name)
        axes[1].hist(tpot, bins=30, alpha=0.5, label=name)
    axes[0].set_xlabel("TTFT (s)")
    axes[1].set_xlabel("TPOT (ms)")
    for ax in axes:
        ax.set_ylabel("requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
