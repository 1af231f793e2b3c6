"""Engine-wide serving metrics: queue sizes, KV usage, token counts per step, step durations,
and the finished requests' own records (`RequestMetrics`: queue time, TTFT, ITL, TPOT, E2E,
preemptions).

Host-only bookkeeping fed by the engine after each step; `LLMEngine.metrics_snapshot()` is the
plain dict that the benchmark harness reads and the server exports as Prometheus metrics.
"""

from __future__ import annotations

from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sequence import Sequence


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
        self.step_running: list[int] = []
        self.step_waiting: list[int] = []
        self.step_kv_used: list[int] = []
        self.finished: list[RequestMetrics] = []

    def record_step(self, duration: float, prefill_tokens: int, sampled: int, running: int,
                    waiting: int, kv_used: int) -> None:
        self.num_steps += 1
        self.prompt_tokens += prefill_tokens
        self.generation_tokens += sampled
        for lst, v in ((self.step_durations, duration), (self.step_running, running),
                       (self.step_waiting, waiting), (self.step_kv_used, kv_used)):
            lst.append(v)
            if len(lst) > self.window:
                del lst[: len(lst) - self.window]

    def record_finished(self, seq: Sequence) -> None:
        self.num_requests_finished += 1
        self.finished.append(seq.metrics)
        if len(self.finished) > self.window:
            del self.finished[: len(self.finished) - self.window]

    def record_rejection(self) -> None:
        self.num_rejections += 1
