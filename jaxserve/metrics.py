"""Serving metrics: per request (queue time, TTFT, inter-token latencies, TPOT, E2E, preemptions)
and engine-wide (queue sizes, KV usage, token counts per step, step durations, compiles).

Host-only bookkeeping fed by the engine after each step; `snapshot()` is a plain dict that the
benchmark harness reads and the server exports as Prometheus metrics.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sequence import Sequence


@dataclasses.dataclass(slots=True)
class RequestStats:
    request_id: str
    arrival_time: float
    queue_time: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first token
    itl: list[float]  # every inter-token latency
    tpot: float | None  # mean time per output token after the first
    e2e: float | None  # arrival -> finished
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int
    finish_reason: str | None

    @staticmethod
    def of(seq: Sequence) -> RequestStats:
        times = seq.token_times
        itl = [b - a for a, b in zip(times, times[1:], strict=False)]
        first = seq.first_token_time
        return RequestStats(
            request_id=seq.request_id,
            arrival_time=seq.arrival_time,
            queue_time=(seq.first_scheduled_time - seq.arrival_time
                        if seq.first_scheduled_time is not None else None),
            ttft=first - seq.arrival_time if first is not None else None,
            itl=itl,
            tpot=(times[-1] - first) / (len(times) - 1) if len(times) > 1 else None,
            e2e=(seq.finished_time - seq.arrival_time if seq.finished_time is not None
                 else None),
            prompt_tokens=seq.num_prompt_tokens,
            output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
            finish_reason=seq.finish_reason,
        )


class EngineMetrics:
    """Counters and per-step samples. Lists of per-step samples are bounded to `window` steps."""

    def __init__(self, window: int = 100_000):
        self.window = window
        self.num_steps = 0
        self.prompt_tokens = 0  # prompt tokens computed (recomputation after preemption included)
        self.generation_tokens = 0
        self.num_requests_finished = 0
        self.num_rejections = 0
        self.step_durations: list[float] = []
        self.step_prefill_tokens: list[int] = []
        self.step_decode_tokens: list[int] = []
        self.step_running: list[int] = []
        self.step_waiting: list[int] = []
        self.step_kv_used: list[int] = []
        self.finished: list[RequestStats] = []

    def record_step(self, duration: float, prefill_tokens: int, decode_tokens: int,
                    sampled: int, running: int, waiting: int, kv_used: int) -> None:
        self.num_steps += 1
        self.prompt_tokens += prefill_tokens
        self.generation_tokens += sampled
        for lst, v in ((self.step_durations, duration), (self.step_prefill_tokens, prefill_tokens),
                       (self.step_decode_tokens, decode_tokens), (self.step_running, running),
                       (self.step_waiting, waiting), (self.step_kv_used, kv_used)):
            lst.append(v)
            if len(lst) > self.window:
                del lst[: len(lst) - self.window]

    def record_finished(self, seq: Sequence) -> RequestStats:
        stats = RequestStats.of(seq)
        self.num_requests_finished += 1
        self.finished.append(stats)
        if len(self.finished) > self.window:
            del self.finished[: len(self.finished) - self.window]
        return stats

    def record_rejection(self) -> None:
        self.num_rejections += 1
