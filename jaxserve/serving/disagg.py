"""The front of disaggregated serving: prefill and decode engines in their own processes, one
front that clients see (both fronts' ports, over serving/core.py), and the handover between.

Each engine process is `scripts/serve.py --role prefill|decode`; the front keeps one socket
connection to each (EngineLink) and drives a request through them (DisaggSet, which takes the
place of the colocated ReplicaSet):

1. a prefill engine, picked by the prefix-aware router (core/router.py), runs the prompt and
   sends the first token, then holds the request's blocks;
2. the least-loaded decode engine takes the request with its first token and reserves its
   blocks, keeping those its prefix cache holds by name; when every decode engine refuses for
   want of room, the front waits and asks again;
3. the prefill engine offers the other blocks; the decode engine pulls them
   (runtime/kv_transfer.py) and decodes; the prefill engine is told to free its copy.

Frames: serving/handover_frames.py. Under the launcher the engines serve only a front that
proves their secret, and each handover's blocks wait under a number only the secret gives
(serving/engine_secret.py). With n > 1 each sample is its own request through the engines
(seeds as one engine gives its samples) and the front merges their outputs. An engine whose
connection drops fails the requests it held, with an error naming it; the others go on, and
/health and /metrics name it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.config import EngineConfig, option
from jaxserve.core import admission
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.core.router import Router
from jaxserve.core.sampling_params import SamplingParams, fold_seed
from jaxserve.engine.llm_engine import QueueFullError
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.models.loader import load_model
from jaxserve.models.lora import load_adapter
from jaxserve.serving import engine_secret
from jaxserve.serving.async_engine import RequestStream
from jaxserve.serving.protocol import ProtocolError, encode, logprob_from_wire, read_frame

logger = logging.getLogger(__name__)

_GONE = {"type": "gone"}  # what a link's queues get when its connection drops
_MAX_FRAME = 1 << 26
_REFUSED = {"queue_full", "invalid_field", "invalid_request", "limit_exceeded"}


class EngineLink:
    """One connection to an engine process; frames are sorted to the request they name."""

    def __init__(self, name: str, role: str, address: str, api_key: str | None = None,
                 secret: bytes | None = None):
        """`secret`: the engines' secret, proved in place of `api_key`."""
        self.name, self.role, self.address, self.api_key = name, role, address, api_key
        self.secret = secret
        self.alive = False
        self.info: dict = {}
        self.in_flight = 0  # requests it holds for this front
        self.queues: dict[str, asyncio.Queue] = {}
        self._replies: asyncio.Queue = asyncio.Queue()  # frames that name no request
        self._ask_lock = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None

    @property
    def gone_message(self) -> str:
        return f"the {self.role} engine {self.name} ({self.address}) is gone"

    async def connect(self, timeout_s: float) -> None:
        """Connect, retrying while the engine process starts (it compiles first)."""
        host, port = self.address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_connection(host, int(port),
                                                                     limit=_MAX_FRAME)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{self.role} engine {self.name} at {self.address} "
                                          f"did not answer within {timeout_s:.0f}s") from None
                await asyncio.sleep(0.2)
        self.alive = True
        self._task = asyncio.create_task(self._read(reader))
        if self.secret is not None:
            await self._hello()
        elif self.api_key is not None:
            await self.ask({"type": "auth", "api_key": self.api_key})
        self.info = await self.ask({"type": "engine_info"})
        if self.info.get("role") != self.role:
            raise ConnectionError(f"{self.address} is a {self.info.get('role')} engine, not a "
                                  f"{self.role} engine")

    async def _hello(self) -> None:
        """Answer the engine's challenge with a proof of the secret, and check its proof back:
        a process that took an engine's port gets no request."""
        where = f"{self.role} engine {self.name} at {self.address}"
        try:
            challenge = await asyncio.wait_for(self._replies.get(), 30.0)
        except TimeoutError:
            challenge = _GONE
        if challenge["type"] != "challenge" or not isinstance(challenge.get("nonce"), str):
            raise ConnectionError(f"{where} sent no challenge: it was not started with the "
                                  f"engines' secret")
        theirs, mine = challenge["nonce"], engine_secret.nonce()
        reply = await self.ask({"type": "hello", "nonce": mine, "proof": engine_secret.proof(
            self.secret, "front", theirs, mine)})
        if not engine_secret.is_proof(self.secret, reply.get("proof"), "engine", theirs, mine):
            raise ConnectionError(f"{where} did not prove the engines' secret")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def send(self, msg: dict) -> None:
        if not self.alive:
            raise ConnectionError(self.gone_message)
        self._writer.write(encode(msg))

    def open(self, request_id: str) -> asyncio.Queue:
        q = self.queues[request_id] = asyncio.Queue()
        if not self.alive:
            q.put_nowait(_GONE)
        return q

    def drop(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def ask(self, msg: dict, timeout_s: float = 30.0) -> dict:
        """Send a frame that names no request and wait for its answer."""
        async with self._ask_lock:
            self.send(msg)
            reply = await asyncio.wait_for(self._replies.get(), timeout_s)
        if reply is _GONE:
            raise ConnectionError(self.gone_message)
        if reply["type"] == "error":
            raise ConnectionError(f"{self.name}: {reply['message']}")
        return reply

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_frame(reader, _MAX_FRAME)) is not None:
                rid = msg.get("id")
                if rid is None:
                    self._replies.put_nowait(msg)
                elif rid in self.queues:
                    self.queues[rid].put_nowait(msg)
        except (ConnectionError, ProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            if self.alive:
                logger.error("%s", self.gone_message)
            self.alive = False
            for q in self.queues.values():
                q.put_nowait(_GONE)
            self._replies.put_nowait(_GONE)


@dataclasses.dataclass(slots=True)
class HandoverCounts:
    """The front's record of finished handovers (what /metrics shows)."""

    num: int = 0
    bytes: int = 0
    seconds: float = 0.0  # the decode engines' pull times
    blocks_cached: int = 0  # prompt blocks the decode side held already: not sent
    num_failed: int = 0
    num_waited: int = 0  # handovers that waited because every decode engine was full
    last_bytes: int = 0
    last_seconds: float = 0.0


class _Sample:
    """One sample's completion, built from the frames of the engine that runs it."""

    def __init__(self, index: int, params: SamplingParams):
        self.index = index
        self.params = params
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.error: str | None = None
        self.prefill: EngineLink | None = None
        self.decode: EngineLink | None = None
        self.released = False  # the prefill engine has let its blocks go
        self.pulled = False  # the decode engine has its K/V
        self.aborted = False
        self.final_sent = False  # its stream has had this sample's last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token(self, frame: dict) -> tuple[str, list[int]]:
        ids = frame["token_ids"]
        self.text += frame["text"]
        self.token_ids += ids
        if self.logprobs is not None:
            self.logprobs += [logprob_from_wire(e) for e in frame.get("logprobs") or []]
        return frame["text"], ids

    def done(self, frame: dict) -> tuple[str, list[int]]:
        ids = frame["token_ids"][len(self.token_ids):]
        new_text = frame["text"][len(self.text):] if frame["text"].startswith(self.text) else ""
        self.text, self.token_ids = frame["text"], list(frame["token_ids"])
        if self.logprobs is not None and frame.get("logprobs") is not None:
            self.logprobs = [logprob_from_wire(e) for e in frame["logprobs"]]
        self.finish_reason, self.stop_reason = frame["finish_reason"], frame["stop_reason"]
        return new_text, ids

    def fail(self, error: str) -> None:
        self.error = self.error or error
        self.finish_reason = "error"

    def output(self, new_text: str = "", new_ids: list[int] | None = None,
               updated: bool = True) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, self.logprobs, new_text, new_ids or [],
                                updated)


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, stream: RequestStream, owner: DisaggSet,
                 lora: LoRARequest | None = None):
        self.id = request_id
        self.owner = owner
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.lora = lora
        # the adapter as every frame to an engine names it (serving/loras.py)
        self.lora_fields = {} if lora is None else {
            "lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id,
            "lora_path": lora.lora_path}
        self.stream = stream
        self.metrics = RequestMetrics(request_id, time.perf_counter(), len(prompt_ids))
        n = params.n
        self.samples = [_Sample(i, params if n == 1 else dataclasses.replace(
            params, n=1, prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            seed=None if params.seed is None else (fold_seed(params.seed) + i) & 0xFFFFFFFF))
            for i in range(n)]
        self.prompt_logprobs = None

    def engine_id(self, sample: _Sample) -> str:
        return self.id if len(self.samples) == 1 else f"{self.id}#{sample.index}"

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def emit(self, sample: _Sample, new_text: str, new_ids: list[int]) -> None:
        now = time.perf_counter()
        sample.final_sent = sample.finished
        if self.stream.orphaned:
            self.owner.tokens_after_disconnect += len(new_ids)
        if sample.index == 0:
            self.metrics.token_times += [now] * len(new_ids)
        finished = self.finished
        if finished:
            self.metrics.finished_time = now
            errors = [s.error for s in self.samples if s.error]
            self.metrics.error = errors[0] if errors else None
            self.metrics.finish_reason = self.samples[0].finish_reason
        outs = [s.output(new_text, new_ids) if s is sample else s.output(updated=False)
                for s in self.samples]
        self.stream._put(RequestOutput(self.id, self.prompt, self.prompt_ids, outs, finished,
                                       self.metrics, self.prompt_logprobs))


def _wire(params: SamplingParams) -> dict[str, Any]:
    return {f.name: v for f in dataclasses.fields(params)
            if (v := getattr(params, f.name)) is not None}


class DisaggSet:
    """The ReplicaSet interface (serving/replicas.py) over remote prefill and decode engines."""

    def __init__(self, prefill: list[str], decode: list[str], block_size: int,
                 max_queue_per_request: int, *, prefix_aware: bool = True,
                 api_key: str | None = None, secret: bytes | None = None,
                 connect_timeout_s: float = 600.0,
                 read_adapter: Callable[[str], Any] | None = None):
        """`read_adapter`: reads and checks a LoRA adapter from its path (FrontModel's);
        None: this front serves none."""
        if not prefill or not decode:
            raise ValueError("prefill_engines and decode_engines: give at least one address "
                             "of each")
        self.prefill = [EngineLink(f"prefill-{i}", "prefill", a, api_key, secret)
                        for i, a in enumerate(prefill)]
        self.decode = [EngineLink(f"decode-{i}", "decode", a, api_key, secret)
                       for i, a in enumerate(decode)]
        self.router = Router(len(prefill), block_size, prefix_aware=prefix_aware)
        self.max_queue_per_request = max_queue_per_request
        self.connect_timeout_s = connect_timeout_s
        self.read_adapter = read_adapter
        self.counts = HandoverCounts()
        self.tokens_after_disconnect = 0
        self._live: dict[str, _Request] = {}
        self._tasks: set[asyncio.Task] = set()
        self._snaps: dict[str, dict] = {}  # per engine: its latest stats
        self.limits: admission.Limits | None = None  # the serving core's (admit_under)

    @property
    def links(self) -> list[EngineLink]:
        return self.prefill + self.decode

    # ----------------------------------------------------------------- the serving core's API

    def start(self) -> None:
        pass

    def admit_under(self, limits: admission.Limits) -> None:
        self.limits = limits

    async def connect(self) -> None:
        await asyncio.gather(*(link.connect(self.connect_timeout_s) for link in self.links))
        logger.info("disaggregated: %s", ", ".join(f"{x.name} at {x.address}"
                                                   for x in self.links))

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for link in self.links:
            link.close()

    @property
    def is_alive(self) -> bool:
        return all(link.alive for link in self.links)

    def health(self) -> dict:
        return {"engines": {x.name: {"role": x.role, "address": x.address,
                                     "status": "ok" if x.alive else "gone"}
                            for x in self.links}}

    async def add_request(self, request_id: str, prompt: str | None = None,
                          params: SamplingParams | None = None, *,
                          prompt_token_ids: list[int] | None = None, priority: int = 0,
                          cache_salt: str | None = None, pooling: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Admit the request (core/admission.py; its prefill engine admits it again), start
        its prompt on a prefill engine and return its stream once the first token (or a
        refusal: ValueError, QueueFullError) is back."""
        if prompt_token_ids is None:
            raise ValueError("prompt: this front needs the prompt's token ids")
        if pooling is not None:
            raise ValueError("pooling: embeddings are served by an engine in this process "
                             "only, not through a disaggregated front")
        params = admission.admit(params if params is not None else SamplingParams(),
                                 len(prompt_token_ids), self.limits, pool_elsewhere=True)
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               self.max_queue_per_request)
        req = _Request(request_id, prompt, list(prompt_token_ids), params, stream, self,
                       lora_request)
        self._live[request_id] = req
        try:
            firsts = await asyncio.gather(*(self._prefill(req, s, priority, cache_salt)
                                            for s in req.samples))
        except BaseException:  # refused, or the client left: nothing stays held
            for s in req.samples:
                s.final_sent = True
                self._settle(req, s)
            self._end(req)
            raise
        for s, (q, first) in zip(req.samples, firsts, strict=True):
            task = asyncio.create_task(self._follow(req, s, q, first, priority, cache_salt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return stream

    def abort(self, request_id: str) -> None:
        req = self._live.get(request_id)
        for s in req.samples if req is not None else ():
            s.aborted = True
            for link in (s.prefill if not s.released else None, s.decode):
                if link is not None and link.alive:
                    link.send({"type": "abort", "id": req.engine_id(s)})

    async def num_unfinished(self) -> int:
        return len(self._live)

    async def add_lora(self, lora: LoRARequest) -> None:
        """Check the adapter here (ValueError naming why); the engines read it when a frame
        first names it."""
        if self.read_adapter is None:
            raise ValueError("lora_request: this front serves no adapters (enable_lora is off)")
        await asyncio.to_thread(self.read_adapter, lora.lora_path)

    async def lora_in_use(self, lora_id: int) -> bool:
        return any(r.lora is not None and r.lora.lora_int_id == lora_id
                   for r in self._live.values())

    async def remove_lora(self, lora_id: int) -> None:
        """Nothing to do on the engines: no frame names the adapter again, and their host
        copies go least recently used first."""

    async def abort_all(self) -> None:
        for rid in list(self._live):
            self.abort(rid)

    async def poll(self) -> None:
        """Fetch every live engine's figures (for /metrics and stats)."""
        async def one(link):
            try:
                self._snaps[link.name] = await link.ask({"type": "stats"}, 5.0)
            except (ConnectionError, TimeoutError):
                self._snaps.pop(link.name, None)
        await asyncio.gather(*(one(x) for x in self.links if x.alive))

    async def snapshot(self) -> dict:
        await self.poll()
        snaps = [s for x in self.links if (s := self._snaps.get(x.name))]
        keys = [k for k, v in snaps[0].items() if isinstance(v, int | float)] if snaps else []
        merged = {k: sum(s.get(k, 0) for s in snaps) for k in keys if k != "type"}
        c = self.counts
        return merged | {
            "engines": {x.name: self._snaps.get(x.name, {}) | {
                "role": x.role, "address": x.address, "alive": x.alive} for x in self.links},
            "engines_gone": [x.name for x in self.links if not x.alive],
            "front_requests": len(self._live), "front_tasks": len(self._tasks),
            "handovers": c.num, "handover_bytes": c.bytes, "handover_seconds": c.seconds,
            "handover_blocks_cached": c.blocks_cached, "handovers_failed": c.num_failed,
            "handover_last_bytes": c.last_bytes, "handover_last_seconds": c.last_seconds}

    # ------------------------------------------------------------------------ one sample

    async def _prefill(self, req: _Request, s: _Sample, priority: int, salt: str | None):
        """Send the sample's prompt to a prefill engine; its queue and first frame."""
        eid = req.engine_id(s)
        self.router.down.update(i for i, x in enumerate(self.prefill) if not x.alive)
        if len(self.router.down) == len(self.prefill):
            return asyncio.Queue(), {"type": "error", "message": "no prefill engine is up"}
        lora = None if req.lora is None else str(req.lora.lora_int_id)
        link = self.prefill[self.router.route(eid, req.prompt_ids, salt, lora)]
        s.prefill = link
        q = link.open(eid)
        try:
            link.send({"type": "generate", "id": eid, "prompt_token_ids": req.prompt_ids,
                       "params": _wire(s.params), "priority": priority, "stream": True,
                       "cache_salt": salt, **req.lora_fields})
        except ConnectionError:
            return q, _GONE
        first = await q.get()
        if first["type"] == "error" and first.get("code") in _REFUSED:
            self.router.finished(eid)
            link.drop(eid)
            s.released = True
            err = QueueFullError if first["code"] == "queue_full" else ValueError
            raise err(first["message"])
        return q, first

    async def _follow(self, req: _Request, s: _Sample, q: asyncio.Queue, first: dict,
                      priority: int, salt: str | None) -> None:
        eid = req.engine_id(s)
        try:
            if not self._frame(req, s, first, s.prefill) or s.finished:
                return
            if s.aborted:
                s.finish_reason = "abort"
                return
            r = await self._reserve(req, s, priority, salt)
            if r is None:
                return
            dq, reserved = r
            name = engine_secret.offer_name()
            s.prefill.send({"type": "offer", "id": eid, "first_block": reserved["first_block"],
                            "num_blocks": reserved["num_blocks"], "name": name})
            offered = await q.get()
            if offered["type"] != "offered":
                self._frame(req, s, offered, s.prefill)
                if not s.finished:
                    s.fail(f"offering the K/V failed: {offered.get('message')}")
                return
            s.decode.send({"type": "pull", "id": eid, "name": name,
                           "address": s.prefill.info["transfer_address"]})
            while not s.finished:
                msg = await dq.get()
                if msg["type"] == "pulled":
                    self._pulled(req, s, reserved, msg)
                elif not self._frame(req, s, msg, s.decode):
                    return
        except ConnectionError as e:
            s.fail(str(e))
        finally:
            self._settle(req, s)

    def _frame(self, req: _Request, s: _Sample, msg: dict, link: EngineLink) -> bool:
        """Apply a token, done or error frame from `link`; False when the sample ended."""
        kind = msg["type"]
        if kind == "token":
            new_text, ids = s.token(msg)
            req.emit(s, new_text, ids)
            return True
        if kind == "done" and msg["finish_reason"] != "handover":
            if s.index == 0 and msg.get("prompt_logprobs") is not None:
                req.prompt_logprobs = [logprob_from_wire(e) for e in msg["prompt_logprobs"]]
            new_text, ids = s.done(msg)
            req.emit(s, new_text, ids)
            return False
        if kind == "done":  # the prefill copy released: nothing for the client
            return True
        where = f"{link.name}: " if link is not None else ""
        s.fail(link.gone_message if msg is _GONE else f"{where}{msg.get('message')}")
        return False

    async def _reserve(self, req: _Request, s: _Sample, priority: int, salt: str | None):
        """Find a decode engine with room for the sample: its queue and "reserved" frame, or
        None (the sample ended meanwhile)."""
        eid = req.engine_id(s)
        waited = False
        frame = {"type": "accept", "id": eid, "prompt_token_ids": req.prompt_ids,
                 "params": _wire(s.params), "priority": priority, "stream": True,
                 "cache_salt": salt, "first_token": s.token_ids[0], **req.lora_fields}
        if s.logprobs:
            frame["first_logprob"] = {"logprob": s.logprobs[0]["logprob"], "top": [
                [t, lp] for t, lp in s.logprobs[0]["top"].items()]}
        while True:
            links = sorted((x for x in self.decode if x.alive), key=lambda x: x.in_flight)
            if not links:
                s.fail("no decode engine is up")
                return None
            for link in links:
                dq = link.open(eid)
                try:
                    link.send(frame)
                except ConnectionError:
                    link.drop(eid)
                    continue
                msg = await dq.get()
                if msg["type"] == "reserved":
                    s.decode = link
                    link.in_flight += 1
                    self.counts.blocks_cached += msg["first_block"]
                    return dq, msg
                link.drop(eid)
                if msg is not _GONE and msg.get("code") != "no_room":
                    s.fail(f"{link.name} refused the handover: {msg.get('message')}")
                    return None
            if not s.prefill.alive:
                s.fail(s.prefill.gone_message)
                return None
            if s.aborted:
                s.finish_reason = "abort"
                return None
            self.counts.num_waited += not waited
            waited = True
            await asyncio.sleep(0.05)  # every decode engine is full: ask again

    def _pulled(self, req: _Request, s: _Sample, reserved: dict, msg: dict) -> None:
        c = self.counts
        c.num += 1
        c.bytes += msg["bytes"]
        c.seconds += msg["seconds"]
        c.last_bytes, c.last_seconds = msg["bytes"], msg["seconds"]
        s.pulled = True
        self._let_go(req, s, "release")

    def _let_go(self, req: _Request, s: _Sample, how: str) -> None:
        """The prefill engine frees the sample's blocks: "release" after the pull, "abort"
        otherwise."""
        if not s.released and s.prefill is not None:
            s.released = True
            eid = req.engine_id(s)
            self.router.finished(eid)
            if s.prefill.alive:
                s.prefill.send({"type": how, "id": eid})
            s.prefill.drop(eid)

    def _settle(self, req: _Request, s: _Sample) -> None:
        """The sample is over (or its task was cancelled): nothing stays held anywhere, and
        its stream has its end."""
        eid = req.engine_id(s)
        if not s.finished:
            s.fail("the front stopped")
        self._let_go(req, s, "abort")
        if s.decode is not None:
            s.decode.in_flight -= 1
            if not s.pulled:
                self.counts.num_failed += 1
            ended_there = s.pulled and s.error is None and not s.aborted
            if s.decode.alive and not ended_there:
                s.decode.send({"type": "abort", "id": eid})
            s.decode.drop(eid)
        if not s.final_sent:
            req.emit(s, "", [])
        if req.finished:
            self._end(req)

    def _end(self, req: _Request) -> None:
        self._live.pop(req.id, None)


class DisaggCollector:
    """/metrics families of the disaggregated front: each engine's state and figures, and the
    handovers (read from the last poll)."""

    def __init__(self, engines: DisaggSet):
        self.engines = engines

    def collect(self):
        e = self.engines
        up = GaugeMetricFamily("jaxserve_engine_up", "1 while the engine's connection lives, "
                               "0 once it is gone", labels=["engine", "role", "address"])
        for x in e.links:
            up.add_metric([x.name, x.role, x.address], float(x.alive))
        yield up
        for key, doc in (("kv_blocks_used", "KV blocks in use"),
                         ("num_running", "Requests running"),
                         ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
                         ("handover_held", "Requests held for a handover")):
            g = GaugeMetricFamily(f"jaxserve_engine_{key}", f"{doc}, per engine",
                                  labels=["engine"])
            for name, snap in e._snaps.items():
                g.add_metric([name], float(snap.get(key, 0)))
            yield g
        c = e.counts
        for name, value, doc in (
                ("handovers", c.num, "Requests handed over from prefill to decode"),
                ("handover_bytes", c.bytes, "K/V bytes pulled by decode engines"),
                ("handover_seconds", c.seconds, "Time decode engines spent pulling K/V"),
                ("handover_blocks_cached", c.blocks_cached,
                 "Prompt blocks a decode engine held already (not sent)"),
                ("handovers_failed", c.num_failed, "Handovers that failed"),
                ("handovers_waited", c.num_waited,
                 "Handovers that waited for room on a decode engine")):
            yield CounterMetricFamily(f"jaxserve_{name}", doc, value=value)
        for name, value, doc in (
                ("handover_last_bytes", c.last_bytes, "Bytes of the latest handover"),
                ("handover_last_seconds", c.last_seconds, "Pull time of the latest handover")):
            yield GaugeMetricFamily(f"jaxserve_{name}", doc, value=value)


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    prefill_engines: tuple[str, ...] | None = option(
        None, "serve as the front of these prefill engines (host:port of each one's socket "
              "protocol; with decode_engines): requests run there, then on a decode engine")
    decode_engines: tuple[str, ...] | None = option(
        None, "the decode engines (host:port) that take requests over from prefill_engines")
    engine_connect_timeout_s: float = option(
        600.0, "how long the front waits for each engine process to start answering")

    @property
    def is_front(self) -> bool:
        return bool(self.prefill_engines or self.decode_engines)


class FrontModel:
    """What the front needs of the model without running it: its tokenizer, config, grammar
    compiler (the interface of LLMEngine that serving/core.py reads)."""

    def __init__(self, config: EngineConfig):
        self.config = config.on_platform("cpu")
        self.loaded = load_model(config.model)
        self.loaded.params = None  # the front runs no model: only the config and tokenizer
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.read_adapter = (functools.partial(load_adapter, cfg=self.model_config,
                                               max_rank=self.config.max_lora_rank)
                             if self.config.enable_lora else None)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                         frozenset(eos))
                         if self.tokenizer is not None else None)
