"""Reports: the summary of a run (throughput, latency percentiles, engine samples), the table,
and the JSON record with the environment and configuration that made it.

A tokens/s figure means little without the arrival rate, the length distributions and latency
percentiles, so every summary carries all of them together with the configuration.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from typing import Any

import numpy as np

from jaxserve.bench.workload import BenchRequest
from jaxserve.core.outputs import RequestMetrics


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[RequestMetrics], duration_s: float, workload: list[BenchRequest],
              samples: dict[str, list[float]] | None = None) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    span = max(r.arrival_s for r in workload) if workload else 0.0
    out: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(done),
        "rejections": len(results) - len(done),
        "duration_s": duration_s,
        "offered_req_per_s": len(workload) / span if span > 0 else None,
        "admitted_req_per_s": len(done) / duration_s,
        "completed_req_per_s": len(done) / duration_s,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
        "preemptions": sum(r.num_preemptions for r in done),
    }
    out["prompt_tok_per_s"] = out["prompt_tokens"] / duration_s
    out["output_tok_per_s"] = out["output_tokens"] / duration_s
    series = {"ttft": [r.ttft for r in done if r.ttft is not None],
              "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [x for r in done for x in r.itl],
              "e2e": [r.e2e for r in done if r.e2e is not None],
              "queue": [r.queue_time for r in done if r.queue_time is not None]}
    for name, vals in series.items():
        out[f"{name}_mean_s"] = float(np.mean(vals)) if vals else None
        for q in (50, 95, 99):
            out[f"{name}_p{q}_s"] = _pct(vals, q)
    if samples:
        out["engine_steps"] = len(samples["running"])
    for key, vals in (samples or {}).items():
        if not isinstance(vals, list):  # a counter over the run
            out[key] = vals
            continue
        out[f"mean_{key}"] = float(np.mean(vals)) if vals else None
        out[f"peak_{key}"] = float(np.max(vals)) if vals else None
    if samples and "prefix_cache_queries" in samples:
        q = samples["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = samples["prefix_cache_hits"] / q if q else 0.0
    if samples and samples.get("spec_proposed_tokens"):
        out["spec_acceptance_rate"] = (samples["spec_accepted_tokens"]
                                       / samples["spec_proposed_tokens"])
    return out


def slo_attainment(results: list[RequestMetrics], ttft_s: float, tpot_s: float) -> float:
    """DistServe's goodput measure: the share of requests (refused ones count as misses) whose
    TTFT is within `ttft_s` and whose TPOT (when it has one) is within `tpot_s`."""
    met = sum(r.error is None and r.ttft is not None and r.ttft <= ttft_s
              and (r.tpot is None or r.tpot <= tpot_s) for r in results)
    return met / len(results) if results else 0.0


def max_goodput_rate(points: list[tuple[float, float]], share: float = 0.9) -> float | None:
    """The highest offered rate at which the attainment stays at or above `share` at that rate
    and at every lower rate tried ((rate, attainment) pairs); None if even the lowest misses."""
    best = None
    for rate, attained in sorted(points):
        if attained < share:
            break
        best = rate
    return best


_TABLE_ROWS = [("completed req/s", "completed_req_per_s", 1), ("output tok/s", "output_tok_per_s",
                                                                  1),
               ("prompt tok/s", "prompt_tok_per_s", 1), ("TTFT p50 (s)", "ttft_p50_s", 1),
               ("TTFT p99 (s)", "ttft_p99_s", 1), ("TPOT p50 (ms)", "tpot_p50_s", 1e3),
               ("TPOT p99 (ms)", "tpot_p99_s", 1e3), ("ITL p99 (ms)", "itl_p99_s", 1e3),
               ("E2E p50 (s)", "e2e_p50_s", 1), ("E2E p99 (s)", "e2e_p99_s", 1),
               ("queue p50 (s)", "queue_p50_s", 1), ("mean running", "mean_running", 1),
               ("mean waiting", "mean_waiting", 1), ("mean KV usage", "mean_kv_usage", 1),
               ("peak KV usage", "peak_kv_usage", 1), ("preemptions", "preemptions", 1),
               ("rejections", "rejections", 1), ("engine steps", "engine_steps", 1),
               ("prefill computed", "prompt_tokens_computed", 1),
               ("prefix hit rate", "prefix_cache_hit_rate", 1),
               ("prefix hits (tok)", "prefix_cache_hits", 1),
               ("host-tier hits", "prefix_cache_host_hits", 1),
               ("spec proposed (tok)", "spec_proposed_tokens", 1),
               ("spec accepted (tok)", "spec_accepted_tokens", 1),
               ("spec acceptance", "spec_acceptance_rate", 1),
               ("spec steps", "spec_steps", 1),
               ("tok/s vs jaxserve", "throughput_ratio_vs_jaxserve", 1),
               ("SLO attainment", "slo_attainment", 1)]


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    width = max(14, *(len(n) + 2 for n in names))
    lines = ["metric".ljust(20) + "".join(n.rjust(width) for n in names)]
    for label, key, scale in _TABLE_ROWS:
        if not any(s.get(key) is not None for s in summaries.values()):
            continue
        cells = []
        for n in names:
            v = summaries[n].get(key)
            cells.append(("-" if v is None else f"{v * scale:.3f}").rjust(width))
        lines.append(label.ljust(20) + "".join(cells))
    return "\n".join(lines)


def environment(engine=None) -> dict[str, Any]:
    import jax

    env = {"python": platform.python_version(), "jax": jax.__version__,
           "device": str(jax.devices()[0]), "platform": jax.default_backend(),
           "machine": platform.machine()}
    if engine is not None:
        env |= {"model": engine.loaded.path, "dtype": str(np.dtype(engine.runner.dtype)),
                "engine_config": {k: v for k, v in dataclasses.asdict(engine.config).items()},
                "attention_backend": engine.runner.attention_backend,
                "num_kv_blocks": engine.runner.num_blocks}
    return env


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
