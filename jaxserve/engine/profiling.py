"""XLA profiler sessions over a bounded window of engine steps.

The trace (jax.profiler, written under DIR/plugins/profile/<run>/) holds host annotations for the
phases of each step, jaxserve.schedule / jaxserve.prepare_inputs / jaxserve.forward /
jaxserve.postprocess, and the named scopes forward/ and sample/ on the compiled step's ops. Open
it with TensorBoard (`tensorboard --logdir DIR`, Profile tab) or Perfetto (ui.perfetto.dev,
load the .trace.json.gz, or convert the .xplane.pb with the TensorBoard profile plugin).
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


class StepWindowProfiler:
    """Call `on_step()` after every engine step: the first call starts a trace, the call after
    `num_steps` steps stops it, so a long run yields a trace of bounded size."""

    def __init__(self, log_dir: str, num_steps: int = 20):
        if num_steps <= 0:
            raise ValueError(f"profile steps must be positive, got {num_steps}")
        self.log_dir = log_dir
        self.num_steps = num_steps
        self.steps = 0
        self.active = False
        self.done = False

    def on_step(self, *_args) -> None:
        if self.done:
            return
        if not self.active:
            jax.profiler.start_trace(self.log_dir)
            self.active = True
            logger.info("profiling %d steps into %s", self.num_steps, self.log_dir)
            return
        self.steps += 1
        if self.steps >= self.num_steps:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
            logger.info("profile written to %s", self.log_dir)


def start_profiler_server(port: int) -> None:
    """Let TensorBoard or `jax.profiler` capture a live trace from this process."""
    jax.profiler.start_server(port)
    logger.info("jax profiler server on port %d", port)
