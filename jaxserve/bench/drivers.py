"""Drivers: run a workload through jaxserve in process or over the socket protocol, and compare
systems side by side. Every driver returns one `RequestMetrics` per request, in workload order,
and the run's duration."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from jaxserve.bench import hf_baselines
from jaxserve.bench.report import summarize
from jaxserve.bench.workload import BenchRequest, progress_bar
from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.serving.client import AsyncClient, ServerError
from jaxserve.testing.oracle import load_hf_model

# Engine counters a run reports as differences between its start and its end:
# {name in the summary: key of metrics_snapshot()}.
_COUNTERS = {"prompt_tokens_computed": "prompt_tokens",  # prefill tokens the steps computed
             "prefix_cache_queries": "prefix_cache_queries",
             "prefix_cache_hits": "prefix_cache_hits",
             "prefix_cache_host_hits": "prefix_cache_host_hits",
             "spec_proposed_tokens": "spec_proposed_tokens",  # speculative decoding
             "spec_accepted_tokens": "spec_accepted_tokens",
             "spec_steps": "spec_steps"}


def run_engine(engine, workload: list[BenchRequest], progress: bool = True,
               on_step: Callable[[int], None] | None = None, concurrency: int | None = None,
               ignore_eos: bool = True):
    """Feed the workload to an LLMEngine in process at its arrival times (or, with
    `concurrency`, closed loop: a new request as soon as fewer than that many are in flight);
    greedy, to max_tokens (or an EOS, unless `ignore_eos`);
    a conversation's next turn arrives when its answer is complete; step until done.
    Returns (metrics per request and turn, in workload order, duration, engine samples: per
    step, and the counters' differences over the run)."""
    pending = sorted(workload, key=lambda r: r.arrival_s)
    by_id = {r.request_id: r for r in workload}
    order = [r.request_id for r in workload]
    results: dict[str, RequestMetrics] = {}
    first_step = engine.metrics.num_steps
    before = engine.metrics_snapshot()
    t0 = time.perf_counter()
    bar = progress_bar(len(workload) + sum(len(r.followups) for r in workload), "requests",
                       progress)
    steps = 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and (engine.num_unfinished_requests < concurrency if concurrency
                           else pending[0].arrival_s <= now):
            r = pending.pop(0)
            arrival = time.perf_counter() if concurrency else t0 + r.arrival_s
            rid = r.request_id
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                    ignore_eos=ignore_eos)
            try:
                engine.add_request(rid, prompt_token_ids=r.prompt_token_ids, params=params,
                                   arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 - refused requests are part of the result
                results[rid] = RequestMetrics(rid, arrival, len(r.prompt_token_ids),
                                              error=f"{type(e).__name__}: {e}")
                bar.update(1)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0].arrival_s - now)) if pending else 0)
            continue
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.metrics
                bar.update(1)
                r = by_id[out.request_id]
                if r.followups and out.metrics.error is None:
                    nxt = r.next_turn(out.outputs[0].token_ids, time.perf_counter() - t0)
                    by_id[nxt.request_id] = nxt
                    order.append(nxt.request_id)
                    pending.insert(0, nxt)
        steps += 1
        if on_step is not None:
            on_step(steps)
    duration = time.perf_counter() - t0
    bar.close()
    m = engine.metrics
    total = engine.block_manager.num_blocks
    after = engine.metrics_snapshot()
    samples = {"running": m.step_running[first_step:],
               "waiting": m.step_waiting[first_step:],
               "kv_usage": [u / total for u in m.step_kv_used[first_step:]],
               **{name: after[key] - before[key] for name, key in _COUNTERS.items()}}
    return [results[rid] for rid in order], duration, samples


def run_server(port: int, workload: list[BenchRequest], host: str = "127.0.0.1",
               concurrency: int | None = None, progress: bool = True):
    """Send the workload over the socket protocol: open loop at arrival times, or closed loop
    with `concurrency` clients each sending one request after another."""
    async def one(client, r: BenchRequest) -> RequestMetrics:
        res = RequestMetrics(r.request_id, time.perf_counter(), len(r.prompt_token_ids))
        try:
            async for f in client.generate_stream(prompt_token_ids=r.prompt_token_ids,
                                                  max_tokens=r.max_tokens, temperature=0,
                                                  ignore_eos=True, request_id=res.request_id):
                now = time.perf_counter()
                if f["type"] == "token":
                    res.token_times.extend([now] * len(f["token_ids"]))
                else:
                    res.finish_reason = f["finish_reason"]
                    res.finished_time = now
        except ServerError as e:
            res.error = str(e)
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
                    out.append(await one(c, queue.pop(0)))
                return out

            parts = await asyncio.gather(*(worker(c) for c in clients))
            for c in clients:
                await c.close()
            by_id = {m.request_id: m for p in parts for m in p}
            return [by_id[r.request_id] for r in workload], time.perf_counter() - t0
        client = await AsyncClient(host, port).connect()

        async def at_arrival(r):
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            return await one(client, r)

        res = await asyncio.gather(*(at_arrival(r) for r in workload))
        await client.close()
        return list(res), time.perf_counter() - t0

    bar = progress_bar(len(workload), "requests", progress)
    try:
        return asyncio.run(main())
    finally:
        bar.close()


SYSTEMS = ("jaxserve", "jaxserve-static", "hf-static", "hf-continuous")


def compare(engine_factory: Callable[[str], Any], workload: list[BenchRequest],
            model_path: str | None, hf_batch: int = 8, progress: bool = True,
            systems: tuple[str, ...] = SYSTEMS, log: Callable[[str], None] = print):
    """Run the same workload through each system in one process.

    `engine_factory(policy)` gives a warmed-up engine. Returns ({system: summary},
    {system: per-request metrics})."""
    out, raw = {}, {}
    for system in systems:
        if system.startswith("hf"):
            try:
                model = load_hf_model(model_path)
            except ImportError as e:
                log(f"{system}: skipped, torch/transformers are missing ({e})")
                continue
            if system == "hf-static":
                res, dur = hf_baselines.run_static(model, workload, hf_batch, progress)
            else:
                res, dur = hf_baselines.run_continuous(model, workload, progress)
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
