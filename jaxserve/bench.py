"""Benchmark harness: seeded workloads, runners (in process, over the socket, HF baselines),
the full metric set, side-by-side comparison, sweeps, plots and a step timeline.

A tokens/s figure means little without the arrival rate, the length distributions and latency
percentiles, so every summary carries all of them together with the configuration that made it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 64
    rate: float | None = None  # offered requests/s (Poisson arrivals); None: all at once
    prompt_len: str = "uniform:16:128"  # fixed:N | uniform:A:B | longtail:MEDIAN:MAX
    output_len: str = "longtail:32:256"
    shared_prefix_len: int = 0  # tokens every prompt starts with
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int


def _lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    kind, *args = spec.split(":")
    vals = [int(a) for a in args]
    if kind == "fixed" and len(vals) == 1:
        out = np.full(n, vals[0])
    elif kind == "uniform" and len(vals) == 2:
        out = rng.integers(vals[0], vals[1] + 1, n)
    elif kind == "longtail" and len(vals) == 2:
        # Lognormal with the given median, heavy right tail, capped at MAX.
        out = np.minimum(rng.lognormal(math.log(vals[0]), 0.9, n), vals[1])
    else:
        raise ValueError(f"length spec {spec!r}: expected fixed:N, uniform:A:B or "
                         f"longtail:MEDIAN:MAX")
    return [max(1, int(x)) for x in out]


def make_workload(cfg: WorkloadConfig, vocab_size: int) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    prompts = _lengths(cfg.prompt_len, cfg.num_requests, rng)
    outputs = _lengths(cfg.output_len, cfg.num_requests, rng)
    if cfg.rate:
        arrivals = np.cumsum(rng.exponential(1.0 / cfg.rate, cfg.num_requests))
        arrivals -= arrivals[0]
    else:
        arrivals = np.zeros(cfg.num_requests)
    # Ordinary token ids, away from the special tokens at both ends of most vocabularies.
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    prefix = rng.integers(lo, hi, cfg.shared_prefix_len).tolist()
    reqs = []
    for i in range(cfg.num_requests):
        own = rng.integers(lo, hi, max(1, prompts[i] - len(prefix))).tolist()
        reqs.append(BenchRequest(i, float(arrivals[i]), prefix + own, outputs[i]))
    return reqs


# ---------------------------------------------------------------------------------- results


@dataclasses.dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    output_tokens: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    rejected: str | None = None  # the error, if the request was refused

    @property
    def tpot(self) -> float | None:
        return sum(self.itl) / len(self.itl) if self.itl else None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[RequestResult], duration_s: float, workload: list[BenchRequest],
              samples: dict[str, list[float]] | None = None) -> dict[str, Any]:
    done = [r for r in results if r.rejected is None]
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
        "preemptions": sum(r.preemptions for r in done),
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
        out[f"mean_{key}"] = float(np.mean(vals)) if vals else None
        out[f"peak_{key}"] = float(np.max(vals)) if vals else None
    return out


# ---------------------------------------------------------------------------- jaxserve runs


def run_engine(engine, workload: list[BenchRequest], progress: bool = True,
               on_step: Callable[[int], None] | None = None, concurrency: int | None = None):
    """Feed the workload to an LLMEngine in process at its arrival times (or, with
    `concurrency`, closed loop: a new request as soon as fewer than that many are in flight);
    step until done."""
    from tqdm.auto import tqdm

    from jaxserve.sampling_params import SamplingParams

    pending = sorted(workload, key=lambda r: r.arrival_s)
    results: dict[str, RequestResult] = {}
    start_finished = len(engine.metrics.finished)
    first_step = engine.metrics.num_steps
    t0 = time.perf_counter()
    bar = tqdm(total=len(workload), desc="requests", unit="req", disable=not progress)
    steps = 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and (engine.num_unfinished_requests < concurrency if concurrency
                           else pending[0].arrival_s <= now):
            r = pending.pop(0)
            arrival = time.perf_counter() if concurrency else t0 + r.arrival_s
            rid = f"bench-{r.index}"
            results[rid] = RequestResult(r.index, len(r.prompt_token_ids))
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            try:
                engine.add_request(rid, prompt_token_ids=r.prompt_token_ids, params=params,
                                   arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 - refused requests are part of the result
                results[rid].rejected = f"{type(e).__name__}: {e}"
                bar.update(1)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0].arrival_s - now)) if pending else 0)
            continue
        for out in engine.step():
            if out.finished:
                bar.update(1)
        steps += 1
        if on_step is not None:
            on_step(steps)
    duration = time.perf_counter() - t0
    bar.close()
    for st in engine.metrics.finished[start_finished:]:
        res = results.get(st.request_id)
        if res is None:
            continue
        res.output_tokens, res.queue_time, res.ttft = st.output_tokens, st.queue_time, st.ttft
        res.itl, res.e2e, res.preemptions = st.itl, st.e2e, st.num_preemptions
        res.finish_reason = st.finish_reason
    m = engine.metrics
    total = engine.block_manager.num_blocks
    samples = {"running": m.step_running[first_step:],
               "waiting": m.step_waiting[first_step:],
               "kv_usage": [u / total for u in m.step_kv_used[first_step:]]}
    return list(results.values()), duration, samples


def run_server(port: int, workload: list[BenchRequest], host: str = "127.0.0.1",
               concurrency: int | None = None, progress: bool = True):
    """Send the workload over the socket protocol: open loop at arrival times, or closed loop
    with `concurrency` clients each sending one request after another."""
    from tqdm.auto import tqdm

    from jaxserve.client import AsyncClient, ServerError

    async def one(client, r: BenchRequest, t0: float) -> RequestResult:
        res = RequestResult(r.index, len(r.prompt_token_ids))
        sent = time.perf_counter()
        last = None
        try:
            async for f in client.generate_stream(prompt_token_ids=r.prompt_token_ids,
                                                  max_tokens=r.max_tokens, temperature=0,
                                                  ignore_eos=True, request_id=f"b{r.index}"):
                now = time.perf_counter()
                if f["type"] == "token":
                    if last is None:
                        res.ttft = now - sent
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_tokens += len(f["token_ids"])
                else:
                    res.finish_reason = f["finish_reason"]
                    res.e2e = now - sent
        except ServerError as e:
            res.rejected = str(e)
        bar.update(1)
        return res

    async def main():
        t0 = time.perf_counter()
        if concurrency:
            queue = list(workload)
            clients = [await AsyncClient(host, port).connect() for _ in range(concurrency)]

            async def worker(c):
                out = []
                while queue:
                    out.append(await one(c, queue.pop(0), t0))
                return out

            parts = await asyncio.gather(*(worker(c) for c in clients))
            for c in clients:
                await c.close()
            return [r for p in parts for r in p], time.perf_counter() - t0
        client = await AsyncClient(host, port).connect()

        async def at_arrival(r):
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            return await one(client, r, t0)

        res = await asyncio.gather(*(at_arrival(r) for r in workload))
        await client.close()
        return list(res), time.perf_counter() - t0

    bar = tqdm(total=len(workload), desc="requests", unit="req", disable=not progress)
    try:
        return asyncio.run(main())
    finally:
        bar.close()


# -------------------------------------------------------------------------------- HF baselines


class _TimingStreamer:
    """A transformers streamer that only records when each generation step emits tokens."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load_hf_model(model_path: str | None):
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from models.loader import default_model_path

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf_static(model, workload: list[BenchRequest], batch_size: int = 8,
                  progress: bool = True):
    """HF `generate` in static batches of arrival order: a batch starts when its last member
    has arrived and the previous batch is done, and runs until its longest member finishes."""
    import torch
    from tqdm.auto import tqdm

    reqs = sorted(workload, key=lambda r: r.arrival_s)
    results = []
    bar = tqdm(total=len(reqs), desc="hf static", unit="req", disable=not progress)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        wait = t0 + max(r.arrival_s for r in batch) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in batch)
        streamer = _TimingStreamer()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, streamer=streamer)
        for r in batch:
            times = streamer.times[:r.max_tokens]  # its own tokens; the rest is batch waste
            arrival = t0 + r.arrival_s
            results.append(RequestResult(
                r.index, len(r.prompt_token_ids), output_tokens=len(times),
                queue_time=started - arrival, ttft=times[0] - arrival,
                itl=[b - a for a, b in itertools.pairwise(times)],
                e2e=streamer.times[-1] - arrival,  # answered when the batch returns
                finish_reason="length"))
        bar.update(len(batch))
    bar.close()
    return results, time.perf_counter() - t0


def run_hf_continuous(model, workload: list[BenchRequest], progress: bool = True):
    """HF transformers' own continuous batching (the manager behind `generate_batch`), with
    each request's own max_new_tokens and its arrival time."""
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(r.max_tokens for r in workload), do_sample=False,
                          eos_token_id=-1, pad_token_id=0)
    pending = sorted(workload, key=lambda r: r.arrival_s)
    done: dict[str, Any] = {}
    sent: dict[str, float] = {}
    bar = tqdm(total=len(workload), desc="hf continuous", unit="req", disable=not progress)
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=10,
                                                   warmup=False) as manager:
        # The manager's thread takes seconds to start serving; wait for one tiny request so
        # that start-up is not billed to the workload.
        manager.add_request(workload[0].prompt_token_ids, request_id="warmup", max_new_tokens=1,
                            eos_token_id=-1)
        while (out := manager.get_result(timeout=1)) is None or not out.is_finished():
            if not manager.is_running():
                raise RuntimeError("HF continuous batching manager stopped")
        t0 = time.perf_counter()
        while len(done) < len(workload):
            now = time.perf_counter()
            while pending and t0 + pending[0].arrival_s <= now:
                r = pending.pop(0)
                manager.add_request(r.prompt_token_ids, request_id=f"r{r.index}",
                                    max_new_tokens=r.max_tokens, record_timestamps=True,
                                    eos_token_id=-1)
                sent[f"r{r.index}"] = t0 + r.arrival_s
            out = manager.get_result(timeout=0.01)
            if out is not None and out.is_finished():
                done[out.request_id] = out
                bar.update(1)
            elif not manager.is_running():
                raise RuntimeError("HF continuous batching manager stopped")
        duration = time.perf_counter() - t0
    bar.close()
    results = []
    for r in workload:
        out = done[f"r{r.index}"]
        times = out.timestamps or []
        arrival = sent[f"r{r.index}"]
        results.append(RequestResult(
            r.index, len(r.prompt_token_ids), output_tokens=len(out.generated_tokens),
            queue_time=(out.lifespan[0] - arrival) if out.lifespan[0] > 0 else None,
            ttft=times[0] - arrival if times else None,
            itl=[b - a for a, b in itertools.pairwise(times)],
            e2e=(times[-1] - arrival) if times else None,
            finish_reason="length" if out.error is None else out.error))
    return results, duration


# -------------------------------------------------------------------------------- comparison

SYSTEMS = ("jaxserve", "jaxserve-static", "hf-static", "hf-continuous")


def compare(engine_factory: Callable[[str], Any], workload: list[BenchRequest],
            model_path: str | None, hf_batch: int = 8, progress: bool = True,
            systems: tuple[str, ...] = SYSTEMS, log: Callable[[str], None] = print):
    """Run the same workload through each system in one process.

    Returns ({system: summary}, {system: per-request results})."""
    out, raw = {}, {}
    for system in systems:
        if system.startswith("hf"):
            try:
                model = load_hf_model(model_path)
            except ImportError as e:
                log(f"{system}: skipped, torch/transformers are missing ({e})")
                continue
            if system == "hf-static":
                res, dur = run_hf_static(model, workload, hf_batch, progress)
            else:
                res, dur = run_hf_continuous(model, workload, progress)
            out[system], raw[system] = summarize(res, dur, workload), res
        else:
            engine = engine_factory("static" if system == "jaxserve-static" else "fcfs")
            res, dur, samples = run_engine(engine, workload, progress)
            out[system], raw[system] = summarize(res, dur, workload, samples), res
    base = out.get("jaxserve")
    if base:
        for s in out.values():
            s["throughput_ratio_vs_jaxserve"] = (s["output_tok_per_s"] / base["output_tok_per_s"]
                                                 if base["output_tok_per_s"] else None)
    return out, raw


# ------------------------------------------------------------------------------------ sweeps


def parse_sweep(specs: list[str]) -> list[dict[str, Any]]:
    """["max_num_seqs=4,8", "rate=1,2"] -> the cartesian product as dicts."""
    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if not values:
            raise ValueError(f"--sweep {spec!r}: expected name=v1,v2,...")
        axes.append([(name, float(v) if "." in v else int(v)) for v in values.split(",")])
    return [dict(p) for p in itertools.product(*axes)]


# ------------------------------------------------------------------------------------- output

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
               ("tok/s vs jaxserve", "throughput_ratio_vs_jaxserve", 1)]


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


# ------------------------------------------------------------------------------------- plots


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


def plot_timeline(trace, path: str, max_num_seqs: int, request_ids: list[str] | None = None,
                  title: str = "step timeline") -> None:
    """PNG of the timeline for `request_ids` (default all); the bottom row counts, for every
    step, the sequence slots left idle (from the whole trace, not only the rows shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def plot_distributions(results: dict[str, list[RequestResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
