"""Seeded benchmark workloads: arrivals (all at once or Poisson), prompt and output length
distributions, and the shapes of prompts that real users send:

- a long system prompt every request starts with (`shared_prefix_len`);
- few-shot prompts: one of a few sets of examples (`prefix_groups` shared prefixes), then the
  question;
- multi-turn chat (`turns`): each later turn's prompt is the previous prompt, the answer the
  engine gave to it and a new user message, sent when that answer is complete.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import option


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = option(64, "requests in the workload")
    rate: float | None = option(None, "offered req/s, Poisson arrivals (default: all at once)")
    prompt_len: str = option("uniform:16:128", "prompt lengths: fixed:N, uniform:A:B or "
                                               "longtail:MEDIAN:MAX")
    output_len: str = option("longtail:32:256", "output lengths (max_tokens), same forms")
    shared_prefix_len: int = option(0, "tokens every prompt starts with (a system prompt)")
    prefix_groups: int = option(1, "distinct shared prefixes (e.g. few-shot example sets); "
                                   "request i starts with prefix i mod this")
    turns: int = option(1, "turns per conversation: each later turn's prompt is the previous "
                           "prompt + its answer + a new user message (turn_len)")
    turn_len: str = option("uniform:16:64", "lengths of the later turns' user messages")
    seed: int = option(0, "workload seed (lengths, arrivals, token ids)")

    def __post_init__(self):
        for name in ("num_requests", "prefix_groups", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    followups: tuple[list[int], ...] = ()  # user messages of the conversation's later turns
    turn: int = 0

    @property
    def request_id(self) -> str:
        """Its id in every driver: one per request and turn."""
        return f"bench-{self.index}" + (f"-t{self.turn}" if self.turn else "")

    def next_turn(self, answer: list[int], arrival_s: float) -> BenchRequest:
        """The conversation's next request: this prompt + its answer + the next message."""
        return dataclasses.replace(
            self, arrival_s=arrival_s, followups=self.followups[1:], turn=self.turn + 1,
            prompt_token_ids=self.prompt_token_ids + list(answer) + self.followups[0])


def progress_bar(total: int, desc: str, enabled: bool):
    """A bar over a run's requests, for every driver alike (off: it draws nothing)."""
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled)


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
    prefixes = [rng.integers(lo, hi, cfg.shared_prefix_len).tolist()
                for _ in range(cfg.prefix_groups)]
    later = _lengths(cfg.turn_len, cfg.num_requests * (cfg.turns - 1), rng)
    reqs = []
    for i in range(cfg.num_requests):
        prefix = prefixes[i % cfg.prefix_groups]
        own = rng.integers(lo, hi, max(1, prompts[i] - len(prefix))).tolist()
        msgs = tuple(rng.integers(lo, hi, n).tolist()
                     for n in later[i * (cfg.turns - 1):(i + 1) * (cfg.turns - 1)])
        reqs.append(BenchRequest(i, float(arrivals[i]), prefix + own, outputs[i], msgs))
    return reqs
