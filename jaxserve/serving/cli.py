"""`python scripts/serve.py`: load, warm up, then serve the socket protocol and OpenAI HTTP.

Every EngineConfig and ServerConfig field is a command-line option (see --help); the API key may
also come from --api-key-file or the environment (serving/api_key.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from jaxserve.config import EngineConfig, Role, add_options, from_options
from jaxserve.engine import data_parallel
from jaxserve.engine.llm_engine import settle_heap
from jaxserve.engine.profiling import StepWindowProfiler, start_profiler_server
from jaxserve.runtime import distributed
from jaxserve.runtime.distributed import DistributedConfig
from jaxserve.serving import api_key, engine_secret
from jaxserve.serving.disagg import DisaggSet, FrontConfig, FrontModel
from jaxserve.serving.loras import check_lora_options
from jaxserve.serving.server import Server, ServerConfig

logger = logging.getLogger("jaxserve.server")


def parse_args(argv: list[str] | None = None, prog: str = "serve.py") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_options(ap.add_argument_group("engine"), EngineConfig)
    server = ap.add_argument_group("server")
    add_options(server, ServerConfig)
    api_key.add_file_option(server)
    add_options(ap.add_argument_group("several processes (one engine over all their devices; "
                                      "process 0 serves)"), DistributedConfig)
    add_options(ap.add_argument_group("disaggregated serving (python -m jaxserve launch "
                                      "--prefill N --decode M starts it all)"), FrontConfig)
    ap.add_argument("--profile-dir", default=None,
                    help="write an XLA profiler trace of --profile-steps engine steps here "
                         "(starting with the first request)")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--profiler-port", type=int, default=None,
                    help="start a jax.profiler server on this port for live capture")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip compiling every bucket before accepting connections")
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def split_config(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Raises SystemExit naming the field when a value is refused."""
    try:  # --http-port 0 turns the HTTP front off
        return (from_options(EngineConfig, args),
                from_options(ServerConfig, args, http_port=args.http_port or None,
                             api_key=api_key.resolve(args.api_key, args.api_key_file)))
    except ValueError as e:
        raise SystemExit(f"serve.py: error: {e}") from None


async def serve(engines, server_config: ServerConfig, step_hooks: tuple = (),
                remote=None, secret: bytes | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down in order."""
    server = Server(engines, server_config, step_hooks, remote, secret)
    try:
        await server.start()
    except ValueError as e:  # an adapter of --lora-modules that does not load
        server.stop()
        raise SystemExit(f"serve.py: error: {e}") from None
    logger.info("jaxserve listening on %s", server.where())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: finishing in-flight requests (up to %.0fs)",
                server_config.shutdown_timeout_s)
    await server.shutdown()
    logger.info("stopped")


def main(argv: list[str] | None = None, prog: str = "serve.py") -> int:
    """`prog`: the command's name in its help and errors."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    engine_config, server_config = split_config(args)
    front = from_options(FrontConfig, args)
    try:  # refused here, before the model loads
        check_lora_options(engine_config.enable_lora, server_config.lora_modules)
        # the processes of disaggregated serving prove this to each other; a plain server's
        # socket is governed by --api-key alone
        is_internal = front.is_front or engine_config.role is not Role.BOTH
        secret = engine_secret.from_env() if is_internal else None
    except ValueError as e:
        raise SystemExit(f"serve.py: error: {e}") from None
    if front.is_front:  # the engines run elsewhere: serve the clients and route to them
        model = FrontModel(engine_config)
        remote = DisaggSet(list(front.prefill_engines or ()), list(front.decode_engines or ()),
                           engine_config.block_size, server_config.max_queue_per_request,
                           prefix_aware=engine_config.enable_prefix_caching,
                           api_key=server_config.api_key, secret=secret,
                           connect_timeout_s=front.engine_connect_timeout_s,
                           read_adapter=model.read_adapter)
        asyncio.run(serve(model, server_config, remote=remote))
        return 0
    dist = distributed.initialize(from_options(DistributedConfig, args))
    if dist.is_multiprocess and engine_config.data_parallel_size > 1:
        raise SystemExit("data_parallel_size > 1 runs in one process; across processes the "
                         "engine is one tensor-parallel replica")
    t0 = time.perf_counter()
    engines = data_parallel.build_replicas(engine_config)
    logger.info("model loaded in %.1fs (%s)", time.perf_counter() - t0, engines[0].loaded.path)
    if not args.no_warmup:
        dt = data_parallel.warmup(engines)
        logger.info("warmup compiled %d programs in %.1fs",
                    sum(e.runner.num_compiles for e in engines), dt)
    if dist.is_multiprocess and dist.process_id != 0:
        # A follower ends when process 0 does (it stops them on its way out, or they notice
        # it is gone), so a Ctrl-C or a SIGTERM sent to every process shuts down in order.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        logger.info("process %d of %d: running process 0's steps (it serves the clients)",
                    dist.process_id, dist.num_processes)
        engines[0].runner.follow()
        logger.info("process 0 stopped; exiting")
        distributed.leave(dist)
        return 0
    settle_heap()
    hooks = ()
    profiler = None
    if args.profile_dir:
        profiler = StepWindowProfiler(args.profile_dir, args.profile_steps)
        hooks = (profiler.on_step,)
    if args.profiler_port:
        start_profiler_server(args.profiler_port)
    asyncio.run(serve(engines, server_config, hooks, secret=secret))
    engines[0].runner.stop_followers()
    if profiler is not None:
        profiler.stop()
    distributed.leave(dist)
    return 0
