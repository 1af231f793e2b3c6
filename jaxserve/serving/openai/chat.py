"""POST /v1/chat/completions: the messages (and tools) through the chat template, the `n`
choices as messages or streamed deltas, with tool calls parsed from the text (or forced by a
grammar under tool_choice required or a named function) and a reasoning model's thinking
apart as reasoning_content."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from aiohttp import web

from jaxserve.serving import reasoning, tools
from jaxserve.serving.openai import chat_template, outputs
from jaxserve.serving.openai.errors import ApiError
from jaxserve.serving.openai.front import Front


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post("/v1/chat/completions", functools.partial(chat_completions, front))


async def chat_completions(front: Front, request: web.Request) -> web.StreamResponse:
    body = await front.body(request)
    try:
        choice = tools.parse_tool_choice(body)
        messages = tools.check_messages(body.get("messages"))
    except tools.ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    prompt = await chat_template.chat_prompt(front, body, messages, choice, "messages")
    params, names = front.params(body, {"prompt": "messages"}, open_ended=True)
    if choice is not None and choice.is_forced:
        await chat_template.force_calls(front, params, choice)
    await chat_template.after_reasoning(front, params)
    include_usage = front.include_usage(body)
    engine_id, stream = await front.submit(prompt, None, params, "chat", names,
                                           body.get("cache_salt"), model=body.get("model"))
    created, model = int(time.time()), front.model(body)
    tok = front.server.engine.tokenizer
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    calling = choice is not None and choice.mode != "none"
    if body.get("stream"):
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model}
        first = base | {"choices": [{"index": i, "delta": {"role": "assistant",
                                                            "content": ""},
                                     "finish_reason": None} for i in range(params.n)]}
        parsers = {i: tools.CallParser(choice) for i in range(params.n)} if calling else {}
        splitters = {i: reasoning.splitter(front.reasoning) for i in range(params.n)}
        unscored = body.get("prompt_logprobs") is not None

        def chunk(out):
            nonlocal unscored
            rows: list[list[dict]] = []  # per choice, its deltas in order
            for comp in outputs.moved(out):
                lp = outputs.chat_logprobs(tok, comp, new_only=True)
                parser, splitter = parsers.get(comp.index), splitters.get(comp.index)
                final = comp.finish_reason is not None
                thought, text = reasoning.parts(splitter, comp.new_text, final)
                deltas = [{"reasoning_content": thought}] if thought else []
                deltas += (call_deltas(parser, text, final) if parser is not None else
                           [{"content": text}] if text else [])
                finish = finish_reason(comp.finish_reason, parser)
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
                chunks[0]["prompt_logprobs"] = outputs.prompt_logprobs(tok, out)
            return chunks
        return await front.sse(request, engine_id, stream, chunk, [first],
                               end=outputs.usage_chunk(base) if include_usage else None)
    out = await front.collect(request, engine_id, stream)

    def answer(c) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if front.reasoning is not None:
            message["reasoning_content"], message["content"] = reasoning.split(
                front.reasoning, c.text)
        finish = c.finish_reason
        if calling and message["content"] is not None:
            message["content"], calls = tools.split_calls(message["content"], choice)
            if calls:
                message["tool_calls"] = [call_json(x) for x in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message, "logprobs": outputs.chat_logprobs(tok, c),
                "finish_reason": finish}

    return web.json_response({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [answer(c) for c in out.outputs], "usage": outputs.usage(out)}
        | ({"prompt_logprobs": outputs.prompt_logprobs(tok, out)}
           if body.get("prompt_logprobs") is not None else {}))


def call_json(call: dict) -> dict:
    return {"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


def call_deltas(parser: tools.CallParser, text: str, final: bool) -> list[dict]:
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


def finish_reason(reason: str | None, parser: tools.CallParser | None) -> str | None:
    """A choice that called tools and stopped finishes with tool_calls, as OpenAI's do."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.num_calls else reason
