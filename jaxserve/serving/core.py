"""The serving core both fronts stand on (the socket protocol, socket_front.py; OpenAI HTTP,
openai/): the engine threads behind the router, the server's limits and API key, prompts
tokenized off the event loop, requests submitted and aborted, Prometheus export, and the drain
at shutdown. server.py runs the fronts over one core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import itertools
import time

from jaxserve.config import Role, option
from jaxserve.core.admission import LimitError, Limits
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import ParamError
from jaxserve.engine import data_parallel
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.serving.async_engine import RequestStream
from jaxserve.serving.disagg import DisaggCollector
from jaxserve.serving.flow import StallWatch
from jaxserve.serving.loras import LoRAError, ServerLoRAs, check_lora_options, parse_lora_module
from jaxserve.serving.prometheus import PrometheusExporter
from jaxserve.serving.reasoning import ReasoningParser
from jaxserve.serving.replicas import ReplicaSet


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address both fronts bind to")
    port: int = option(7070, "socket protocol port (0: any free port)")
    http_port: int | None = option(8000, "OpenAI-compatible HTTP port (0: off)")
    api_key: str | None = option(None, "clients must present this key (socket auth frame, "
                                       "HTTP Bearer or x-api-key); --api-key-file or "
                                       "$JAXSERVE_API_KEY give it out of the process list")
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
    max_stored_responses: int = option(1024, "responses kept for previous_response_id (least "
                                             "recently used go first; 0: none)")
    max_stored_response_bytes: int = option(64 << 20, "bytes of JSON the kept responses may "
                                                      "hold (least recently used go first)")
    model_name: str = option("jaxserve", "the model id /v1/models reports and requests name",
                             aliases=("--served-model-name",))
    lora_modules: tuple[str, ...] | None = option(
        None, "LoRA adapters loaded at start (needs --enable-lora), each name=path or a JSON "
              "object {\"name\", \"path\", \"base_model_name\"}; a request's model names one")
    lora_allowed_dir: str | None = option(
        None, "a LoRA adapter's path (--lora-modules, /v1/load_lora_adapter) must lie inside "
              "this directory (default: anywhere)")
    reasoning_parser: ReasoningParser | None = option(
        None, "give a thinking model's reasoning apart from its answer in chat and Responses "
              "(vLLM's formats); structured output then constrains the answer only (default: "
              "off)")

    def __post_init__(self):
        for name in ("max_frame_bytes", "max_concurrent_per_connection", "max_queue_per_request",
                     "write_stall_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_stored_responses", "max_stored_response_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.reasoning_parser is not None:
            try:
                object.__setattr__(self, "reasoning_parser",
                                   ReasoningParser(self.reasoning_parser))
            except ValueError:
                raise ValueError(f"reasoning_parser must be one of "
                                 f"{', '.join(ReasoningParser)}, got "
                                 f"{self.reasoning_parser!r}") from None
        if self.lora_modules is not None:
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
            names = [parse_lora_module(m).name for m in self.lora_modules]
            if len(set(names)) < len(names) or self.model_name in names:
                raise ValueError(f"lora_modules: names must differ from each other and from "
                                 f"model_name, got {names}")


class ServingCore:
    """What the fronts share; a front adds its own listener and connections on top."""

    def __init__(self, engines: LLMEngine | list[LLMEngine], config: ServerConfig | None = None,
                 step_hooks: tuple = (), remote=None):
        """`engines`: one engine, or the data-parallel replicas of
        engine/data_parallel.build_replicas (requests are routed among them). `remote`: engines
        in other processes (a serving/disagg.py DisaggSet) that serve instead; `engines` then
        only lends the model's tokenizer and config."""
        engines = engines if isinstance(engines, list) else [engines]
        self.engine = engines[0]  # all replicas share its tokenizer and config
        self.config = config or ServerConfig()
        if remote is not None:
            self.exporter = PrometheusExporter(remote.router)
            self.exporter.registry.register(DisaggCollector(remote))
            self.replicas = remote
        else:
            router = data_parallel.make_router(engines)
            self.exporter = PrometheusExporter(router)

            def on_step(replica, engine, outputs):
                self.exporter.update(engine, outputs, replica)
                for hook in step_hooks:  # each: hook(engine, outputs), on the replica's thread
                    hook(engine, outputs)

            self.replicas = ReplicaSet(engines, router, self.config.max_queue_per_request,
                                       on_step)
        engine_cfg = self.engine.config
        self.replicas.admit_under(Limits(engine_cfg.max_model_len, engine_cfg.max_logprobs,
                                         self.config.max_tokens_limit))
        check_lora_options(self.engine.config.enable_lora, self.config.lora_modules)
        self.loras = ServerLoRAs(self.replicas, self.config.model_name,
                                 self.engine.config.enable_lora, self.config.lora_allowed_dir,
                                 role_engine=self.engine.config.role is not Role.BOTH)
        self.draining = False
        self._ids = itertools.count()
        self.stall_watch = StallWatch(self.config.write_stall_timeout_s)
        # Prompts are tokenized here, off the event loop (the tokenizer releases the GIL), one
        # at a time; a prompt too long to possibly fit is refused before it is read at all.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, "jaxserve-tokenize")
        tok = self.engine.tokenizer
        self._max_token_chars = (max(map(len, tok.get_vocab())) if tok is not None else 0)
        self.num_disconnects = 0  # requests whose client left before their end

    def start(self) -> None:
        self.replicas.start()
        self.stall_watch.start()

    async def load_lora_modules(self) -> None:
        """Load `lora_modules` on every engine; ValueError naming the entry that fails. A
        prefill or decode engine loads none: its front names them (serving/loras.py)."""
        for text in () if self.loras.role_engine else self.config.lora_modules or ():
            m = parse_lora_module(text)
            try:
                await self.loras.load(m.name, m.path, m.base_model_name)
            except LoRAError as e:
                raise ValueError(f"lora_modules: {m.name!r}: {e}") from None

    async def finish(self) -> None:
        """Take no new requests; let those in flight finish within `shutdown_timeout_s`, then
        abort the rest."""
        self.draining = True
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        try:
            while time.monotonic() < deadline:
                if not await self.replicas.num_unfinished():
                    break
                await asyncio.sleep(0.05)
            await self.replicas.abort_all()
        except RuntimeError:  # the engine loop is gone: nothing left to finish
            pass

    def stop(self) -> None:
        self.stall_watch.stop()
        self.replicas.stop()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def new_engine_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def prompt_ids(self, prompt: str | None,
                         prompt_token_ids: list[int] | None) -> list[int] | None:
        """The request's prompt as token ids, within the server's prompt limits; raises
        LimitError.

        The event loop never tokenizes: a prompt with more characters than the limit's tokens
        could hold (each at most the vocabulary's longest token) is refused unread, and any
        other goes to the tokenizer thread."""
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
                     priority: int = 0, cache_salt: str | None = None,
                     pooling: str | None = None, model: str | None = None,
                     lora: LoRARequest | None = None) -> RequestStream:
        """`pooling`: an embedding request (engines in this process only). `model`: the
        base model's name or a loaded adapter's (LoRAError 404 for neither), looked up in the
        same turn of the event loop that queues the request (see serving/loras.py); `lora`:
        the adapter itself instead (a role engine's, as its front named it). `params` as the
        front translated them: the engine admits them (core/admission.py), raising
        ParamError or LimitError naming the field."""
        if params.structured_outputs is not None and self.engine.grammars is not None:
            try:  # compiled here, on the tokenizer thread: the engine thread finds it ready
                await self.off_loop(self.engine.grammars.check, params.structured_outputs)
            except ParamError:
                raise
            except ValueError as e:
                raise LimitError(str(e), "structured_outputs") from None
        lora = lora if lora is not None else self.loras.resolve(model)
        extra = {} if pooling is None else {"pooling": pooling}
        if lora is not None:
            extra["lora_request"] = lora
        return await self.replicas.add_request(engine_id, prompt, params,
                                               prompt_token_ids=prompt_token_ids,
                                               priority=priority, cache_salt=cache_salt,
                                               **extra)

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
        snap = await self.replicas.snapshot()
        return {**snap, "num_disconnects": self.num_disconnects,
                "tokens_after_disconnect": self.replicas.tokens_after_disconnect,
                "num_slow_readers_cut_off": self.stall_watch.num_cut_off}

    def authorized(self, key: str | None) -> bool:
        want = self.config.api_key
        if want is None:
            return True
        return isinstance(key, str) and hmac.compare_digest(key.encode(), want.encode())


def engine_failure(out: RequestOutput) -> str | None:
    """What to tell the client of a request that failed inside the engine (None if it did
    not)."""
    if out.outputs[0].finish_reason != "error":
        return None
    return f"the request failed in the engine: {out.metrics.error}"
