"""OpenAI-compatible HTTP front (aiohttp): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events; chat with tool calls), /v1/responses (stored responses
readable and deletable by id), /v1/embeddings (serving/embeddings.py), /v1/models,
/v1/load_lora_adapter and /v1/unload_lora_adapter (serving/loras.py), /health, /metrics
(Prometheus text); Anthropic's /v1/messages on the same helpers (serving/anthropic.py).

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}} (Anthropic's on its
routes), with 400 for bad fields, 401 for a missing or wrong key, 404 for an unknown model or
route, 409 for unloading a LoRA adapter that requests still run, 429 when the waiting queue is
full, 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import re
import time
import uuid
from typing import Any

import jinja2
from aiohttp import web

from jaxserve import __version__
from jaxserve.core import nesting
from jaxserve.core.admission import LimitError
from jaxserve.core.sampling_params import SamplingParams, param_names
from jaxserve.engine.llm import normalized
from jaxserve.engine.llm_engine import QueueFullError
from jaxserve.serving import anthropic, embeddings, reasoning, responses, tools
from jaxserve.serving.async_engine import StreamOverflow
from jaxserve.serving.core import ServingCore, engine_failure
from jaxserve.serving.http_common import ApiError, typed_event
from jaxserve.serving.loras import LoRAError
from jaxserve.serving.replicas import ReplicaSet

logger = logging.getLogger(__name__)


_KEYED = ("/v1/", "/tokenize", "/detokenize")  # the routes behind the API key


async def serve(core: ServingCore, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the HTTP front on host:port -> (its runner, to clean up at shutdown; the port)."""
    # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
    # aborts the request. The drain before shutdown has its own deadline.
    runner = web.AppRunner(build_app(core), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def build_app(server: ServingCore) -> web.Application:
    api = _Api(server)
    app = web.Application(middlewares=[api.middleware],
                          client_max_size=server.config.max_frame_bytes)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/v1/responses", api.responses)
    app.router.add_post("/v1/embeddings", api.embeddings)
    app.router.add_get("/v1/responses/{response_id}", api.get_response)
    app.router.add_delete("/v1/responses/{response_id}", api.delete_response)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/load_lora_adapter", api.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", api.unload_lora_adapter)
    app.router.add_get("/health", api.health)
    app.router.add_get("/version", api.version)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/metrics", api.metrics)
    anthropic.add_routes(app, api)  # /v1/messages, /v1/messages/count_tokens
    return app


class _Api:
    def __init__(self, server: ServingCore):
        self.server = server
        cfg = server.config
        self.store = responses.ResponseStore(cfg.max_stored_responses,
                                             cfg.max_stored_response_bytes)
        self.reasoning = cfg.reasoning_parser

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        try:
            if request.path.startswith(_KEYED) or (request.path == "/metrics"
                                                   and not self.server.config.public_metrics):
                auth = request.headers.get("Authorization", "")
                # Bearer, or Anthropic's header
                key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
                if not self.server.authorized(key):
                    raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                                   code="invalid_api_key")
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPException as e:
            if e.status == 404:
                error = ApiError(404, f"no route {request.method} {request.path}",
                                 kind="not_found_error")
            elif e.status == 405:
                error = ApiError(405, f"method {request.method} not allowed on {request.path}",
                                 kind="invalid_request_error")
            elif e.status == 413:
                error = ApiError(413, "request body too large")
            else:
                raise
        return (anthropic.error_response(error) if anthropic.serves(request.path)
                else error.response())

    # ------------------------------------------------------------------------------ helpers

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:  # every field bounded in depth before anything walks it
            body = nesting.loads_body(await request.read())
        except nesting.TooDeep as e:
            raise ApiError(400, str(e), param=e.field) from None
        except ValueError:  # bad JSON or bad UTF-8
            raise ApiError(400, "request body must be JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            self.server.loras.resolve(body.get("model"))
        except LoRAError as e:
            raise _lora_error(e) from None
        return body

    def _params(self, body: dict, names: dict[str, str] | None = None, *,
                open_ended: bool = False) -> tuple[SamplingParams, dict[str, str]]:
        """The body translated into SamplingParams, unchecked (the engine admits them: see
        core/admission.py): its fields under their own names, plus OpenAI's spellings
        (max_completion_tokens; chat's logprobs: true with top_logprobs: k; response_format
        and guided_* as structured_outputs). `open_ended`: no max_tokens means up to the end
        of the context, as OpenAI's chat API has it (else SamplingParams' default). Also
        returns `names` (the route's {internal field: body field}) with those spellings
        added, for _field_error."""
        names = dict(names or {})
        raw = {k: body[k] for k in param_names() if k in body}
        if raw.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            raw["max_tokens"] = body["max_completion_tokens"]
            names["max_tokens"] = "max_completion_tokens"
        top = body.get("top_logprobs")
        if isinstance(raw.get("logprobs"), bool):
            if top is not None and not raw["logprobs"]:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            raw["logprobs"] = (0 if top is None else top) if raw["logprobs"] else None
            names["logprobs"] = "logprobs" if top is None else "top_logprobs"
        structured = self._structured(body)
        if structured is not None:
            if raw.get("structured_outputs") is not None:
                raise ApiError(400, "give structured_outputs or response_format / guided_*, "
                                    "not both", param="structured_outputs")
            names["structured_outputs"], raw["structured_outputs"] = structured
        try:
            params = SamplingParams.from_dict(raw)
        except ValueError as e:
            raise _field_error(str(e), names) from None
        if open_ended and raw.get("max_tokens") is None:
            params.max_tokens = None
        return params, names

    def _template_options(self, body: dict, messages: list[dict]) -> dict:
        """vLLM's add_generation_prompt (default true), continue_final_message (the reply
        goes on from the last, assistant, message instead of starting a new one) and
        chat_template_kwargs (more variables for the template, as enable_thinking)."""
        extra = body.get("chat_template_kwargs")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ApiError(400, "chat_template_kwargs must be an object",
                           param="chat_template_kwargs")
        # apply_chat_template's own arguments are the server's to set
        taken = sorted(set(extra) & (set(inspect.signature(
            self.server.engine.tokenizer.apply_chat_template).parameters) | {"messages"}))
        if taken:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)}",
                           param="chat_template_kwargs")
        opts = dict(extra)
        for name, default in (("add_generation_prompt", True),
                              ("continue_final_message", False)):
            value = body.get(name, default)
            if not isinstance(value, bool):
                raise ApiError(400, f"{name} must be a boolean", param=name)
            opts[name] = value
        if opts["continue_final_message"]:
            if opts["add_generation_prompt"] and "add_generation_prompt" in body:
                raise ApiError(400, "continue_final_message and add_generation_prompt cannot "
                                    "both be true", param="continue_final_message")
            if messages[-1]["role"] != "assistant":
                raise ApiError(400, "continue_final_message needs an assistant message last",
                               param="continue_final_message")
            opts["add_generation_prompt"] = False
        return opts

    #: vLLM's earlier request fields for structured output, and the kind each one names
    GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}

    @classmethod
    def _structured(cls, body: dict) -> tuple[str, dict] | None:
        """OpenAI's `response_format` (json_object, json_schema; text means none) or vLLM's
        guided_* fields: (the field, its `structured_outputs` value)."""
        found = []
        fmt = body.get("response_format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = fmt.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise ApiError(400, "response_format.json_schema.schema must be a JSON "
                                        "schema object", param="response_format")
                found.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise ApiError(400, "response_format.type must be text, json_object or "
                                    "json_schema", param="response_format")
        found += [(name, {kind: body[name]}) for name, kind in cls.GUIDED.items()
                  if body.get(name) is not None]
        if len(found) > 1:
            raise ApiError(400, "give one of response_format and the guided_* fields",
                           param="response_format")
        return found[0] if found else None

    async def _submit(self, prompt, prompt_ids, params: SamplingParams, prefix: str,
                      names: dict[str, str], cache_salt=None, pooling: str | None = None,
                      model: str | None = None):
        """`names`: {internal field: body field} for errors (_field_error). `model`: the
        body's, the base model or a loaded adapter (unloaded since _body checked it: 404)."""
        if self.server.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        engine_id = self.server.new_engine_id(prefix)
        try:
            prompt_ids = await self.server.prompt_ids(prompt, prompt_ids)
            stream = await self.server.submit(engine_id, prompt, prompt_ids, params,
                                              cache_salt=cache_salt, pooling=pooling,
                                              model=model)
        except LimitError as e:
            raise _field_error(str(e), names, e.param) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        except LoRAError as e:
            raise _lora_error(e) from None
        except ValueError as e:
            raise _field_error(str(e), names) from None
        return engine_id, stream

    async def _collect(self, request: web.Request, engine_id: str, stream):
        """The final output. A client that disconnects cancels this handler (the runner's
        handler_cancellation), and the request is aborted at once."""
        try:
            async for out in stream:
                if out.finished:
                    failure = engine_failure(out)
                    if failure is not None:
                        raise ApiError(500, failure, kind="server_error")
                    return out
        finally:
            self.server.client_left(engine_id, stream)  # a no-op once it finished

    @staticmethod
    def _include_usage(body: dict) -> bool:
        """`stream_options: {"include_usage": true}`: a last chunk carries the usage."""
        opts = body.get("stream_options")
        if opts is None:
            return False
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise ApiError(400, "stream_options must be an object whose include_usage is a "
                                "boolean", param="stream_options")
        if not body.get("stream"):
            raise ApiError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")
        return opts.get("include_usage", False)

    async def _sse(self, request: web.Request, engine_id: str, stream, make_chunk, first=(),
                   end=None, error=None, encode=None, done: bytes = b"data: [DONE]\n\n"):
        """Stream the events `make_chunk(output)` makes (a dict, a list of them or None) after
        `first`, then `end(last output)`'s and `done`. A request that fails in the engine ends
        with `error(message)`'s event (OpenAI's error body by default). A client that stops
        reading is cut off (serving/flow.py), one that disconnects cancels this handler;
        either way the request is aborted."""
        encode = encode or _event
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        transport = request.transport
        watched = self.server.stall_watch.watch(transport, transport.abort)
        stream.on_overflow = lambda s: transport.abort()

        async def send(events) -> None:
            for e in events if isinstance(events, list) else [events]:
                if e is not None:
                    data = encode(e)
                    watched.written += len(data)
                    await resp.write(data)

        try:
            await send(list(first))
            last = None
            async for out in stream:
                last = out
                failure = engine_failure(out)
                if failure is not None:
                    await send(error(failure) if error else
                               ApiError(500, failure, kind="server_error").body())
                    break
                await send(make_chunk(out))
            else:
                if end is not None and last is not None:
                    await send(end(last))
            if done:
                watched.written += len(done)
                await resp.write(done)
        except (ConnectionError, RuntimeError, StreamOverflow):
            pass
        except Exception as e:  # noqa: BLE001 - building an event failed: end the stream
            logger.exception("stream %s failed", engine_id)
            message = f"the server failed building the stream: {type(e).__name__}: {e}"
            with contextlib.suppress(ConnectionError, RuntimeError):
                await send(error(message) if error else
                           ApiError(500, message, kind="server_error").body())
        finally:
            self.server.stall_watch.unwatch(watched)
            self.server.client_left(engine_id, stream)  # a no-op once it finished
        return resp

    # ------------------------------------------------------------------------------ routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        prompt_ids = None
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                     for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids "
                                    "(one prompt per request)", param="prompt")
            prompt, prompt_ids = None, prompt
        elif not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ApiError(400, "echo must be a boolean", param="echo")
        params, names = self._params(body, {"prompt_token_ids": "prompt"})
        if echo and params.logprobs is not None and params.prompt_logprobs is None:
            # OpenAI's echo with logprobs scores the prompt's tokens too
            params.prompt_logprobs = params.logprobs
        include_usage = self._include_usage(body)
        engine_id, stream = await self._submit(prompt, prompt_ids, params, "cmpl", names,
                                               body.get("cache_salt"), model=body.get("model"))
        created, model = int(time.time()), self._model(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        echoed = ""
        if echo:  # the prompt's text, before each choice's
            tok = self.server.engine.tokenizer
            echoed = prompt if prompt is not None else (tok.decode(prompt_ids) if tok else "")

        def logprobs(out, comp, new_only: bool, lead: bool) -> dict | None:
            """The choice's logprobs (this chunk's when `new_only`); `lead`: they start with
            the echoed prompt's, as OpenAI's echo does (text offsets count the echo too)."""
            lp = self._completion_logprobs(comp, new_only, shift=len(echoed))
            if not (lead and echo and params.logprobs is not None):
                return lp
            pairs = list(zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True))
            head = self._completion_logprobs_of(pairs, 0, first=out.prompt_token_ids[0])
            return head if lp is None else {k: head[k] + lp[k] for k in head}

        def extra(out) -> dict:  # vLLM's prompt_logprobs field, on a choice's first chunk
            return ({"prompt_logprobs": self._prompt_logprobs(out)}
                    if body.get("prompt_logprobs") is not None else {})

        if body.get("stream"):
            unstarted = set(range(params.n))

            def chunk(out):
                choices = []
                for comp in _moved(out):
                    lead = comp.index in unstarted  # its first chunk leads with the echo
                    unstarted.discard(comp.index)
                    text = echoed + comp.new_text if lead else comp.new_text
                    lp = logprobs(out, comp, True, lead)
                    if text or comp.finish_reason or lp is not None or lead:
                        choices.append({"index": comp.index, "text": text, "logprobs": lp,
                                        "finish_reason": comp.finish_reason}
                                       | (extra(out) if lead else {}))
                return {"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": choices} if choices else None
            base = {"id": rid, "object": "text_completion", "created": created, "model": model}
            return await self._sse(request, engine_id, stream, chunk,
                                   end=_usage_chunk(base) if include_usage else None)
        out = await self._collect(request, engine_id, stream)
        return web.json_response({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": echoed + c.text,
                         "logprobs": logprobs(out, c, False, True),
                         "finish_reason": c.finish_reason} | extra(out) for c in out.outputs],
            "usage": _usage(out)})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        try:
            choice = tools.parse_tool_choice(body)
            messages = tools.check_messages(body.get("messages"))
        except tools.ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None
        prompt = await self._chat_prompt(body, messages, choice, "messages")
        params, names = self._params(body, {"prompt": "messages"}, open_ended=True)
        if choice is not None and choice.is_forced:
            await self._force_calls(params, choice)
        await self._after_reasoning(params)
        include_usage = self._include_usage(body)
        engine_id, stream = await self._submit(prompt, None, params, "chat", names,
                                               body.get("cache_salt"), model=body.get("model"))
        created, model = int(time.time()), self._model(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        calling = choice is not None and choice.mode != "none"
        if body.get("stream"):
            base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model}
            first = base | {"choices": [{"index": i, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "finish_reason": None} for i in range(params.n)]}
            parsers = {i: tools.CallParser(choice) for i in range(params.n)} if calling else {}
            splitters = {i: reasoning.splitter(self.reasoning) for i in range(params.n)}
            unscored = body.get("prompt_logprobs") is not None

            def chunk(out):
                nonlocal unscored
                rows: list[list[dict]] = []  # per choice, its deltas in order
                for comp in _moved(out):
                    lp = self._chat_logprobs(comp, new_only=True)
                    parser, splitter = parsers.get(comp.index), splitters.get(comp.index)
                    final = comp.finish_reason is not None
                    thought, text = reasoning.parts(splitter, comp.new_text, final)
                    deltas = [{"reasoning_content": thought}] if thought else []
                    deltas += (_call_deltas(parser, text, final) if parser is not None else
                               [{"content": text}] if text else [])
                    finish = _finish(comp.finish_reason, parser)
                    if not deltas and (finish or lp is not None):
                        deltas = [{}]
                    rows.append([{"index": comp.index, "delta": d,
                                  "logprobs": lp if j == 0 else None,
                                  "finish_reason": finish if j == len(deltas) - 1 else None}
                                 for j, d in enumerate(deltas)])
                chunks = [base | {"choices": [r[j] for r in rows if j < len(r)]}
                          for j in range(max(map(len, rows), default=0))]
                if chunks and unscored:  # vLLM's prompt_logprobs, once, on the first chunk
                    unscored = False
                    chunks[0]["prompt_logprobs"] = self._prompt_logprobs(out)
                return chunks
            return await self._sse(request, engine_id, stream, chunk, [first],
                                   end=_usage_chunk(base) if include_usage else None)
        out = await self._collect(request, engine_id, stream)

        def answer(c) -> dict:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if self.reasoning is not None:
                message["reasoning_content"], message["content"] = reasoning.split(
                    self.reasoning, c.text)
            finish = c.finish_reason
            if calling and message["content"] is not None:
                message["content"], calls = tools.split_calls(message["content"], choice)
                if calls:
                    message["tool_calls"] = [_call_json(x) for x in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": c.index, "message": message, "logprobs": self._chat_logprobs(c),
                    "finish_reason": finish}

        return web.json_response({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [answer(c) for c in out.outputs], "usage": _usage(out)}
            | ({"prompt_logprobs": self._prompt_logprobs(out)}
               if body.get("prompt_logprobs") is not None else {}))

    async def _chat_prompt(self, body: dict, messages: list[dict],
                           choice: tools.ToolChoice | None, field: str) -> str:
        """The conversation (and tools) through the model's chat template, off the loop;
        `field`: the body's field the messages came from."""
        tok = self.server.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template", param=field)
        chars = sum(len(m["content"]) + len(m.get("reasoning_content", ""))
                    + sum(len(c["arguments"]) for c in m.get("tool_calls", ())) for m in messages)
        chars += len(json.dumps([t.spec() for t in choice.tools])) if choice else 0
        limit = self.server.max_prompt_chars
        if chars > limit:
            raise ApiError(400, f"{field} hold {chars} characters, more than the prompt limit's "
                                f"tokens can hold ({limit})", param=field)
        rendered, extra = tools.render(messages, choice, tools.takes_tools(tok.chat_template))
        try:
            return await self.server.off_loop(tok.apply_chat_template, rendered, tokenize=False,
                                              **extra, **self._template_options(body, messages))
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise ApiError(400, f"the chat template refused the {field}: {e}",
                           param=field) from None

    async def _force_calls(self, params: SamplingParams, choice: tools.ToolChoice) -> None:
        """tool_choice required or a named function: the output is a grammar's tool calls."""
        if params.structured_outputs is not None:
            raise ApiError(400, "tool_choice required or a named function cannot be combined "
                                "with structured output", param="tool_choice")
        params.structured_outputs = await self._grammar({"grammar": choice.grammar()}, "tools")

    async def _after_reasoning(self, params: SamplingParams) -> None:
        """Under a reasoning parser, structured output (forced tool calls too) constrains the
        answer only: the reasoning before it is free."""
        if self.reasoning is None or params.structured_outputs is None:
            return
        try:
            params.structured_outputs = await self.server.off_loop(
                reasoning.grammar_after, self.reasoning, params.structured_outputs,
                self.server.engine.tokenizer)
        except ValueError as e:
            raise ApiError(400, str(e), param="structured_outputs") from None

    async def _grammar(self, spec: dict, field: str) -> dict:
        """`spec` compiled on the tokenizer thread (the engine finds it ready); a 400 naming
        the body's `field` if it does not compile."""
        if self.server.engine.grammars is not None:
            try:
                await self.server.off_loop(self.server.engine.grammars.check, spec)
            except ValueError as e:
                raise _field_error(str(e), {"structured_outputs": field}) from None
        return spec

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: `input` (and the stored conversation of
        `previous_response_id`) with `instructions` through the chat template; the answer as
        output items, or with `stream` as the typed event stream."""
        body = await self._body(request)
        try:
            choice = tools.parse_tool_choice(body)
            messages = responses.input_messages(body.get("input"))
            structured = responses.text_format(body)
        except tools.ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None
        instructions, store = body.get("instructions"), body.get("store", True)
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", param="instructions")
        if not isinstance(store, bool):
            raise ApiError(400, "store must be a boolean", param="store")
        prev = body.get("previous_response_id")
        if prev is not None:
            record = self.store.get(prev) if isinstance(prev, str) else None
            if record is None:
                raise ApiError(400, f"no stored response {prev!r} (never stored, stored with "
                                    "store: false, or evicted)", param="previous_response_id")
            messages = record["conversation"] + messages
        system = [{"role": "system", "content": instructions}] if instructions else []
        prompt = await self._chat_prompt({k: body[k] for k in ("chat_template_kwargs",)
                                          if k in body}, system + messages, choice, "input")
        sampling = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
        params, names = self._params(sampling | {"max_tokens": body.get("max_output_tokens")},
                                     {"max_tokens": "max_output_tokens", "prompt": "input"},
                                     open_ended=True)
        if structured is not None:
            params.structured_outputs = await self._grammar(structured, "text")
        if choice is not None and choice.is_forced:
            await self._force_calls(params, choice)
        await self._after_reasoning(params)
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        builder = responses.ResponseBuilder({
            "id": responses.new_id("resp"), "object": "response",
            "created_at": int(time.time()), "model": self._model(body),
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": params.temperature, "top_p": params.top_p,
            "tools": [t.spec()["function"] | {"type": "function", "strict": False}
                      for t in (choice.tools if choice else ())],
            "tool_choice": body.get("tool_choice", "auto" if choice else "none"),
            "parallel_tool_calls": choice.parallel if choice else True,
            "previous_response_id": prev, "text": {"format": fmt}, "metadata": {},
            "store": store, "truncation": "disabled", "usage": None}, choice, self.reasoning)

        engine_id, stream = await self._submit(prompt, None, params, "resp", names,
                                               model=body.get("model"))

        def finish(out) -> list[dict]:
            events = builder.finish(out)
            if store:
                self.store.put(builder.response["id"], {
                    "conversation": messages + builder.conversation(),
                    "response": builder.response})
            return events

        if body.get("stream"):
            def chunk(out):
                comp = out.outputs[0]
                return builder.feed(comp.new_text, final=comp.finish_reason is not None)
            return await self._sse(request, engine_id, stream, chunk, builder.start(),
                                   end=finish, error=builder.error, encode=typed_event,
                                   done=b"")
        out = await self._collect(request, engine_id, stream)
        builder.feed(out.outputs[0].text, final=True)
        finish(out)
        return web.json_response(builder.response)

    async def embeddings(self, request: web.Request) -> web.Response:
        """Each input queued as an embedding request (serving/embeddings.py); all answered
        together, or an error (the others then aborted)."""
        body = await self._body(request)
        hidden = self.server.engine.model_config.hidden_size
        try:
            items = embeddings.parse_inputs(body)
            fmt, normalize = embeddings.parse_options(body, hidden)
        except embeddings.EmbeddingsError as e:
            raise ApiError(400, str(e), param=e.param) from None
        if not isinstance(self.server.replicas, ReplicaSet):
            raise ApiError(400, "embeddings are served by an engine in this process only, "
                                "not through a disaggregated front", param="input")
        if self._model(body) != self.server.config.model_name:
            raise ApiError(400, "embeddings come from the base model only, not a LoRA adapter",
                           param="model")
        params = SamplingParams(max_tokens=1)  # unused: the engine pools the prompt instead
        names = {"prompt": "input", "prompt_token_ids": "input"}
        submitted = []
        try:
            for item in items:
                text, ids = (item, None) if isinstance(item, str) else (None, item)
                submitted.append(await self._submit(text, ids, params, "embd", names,
                                                    body.get("cache_salt"),
                                                    self.server.engine.config.pooling))
            outs = await asyncio.gather(*(self._collect(request, eid, stream)
                                          for eid, stream in submitted))
        finally:
            for eid, stream in submitted:
                self.server.client_left(eid, stream)  # a no-op for those that finished
        if any(o.embedding is None for o in outs):  # aborted (a shutdown)
            raise ApiError(503, "the request ended before its embedding", kind="server_error")
        vectors = [normalized(o.embedding) if normalize else o.embedding for o in outs]
        return web.json_response(embeddings.response(
            vectors, sum(len(o.prompt_token_ids) for o in outs), fmt,
            self.server.config.model_name))

    async def get_response(self, request: web.Request) -> web.Response:
        record = self.store.get(request.match_info["response_id"])
        if record is None:
            raise ApiError(404, "no such stored response", kind="not_found_error")
        return web.json_response(record["response"])

    async def delete_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if not self.store.delete(rid):
            raise ApiError(404, "no such stored response", kind="not_found_error")
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

    def _token_text(self, token_id: int) -> str:
        tok = self.server.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def _completion_logprobs(self, comp, new_only: bool = False,
                             shift: int = 0) -> dict | None:
        """OpenAI completions' shape: tokens, token_logprobs, top_logprobs, text_offset (from
        the completion's start, plus `shift`)."""
        pairs = _entries(comp, new_only)
        if pairs is None:
            return None
        start = len(comp.text) - len(comp.new_text) if new_only else 0
        return self._completion_logprobs_of(pairs, shift + start)

    def _completion_logprobs_of(self, pairs: list[tuple[int, dict]], start: int,
                                first: int | None = None) -> dict:
        """(token id, entry) pairs in completions' shape; `first`: a token before them with
        no logprob (an echoed prompt's first), given as null like OpenAI does."""
        tokens = [self._token_text(t) for t, _ in pairs]
        lps = [e["logprob"] for _, e in pairs]
        tops = [{self._token_text(k): v for k, v in e["top"].items()} for _, e in pairs]
        if first is not None:
            tokens, lps, tops = [self._token_text(first), *tokens], [None, *lps], [None, *tops]
        offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=start))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_logprobs(self, out) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first: null), {token id: {logprob,
        rank, decoded_token}} for the token itself and the top ones."""
        result = []
        for token, e in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            if e is None:
                result.append(None)
                continue
            entry = {str(token): {"logprob": e["logprob"], "rank": e["rank"],
                                  "decoded_token": self._token_text(token)}}
            for rank, (t, lp) in enumerate(e["top"].items(), 1):
                entry.setdefault(str(t), {"logprob": lp, "rank": rank,
                                          "decoded_token": self._token_text(t)})
            result.append(entry)
        return result

    def _chat_logprobs(self, comp, new_only: bool = False) -> dict | None:
        """OpenAI chat's shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        pairs = _entries(comp, new_only)
        if pairs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [item(t, e["logprob"]) | {"top_logprobs": [
            item(k, v) for k, v in e["top"].items()]} for t, e in pairs]}

    def _model(self, body: dict) -> str:
        """The model a request names: the base model's name or an adapter's."""
        return body.get("model") or self.server.config.model_name

    async def models(self, request: web.Request) -> web.Response:
        """The base model, then each loaded LoRA adapter (vLLM's shape: `root` its path,
        `parent` the model it adapts)."""
        loras = self.server.loras
        base = {"object": "model", "created": 0, "owned_by": "jaxserve",
                "max_model_len": self.server.engine.config.max_model_len}
        return web.json_response({"object": "list", "data": [
            base | {"id": self.server.config.model_name, "root": self.server.config.model_name,
                    "parent": None}] + [
            base | {"id": name, "root": lora.lora_path, "parent": loras.parents[name]}
            for name, lora in loras.loaded.items()]})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime load: {"lora_name", "lora_path"} -> plain-text success."""
        body = await self._body(request)
        try:
            await self.server.loras.load(body.get("lora_name"), body.get("lora_path"))
        except LoRAError as e:
            raise _lora_error(e) from None
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added "
                                 f"successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime unload: {"lora_name"}; refused (409) while a request runs it."""
        body = await self._body(request)
        try:
            await self.server.loras.unload(body.get("lora_name"))
        except LoRAError as e:
            raise _lora_error(e) from None
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed "
                                 f"successfully.")

    async def health(self, request: web.Request) -> web.Response:
        replicas = self.server.replicas
        body = replicas.health()  # with remote engines: each one's state, by name
        if not replicas.is_alive:
            return web.json_response({"status": "error"} | body, status=503)
        return web.json_response({"status": "ok"} | body)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {"prompt": text} (add_special_tokens, default true) or
        {"messages": [...]} through the chat template -> the token ids and their count."""
        body = await self._body(request)
        tok = self.server.engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise ApiError(400, "add_special_tokens must be a boolean",
                           param="add_special_tokens")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise ApiError(400, "messages must be a non-empty list of {role, content}",
                               param="messages")
            text = await self.server.off_loop(tok.apply_chat_template, messages,
                                              tokenize=False,
                                              **self._template_options(body, messages))
            add_special = False  # the template wrote them
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError(400, "prompt must be a string", param="prompt")
        if len(text) > self.server.max_prompt_chars:
            raise ApiError(400, "prompt is longer than the prompt limit", param="prompt")
        ids = await self.server.off_loop(
            lambda: tok(text, add_special_tokens=add_special).input_ids)
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": self.server.engine.config.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tok = self.server.engine.tokenizer
        ids = body.get("tokens")
        vocab = self.server.engine.model_config.vocab_size
        if tok is None:
            raise ApiError(400, "this model has no tokenizer")
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})",
                           param="tokens")
        return web.json_response({"prompt": tok.decode(ids)})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text. Behind the API key when one is set, unless `public_metrics`."""
        await self.server.replicas.poll()
        return web.Response(body=self.server.exporter.render(),
                            content_type="text/plain", charset="utf-8")


def _field_error(message: str, names: dict[str, str], param: str | None = None) -> ApiError:
    """A 400 for an error that names a field by the engine's name (`param`, else the message's
    first word), naming the body's field (`names`: {internal name: body field}) instead, in
    the message too when it starts with the name."""
    param = param or message.split()[0].rstrip(":")
    field = names.get(param, param)
    if field != param and re.match(rf"{re.escape(param)}\b", message):
        message = field + message[len(param):]
    return ApiError(400, message, param=field)


def _lora_error(e: LoRAError) -> ApiError:
    if e.status == 404:
        return ApiError(404, str(e), param=e.param, kind="not_found_error",
                        code="model_not_found")
    return ApiError(e.status, str(e), param=e.param)


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _usage_chunk(base: dict):
    """stream_options.include_usage: a last chunk with no choices carries the usage, as
    OpenAI's API does."""
    return lambda last: base | {"choices": [], "usage": _usage(last)}


def _usage(out) -> dict:
    p, c = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _moved(out) -> list:
    """The samples with something new in this output (all but the n > 1 ones that waited)."""
    return [c for c in out.outputs if c.updated]


def _entries(comp, new_only: bool) -> list[tuple[int, dict]] | None:
    """(token id, {"logprob", "top"}) for the completion's tokens (or this step's only)."""
    if comp.logprobs is None:
        return None
    # The engine keeps appending to the entries: the output's own token ids say how many
    # are its own.
    ids = comp.token_ids
    entries = comp.logprobs[:len(ids)]
    if new_only:
        n = len(comp.new_token_ids)
        ids, entries = ids[len(ids) - n:], entries[len(entries) - n:]
        if not n:
            return None
    return list(zip(ids, entries, strict=True))


def _call_json(call: dict) -> dict:
    return {"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


def _call_deltas(parser: tools.CallParser, text: str, final: bool) -> list[dict]:
    """A choice's new text as chat deltas (`final`: its last): text as content; a call as
    OpenAI streams one, a delta with its index, id, type and name, then one with its
    arguments."""
    events = tools.text_events(parser, text, final)
    deltas, k = [], parser.num_calls - sum(kind == "call" for kind, _ in events)
    for kind, e in events:
        if kind == "text":
            deltas.append({"content": e})
            continue
        deltas.append({"tool_calls": [{"index": k, "id": e["id"], "type": "function",
                                       "function": {"name": e["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": k, "function": {"arguments": e["arguments"]}}]})
        k += 1
    return deltas


def _finish(reason: str | None, parser: tools.CallParser | None) -> str | None:
    """A choice that called tools and stopped finishes with tool_calls, as OpenAI's do."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.num_calls else reason
