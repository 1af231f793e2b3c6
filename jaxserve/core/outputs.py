"""What a request reports: its completion so far and one record of its timings.

`RequestMetrics` is the only per-request timing record: the engine fills it as the request moves
(a `Sequence` owns one), the serving metrics aggregate it, and the benchmark drivers build the
same record for the systems they measure from outside (the socket server, HF baselines).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    first_scheduled_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    finished_time: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None  # why the request was refused, if it was

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def queue_time(self) -> float | None:  # arrival -> first scheduled
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def ttft(self) -> float | None:  # arrival -> first token
        t = self.first_token_time
        return None if t is None else t - self.arrival_time

    @property
    def itl(self) -> list[float]:  # every inter-token latency
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot(self) -> float | None:  # mean time per output token after the first
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def e2e(self) -> float | None:  # arrival -> finished
        t = self.finished_time
        return None if t is None else t - self.arrival_time


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # all text so far (stop strings trimmed)
    # The generated token ids, of which the first `num_token_ids` (None: all) are this
    # output's: the engine passes the sequence's own growing list instead of a copy at every
    # step. Read them as `token_ids`.
    all_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # Per token: {"logprob": float, "top": {token_id: logprob}} when logprobs were requested.
    logprobs: list[dict] | None = None
    new_text: str = ""  # what this step added, for streaming
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    # False for a sample of an n > 1 request that did not move in this step (its state is
    # repeated so every output carries all n; streams skip it)
    updated: bool = True
    num_token_ids: int | None = None

    @property
    def token_ids(self) -> list[int]:
        """All generated token ids up to this output."""
        n = self.num_token_ids
        return self.all_token_ids if n is None else self.all_token_ids[:n]


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics  # live: the engine keeps updating it until the request finishes
    # With prompt_logprobs: entry i for prompt token i, {"logprob", "rank", "top"} (the first,
    # with nothing before it, None); complete by the request's first output.
    prompt_logprobs: list[dict | None] | None = None
    # An embedding request's pooled final hidden state, (D,) float32 (numpy), once finished.
    embedding: Any = None
