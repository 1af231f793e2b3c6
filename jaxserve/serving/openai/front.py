"""The HTTP front's shared request handling (`Front`): the body read and bounded, its sampling
fields translated into SamplingParams, the request submitted, and its answer collected or
streamed as server-sent events. The routes of each API (one module each) stand on it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web

from jaxserve.core import nesting
from jaxserve.core.admission import LimitError
from jaxserve.core.sampling_params import SamplingParams, param_names
from jaxserve.engine.llm_engine import QueueFullError
from jaxserve.serving.async_engine import StreamOverflow
from jaxserve.serving.core import ServingCore, engine_failure
from jaxserve.serving.loras import LoRAError
from jaxserve.serving.openai import response_builder
from jaxserve.serving.openai.errors import ApiError, event, field_error, lora_error

logger = logging.getLogger(__name__)


class Front:
    """What every route holds: the serving core, the stored responses, the reasoning parser."""

    def __init__(self, server: ServingCore):
        self.server = server
        cfg = server.config
        self.store = response_builder.ResponseStore(cfg.max_stored_responses,
                                                    cfg.max_stored_response_bytes)
        self.reasoning = cfg.reasoning_parser

    def model(self, body: dict) -> str:
        """The model a request names: the base model's name or an adapter's."""
        return body.get("model") or self.server.config.model_name

    async def body(self, request: web.Request) -> dict[str, Any]:
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
            raise lora_error(e) from None
        return body

    def params(self, body: dict, names: dict[str, str] | None = None, *,
               open_ended: bool = False) -> tuple[SamplingParams, dict[str, str]]:
        """The body translated into SamplingParams, unchecked (the engine admits them: see
        core/admission.py): its fields under their own names, plus OpenAI's spellings
        (max_completion_tokens; chat's logprobs: true with top_logprobs: k; response_format
        and guided_* as structured_outputs). `open_ended`: no max_tokens means up to the end
        of the context, as OpenAI's chat API has it (else SamplingParams' default). Also
        returns `names` (the route's {internal field: body field}) with those spellings
        added, for field_error."""
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
        structured = self.structured(body)
        if structured is not None:
            if raw.get("structured_outputs") is not None:
                raise ApiError(400, "give structured_outputs or response_format / guided_*, "
                                    "not both", param="structured_outputs")
            names["structured_outputs"], raw["structured_outputs"] = structured
        try:
            params = SamplingParams.from_dict(raw)
        except ValueError as e:
            raise field_error(str(e), names) from None
        if open_ended and raw.get("max_tokens") is None:
            params.max_tokens = None
        return params, names


    #: vLLM's earlier request fields for structured output, and the kind each one names
    GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}

    @classmethod
    def structured(cls, body: dict) -> tuple[str, dict] | None:
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

    async def submit(self, prompt, prompt_ids, params: SamplingParams, prefix: str,
                     names: dict[str, str], cache_salt=None, pooling: str | None = None,
                     model: str | None = None):
        """`names`: {internal field: body field} for errors (field_error). `model`: the
        body's, the base model or a loaded adapter (unloaded since body() checked it: 404)."""
        if self.server.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        engine_id = self.server.new_engine_id(prefix)
        try:
            prompt_ids = await self.server.prompt_ids(prompt, prompt_ids)
            stream = await self.server.submit(engine_id, prompt, prompt_ids, params,
                                              cache_salt=cache_salt, pooling=pooling,
                                              model=model)
        except LimitError as e:
            raise field_error(str(e), names, e.param) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        except LoRAError as e:
            raise lora_error(e) from None
        except ValueError as e:
            raise field_error(str(e), names) from None
        return engine_id, stream

    async def collect(self, request: web.Request, engine_id: str, stream):
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
    def include_usage(body: dict) -> bool:
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

    async def sse(self, request: web.Request, engine_id: str, stream, make_chunk, first=(),
                  end=None, error=None, encode=None, done: bytes = b"data: [DONE]\n\n"):
        """Stream the events `make_chunk(output)` makes (a dict, a list of them or None) after
        `first`, then `end(last output)`'s and `done`. A request that fails in the engine ends
        with `error(message)`'s event (OpenAI's error body by default). A client that stops
        reading is cut off (serving/flow.py), one that disconnects cancels this handler;
        either way the request is aborted."""
        encode = encode or event
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
