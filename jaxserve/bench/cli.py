"""Benchmark jaxserve with the full serving metric set.

    python scripts/bench.py --num-requests 64 --output-len longtail:32:256           # in process
    python scripts/bench.py --compare                     # + static batching and HF baselines
    python scripts/bench.py --compare --rate 8            # arrivals: Poisson at 8 req/s
    python scripts/bench.py --sweep max_num_seqs=4,8,16 --sweep rate=2,4              # curves
    python scripts/bench.py --server 127.0.0.1:7070 --concurrency 8          # a running server
    python scripts/bench.py --server 127.0.0.1:7070 --sweep rate=0.1,0.2,0.4 \
        --goodput-ttft-s 4 --goodput-tpot-s 0.2        # goodput: the best rate keeping 90%
    python scripts/bench.py --profile-dir traces --profile-steps 20        # XLA profiler trace

Prefix-caching workloads (run each with and without --no-prefix-caching):

    python scripts/bench.py --shared-prefix-len 512 --prompt-len fixed:544 --output-len fixed:32
    python scripts/bench.py --shared-prefix-len 768 --prefix-groups 4 --prompt-len uniform:800:900
    python scripts/bench.py --num-requests 16 --turns 8 --prompt-len uniform:64:128 \
        --output-len fixed:32                                          # multi-turn chat

Prints a table and writes OUT_DIR/bench.json (every figure plus the full configuration) and PNG
plots (sweep curve, TTFT/TPOT distributions, step timeline) when matplotlib is installed.
Workload and engine options are the fields of WorkloadConfig and EngineConfig, with their
defaults: the engine runs as a user's `LLM()` would unless a flag says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from typing import Any

from jaxserve.bench import drivers, plots, report, roofline
from jaxserve.bench.workload import WorkloadConfig, make_workload
from jaxserve.config import EngineConfig, add_options, from_options
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.profiling import StepWindowProfiler, start_profiler_server
from jaxserve.models.loader import load_model

# The workload's seed has the --seed flag; the engine's seed only matters for sampled requests,
# and the bench's requests are greedy.
_ENGINE_SKIP = ("seed", "enable_step_trace")


def parse_args(argv=None, prog: str = "bench.py") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    add_options(ap.add_argument_group("workload"), WorkloadConfig)
    e = ap.add_argument_group("engine")
    add_options(e, EngineConfig, skip=_ENGINE_SKIP)
    e.add_argument("--no-warmup", action="store_true",
                   help="skip compiling every bucket before the timed run")
    r = ap.add_argument_group("run")
    r.add_argument("--compare", action="store_true",
                   help="also run jaxserve static batching, HF generate (static batches) and "
                        "HF continuous batching on the same workload")
    r.add_argument("--hf-batch", type=int, default=8, help="HF generate batch size")
    r.add_argument("--sweep", action="append", default=[],
                   help="name=v1,v2 over engine fields or 'rate'; repeat for a grid")
    r.add_argument("--server", default=None, help="HOST:PORT of a running serve.py")
    r.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: this many requests in flight (clients, with --server)")
    r.add_argument("--out-dir", default="bench-out", help="where bench.json and plots go")
    r.add_argument("--profile-dir", default=None,
                   help="write an XLA profiler trace of --profile-steps engine steps here")
    r.add_argument("--profile-steps", type=int, default=20)
    r.add_argument("--profiler-port", type=int, default=None,
                   help="start a jax.profiler server on this port for live capture")
    r.add_argument("--timeline-requests", type=int, default=12,
                   help="requests shown in the step timeline plot")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--goodput-ttft-s", type=float, default=None,
                   help="goodput mode (with --goodput-tpot-s): report the share of requests "
                        "within both targets, and over a rate sweep the highest rate keeping "
                        "90 percent of them")
    r.add_argument("--goodput-tpot-s", type=float, default=None,
                   help="goodput mode: the TPOT target")
    return ap.parse_args(argv)


def parse_sweep(specs: list[str]) -> list[dict[str, Any]]:
    """["max_num_seqs=4,8", "rate=1,2"] -> the cartesian product as dicts."""
    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if not values:
            raise ValueError(f"--sweep {spec!r}: expected name=v1,v2,...")
        axes.append([(name, float(v) if "." in v else int(v)) for v in values.split(",")])
    return [dict(p) for p in itertools.product(*axes)]


def _plot(fn, *args) -> None:
    try:
        fn(*args)
    except plots.PlotsUnavailable as e:
        print(f"plots skipped: {e}", file=sys.stderr)


def main(argv=None, prog: str = "bench.py") -> int:
    """`prog`: the command's name in its help and errors."""
    args = parse_args(argv, prog)
    os.makedirs(args.out_dir, exist_ok=True)
    progress = not args.no_progress
    if args.profiler_port:
        start_profiler_server(args.profiler_port)
    wcfg = from_options(WorkloadConfig, args)
    if wcfg.turns > 1 and (args.server or args.compare):
        raise SystemExit("--turns > 1 runs in process only (the next turn needs the answer): "
                         "drop --server/--compare")
    if args.data_parallel_size > 1 and not args.server:
        raise SystemExit("--data-parallel-size > 1 runs behind a front: start scripts/serve.py "
                         "with it and bench it with --server")
    slo = (args.goodput_ttft_s, args.goodput_tpot_s)
    if (slo[0] is None) != (slo[1] is None) or any(t is not None and t <= 0 for t in slo):
        raise SystemExit("--goodput-ttft-s and --goodput-tpot-s: give both, positive")
    if args.server and args.sweep and any(set(p) - {"rate"} for p in parse_sweep(args.sweep)):
        raise SystemExit("--sweep against --server: only rate=... (the engine runs elsewhere)")

    def summarize(res, dur, workload, samples=None):
        out = report.summarize(res, dur, workload, samples)
        if slo[0] is not None:
            out["slo_attainment"] = report.slo_attainment(res, *slo)
        return out

    loaded = None if args.server else load_model(args.model)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}

    def engine_factory(policy: str | None = None, **overrides):
        kw = {k: v for k, v in overrides.items() if k in engine_fields}
        if policy:
            kw["scheduling_policy"] = policy
        engine = LLMEngine(from_options(EngineConfig, args, enable_step_trace=True, **kw),
                           loaded=loaded)
        if not args.no_warmup:
            engine.warmup()
        return engine

    out = lambda name: os.path.join(args.out_dir, name)
    payload = {"workload": dataclasses.asdict(wcfg), "args": vars(args)}
    if args.server:
        host, _, port = args.server.rpartition(":")
        points = []
        for i, params in enumerate(parse_sweep(args.sweep) if args.sweep else [{}]):
            # new prompts for every point: the server's prefix cache keeps the last point's
            w = dataclasses.replace(wcfg, seed=wcfg.seed + i, **params)
            workload = make_workload(w, vocab_size=49152)
            res, dur = drivers.run_server(int(port), workload, host or "127.0.0.1",
                                          args.concurrency, progress)
            points.append({"params": params, "summary": summarize(res, dur, workload)})
        payload |= {"environment": report.environment(), "summary": points[-1]["summary"],
                    "sweep": points}
        print(report.format_table({",".join(f"{k}={v}" for k, v in p["params"].items())
                                   or "server": p["summary"] for p in points}))
        if slo[0] is not None and args.sweep:
            best = report.max_goodput_rate([(p["params"]["rate"],
                                             p["summary"]["slo_attainment"]) for p in points])
            payload["max_goodput_rate"] = best
            print(f"highest rate with 90% of requests within TTFT {slo[0]} s and TPOT "
                  f"{slo[1]} s: {best} req/s")
    elif args.sweep:
        points = []
        for params in parse_sweep(args.sweep):
            w = dataclasses.replace(wcfg, **{k: v for k, v in params.items()
                                             if k in WorkloadConfig.__dataclass_fields__})
            engine = engine_factory(**params)
            workload = make_workload(w, engine.model_config.vocab_size)
            res, dur, samples = drivers.run_engine(engine, workload, progress)
            points.append({"params": params,
                           "summary": summarize(res, dur, workload, samples)})
            print(params, f"{points[-1]['summary']['output_tok_per_s']:.1f} tok/s, TPOT p99 "
                          f"{points[-1]['summary']['tpot_p99_s'] * 1e3:.1f} ms")
        payload |= {"environment": report.environment(engine), "sweep": points}
        _plot(plots.plot_sweep, points, out("sweep.png"))
        print(report.format_table({",".join(f"{k}={v}" for k, v in p["params"].items()):
                                   p["summary"] for p in points}))
    else:
        engine = engine_factory()
        workload = make_workload(wcfg, engine.model_config.vocab_size)
        if args.compare:
            summaries, raw = drivers.compare(
                lambda p: engine if p == "fcfs" else engine_factory(p), workload,
                args.model, args.hf_batch, progress)
            _plot(plots.plot_distributions, raw, out("latency.png"))
        else:
            profiler = (StepWindowProfiler(args.profile_dir, args.profile_steps)
                        if args.profile_dir else None)
            res, dur, samples = drivers.run_engine(
                engine, workload, progress, on_step=profiler.on_step if profiler else None,
                concurrency=args.concurrency)
            if profiler:
                profiler.stop()
            summaries = {"jaxserve": summarize(res, dur, workload, samples)}
            _plot(plots.plot_distributions, {"jaxserve": res}, out("latency.png"))
        shown = [r.request_id for r in workload[:args.timeline_requests]]
        _plot(plots.plot_timeline, engine.step_trace[:200], out("timeline.png"),
              engine.config.max_num_seqs, shown)
        floor = roofline.decode_vs_floor(engine)
        payload |= {"environment": report.environment(engine), "summaries": summaries,
                    "decode_floor": floor}
        print(report.format_table(summaries))
        print(roofline.format_floor(floor))
    report.write_json(out("bench.json"), payload)
    print(f"wrote {out('bench.json')}")
    return 0
