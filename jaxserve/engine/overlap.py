"""Whether the next step is scheduled asynchronously, chosen from what the steps cost.

Asynchronous scheduling (LLMEngine.step) hides the host's work under the device's step, which
pays when the host's share of a step is large (few sequences, a fast device) and costs where
host and device share the cores and the device's step is long. Rather than decide by device
kind, the engine times its decode-only steps in both modes at each load (the step's rows,
bucketed to a power of two) and runs the cheaper one. A mode never measured at a load is tried
for `trial` steps; the one that lost is tried again every `revisit` steps at that load, so an
estimate never goes stale. Each estimate is the median of its last `window` samples, so a
pause (a collection, another process) does not decide. Host-only: no jax here.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


def load_bucket(rows: int) -> int:
    """The load a step's cost is kept under: its rows rounded up to a power of two."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Load:
    """The samples of one load: seconds per decode step, by mode (True: asynchronous)."""

    samples: dict[bool, deque] = field(default_factory=dict)
    since_trial: int = 0  # decode steps at this load since the losing mode was last tried

    def cost(self, mode: bool) -> float | None:
        s = self.samples.get(mode)
        return statistics.median(s) if s else None


class OverlapChooser:
    """Picks asynchronous or synchronous scheduling per step from measured step times.

    `start`: the mode tried first at every load. `trial`: the samples a mode gets when it is
    tried (after `settle` steps of the switch itself, whose time belongs to neither mode).
    `revisit`: decode steps at one load between trials of the mode that lost there. `margin`:
    how much cheaper the other mode must be to switch back and forth, so noise does not flap.
    """

    def __init__(self, start: bool, trial: int = 12, settle: int = 2, revisit: int = 400,
                 window: int = 24, margin: float = 0.03):
        if window < trial:
            raise ValueError(f"window ({window}) must hold a trial's samples ({trial})")
        self.mode = start
        self.trial, self.settle, self.revisit = trial, settle, revisit
        self.window, self.margin = window, margin
        self._loads: dict[int, _Load] = {}
        self._settling = 0
        self._last: float | None = None  # the last completion, while steps run back to back
        self.switches = 0

    def choose(self, rows: int) -> bool:
        """The mode of the next step, with `rows` sequences running."""
        if rows <= 0:
            return self.mode
        key = load_bucket(rows)
        load = self._loads.setdefault(key, _Load())
        # a mode with too few samples here is tried (the current one first, so a trial
        # under way goes on until it has its samples)
        for mode in (self.mode, not self.mode):
            if len(load.samples.get(mode, ())) < self.trial:
                return self._switch(mode)
        if load.since_trial >= self.revisit:
            load.since_trial = 0
            loser = not self._best(load)
            load.samples.pop(loser, None)  # a revisit measures afresh
            return self._switch(loser)
        return self._switch(self._best(load))

    def completed(self, now: float, rows: int, decode_only: bool, mode: bool,
                  steps: int = 1) -> None:
        """A step completed at `now` (perf_counter): `rows` sequences, launched in `mode`,
        `steps` decode steps in its call. Decode-only steps run back to back are timed."""
        last, self._last = self._last, now
        if self._settling > 0:
            self._settling -= 1
            return
        if last is None or not decode_only or mode != self.mode:
            return
        key = load_bucket(rows)
        load = self._loads.setdefault(key, _Load())
        samples = load.samples.setdefault(mode, deque(maxlen=self.window))
        samples.append((now - last) / steps)
        load.since_trial += 1

    def idle(self) -> None:
        """The engine ran out of work: the next step's time is not a step's cost."""
        self._last = None

    def estimates(self) -> dict[int, dict[str, float | None]]:
        """Seconds per decode step by load and mode (for logs and tests)."""
        return {k: {"async": v.cost(True), "sync": v.cost(False)}
                for k, v in sorted(self._loads.items())}

    def _best(self, load: _Load) -> bool:
        cur, other = load.cost(self.mode), load.cost(not self.mode)
        return (not self.mode) if other < cur * (1 - self.margin) else self.mode

    def _switch(self, mode: bool) -> bool:
        if mode != self.mode:
            self.mode = mode
            self.switches += 1
            self._settling = self.settle
        return mode
