"""Benchmark jaxserve with the full serving metric set (logic in jaxserve/bench.py).

    python scripts/bench.py --num-requests 64 --output-len longtail:32:256           # in process
    python scripts/bench.py --compare                     # + static batching and HF baselines
    python scripts/bench.py --sweep max_num_seqs=4,8,16 --sweep rate=2,4              # curves
    python scripts/bench.py --server 127.0.0.1:7070 --concurrency 8          # a running server
    python scripts/bench.py --profile-dir traces --profile-steps 20        # XLA profiler trace

Prints a table and writes OUT_DIR/bench.json (every figure plus the full configuration) and PNG
plots (sweep curve, TTFT/TPOT distributions, step timeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import bench  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    w = ap.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--rate", type=float, default=None, help="offered req/s (default: all at once)")
    w.add_argument("--prompt-len", default="uniform:16:128")
    w.add_argument("--output-len", default="longtail:32:256")
    w.add_argument("--shared-prefix-len", type=int, default=0)
    w.add_argument("--seed", type=int, default=0)
    e = ap.add_argument_group("engine")
    e.add_argument("--model", default=None)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--max-num-seqs", type=int, default=32)
    e.add_argument("--max-num-batched-tokens", type=int, default=256)
    e.add_argument("--max-model-len", type=int, default=512)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--scheduling-policy", default="fcfs")
    e.add_argument("--attention-backend", default="auto")
    e.add_argument("--preemption-mode", default="recompute")
    e.add_argument("--no-warmup", action="store_true")
    r = ap.add_argument_group("run")
    r.add_argument("--compare", action="store_true",
                   help="also run jaxserve static batching, HF generate (static batches) and "
                        "HF continuous batching on the same workload")
    r.add_argument("--hf-batch", type=int, default=8)
    r.add_argument("--sweep", action="append", default=[],
                   help="name=v1,v2 over engine fields or 'rate'; repeat for a grid")
    r.add_argument("--server", default=None, help="HOST:PORT of a running serve.py")
    r.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: this many requests in flight (clients, with --server)")
    r.add_argument("--out-dir", default="bench-out")
    r.add_argument("--profile-dir", default=None)
    r.add_argument("--profile-steps", type=int, default=20)
    r.add_argument("--profiler-port", type=int, default=None)
    r.add_argument("--timeline-requests", type=int, default=12,
                   help="requests shown in the step timeline plot")
    r.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


ENGINE_KEYS = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "num_kv_blocks", "scheduling_policy", "attention_backend", "preemption_mode")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    progress = not args.no_progress
    import jax

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.profiling import StepWindowProfiler, start_profiler_server
    from models.loader import load_model

    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla"))
    if args.profiler_port:
        start_profiler_server(args.profiler_port)
    wcfg = bench.WorkloadConfig(args.num_requests, args.rate, args.prompt_len, args.output_len,
                                args.shared_prefix_len, args.seed)
    loaded = None if args.server else load_model(args.model)

    def engine_factory(policy: str | None = None, **overrides):
        kw = {k: getattr(args, k) for k in ENGINE_KEYS} | {"enable_step_trace": True}
        if policy:
            kw["scheduling_policy"] = policy
        kw |= {k: v for k, v in overrides.items() if k in EngineConfig.__dataclass_fields__}
        engine = LLMEngine(EngineConfig(**kw), loaded=loaded)
        if not args.no_warmup:
            engine.warmup()
        return engine

    payload = {"workload": dataclasses.asdict(wcfg), "args": vars(args)}
    if args.server:
        host, _, port = args.server.rpartition(":")
        workload = bench.make_workload(wcfg, vocab_size=49152)
        res, dur = bench.run_server(int(port), workload, host or "127.0.0.1", args.concurrency,
                                    progress)
        summary = bench.summarize(res, dur, workload)
        payload |= {"environment": bench.environment(), "summary": summary}
        print(bench.format_table({"server": summary}))
    elif args.sweep:
        points = []
        for params in bench.parse_sweep(args.sweep):
            w = dataclasses.replace(wcfg, **{k: v for k, v in params.items()
                                             if k in bench.WorkloadConfig.__dataclass_fields__})
            engine = engine_factory(**params)
            workload = bench.make_workload(w, engine.model_config.vocab_size)
            res, dur, samples = bench.run_engine(engine, workload, progress)
            points.append({"params": params, "summary": bench.summarize(res, dur, workload,
                                                                        samples)})
            print(params, f"{points[-1]['summary']['output_tok_per_s']:.1f} tok/s, TPOT p99 "
                          f"{points[-1]['summary']['tpot_p99_s'] * 1e3:.1f} ms")
        payload |= {"environment": bench.environment(engine), "sweep": points}
        bench.plot_sweep(points, os.path.join(args.out_dir, "sweep.png"))
        print(bench.format_table({",".join(f"{k}={v}" for k, v in p["params"].items()):
                                  p["summary"] for p in points}))
    else:
        engine = engine_factory()
        workload = bench.make_workload(wcfg, engine.model_config.vocab_size)
        if args.compare:
            summaries, raw = bench.compare(
                lambda policy: engine if policy == "fcfs" else engine_factory(policy), workload,
                args.model, args.hf_batch, progress)
            bench.plot_distributions(raw, os.path.join(args.out_dir, "latency.png"))
        else:
            profiler = (StepWindowProfiler(args.profile_dir, args.profile_steps)
                        if args.profile_dir else None)
            res, dur, samples = bench.run_engine(
                engine, workload, progress, on_step=profiler.on_step if profiler else None,
                concurrency=args.concurrency)
            if profiler:
                profiler.stop()
            summaries = {"jaxserve": bench.summarize(res, dur, workload, samples)}
            bench.plot_distributions({"jaxserve": res},
                                     os.path.join(args.out_dir, "latency.png"))
        shown = [f"bench-{i}" for i in range(min(args.timeline_requests, len(workload)))]
        bench.plot_timeline(engine.step_trace[:200], os.path.join(args.out_dir, "timeline.png"),
                            engine.config.max_num_seqs, shown)
        payload |= {"environment": bench.environment(engine), "summaries": summaries}
        print(bench.format_table(summaries))
    bench.write_json(os.path.join(args.out_dir, "bench.json"), payload)
    print(f"wrote {args.out_dir}/bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
