"""`python scripts/serve.py`: load, warm up, then serve the socket protocol and OpenAI HTTP.

Every EngineConfig and ServerConfig field is a command-line option (see --help).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from jaxserve.config import EngineConfig, add_options, from_options
from jaxserve.serving.server import Server, ServerConfig

logger = logging.getLogger("jaxserve.server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n")[0])
    add_options(ap.add_argument_group("engine"), EngineConfig)
    add_options(ap.add_argument_group("server"), ServerConfig)
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
    # --http-port 0 turns the HTTP front off
    return (from_options(EngineConfig, args),
            from_options(ServerConfig, args, http_port=args.http_port or None))


async def serve(engine, server_config: ServerConfig, step_hooks: tuple = ()) -> None:
    server = Server(engine, server_config, step_hooks)
    await server.start()
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    engine_config, server_config = split_config(args)
    from jaxserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config)
    logger.info("model loaded in %.1fs (%s)", time.perf_counter() - t0, engine.loaded.path)
    if not args.no_warmup:
        dt = engine.warmup()
        logger.info("warmup compiled %d programs in %.1fs", engine.runner.num_compiles, dt)
    hooks = ()
    profiler = None
    if args.profile_dir:
        from jaxserve.engine.profiling import StepWindowProfiler

        profiler = StepWindowProfiler(args.profile_dir, args.profile_steps)
        hooks = (profiler.on_step,)
    if args.profiler_port:
        from jaxserve.engine.profiling import start_profiler_server

        start_profiler_server(args.profiler_port)
    asyncio.run(serve(engine, server_config, hooks))
    if profiler is not None:
        profiler.stop()
    return 0
