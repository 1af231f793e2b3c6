"""OpenAI's Responses API: POST /v1/responses (`input` and the stored conversation of
`previous_response_id`, with `instructions`, through the chat template; the answer as output
items, or with `stream` as the typed event stream) and GET / DELETE of a stored response.
The items, events and store are response_builder.py's."""

from __future__ import annotations

import functools
import time

from aiohttp import web

from jaxserve.serving import tools
from jaxserve.serving.openai import chat_template, response_builder
from jaxserve.serving.openai.errors import ApiError, typed_event
from jaxserve.serving.openai.front import Front


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post("/v1/responses", functools.partial(responses, front))
    app.router.add_get("/v1/responses/{response_id}", functools.partial(get_response, front))
    app.router.add_delete("/v1/responses/{response_id}",
                          functools.partial(delete_response, front))


async def responses(front: Front, request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API: `input` (and the stored conversation of
    `previous_response_id`) with `instructions` through the chat template; the answer as
    output items, or with `stream` as the typed event stream."""
    body = await front.body(request)
    try:
        choice = tools.parse_tool_choice(body)
        messages = response_builder.input_messages(body.get("input"))
        structured = response_builder.text_format(body)
    except tools.ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    instructions, store = body.get("instructions"), body.get("store", True)
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", param="instructions")
    if not isinstance(store, bool):
        raise ApiError(400, "store must be a boolean", param="store")
    prev = body.get("previous_response_id")
    if prev is not None:
        record = front.store.get(prev) if isinstance(prev, str) else None
        if record is None:
            raise ApiError(400, f"no stored response {prev!r} (never stored, stored with "
                                "store: false, or evicted)", param="previous_response_id")
        messages = record["conversation"] + messages
    system = [{"role": "system", "content": instructions}] if instructions else []
    prompt = await chat_template.chat_prompt(
        front, {k: body[k] for k in ("chat_template_kwargs",) if k in body}, system + messages,
        choice, "input")
    sampling = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
    params, names = front.params(sampling | {"max_tokens": body.get("max_output_tokens")},
                                 {"max_tokens": "max_output_tokens", "prompt": "input"},
                                 open_ended=True)
    if structured is not None:
        params.structured_outputs = await chat_template.grammar(front, structured, "text")
    if choice is not None and choice.is_forced:
        await chat_template.force_calls(front, params, choice)
    await chat_template.after_reasoning(front, params)
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    builder = response_builder.ResponseBuilder({
        "id": response_builder.new_id("resp"), "object": "response",
        "created_at": int(time.time()), "model": front.model(body),
        "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "temperature": params.temperature, "top_p": params.top_p,
        "tools": [t.spec()["function"] | {"type": "function", "strict": False}
                  for t in (choice.tools if choice else ())],
        "tool_choice": body.get("tool_choice", "auto" if choice else "none"),
        "parallel_tool_calls": choice.parallel if choice else True,
        "previous_response_id": prev, "text": {"format": fmt}, "metadata": {},
        "store": store, "truncation": "disabled", "usage": None}, choice, front.reasoning)

    engine_id, stream = await front.submit(prompt, None, params, "resp", names,
                                           model=body.get("model"))

    def finish(out) -> list[dict]:
        events = builder.finish(out)
        if store:
            front.store.put(builder.response["id"], {
                "conversation": messages + builder.conversation(),
                "response": builder.response})
        return events

    if body.get("stream"):
        def chunk(out):
            comp = out.outputs[0]
            return builder.feed(comp.new_text, final=comp.finish_reason is not None)
        return await front.sse(request, engine_id, stream, chunk, builder.start(),
                               end=finish, error=builder.error, encode=typed_event,
                               done=b"")
    out = await front.collect(request, engine_id, stream)
    builder.feed(out.outputs[0].text, final=True)
    finish(out)
    return web.json_response(builder.response)


async def get_response(front: Front, request: web.Request) -> web.Response:
    record = front.store.get(request.match_info["response_id"])
    if record is None:
        raise ApiError(404, "no such stored response", kind="not_found_error")
    return web.json_response(record["response"])


async def delete_response(front: Front, request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not front.store.delete(rid):
        raise ApiError(404, "no such stored response", kind="not_found_error")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})
