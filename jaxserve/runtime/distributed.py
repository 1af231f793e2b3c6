"""Multi-host: one engine whose tensor-parallel mesh spans the devices of several processes.

JAX's multi-controller runtime (`jax.distributed.initialize`; gloo collectives on CPUs) makes
every process see every device, and a jitted program over a mesh that spans processes runs
only when every process launches it, with the same inputs, in the same order. Of the two ways
to get there, a scheduler on every process fed the same requests, or one scheduler whose step
inputs reach the others, this engine takes the second: process 0 (the leader) owns the
scheduler, the block manager and the clients; before each step it broadcasts the step's
inputs (`multihost_utils.broadcast_one_to_all`, itself a collective over the same devices),
and the followers run the same compiled step on their shards. Nothing a follower does depends
on timing, arrivals or the host's clock, so the processes cannot drift apart.

Each broadcast is a fixed header (the op and the step's program: its bucket, proposal slots
and decode steps), then, for a step, the StepInputs, whose shapes the program fixes. While the
leader has no work it broadcasts a no-op every second, so a follower waiting for the next step
notices a leader that died, and the leader notices a follower that died. Either way the
collective fails at once (gloo sees the peer's sockets close) and the survivor exits with a
message that says so (`fatal`), instead of waiting on a peer that will never answer.

Not available across processes: the host pool (swap preemption and the prefix cache's host
tier need the whole pool readable from one process) and data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import numpy as np

from jaxserve.config import option
from jaxserve.runtime.step_inputs import Program

logger = logging.getLogger(__name__)

ENV = {"coordinator_address": "JAXSERVE_COORDINATOR_ADDRESS",
       "num_processes": "JAXSERVE_NUM_PROCESSES", "process_id": "JAXSERVE_PROCESS_ID"}

NOOP, STEP, STOP = 0, 1, 2
KEEPALIVE_S = 1.0
_NO_PROGRAM = Program(0, 0, 0)
EXIT_PEER_LOST = 75  # the exit status of a process whose peer is gone


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = option(
        None, "host:port where process 0 runs JAX's coordination service; every process "
              "gives the same (env JAXSERVE_COORDINATOR_ADDRESS)")
    num_processes: int | None = option(
        None, "processes the engine spans (env JAXSERVE_NUM_PROCESSES; default 1)")
    process_id: int | None = option(
        None, "this process's index; 0 schedules and serves, the others follow its steps "
              "(env JAXSERVE_PROCESS_ID)")
    heartbeat_timeout_s: int = option(
        10, "seconds without a heartbeat before JAX's coordination service declares a "
            "process dead (a step's collective notices a dead peer sooner)")

    def resolved(self) -> DistributedConfig:
        """Unset fields from the environment; checked."""
        kw = {}
        for name, var in ENV.items():
            value = getattr(self, name)
            if value is None and os.environ.get(var):
                value = os.environ[var] if name == "coordinator_address" else int(os.environ[var])
            kw[name] = value
        cfg = dataclasses.replace(self, **kw)
        n = cfg.num_processes or 1
        if n > 1:
            if not cfg.coordinator_address:
                raise ValueError(f"num_processes={n} needs coordinator_address (or "
                                 f"{ENV['coordinator_address']})")
            if cfg.process_id is None or not 0 <= cfg.process_id < n:
                raise ValueError(f"process_id must be in [0, {n}) with num_processes={n}, got "
                                 f"{cfg.process_id!r}")
        return cfg

    @property
    def is_multiprocess(self) -> bool:
        return (self.num_processes or 1) > 1


def initialize(cfg: DistributedConfig) -> DistributedConfig:
    """Join the other processes (before anything touches a JAX backend); returns `cfg`
    resolved. A single process does nothing."""
    cfg = cfg.resolved()
    if cfg.is_multiprocess:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # A dead peer is ours to report (fatal, EXIT_PEER_LOST): without this the coordination
        # service tells the others, whose JAX client then aborts them before we can.
        jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                   heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
        logger.info("process %d of %d joined %s; devices: %d here, %d in all", cfg.process_id,
                    cfg.num_processes, cfg.coordinator_address, jax.local_device_count(),
                    jax.device_count())
    return cfg


def leave(cfg: DistributedConfig, timeout_s: float = 30.0) -> None:
    """An orderly exit, every process once it has stopped stepping: followers disconnect from
    the coordination service first, and process 0, which hosts it, waits until they have
    before it shuts the service down (recoverable tasks skip JAX's own shutdown barrier, and a
    follower whose disconnect finds the service gone is aborted by its JAX client)."""
    if not cfg.is_multiprocess:
        return
    import jax
    from jax._src import distributed as jax_distributed  # the client: no public handle

    client = jax_distributed.global_state.client
    if cfg.process_id == 0 and client is not None:
        everyone = list(range(cfg.num_processes))
        deadline = time.monotonic() + timeout_s
        while set(client.get_live_nodes(everyone)) - {0} and time.monotonic() < deadline:
            time.sleep(0.05)
    jax.distributed.shutdown()


def fatal(what: str, error: BaseException) -> None:
    """A collective failed: the processes can no longer run steps together. Say so and exit
    now (an orderly exit would wait on the coordination service's barrier for the dead peer)."""
    import jax

    msg = (f"jaxserve: process {jax.process_index()} of {jax.process_count()}: {what} failed: "
           f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}\n"
           f"jaxserve: another process of this engine has exited or failed; a multi-process "
           f"engine cannot go on without it, so this process exits too "
           f"(status {EXIT_PEER_LOST}).\n")
    sys.stderr.write(msg)
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)


class StepBroadcast:
    """The leader's steps, delivered to every follower in order."""

    def __init__(self, dummy_inputs):
        """`dummy_inputs(program)`: a StepInputs of the program's shapes (values unused)."""
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self._dummy = dummy_inputs
        self._last = time.monotonic()

    def _send_header(self, op: int, program: Program = _NO_PROGRAM,
                     processed: bool = False) -> None:
        self._broadcast(np.asarray([op, *program, processed], np.int32))
        self._last = time.monotonic()

    def send_step(self, inp) -> None:
        """The step's inputs; its logit-processing arrays only when a row uses them (the
        followers know the unused ones)."""
        processed = bool(inp.processing.active)
        self._send_header(STEP, inp.program, processed)
        self._broadcast(inp if processed else dataclasses.replace(inp, processing=None))

    def send(self, op: int) -> None:
        self._send_header(op)

    def keepalive(self) -> None:
        if time.monotonic() - self._last >= KEEPALIVE_S:
            self.send(NOOP)

    def receive(self):
        """-> (op, StepInputs or None): what the leader sent next (a follower blocks here)."""
        op, *program, processed = self._broadcast(
            np.zeros(len(Program._fields) + 2, np.int32)).tolist()
        if op != STEP:
            return op, None
        program = Program(*program)
        template = self._dummy(program._replace(plain=bool(program.plain)))
        if processed:
            return op, self._broadcast(template)
        got = self._broadcast(dataclasses.replace(template, processing=None))
        return op, dataclasses.replace(got, processing=template.processing)
