"""The serving process: the socket protocol (see protocol.py) and, optionally, OpenAI-style HTTP.

One AsyncEngine thread keeps a single continuous batch full for every connection. Each generate
request gets a task that forwards its outputs as frames; a connection that closes aborts its
requests, which returns their KV blocks at once. Malformed input only ever costs the sender an
error frame (or its connection, when the byte stream itself is broken).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import itertools
import logging
import time
from typing import Any

from jaxserve.config import option
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import data_parallel
from jaxserve.engine.llm_engine import LLMEngine, QueueFullError
from jaxserve.serving.async_engine import RequestStream, StreamOverflow
from jaxserve.serving.flow import StallWatch, Watched, configure_transport
from jaxserve.serving.prometheus import PrometheusExporter
from jaxserve.serving.protocol import (
    CLIENT_TYPES,
    ProtocolError,
    encode,
    parse_generate,
    read_frame,
)
from jaxserve.serving.replicas import ReplicaSet

logger = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address both fronts bind to")
    port: int = option(7070, "socket protocol port (0: any free port)")
    http_port: int | None = option(8000, "OpenAI-compatible HTTP port (0: off)")
    api_key: str | None = option(None, "clients must present this key (socket auth frame, "
                                       "HTTP Bearer)")
    max_frame_bytes: int = option(1 << 20, "largest socket frame or HTTP body, in bytes")
    max_prompt_tokens: int | None = option(None, "longest prompt accepted (default: "
                                                 "max_model_len)")
    max_tokens_limit: int | None = option(None, "largest max_tokens a request may ask "
                                                "(default: no cap)")
    max_concurrent_per_connection: int = option(64, "live requests one socket connection may "
                                                    "hold")
    max_queue_per_request: int = option(256, "outputs buffered for a client that does not "
                                             "read before its request is aborted")
    write_stall_timeout_s: float = option(10.0, "a client whose unread output stops moving "
                                                "this long is cut off (see serving/flow.py)")
    shutdown_timeout_s: float = option(10.0, "on SIGINT/SIGTERM, how long in-flight requests "
                                             "may finish before they are aborted")
    public_metrics: bool = option(False, "serve GET /metrics without the API key (it needs "
                                         "the key when --api-key is set)")
    model_name: str = option("jaxserve", "the model id /v1/models reports and requests name")

    def __post_init__(self):
        for name in ("max_frame_bytes", "max_concurrent_per_connection", "max_queue_per_request",
                     "write_stall_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class LimitError(ValueError):
    """A request over one of the server's limits; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Protocol(asyncio.StreamReaderProtocol):
    """Reports the client's end of stream the moment it arrives, before the frames sent ahead
    of it are read: requests a client pipelined and then left are never started."""

    def __init__(self, reader: asyncio.StreamReader, connected):
        super().__init__(reader, connected)
        self.gone = False
        self.on_gone = None

    def _peer_gone(self) -> None:
        if not self.gone:
            self.gone = True
            if self.on_gone is not None:
                self.on_gone()

    def eof_received(self):
        self._peer_gone()
        return super().eof_received()

    def connection_lost(self, exc):
        self._peer_gone()
        super().connection_lost(exc)


class _Conn:
    def __init__(self, number: int, writer: asyncio.StreamWriter):
        self.number = number
        self.writer = writer
        self.active: dict[str, str] = {}  # client id -> engine id
        self.streams: dict[str, RequestStream] = {}  # engine id -> its outputs
        self.tasks: set[asyncio.Task] = set()
        self.closed = False
        self.watched: Watched | None = None
        self._left: set[str] = set()  # engine ids already counted as left by their client

    def left(self, server: Server, engine_id: str) -> None:
        """Abort a request of this connection whose client is gone (again is harmless)."""
        first = engine_id not in self._left
        self._left.add(engine_id)
        server.client_left(engine_id, self.streams.get(engine_id), count=first)

    def send(self, msg: dict[str, Any]) -> None:
        if not self.closed:
            frame = encode(msg)
            self.writer.write(frame)
            if self.watched is not None:
                self.watched.written += len(frame)

    async def drain(self) -> None:
        if not self.closed:
            await self.writer.drain()

    def error(self, code: str, message: str, request_id: str | None = None) -> None:
        msg = {"type": "error", "code": code, "message": message}
        if request_id is not None:
            msg["id"] = request_id
        self.send(msg)

    def kill(self) -> None:
        """Cut the connection off now (a client that stopped reading)."""
        self.writer.transport.abort()  # connection_lost follows: its requests are aborted


class Server:
    def __init__(self, engines: LLMEngine | list[LLMEngine], config: ServerConfig | None = None,
                 step_hooks: tuple = ()):
        """`engines`: one engine, or the data-parallel replicas of
        engine/data_parallel.build_replicas (requests are routed among them)."""
        engines = engines if isinstance(engines, list) else [engines]
        self.engine = engines[0]  # all replicas share its tokenizer and config
        self.config = config or ServerConfig()
        router = data_parallel.make_router(engines)
        self.exporter = PrometheusExporter(router)

        def on_step(replica, engine, outputs):
            self.exporter.update(engine, outputs, replica)
            for hook in step_hooks:  # each: hook(engine, outputs), on the replica's thread
                hook(engine, outputs)

        self.replicas = ReplicaSet(engines, router, self.config.max_queue_per_request, on_step)
        self._conn_numbers = itertools.count()
        self._conns: set[_Conn] = set()
        self._socket_server: asyncio.base_events.Server | None = None
        self._http_runner = None
        self.draining = False
        self.socket_port: int | None = None
        self.http_port: int | None = None
        self._ids = itertools.count()
        self.stall_watch = StallWatch(self.config.write_stall_timeout_s)
        # Prompts are tokenized here, off the event loop (the tokenizer releases the GIL), one
        # at a time; a prompt too long to possibly fit is refused before it is read at all.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, "jaxserve-tokenize")
        tok = self.engine.tokenizer
        self._max_token_chars = (max(map(len, tok.get_vocab())) if tok is not None else 0)
        self.num_disconnects = 0  # requests whose client left before their end

    # --------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.replicas.start()
        self.stall_watch.start()
        cfg = self.config
        loop = asyncio.get_running_loop()

        def protocol() -> _Protocol:
            return _Protocol(asyncio.StreamReader(limit=cfg.max_frame_bytes + 16), self._handle)

        self._socket_server = await loop.create_server(protocol, cfg.host, cfg.port)
        self.socket_port = self._socket_server.sockets[0].getsockname()[1]
        if cfg.http_port is not None:
            from aiohttp import web

            from jaxserve.serving.openai_http import build_app

            # handler_cancellation: a client that disconnects cancels its handler, whose
            # cleanup aborts the request. The drain before shutdown has its own deadline.
            self._http_runner = web.AppRunner(build_app(self), access_log=None,
                                              handler_cancellation=True, shutdown_timeout=1.0)
            await self._http_runner.setup()
            site = web.TCPSite(self._http_runner, cfg.host, cfg.http_port)
            await site.start()
            self.http_port = site._server.sockets[0].getsockname()[1]

    def where(self) -> str:
        s = f"socket {self.config.host}:{self.socket_port}"
        if self.http_port is not None:
            s += f", OpenAI HTTP http://{self.config.host}:{self.http_port}/v1"
        return s

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish within the deadline, abort the rest,
        then close every connection, stuck ones included; returns within about
        `shutdown_timeout_s` + 2 s whatever the clients do."""
        self.draining = True
        if self._socket_server is not None:
            self._socket_server.close()
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        try:
            while time.monotonic() < deadline:
                if not any(await self.replicas.call_all(lambda e: e.num_unfinished_requests)):
                    break
                await asyncio.sleep(0.05)
            await self.replicas.call_all(lambda e: [e.abort(r) for r in list(e.requests)])
        except RuntimeError:  # the engine loop is gone: nothing left to finish
            pass
        await asyncio.sleep(0.2)  # let the final "abort" frames go out
        for conn in list(self._conns):
            conn.closed = True
            if conn.writer.transport.get_write_buffer_size():
                conn.writer.transport.abort()  # a client that does not read its last frames
            else:
                conn.writer.close()
        self.stall_watch.stop()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        self.replicas.stop()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------------------- shared helpers

    def new_engine_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                         params: SamplingParams) -> list[int] | None:
        """The request's prompt as token ids, within the server's limits; raises LimitError.
        A request without max_tokens is capped at `max_tokens_limit`, when there is one.

        The event loop never tokenizes: a prompt with more characters than the limit's tokens
        could hold (each at most the vocabulary's longest token) is refused unread, and any
        other goes to the tokenizer thread."""
        cfg = self.config
        max_tokens = params.max_tokens
        if (cfg.max_tokens_limit is not None and max_tokens is not None
                and max_tokens > cfg.max_tokens_limit):
            raise LimitError(f"max_tokens {max_tokens} exceeds the server's max_tokens_limit "
                             f"({cfg.max_tokens_limit})", "max_tokens")
        limit = self.prompt_token_limit
        ids = prompt_token_ids
        if ids is None and prompt is not None and self.engine.tokenizer is not None:
            if len(prompt) > self.max_prompt_chars:
                raise LimitError(f"prompt has {len(prompt)} characters, more than "
                                 f"max_prompt_tokens ({limit}) tokens can hold", "prompt")
            ids = await self.off_loop(self._encode, prompt)
        if ids is not None and len(ids) > limit:
            raise LimitError(f"prompt has {len(ids)} tokens, more than max_prompt_tokens "
                             f"({limit})", "prompt")
        if params.structured_outputs is not None and self.engine.grammars is not None:
            try:  # compiled here, on the tokenizer thread: the engine thread finds it ready
                await self.off_loop(self.engine.grammars.check, params.structured_outputs)
            except ValueError as e:
                raise LimitError(str(e), "structured_outputs") from None
        if max_tokens is None and cfg.max_tokens_limit is not None and ids is not None:
            room = self.engine.config.max_model_len - len(ids)
            params.max_tokens = max(1, min(cfg.max_tokens_limit, room))
        return ids

    @property
    def prompt_token_limit(self) -> int:
        return self.config.max_prompt_tokens or self.engine.config.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """No prompt longer than this can fit max_prompt_tokens."""
        return self.prompt_token_limit * max(self._max_token_chars, 1)

    async def off_loop(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args, **kwargs))

    def _encode(self, prompt: str) -> list[int]:  # the tokenizer thread; what the engine does
        return self.engine.tokenizer(prompt).input_ids

    async def submit(self, engine_id: str, prompt, prompt_token_ids, params,
                     priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        return await self.replicas.add_request(engine_id, prompt, params,
                                               prompt_token_ids=prompt_token_ids,
                                               priority=priority, cache_salt=cache_salt)

    def client_left(self, engine_id: str, stream: RequestStream | None,
                    count: bool = True) -> None:
        """The client of an unfinished request is gone: abort it; what it still generates
        before the abort lands counts as `tokens_after_disconnect`. `count`: the first time
        for this request (it counts once in `num_disconnects`)."""
        if stream is not None:
            if stream.finished:
                return
            stream.orphaned = True
        self.num_disconnects += count
        self.replicas.abort(engine_id)

    async def stats(self) -> dict:
        """The engines' figures (summed over replicas) plus the server's own."""
        snap = data_parallel.merge_snapshots(
            await self.replicas.call_all(lambda e: e.metrics_snapshot()))
        return {**snap, "num_disconnects": self.num_disconnects,
                "tokens_after_disconnect": self.replicas.tokens_after_disconnect,
                "num_slow_readers_cut_off": self.stall_watch.num_cut_off}

    def authorized(self, key: str | None) -> bool:
        want = self.config.api_key
        if want is None:
            return True
        return isinstance(key, str) and hmac.compare_digest(key.encode(), want.encode())

    # --------------------------------------------------------------------------- socket side

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(next(self._conn_numbers), writer)
        self._conns.add(conn)
        configure_transport(writer.transport)
        conn.watched = self.stall_watch.watch(writer.transport, conn.kill)
        proto = writer.transport.get_protocol()

        def gone() -> None:  # the client closed its end: nothing it asked for runs on
            conn.closed = True
            for engine_id in list(conn.active.values()):
                conn.left(self, engine_id)

        proto.on_gone = gone
        if proto.gone:
            gone()
        authed = self.config.api_key is None
        try:
            while not conn.closed:
                try:
                    msg = await read_frame(reader, self.config.max_frame_bytes)
                except ProtocolError as e:
                    conn.error(e.code, e.message, e.request_id)
                    if e.fatal:
                        await conn.drain()
                        break
                    continue
                if msg is None or conn.closed:
                    break
                kind = msg["type"]
                if kind not in CLIENT_TYPES:
                    conn.error("unknown_type", f"unknown frame type {kind!r}; expected one of "
                                               f"{list(CLIENT_TYPES)}")
                elif kind == "auth":
                    authed = self.authorized(msg.get("api_key"))
                    if authed:
                        conn.send({"type": "auth", "status": "ok"})
                    else:
                        conn.error("unauthorized", "invalid api_key")
                elif not authed:
                    rid = msg.get("id")
                    conn.error("unauthorized", "send an auth frame with the api_key first",
                               rid if isinstance(rid, str) else None)
                elif kind == "generate":
                    await self._generate(conn, msg)
                elif kind == "abort":
                    cid = msg.get("id")
                    if isinstance(cid, str) and cid in conn.active:
                        self.replicas.abort(conn.active[cid])
                    else:
                        conn.error("not_found", f"no active request with id {cid!r}",
                                   cid if isinstance(cid, str) else None)
                elif kind == "health":
                    ok = self.replicas.is_alive
                    conn.send({"type": "health", "status": "ok" if ok else "error"})
                elif kind == "stats":
                    conn.send({"type": "stats", **await self.stats()})
                await conn.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            gone()  # a disconnect (or a broken stream) frees its requests' blocks
            for task in conn.tasks:
                task.cancel()
            self.stall_watch.unwatch(conn.watched)
            self._conns.discard(conn)
            writer.close()

    async def _generate(self, conn: _Conn, msg: dict) -> None:
        try:
            req = parse_generate(msg)
        except ProtocolError as e:
            conn.error(e.code, e.message, e.request_id)
            return
        if self.draining:
            conn.error("shutting_down", "the server is shutting down", req.id)
            return
        if req.id in conn.active:
            conn.error("duplicate_id", f"id {req.id!r} is already active on this connection",
                       req.id)
            return
        if len(conn.active) >= self.config.max_concurrent_per_connection:
            conn.error("limit_exceeded", f"max_concurrent_per_connection "
                                         f"({self.config.max_concurrent_per_connection}) reached",
                       req.id)
            return
        try:
            req.params.validate(self.engine.config.max_logprobs)
        except ValueError as e:  # the message starts with the field's name
            conn.error("invalid_field", f"params.{e}", req.id)
            return
        engine_id = f"c{conn.number}-{req.id}"
        conn.active[req.id] = engine_id  # from here a disconnect aborts it
        try:
            ids = await self.prompt_ids(req.prompt, req.prompt_token_ids, req.params)
            if conn.closed:
                conn.active.pop(req.id, None)
                return
            stream = await self.submit(engine_id, req.prompt, ids, req.params, req.priority,
                                       req.cache_salt)
        except LimitError as e:
            conn.active.pop(req.id, None)
            conn.error("limit_exceeded", str(e), req.id)
            return
        except QueueFullError as e:
            conn.active.pop(req.id, None)
            conn.error("queue_full", str(e), req.id)
            return
        except ValueError as e:
            conn.active.pop(req.id, None)
            conn.error("invalid_request", str(e), req.id)
            return
        conn.streams[engine_id] = stream
        stream.on_overflow = lambda s: conn.kill()
        if conn.closed:  # the client left while the request was being queued
            conn.left(self, engine_id)
        task = asyncio.create_task(self._pump(conn, req.id, engine_id, stream, req.stream))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _pump(self, conn: _Conn, cid: str, engine_id: str, stream: RequestStream,
                    want_stream: bool):
        try:
            async for out in stream:
                for comp in out.outputs if want_stream else ():
                    if comp.new_token_ids and comp.finish_reason != "abort":
                        frame = {"type": "token", "id": cid, "index": comp.index,
                                 "text": comp.new_text, "token_ids": comp.new_token_ids}
                        if comp.logprobs is not None:
                            end = len(comp.token_ids)  # the list may have grown since
                            frame["logprobs"] = wire_logprobs(
                                comp.logprobs[end - len(comp.new_token_ids):end])
                        conn.send(frame)
                if out.finished:
                    failure = engine_failure(out)
                    if failure is not None:
                        conn.error("internal_error", failure, cid)
                    else:
                        conn.send(done_frame(cid, out))
                await conn.drain()
        except (ConnectionError, asyncio.CancelledError, StreamOverflow):
            pass
        finally:
            if not stream.finished:  # before the stream is dropped: left() marks it orphaned
                conn.left(self, engine_id)
            conn.active.pop(cid, None)
            conn.streams.pop(engine_id, None)


def engine_failure(out: RequestOutput) -> str | None:
    """What to tell the client of a request that failed inside the engine (None if it did
    not)."""
    if out.outputs[0].finish_reason != "error":
        return None
    return f"the request failed in the engine: {out.metrics.error}"


def done_frame(cid: str, out: RequestOutput) -> dict[str, Any]:
    """The first sample's fields at the top; with n > 1 every sample under "choices"."""
    comp = out.outputs[0]
    m = out.metrics
    frame = {"type": "done", "id": cid, "finish_reason": comp.finish_reason,
             "stop_reason": comp.stop_reason, "text": comp.text, "token_ids": comp.token_ids,
             "prompt_tokens": len(out.prompt_token_ids),
             "completion_tokens": sum(len(c.token_ids) for c in out.outputs),
             "ttft": m.ttft, "e2e": m.e2e}
    if comp.logprobs is not None:
        frame["logprobs"] = wire_logprobs(comp.logprobs)
    if out.prompt_logprobs is not None:
        frame["prompt_logprobs"] = wire_logprobs(out.prompt_logprobs)
    if len(out.outputs) > 1:
        frame["choices"] = [{"index": c.index, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason, "text": c.text,
                             "token_ids": c.token_ids}
                            | ({"logprobs": wire_logprobs(c.logprobs)}
                               if c.logprobs is not None else {}) for c in out.outputs]
    return frame


def wire_logprobs(entries: list[dict | None]) -> list[dict | None]:
    """Logprob entries as frames carry them: msgpack maps take string keys only, so each
    entry's top tokens go as [[token id, logprob], ...], best first."""
    return [None if e is None else {k: v for k, v in e.items() if k != "top"}
            | {"top": [[t, lp] for t, lp in e["top"].items()]} for e in entries]
