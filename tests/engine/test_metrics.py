"""The engine's metrics samples (engine/metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

from jaxserve.engine.metrics import EngineMetrics


def test_samples_keep_the_newest_window_and_trim_in_halves():
    m = EngineMetrics(window=10)
    lengths = []
    for i in range(55):
        m.record_step(i / 100, 1, 2, i, 0, 3)
        m.record_finished(SimpleNamespace(metrics=i))
        lengths.append(len(m.step_running))
        assert m.step_running[-1] == i and m.finished[-1] == i
        assert len(m.step_running) >= min(i + 1, 10) and len(m.step_running) < 20
        n = len(m.step_running)
        assert m.step_running == list(range(i + 1 - n, i + 1))
        assert m.finished == m.step_running
    # a trim happens once per window appends, not on every one past the window
    assert sum(b < a for a, b in zip(lengths, lengths[1:], strict=False)) == 4  # 20, 30, 40, 50
    assert m.num_steps == 55 and m.num_requests_finished == 55
    assert m.prompt_tokens == 55 and m.generation_tokens == 110
