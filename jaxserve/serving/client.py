"""Clients for the socket protocol (see protocol.py): `Client` (blocking) and `AsyncClient`.

    with Client(port=7070) as c:
        done = c.generate("Hello", max_tokens=16, temperature=0)          # the "done" frame
        for frame in c.generate_stream("Hello", max_tokens=16):           # token..., done
            print(frame.get("text", ""), end="")

    async with AsyncClient(port=7070) as c:
        async for frame in c.generate_stream("Hello", max_tokens=16): ...

Errors from the server raise `ServerError` (with its code), both for whole requests and inside
streams.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

from jaxserve.core.sampling_params import param_names
from jaxserve.serving.protocol import HEADER, decode_body, encode


class ServerError(Exception):
    def __init__(self, frame: dict[str, Any]):
        super().__init__(f"{frame.get('code')}: {frame.get('message')}")
        self.code = frame.get("code")
        self.frame = frame


def _generate_frame(rid: str, prompt, prompt_token_ids, stream: bool, priority: int,
                    params: dict[str, Any], lora_name: str | None = None) -> dict[str, Any]:
    unknown = set(params) - set(param_names())
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    msg = {"type": "generate", "id": rid, "params": params, "stream": stream,
           "priority": priority}
    if lora_name is not None:
        msg["lora_name"] = lora_name
    if prompt_token_ids is not None:
        msg["prompt_token_ids"] = list(prompt_token_ids)
    else:
        msg["prompt"] = prompt
    return msg


class Client:
    """Blocking client; one request in flight at a time per client (frames of others queue)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7070, api_key: str | None = None,
                 timeout: float | None = 300.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._ids = itertools.count()
        self._pending: list[dict] = []
        if api_key is not None:
            self._send({"type": "auth", "api_key": api_key})
            self._expect("auth")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.sock.close()

    def _send(self, msg: dict) -> None:
        self.sock.sendall(encode(msg))

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
        return bytes(buf)

    def _recv(self) -> dict:
        if self._pending:
            return self._pending.pop(0)
        (n,) = HEADER.unpack(self._read_exact(HEADER.size))
        return decode_body(self._read_exact(n))

    def _expect(self, kind: str) -> dict:
        while True:
            frame = self._recv()
            if frame["type"] == "error" and "id" not in frame:
                raise ServerError(frame)
            if frame["type"] == kind:
                return frame

    def health(self) -> dict:
        self._send({"type": "health"})
        return self._expect("health")

    def stats(self) -> dict:
        self._send({"type": "stats"})
        return self._expect("stats")

    def abort(self, request_id: str) -> None:
        self._send({"type": "abort", "id": request_id})

    def generate_stream(self, prompt: str | None = None, *, prompt_token_ids=None,
                        request_id: str | None = None, priority: int = 0,
                        lora_name: str | None = None, **params) -> Iterator[dict]:
        """Yields the request's token frames, then its done frame."""
        rid = request_id or f"req-{next(self._ids)}"
        self._send(_generate_frame(rid, prompt, prompt_token_ids, True, priority, params,
                                   lora_name))
        while True:
            frame = self._recv()
            if frame["type"] == "error" and "id" not in frame:
                raise ServerError(frame)  # about the connection, e.g. unauthorized
            if frame.get("id") != rid:
                continue  # a reply to something else (e.g. a late abort error)
            if frame["type"] == "error":
                raise ServerError(frame)
            yield frame
            if frame["type"] == "done":
                return

    def generate(self, prompt: str | None = None, *, prompt_token_ids=None,
                 request_id: str | None = None, priority: int = 0,
                 lora_name: str | None = None, **params) -> dict:
        """The done frame (text, token_ids, finish_reason, ttft, e2e ...)."""
        rid = request_id or f"req-{next(self._ids)}"
        self._send(_generate_frame(rid, prompt, prompt_token_ids, False, priority, params,
                                   lora_name))
        while True:
            frame = self._recv()
            if frame["type"] == "error" and "id" not in frame:
                raise ServerError(frame)
            if frame.get("id") != rid:
                continue
            if frame["type"] == "error":
                raise ServerError(frame)
            if frame["type"] == "done":
                return frame


class AsyncClient:
    """asyncio client: any number of concurrent requests over one connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7070, api_key: str | None = None):
        self.host, self.port, self.api_key = host, port, api_key
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._replies: dict[str, asyncio.Queue] = {"health": asyncio.Queue(),
                                                   "stats": asyncio.Queue(),
                                                   "auth": asyncio.Queue(),
                                                   "error": asyncio.Queue()}
        self._reader_task: asyncio.Task | None = None

    async def connect(self) -> AsyncClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                 limit=1 << 24)
        self._reader_task = asyncio.create_task(self._read_loop())
        if self.api_key is not None:
            self.writer.write(encode({"type": "auth", "api_key": self.api_key}))
            await self._reply("auth")
        return self

    async def __aenter__(self):
        return await self.connect()

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._reader_task:
            self._reader_task.cancel()
        self.writer.close()

    async def _read_loop(self) -> None:
        try:
            while True:
                (n,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
                frame = decode_body(await self.reader.readexactly(n))
                rid = frame.get("id")
                if rid in self._queues:
                    self._queues[rid].put_nowait(frame)
                elif frame["type"] in self._replies:
                    self._replies[frame["type"]].put_nowait(frame)
        except (asyncio.IncompleteReadError, ConnectionError):
            closed = {"type": "error", "code": "closed", "message": "connection closed"}
            for q in list(self._queues.values()) + list(self._replies.values()):
                q.put_nowait(closed)

    async def _reply(self, kind: str) -> dict:
        frame = await self._replies[kind].get()
        if frame["type"] == "error":
            raise ServerError(frame)
        return frame

    async def health(self) -> dict:
        self.writer.write(encode({"type": "health"}))
        return await self._reply("health")

    async def stats(self) -> dict:
        self.writer.write(encode({"type": "stats"}))
        return await self._reply("stats")

    async def abort(self, request_id: str) -> None:
        self.writer.write(encode({"type": "abort", "id": request_id}))
        await self.writer.drain()

    async def generate_stream(self, prompt: str | None = None, *, prompt_token_ids=None,
                              request_id: str | None = None, priority: int = 0,
                              stream: bool = True, lora_name: str | None = None,
                              **params) -> AsyncIterator[dict]:
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        try:
            self.writer.write(encode(_generate_frame(rid, prompt, prompt_token_ids, stream,
                                                     priority, params, lora_name)))
            await self.writer.drain()
            while True:
                frame = await q.get()
                if frame["type"] == "error":
                    raise ServerError(frame)
                yield frame
                if frame["type"] == "done":
                    return
        finally:
            self._queues.pop(rid, None)

    async def generate(self, prompt: str | None = None, **kw) -> dict:
        async for frame in self.generate_stream(prompt, stream=False, **kw):
            if frame["type"] == "done":
                return frame
        raise ServerError({"code": "closed", "message": "no done frame"})
