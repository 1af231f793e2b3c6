"""Colocated against disaggregated serving in a step-cost simulation (host only, no model).

Each engine owns its device. A step costs `StepCost`: a fixed part, a part per prompt token and
a part per decoding sequence, fitted (`fit`) from an engine's step trace. A colocated engine
runs its decodes and then prompt chunks within the token budget in every step, as the
scheduler does; a prefill engine runs only prompt chunks, a decode engine only decodes, and a
request moves between them after its first token, after `handover_s`. Requests go to the
least-loaded engine of the pool they enter. `goodput_curve` gives, per offered rate, the share
of requests within a TTFT and a TPOT target (report.slo_attainment), for each layout; the
crossover is the lowest rate from which disaggregation attains more.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import numpy as np

from jaxserve.bench.report import slo_attainment
from jaxserve.core.outputs import RequestMetrics


@dataclasses.dataclass(frozen=True)
class StepCost:
    fixed_s: float
    per_prompt_token_s: float
    per_decode_seq_s: float

    def __call__(self, prompt_tokens: int, decode_seqs: int) -> float:
        return (self.fixed_s + self.per_prompt_token_s * prompt_tokens
                + self.per_decode_seq_s * decode_seqs)


def fit(steps: list[tuple[int, int, float]]) -> StepCost:
    """Least squares over (prompt tokens, decode sequences, seconds) of measured steps."""
    a = np.array([[1.0, p, d] for p, d, _ in steps])
    coef, *_ = np.linalg.lstsq(a, np.array([s for _, _, s in steps]), rcond=None)
    return StepCost(*(max(0.0, float(c)) for c in coef))


@dataclasses.dataclass
class _Req:
    metrics: RequestMetrics
    prompt_left: int
    tokens_left: int


class _Engine:
    """One engine's queue and running set, stepping on its own clock."""

    def __init__(self, cost: StepCost, budget: int, max_seqs: int, prefill: bool, decode: bool):
        self.cost, self.budget, self.max_seqs = cost, budget, max_seqs
        self.prefill, self.decode = prefill, decode
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.clock = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, done, handed) -> None:
        """One step from `clock`: finished requests go to `done`, prefilled ones (prefill
        engines) to `handed`."""
        decoding = [r for r in self.running if r.prompt_left == 0] if self.decode else []
        while self.waiting and len(self.running) < self.max_seqs:
            self.running.append(self.waiting.popleft())
        room = self.budget - len(decoding)
        chunks = []
        for r in self.running:
            if r.prompt_left and room > 0:
                n = min(r.prompt_left, room)
                chunks.append((r, n))
                room -= n
        self.clock += self.cost(sum(n for _, n in chunks), len(decoding))
        for r in decoding:
            r.metrics.token_times.append(self.clock)
            r.tokens_left -= 1
        for r, n in chunks:
            r.prompt_left -= n
            if not r.prompt_left:
                r.metrics.token_times.append(self.clock)  # its first token
                r.tokens_left -= 1
                if not self.decode:
                    self.running.remove(r)
                    handed.append(r)
        for r in [r for r in self.running if r.tokens_left <= 0]:
            self.running.remove(r)
            r.metrics.finished_time = self.clock
            done.append(r)


def simulate(requests: list[tuple[float, int, int]], cost: StepCost, disaggregated: bool,
             engines: int = 2, budget: int = 512, max_seqs: int = 16,
             handover_s: float = 0.0) -> list[RequestMetrics]:
    """(arrival s, prompt tokens, output tokens) per request -> their metrics, on `engines`
    colocated engines or engines // 2 prefill plus the rest decode."""
    if disaggregated:
        pre = [_Engine(cost, budget, max_seqs, True, False) for _ in range(engines // 2)]
        dec = [_Engine(cost, budget, max_seqs, False, True) for _ in range(engines - len(pre))]
    else:
        pre = dec = [_Engine(cost, budget, max_seqs, True, True) for _ in range(engines)]
    pending = deque(sorted((a, i, p, o) for i, (a, p, o) in enumerate(requests)))
    moving: list[tuple[float, _Req]] = []  # handed over, arriving at a decode engine then
    done: list[_Req] = []
    pool = list(dict.fromkeys(pre + dec))
    while len(done) < len(requests):
        busy = [e for e in pool if e.load]
        now = min([e.clock for e in busy] + ([pending[0][0]] if pending else [])
                  + [t for t, _ in moving])
        while pending and pending[0][0] <= now:
            a, i, p, o = pending.popleft()
            r = _Req(RequestMetrics(str(i), a, p), p, o)
            min(pre, key=lambda e: e.load).waiting.append(r)
        for t, r in [m for m in moving if m[0] <= now]:
            moving.remove((t, r))
            min(dec, key=lambda e: e.load).running.append(r)  # its blocks came reserved
        for e in pool:
            e.clock = max(e.clock, now)
            if e.load and e.clock <= now:
                handed: list[_Req] = []
                e.step(done, handed)
                moving += [(e.clock + handover_s, r) for r in handed]
    return [r.metrics for r in done]


def workload(rate: float, n: int, prompt: tuple[int, int], output: tuple[int, int],
             seed: int = 0) -> list[tuple[float, int, int]]:
    """Poisson arrivals at `rate`, uniform prompt and output lengths."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.randint(*prompt), rng.randint(*output)))
    return out


def goodput_curve(cost: StepCost, rates: list[float], ttft_s: float, tpot_s: float, *,
                  n: int = 200, prompt=(1000, 2000), output=(64, 256), engines: int = 2,
                  budget: int = 512, max_seqs: int = 16, handover_s: float = 0.0,
                  seed: int = 0) -> list[tuple[float, float, float]]:
    """(rate, colocated attainment, disaggregated attainment) per offered rate."""
    rows = []
    for rate in rates:
        reqs = workload(rate, n, prompt, output, seed)
        rows.append((rate, *(slo_attainment(
            simulate(reqs, cost, d, engines, budget, max_seqs, handover_s), ttft_s, tpot_s)
            for d in (False, True))))
    return rows


def measure(model: str | None, budget: int, max_seqs: int, num_requests: int = 12) -> StepCost:
    """Fit the step cost from the engine's own step trace on long prompts and decodes."""
    from jaxserve import EngineConfig, LLMEngine, SamplingParams

    # two token buckets: decode-only steps on the small one, steps with prompt chunks on the
    # budget (the compile time of every bucket would outlast the measurement)
    engine = LLMEngine(EngineConfig(model=model, max_num_batched_tokens=budget,
                                    max_num_seqs=max_seqs, max_model_len=2048,
                                    token_buckets=(max(max_seqs, 8), budget),
                                    seq_buckets=(max_seqs,), block_buckets=(128,),
                                    enable_step_trace=True,
                                    log_stats_interval_s=0))
    engine.warmup()
    rng = random.Random(0)
    for i in range(num_requests):
        ids = [rng.randrange(100, 20000) for _ in range(rng.randint(200, 1500))]
        engine.add_request(str(i), prompt_token_ids=ids, params=SamplingParams(
            temperature=0, max_tokens=rng.randint(16, 64), ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    trace = engine.step_trace[2:]  # the first steps also pay for first-use costs
    return fit([(s.num_prefill_tokens, sum(d > 0 for _, _, d in s.requests), s.duration_s)
                for s in trace])


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.pd_sim", description=__doc__)
    ap.add_argument("--model", default=None, help="measure the step cost on this model")
    ap.add_argument("--cost", type=float, nargs=3, default=None,
                    metavar=("FIXED_S", "PER_PROMPT_TOKEN_S", "PER_DECODE_SEQ_S"),
                    help="the step cost to simulate (default: measured on --model)")
    ap.add_argument("--rates", type=float, nargs="+", required=True)
    ap.add_argument("--ttft-s", type=float, required=True)
    ap.add_argument("--tpot-s", type=float, required=True)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--handover-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    cost = StepCost(*args.cost) if args.cost else measure(args.model, args.budget,
                                                          args.max_seqs)
    print(f"step cost: {cost.fixed_s * 1e3:.2f} ms + {cost.per_prompt_token_s * 1e6:.1f} us "
          f"per prompt token + {cost.per_decode_seq_s * 1e3:.2f} ms per decoding sequence")
    print("rate req/s   2 colocated   1 prefill + 1 decode")
    rows = goodput_curve(cost, args.rates, args.ttft_s, args.tpot_s, budget=args.budget,
                         max_seqs=args.max_seqs, handover_s=args.handover_s)
    for rate, co, dis in rows:
        print(f"{rate:10.3f}   {co:11.1%}   {dis:20.1%}")
    cross = next((rate for rate, co, dis in rows if dis > co), None)
    print(f"disaggregated attains more from {cross} req/s" if cross is not None
          else "colocated attains as much or more at every rate tried")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
