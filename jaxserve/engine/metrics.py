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
    """Counters and per-step samples. Lists of samples keep at least the last `window` and
    at most 2 x `window`: trimmed back to `window` when they reach twice that, so a sample
    costs O(1) however long the engine runs (trimming one a step moved the whole list)."""

    def __init__(self, window: int = 100_000):
        self.window = window
        self.num_steps = 0
        self.num_overlapped_steps = 0  # of them, launched before the step before was read back
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
            self._keep(lst, v)

    def record_finished(self, seq: Sequence) -> None:
        self.num_requests_finished += 1
        self._keep(self.finished, seq.metrics)

    def _keep(self, samples: list, value) -> None:
        samples.append(value)
        if len(samples) >= 2 * self.window:
            del samples[: len(samples) - self.window]

    def record_rejection(self) -> None:
        self.num_rejections += 1


class StatLogger:
    """Logs one line of serving figures every `interval_s` while the engine steps, as vLLM's
    engine does: prompt and generation throughput over the interval, queue sizes, KV usage and
    the prefix cache's hit rate (over the interval's lookups; device and host tier shares)."""

    def __init__(self, interval_s: float, clock):
        self.interval_s = interval_s
        self.clock = clock
        self._last_time = clock()
        self._last: dict | None = None

    def poll(self, snapshot) -> str | None:
        """The line to log, from `snapshot()` (a metrics_snapshot), once the interval is over;
        else None (and `snapshot` is not called)."""
        now = self.clock()
        dt = now - self._last_time
        if self._last is not None and dt < self.interval_s:
            return None
        snap = snapshot()
        last, self._last, self._last_time = self._last, snap, now
        if last is None:  # the first call only starts the interval
            return None

        def delta(key):
            return snap[key] - last[key]

        queries = delta("prefix_cache_queries")
        hit = delta("prefix_cache_hits") / queries if queries else 0.0
        host = delta("prefix_cache_host_hits") / queries if queries else 0.0
        return (f"Avg prompt throughput: {delta('prompt_tokens') / dt:.1f} tokens/s, "
                f"Avg generation throughput: {delta('generation_tokens') / dt:.1f} tokens/s, "
                f"Running: {snap['num_running']} reqs, Waiting: {snap['num_waiting']} reqs, "
                f"Held: {snap['num_held']} reqs, "
                f"Swapped: {snap['num_swapped']} reqs, "
                f"KV cache usage: {100 * snap['kv_usage']:.1f}%, "
                f"Prefix cache hit rate: {100 * hit:.1f}% "
                f"(device {100 * (hit - host):.1f}%, host {100 * host:.1f}%)")
