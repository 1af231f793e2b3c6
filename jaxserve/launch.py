"""Start one engine as several processes on this machine (runtime/distributed.py), or the
processes of disaggregated serving (serving/disagg.py).

`python -m jaxserve launch --num-processes 2 --cpu-devices-per-process 2 -- scripts/serve.py
--tensor-parallel-size 4` runs the script once per process, each told the coordinator address,
the process count and its index through the environment (the variables in
`distributed.ENV`); on a CPU each process gets its forced devices. On several machines, run
the script on each with the same three values as flags instead.

The launcher only starts, relays signals and waits: a process whose peer dies exits on its own
(with a message saying so). The launcher prints every process's exit status and returns that
of the first process to fail for its own reason (128 + N for a process killed by signal N): a
process that exits because its peer was lost (EXIT_PEER_LOST) is reported only when no other
failed, or 0 when all succeeded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from jaxserve.runtime.distributed import ENV, EXIT_PEER_LOST
from jaxserve.serving import api_key, engine_secret


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now: each held open until all are picked, so the system cannot
    hand one out twice (a port closed at once may be the next one given)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def launch(num_processes: int, command: list[str], cpu_devices_per_process: int | None = None,
           coordinator_port: int | None = None) -> int:
    if num_processes < 1:
        raise ValueError(f"num_processes must be positive, got {num_processes}")
    if not command:
        raise ValueError("give the script to run, e.g. -- scripts/serve.py ...")
    address = f"127.0.0.1:{coordinator_port or free_port()}"
    runs = []
    for i in range(num_processes):
        env = dict(os.environ, **{ENV["coordinator_address"]: address,
                                  ENV["num_processes"]: str(num_processes),
                                  ENV["process_id"]: str(i)})
        if cpu_devices_per_process:
            env = _forced_cpu_devices(env, cpu_devices_per_process)
            env.setdefault("JAX_PLATFORMS", "cpu")
        runs.append((f"process {i} of {num_processes}", command, env,
                     f" (coordinator {address})"))
    return _run(runs)


def launch_disaggregated(num_prefill: int, num_decode: int, command: list[str],
                         devices_per_engine: int | None = None) -> int:
    """`num_prefill` prefill and `num_decode` decode engines, each `command` with --role and
    a free socket port (HTTP off), and one front: `command` as given (its ports are the
    clients'), told the engines' addresses (serving/disagg.py). `devices_per_engine`: give
    each engine devices of its own (for --tensor-parallel-size): GPUs by
    CUDA_VISIBLE_DEVICES, engine i the i-th run of that many; on a CPU, that many forced.
    Every process gets a fresh secret in its environment: the engines serve only a front
    that proves it (serving/engine_secret.py)."""
    for name, n in (("prefill", num_prefill), ("decode", num_decode)):
        if n < 1:
            raise ValueError(f"{name} must be positive, got {n}")
    if not command:
        raise ValueError("give the script to run, e.g. -- scripts/serve.py ...")
    if devices_per_engine is not None and devices_per_engine < 1:
        raise ValueError(f"devices_per_engine must be positive, got {devices_per_engine}")
    runs, addresses = [], {"prefill": [], "decode": []}
    ports = iter(free_ports(num_prefill + num_decode))
    secret = {engine_secret.ENV: engine_secret.new()}  # in the environment: argv is public
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(n):
            port = next(ports)
            addresses[role].append(f"127.0.0.1:{port}")
            env = dict(os.environ, **secret)
            if devices_per_engine:
                env = engine_devices(env, len(runs), devices_per_engine)
            runs.append((f"{role} {i}", [*command, "--role", role, "--host", "127.0.0.1",
                                         "--port", str(port), "--http-port", "0"],
                         env, f" (127.0.0.1:{port})"))
    runs.append(("front", [*command, "--prefill-engines", *addresses["prefill"],
                           "--decode-engines", *addresses["decode"]],
                 dict(os.environ, **secret), ""))
    return _run(runs)


def engine_devices(env: dict, index: int, count: int) -> dict:
    """`env` for the engine process `index` of several given `count` devices each: its own
    CUDA_VISIBLE_DEVICES (of those already visible, if set) and `count` forced CPU devices."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range((index + 1) * count)]
    mine = gpus[index * count:(index + 1) * count]
    if len(mine) < count:
        raise ValueError(f"devices_per_engine={count}: engine {index} needs {count} GPUs "
                         f"past the first {index * count} of CUDA_VISIBLE_DEVICES={visible}")
    return {**_forced_cpu_devices(env, count), "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _forced_cpu_devices(env: dict, count: int) -> dict:
    """`env` with XLA_FLAGS forcing `count` CPU devices (replacing any such flag)."""
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**env, "XLA_FLAGS": " ".join(
        flags + [f"--xla_force_host_platform_device_count={count}"])}


def _run(runs: list[tuple[str, list[str], dict, str]]) -> int:
    """Start (name, command, environment, note) each, relay SIGINT/SIGTERM, wait for all. An
    --api-key in a command goes to its process through the environment, out of its argv."""
    runs = [(name, *api_key.to_environment(command, env), note)
            for name, command, env, note in runs]
    procs = []
    for name, command, env, note in runs:
        procs.append(subprocess.Popen([sys.executable, *command], env=env))
        print(f"[launch] {name}: pid {procs[-1].pid}{note}", file=sys.stderr, flush=True)

    def relay(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # Relay only while the children live; the caller's own handlers come back afterwards.
    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGINT, signal.SIGTERM)}
    failures = []  # exit statuses in the order the polls saw them
    try:
        while any(p.returncode is None for p in procs):
            for p in procs:
                if p.returncode is None and p.poll() is not None and p.returncode:
                    failures.append(p.returncode if p.returncode > 0 else 128 - p.returncode)
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"[launch] exit statuses: {[p.returncode for p in procs]}", file=sys.stderr,
          flush=True)
    # A process that left because its peer did is a consequence, not the cause; one poll can
    # see both exits, so the cause is the first failure that is not EXIT_PEER_LOST.
    causes = [f for f in failures if f != EXIT_PEER_LOST]
    return (causes or failures or [0])[0]
