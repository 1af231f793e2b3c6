"""`python scripts/serve.py`: load, warm up, then serve the socket protocol and OpenAI HTTP.

Every EngineConfig and ServerConfig field is a command-line option (see --help).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import time
import typing

from jaxserve.config import EngineConfig
from jaxserve.server import Server, ServerConfig

logger = logging.getLogger("jaxserve.server")


def _add_dataclass_options(group, cls, skip=()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        opt = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        default = f.default
        help_ = f"default: {default}"
        if hints[f.name] is bool:
            group.add_argument(opt, action=argparse.BooleanOptionalAction, default=default,
                               help=help_)
        elif "tuple" in hint:
            group.add_argument(opt, type=int, nargs="+", default=default, help=help_)
        else:
            base = next((t for t in (int, float, str) if t.__name__ in hint), str)
            group.add_argument(opt, type=base, default=default, help=help_)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n")[0])
    _add_dataclass_options(ap.add_argument_group("engine"), EngineConfig)
    _add_dataclass_options(ap.add_argument_group("server"), ServerConfig)
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
    d = vars(args)
    eng = {f.name: d[f.name] for f in dataclasses.fields(EngineConfig)}
    for k in ("token_buckets", "seq_buckets", "block_buckets"):
        if eng[k] is not None:
            eng[k] = tuple(eng[k])
    srv = {f.name: d[f.name] for f in dataclasses.fields(ServerConfig)}
    if srv["http_port"] == 0:
        srv["http_port"] = None  # --http-port 0 turns the HTTP front off
    return EngineConfig(**eng), ServerConfig(**srv)


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
    from jaxserve.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config)
    logger.info("model loaded in %.1fs (%s)", time.perf_counter() - t0, engine.loaded.path)
    if not args.no_warmup:
        dt = engine.warmup()
        logger.info("warmup compiled %d programs in %.1fs", engine.runner.num_compiles, dt)
    hooks = ()
    profiler = None
    if args.profile_dir:
        from jaxserve.profiling import StepWindowProfiler

        profiler = StepWindowProfiler(args.profile_dir, args.profile_steps)
        hooks = (profiler.on_step,)
    if args.profiler_port:
        from jaxserve.profiling import start_profiler_server

        start_profiler_server(args.profiler_port)
    asyncio.run(serve(engine, server_config, hooks))
    if profiler is not None:
        profiler.stop()
    return 0
