"""The socket front: the msgpack protocol of protocol.py over TCP, on the serving core.

Each generate request gets a task that forwards its outputs as frames; a connection that closes
aborts its requests, which returns their KV blocks at once. Malformed input only ever costs the
sender an error frame (or its connection, when the byte stream itself is broken). A prefill or
decode engine given the engines' secret serves only a peer that proves it (engine_secret.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from jaxserve.config import Role
from jaxserve.core.admission import LimitError
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import ParamError
from jaxserve.engine.llm_engine import QueueFullError
from jaxserve.serving import engine_secret
from jaxserve.serving.async_engine import RequestStream, StreamOverflow
from jaxserve.serving.core import ServingCore, engine_failure
from jaxserve.serving.flow import Watched, configure_transport
from jaxserve.serving.handover_frames import HandoverFrames
from jaxserve.serving.loras import LoRAError
from jaxserve.serving.protocol import (
    CLIENT_TYPES,
    ProtocolError,
    encode,
    parse_generate,
    read_frame,
)

logger = logging.getLogger(__name__)


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
        self.handler = asyncio.current_task()  # the task that reads its frames
        self.closed = False
        self.watched: Watched | None = None
        self._left: set[str] = set()  # engine ids already counted as left by their client
        self.abort_queued: set[str] = set()  # engine ids aborted before they were queued

    def left(self, core: ServingCore, engine_id: str) -> None:
        """Abort a request of this connection whose client is gone (again is harmless)."""
        first = engine_id not in self._left
        self._left.add(engine_id)
        core.client_left(engine_id, self.streams.get(engine_id), count=first)

    def send(self, msg: dict[str, Any]) -> None:
        if not self.closed:
            frame = encode(msg)
            self.writer.write(frame)
            if self.watched is not None:
                self.watched.written += len(frame)

    async def drain(self) -> None:
        if not self.closed:
            await self.writer.drain()

    def error(self, code: str, message: str, request_id: str | None = None,
              last: bool = False) -> None:
        """`last`: the frame before the server closes, written even after the client's
        half-close (its sending end is gone, its reading end may still be open)."""
        msg = {"type": "error", "code": code, "message": message}
        if request_id is not None:
            msg["id"] = request_id
        if last and self.closed and not self.writer.transport.is_closing():
            self.writer.write(encode(msg))
        else:
            self.send(msg)

    def kill(self) -> None:
        """Cut the connection off now (a client that stopped reading)."""
        self.writer.transport.abort()  # connection_lost follows: its requests are aborted


class SocketFront:
    def __init__(self, core: ServingCore, secret: bytes | None = None):
        """`secret`: the engines' secret, which a prefill or decode engine started by the
        launcher has; each connection must then prove it before any other frame."""
        self.core = core
        role = core.engine.config.role
        # a prefill or decode engine also speaks to the front of disaggregated serving
        self.worker = HandoverFrames(self) if role is not Role.BOTH else None
        self.secret = secret
        self._conn_numbers = itertools.count()
        self._conns: set[_Conn] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port -> the port bound."""
        limit = self.core.config.max_frame_bytes + 16

        def protocol() -> _Protocol:
            return _Protocol(asyncio.StreamReader(limit=limit), self._handle)

        self._server = await asyncio.get_running_loop().create_server(protocol, host, port)
        return self._server.sockets[0].getsockname()[1]

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close_connections(self, timeout_s: float = 1.0) -> None:
        """Close every connection, cutting off those that do not read their last frames, and
        let their handlers see the end (up to `timeout_s`): a handler still waiting when the
        event loop closes is cancelled, which asyncio logs as an error with a traceback."""
        for conn in list(self._conns):
            conn.closed = True
            if conn.writer.transport.get_write_buffer_size():
                conn.writer.transport.abort()
            else:
                conn.writer.close()
        if self._conns:
            await asyncio.wait([c.handler for c in self._conns], timeout=timeout_s)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(next(self._conn_numbers), writer)
        self._conns.add(conn)
        configure_transport(writer.transport)
        conn.watched = self.core.stall_watch.watch(writer.transport, conn.kill)
        proto = writer.transport.get_protocol()

        def gone() -> None:  # the client closed its end: nothing it asked for runs on
            conn.closed = True
            for engine_id in list(conn.active.values()):
                conn.left(self.core, engine_id)

        proto.on_gone = gone
        if proto.gone:
            gone()
        authed = self.core.config.api_key is None
        try:
            if self.secret is not None:  # the front of this engine's launch, or no one
                authed = await self._hello(conn, reader)
                if not authed:
                    return
            while not conn.closed:
                try:
                    msg = await read_frame(reader, self.core.config.max_frame_bytes)
                except ProtocolError as e:
                    conn.error(e.code, e.message, e.request_id, last=e.fatal)
                    if e.fatal:
                        if not writer.transport.is_closing():
                            await writer.drain()
                        break
                    continue
                if msg is None or conn.closed:
                    break
                kind = msg["type"]
                types = CLIENT_TYPES + (self.worker.TYPES if self.worker else ())
                if kind not in types:
                    conn.error("unknown_type", f"unknown frame type {kind!r}; expected one of "
                                               f"{list(types)}")
                elif kind == "auth":
                    authed = self.core.authorized(msg.get("api_key"))
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
                        engine_id = conn.active[cid]
                        if engine_id in conn.streams:
                            self.core.replicas.abort(engine_id)
                        else:  # still being queued: aborted once it is
                            conn.abort_queued.add(engine_id)
                    else:
                        conn.error("not_found", f"no active request with id {cid!r}",
                                   cid if isinstance(cid, str) else None)
                elif kind == "health":
                    ok = self.core.replicas.is_alive
                    conn.send({"type": "health", "status": "ok" if ok else "error"}
                              | self.core.replicas.health())
                elif kind == "stats":
                    conn.send({"type": "stats", **await self.core.stats()})
                else:
                    await self.worker.handle(conn, msg)
                await conn.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            gone()  # a disconnect (or a broken stream) frees its requests' blocks
            for task in conn.tasks:
                task.cancel()
            self.core.stall_watch.unwatch(conn.watched)
            self._conns.discard(conn)
            writer.close()

    async def _hello(self, conn: _Conn, reader: asyncio.StreamReader) -> bool:
        """Challenge the peer to prove the engines' secret; True when it does. Otherwise it
        gets an error and the connection closes, with the reason logged, before any frame of
        its runs."""
        mine = engine_secret.nonce()
        conn.send({"type": "challenge", "nonce": mine})
        try:
            msg = await read_frame(reader, self.core.config.max_frame_bytes)
            reason = _refusal(self.secret, mine, msg)
        except ProtocolError as e:
            reason = f"its first frame is malformed: {e.message}"
        if reason is None:
            conn.send({"type": "hello", "proof": engine_secret.proof(
                self.secret, "engine", mine, msg["nonce"])})
            return True
        host, port = conn.writer.get_extra_info("peername")[:2]
        logger.warning("refused connection %d from %s:%d: %s", conn.number, host, port, reason)
        conn.error("unauthorized", "this engine serves only the front of its launch: answer "
                                   "the challenge with a hello proving the engines' secret",
                   last=True)
        if not conn.writer.transport.is_closing():
            await conn.writer.drain()
        return False

    async def _generate(self, conn: _Conn, msg: dict) -> None:
        try:
            req = parse_generate(msg)
        except ProtocolError as e:
            conn.error(e.code, e.message, e.request_id)
            return
        if self.core.draining:
            conn.error("shutting_down", "the server is shutting down", req.id)
            return
        if req.id in conn.active:
            conn.error("duplicate_id", f"id {req.id!r} is already active on this connection",
                       req.id)
            return
        most = self.core.config.max_concurrent_per_connection
        if len(conn.active) >= most:
            conn.error("limit_exceeded", f"max_concurrent_per_connection ({most}) reached",
                       req.id)
            return
        engine_id = f"c{conn.number}-{req.id}"
        conn.active[req.id] = engine_id  # from here a disconnect aborts it
        # Queued off the read loop: the next frame (a 65th request, an abort) is read at once,
        # not after the engine thread took this one between two of its steps.
        task = asyncio.create_task(self._queue(conn, req, engine_id))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _queue(self, conn: _Conn, req, engine_id: str) -> None:
        try:
            ids = await self.core.prompt_ids(req.prompt, req.prompt_token_ids)
            if conn.closed:
                conn.active.pop(req.id, None)
                return
            lora = self.core.loras.from_frame(req)
            stream = await self.core.submit(engine_id, req.prompt, ids, req.params, req.priority,
                                            req.cache_salt, model=req.lora_name, lora=lora)
        except LimitError as e:
            conn.active.pop(req.id, None)
            conn.error("limit_exceeded", str(e), req.id)
            return
        except ParamError as e:  # the message starts with the field's name
            conn.active.pop(req.id, None)
            conn.error("invalid_field", f"params.{e}", req.id)
            return
        except QueueFullError as e:
            conn.active.pop(req.id, None)
            conn.error("queue_full", str(e), req.id)
            return
        except LoRAError as e:
            conn.active.pop(req.id, None)
            if e.status == 404:
                conn.error("not_found", f"lora_name: no LoRA adapter {req.lora_name!r} is "
                                        f"loaded", req.id)
            else:
                conn.error("invalid_field", str(e), req.id)
            return
        except ValueError as e:
            conn.active.pop(req.id, None)
            conn.error("invalid_request", str(e), req.id)
            return
        except Exception as e:  # noqa: BLE001 - e.g. a dead engine loop: this request fails
            conn.active.pop(req.id, None)
            conn.error("internal_error", f"{type(e).__name__}: {e}", req.id)
            return
        self.start_pump(conn, req.id, engine_id, stream, req.stream)
        if engine_id in conn.abort_queued:
            conn.abort_queued.discard(engine_id)
            self.core.replicas.abort(engine_id)

    def start_pump(self, conn: _Conn, cid: str, engine_id: str, stream: RequestStream,
                   want_stream: bool) -> None:
        """Forward a queued request's outputs to its connection as frames."""
        conn.streams[engine_id] = stream
        stream.on_overflow = lambda s: conn.kill()
        if conn.closed:  # the client left while the request was being queued
            conn.left(self.core, engine_id)
        task = asyncio.create_task(self._pump(conn, cid, engine_id, stream, want_stream))
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
                conn.left(self.core, engine_id)
            conn.active.pop(cid, None)
            conn.streams.pop(engine_id, None)


def _refusal(secret: bytes, mine: str, msg: dict | None) -> str | None:
    """Why a peer's first frame does not prove the secret for our nonce `mine` (None: it
    does)."""
    if msg is None:
        return "it closed before its hello"
    if msg["type"] != "hello":
        return f"its first frame is {msg['type']!r}, not a hello"
    if not isinstance(msg.get("nonce"), str):
        return "its hello has no nonce"
    if not engine_secret.is_proof(secret, msg.get("proof"), "front", mine, msg["nonce"]):
        return "its hello's proof is wrong (not this launch's secret)"
    return None


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
