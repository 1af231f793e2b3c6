"""Host overhead per step: scheduling plus building the padded step metadata, no model.

    python scripts/bench_scheduler.py [--running 64 256 1024] [--steps 300]

Keeps N requests of mixed prompt and output lengths in flight (a finished one is replaced at
once), drives the real Scheduler and BlockManager with SimExecutor, and times schedule() and
build_step_inputs() for every step. Prints median and p99 per N.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runtime.logits_processing import LogitsShape
from jaxserve.runtime.step_inputs import build_step_inputs
from jaxserve.testing.sim import SimExecutor


def bench(num_running: int, steps: int, seed: int = 0) -> dict:
    block_size, max_len = 16, 4096
    budget = max(2048, 2 * num_running)
    cfg = EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=budget,
                       max_model_len=max_len, block_size=block_size)
    buckets = cfg.buckets()
    num_blocks = num_running * (max_len // block_size) // 2
    logits_shape = LogitsShape(vocab_size=49152, history=max_len)
    sim = SimExecutor(cfg.scheduler_config(), num_blocks, block_size,
                      check_kv=False)
    rng = np.random.default_rng(seed)
    counter = 0

    def top_up():
        nonlocal counter
        while len(sim.requests) < num_running:
            prompt = int(min(rng.lognormal(5.0, 1.0), 1500)) + 1
            sim.add(f"r{counter}", prompt, int(rng.integers(16, 512)))
            counter += 1

    top_up()
    for _ in range(20):  # reach a steady mix of decodes and prefill chunks
        sim.step()
        top_up()
    sched_t, build_t, sizes = [], [], []
    sched = sim.scheduler
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        if out.scheduled:
            build_step_inputs(out.scheduled, buckets, block_size, num_blocks, logits_shape)
        t2 = time.perf_counter()
        sched_t.append(t1 - t0)
        build_t.append(t2 - t1)
        sizes.append(len(out.scheduled))
        sim.execute(out)  # the engine's postprocess (not timed: it is not scheduling)
        top_up()
    total = np.array(sched_t) + np.array(build_t)
    ms = lambda a, q: float(np.percentile(a, q) * 1e3)
    return {"running": num_running, "seqs_per_step": float(np.mean(sizes)),
            "schedule_p50_ms": ms(sched_t, 50), "build_p50_ms": ms(build_t, 50),
            "total_p50_ms": ms(total, 50), "total_p99_ms": ms(total, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"{'running':>8} {'seqs/step':>9} {'sched p50':>10} {'build p50':>10} "
          f"{'total p50':>10} {'total p99':>10}  (ms)")
    for n in args.running:
        r = bench(n, args.steps)
        print(f"{r['running']:>8} {r['seqs_per_step']:>9.0f} {r['schedule_p50_ms']:>10.3f} "
              f"{r['build_p50_ms']:>10.3f} {r['total_p50_ms']:>10.3f} {r['total_p99_ms']:>10.3f}")
