"""Seeded benchmark workloads: arrivals (all at once or Poisson), prompt and output length
distributions, an optional prefix shared by every prompt."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxserve.config import option


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = option(64, "requests in the workload")
    rate: float | None = option(None, "offered req/s, Poisson arrivals (default: all at once)")
    prompt_len: str = option("uniform:16:128", "prompt lengths: fixed:N, uniform:A:B or "
                                               "longtail:MEDIAN:MAX")
    output_len: str = option("longtail:32:256", "output lengths (max_tokens), same forms")
    shared_prefix_len: int = option(0, "tokens every prompt starts with")
    seed: int = option(0, "workload seed (lengths, arrivals, token ids)")


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
