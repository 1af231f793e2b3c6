"""AsyncEngine: one background thread owns the LLMEngine and steps it while there is work.

Requests enter from any asyncio task (any number of connections) through a thread-safe command
queue; the engine thread applies commands between steps, so the engine itself is never touched
by two threads. Outputs go back through one `loop.call_soon_threadsafe` per step and event loop,
each into its request's bounded asyncio queue. The engine thread never blocks on a consumer:
when a request's queue is full (its client stopped reading), the request is marked overflowed
and aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class StreamOverflow(Exception):
    """The request's client did not take its outputs fast enough; the request was aborted."""


_OVERFLOW = object()  # the last item of an overflowed stream


class RequestStream:
    """The outputs of one request, consumed on the asyncio loop that created it.

    At most `maxsize` outputs wait for the consumer; one more aborts the request (through
    `on_overflow`) and ends the stream: the consumer's next read raises StreamOverflow, so a
    consumer never waits for a final output that will not come."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, maxsize: int):
        self.request_id = request_id
        self.loop = loop
        self.maxsize = maxsize
        self.queue: asyncio.Queue = asyncio.Queue()  # bounded by maxsize in _put
        self.overflowed = False
        self.finished = False
        self.orphaned = False  # its client is gone; an abort is on its way to the engine
        self.on_overflow: Callable[[RequestStream], None] | None = None

    def _put(self, out: RequestOutput) -> None:  # runs on the stream's loop
        if self.overflowed:
            return
        if self.queue.qsize() >= self.maxsize:
            self.overflowed = True
            self.queue.put_nowait(_OVERFLOW)
            if self.on_overflow:
                self.on_overflow(self)
            return
        self.queue.put_nowait(out)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out is _OVERFLOW:
            self.finished = True
            raise StreamOverflow(f"request {self.request_id}: more than {self.maxsize} outputs "
                                 f"were waiting for the client")
        self.finished = out.finished
        return out


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue_per_request: int = 256,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.max_queue_per_request = max_queue_per_request
        self.on_step = on_step  # called on the engine thread after every step
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self.error: BaseException | None = None
        self.tokens_after_disconnect = 0  # generated for streams whose client had gone

    # --------------------------------------------------------------------------- asyncio side

    def start(self) -> None:
        self._thread.start()

    async def add_request(self, request_id: str, prompt: str | None = None,
                          params: SamplingParams | None = None, *,
                          prompt_token_ids: list[int] | None = None,
                          priority: int = 0, cache_salt: str | None = None,
                          pooling: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request; raises what LLMEngine.add_request raises (ValueError, ...).
        `pooling`: an embedding request (its finished output carries `embedding`);
        `lora_request`: the adapter it runs under."""
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               self.max_queue_per_request)
        stream.on_overflow = lambda s: self.abort(s.request_id)
        kwargs = dict(prompt=prompt, params=params, prompt_token_ids=prompt_token_ids,
                      priority=priority, arrival_time=time.perf_counter(),
                      cache_salt=cache_salt, pooling=pooling, lora_request=lora_request)
        await self._add(stream, "add", kwargs)
        return stream

    async def take_over(self, request_id: str, **kwargs) -> tuple[RequestStream, Any]:
        """A decode engine takes a prefilled request over: engine.handover.reserve(request_id,
        **kwargs) on the engine thread; its stream and the Reservation (or what it raises)."""
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               self.max_queue_per_request)
        stream.on_overflow = lambda s: self.abort(s.request_id)
        return stream, await self._add(stream, "take_over", kwargs)

    async def _add(self, stream: RequestStream, kind: str, kwargs: dict) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send((kind, stream, kwargs, fut))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller is gone (a client that disconnected), but
            self.abort(stream.request_id)  # the engine may queue it anyway: abort after it
            raise

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, None, None))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, None, fut))
        return await asyncio.wrap_future(fut)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, cmd) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"engine loop is not running ({self.error!r})")
        self._cmds.put(cmd)
        self._wake.set()

    # ----------------------------------------------------------------------------- engine side

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, a, b, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue  # its caller is gone (cancelled while it waited): nothing to do
            try:
                if kind == "add":
                    self.engine.add_request(a.request_id, **b)
                    self._streams[a.request_id] = a
                    fut.set_result(None)
                elif kind == "take_over":
                    reservation = self.engine.handover.reserve(a.request_id, **b)
                    self._streams[a.request_id] = a
                    fut.set_result(reservation)
                elif kind == "abort":
                    self.engine.abort(a)  # its "abort" output comes from the next step()
                elif kind == "call":
                    fut.set_result(a(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
                if fut is not None:
                    fut.set_exception(e)

    def _run(self) -> None:
        """Step while there is work. Nothing a request does ends this loop: the engine fails a
        request whose own values or tokens break a step; anything else that escapes a step
        fails the requests in flight, and the loop goes on serving new ones."""
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:  # new requests and aborts join between a step's end and the next launch
                    outputs = self.engine.step_overlapped(self._apply_commands)
                except Exception as e:  # noqa: BLE001
                    logger.exception("engine step failed; failing the requests in flight")
                    self.engine.fail_all(f"internal error: {type(e).__name__}: {e}")
                    outputs = self.engine.take_pending_outputs()
                self._deliver(outputs)
        except BaseException as e:  # the server reports a dead loop through health checks
            self.error = e
            logger.exception("engine loop died")
            raise

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = (self._streams.pop(out.request_id, None) if out.finished
                      else self._streams.get(out.request_id))
            if stream is not None:
                if stream.orphaned:
                    self.tokens_after_disconnect += len(out.outputs[0].new_token_ids)
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():  # one wakeup of each loop per step
            loop.call_soon_threadsafe(_put_all, items)
        if self.on_step is not None:
            try:
                self.on_step(self.engine, outputs)
            except Exception:  # noqa: BLE001 - a metrics hook must not stop serving
                logger.exception("step hook failed")
