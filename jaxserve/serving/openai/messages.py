"""Anthropic's Messages API on the HTTP front: POST /v1/messages (the message, or with `stream`
Anthropic's event stream, built by message_builder.py) and POST /v1/messages/count_tokens,
over the front's chat machinery (front.py, chat_template.py) and the tool calls of tools.py.

`system` and `messages` become chat messages in the form tools.check_messages returns: an
assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages. A
last assistant message is a prefill the answer goes on from. `tool_choice` `any` and `tool`
force the calls with the tools' grammar, as chat's `required` and a named function do. Under
a reasoning parser (serving/reasoning.py) the reasoning comes first as a `thinking` block, and
an assistant's `thinking` blocks go back to the template as its reasoning. Errors
on these routes come in Anthropic's shape, {"type": "error", "error": {"type", "message"}},
the message naming the field.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from aiohttp import web

from jaxserve.core.admission import LimitError
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.serving import tools
from jaxserve.serving.openai import chat_template
from jaxserve.serving.openai.errors import ApiError, typed_event
from jaxserve.serving.openai.front import Front
from jaxserve.serving.openai.message_builder import MessageBuilder, error_body

PREFIX = "/v1/messages"
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post(PREFIX, functools.partial(create, front))
    app.router.add_post(PREFIX + "/count_tokens", functools.partial(count_tokens, front))


def serves(path: str) -> bool:
    """Whether `path` is this API's (its errors then come in Anthropic's shape)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_response(e: ApiError) -> web.Response:
    """`e` in Anthropic's shape, its message led by the field (the prompt is `messages`)."""
    param = "messages" if e.param == "prompt" else e.param
    named = param is None or e.message.startswith(param)
    return web.json_response(error_body(e.status,
                                        e.message if named else f"{param}: {e.message}"),
                             status=e.status)


async def create(front: Front, request: web.Request) -> web.StreamResponse:
    body = await front.body(request)
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    stream, meta = body.get("stream", False), body.get("metadata")
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    if meta is not None and not (isinstance(meta, dict)
                                 and isinstance(meta.get("user_id"), str | None)):
        raise ApiError(400, "metadata must be an object whose user_id is a string",
                       param="metadata")
    prompt, choice = await _prompt(front, body)
    params, names = _params(front, body)
    if choice is not None and choice.is_forced:
        await chat_template.force_calls(front, params, choice)
    await chat_template.after_reasoning(front, params)
    ids = await _prompt_ids(front, prompt)
    engine_id, out_stream = await front.submit(prompt, ids, params, "msg", names,
                                               model=body["model"])
    builder = MessageBuilder({
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
        "model": body["model"], "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(ids), "output_tokens": 0}}, choice, front.reasoning)
    if stream:
        def chunk(out):
            comp = out.outputs[0]
            return builder.feed(comp.new_text, final=comp.finish_reason is not None)
        return await front.sse(request, engine_id, out_stream, chunk, builder.start(),
                               end=builder.finish, error=builder.error,
                               encode=typed_event, done=b"")
    out = await front.collect(request, engine_id, out_stream)
    builder.feed(out.outputs[0].text, final=True)
    builder.finish(out)
    return web.json_response(builder.message)


async def count_tokens(front: Front, request: web.Request) -> web.Response:
    """The templated prompt's tokens (system and tools included), as create counts them."""
    body = await front.body(request)
    prompt, _ = await _prompt(front, body)
    ids = await _prompt_ids(front, prompt)
    return web.json_response({"input_tokens": len(ids)})


async def _prompt(front: Front, body: dict) -> tuple[str, tools.ToolChoice | None]:
    """The conversation and tools through the chat template, and the tool choice."""
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "model: field required (a string)", param="model")
    try:
        choice = tool_choice(body)
    except tools.ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    messages = conversation(body)
    last = messages[-1]
    prefill = last["role"] == "assistant" and "tool_calls" not in last and last["content"]
    options = {"continue_final_message": bool(prefill),
               "chat_template_kwargs": _template_kwargs(body)}
    return await chat_template.chat_prompt(front, options, messages, choice, "messages"), choice


def _params(front: Front, body: dict) -> tuple[SamplingParams, dict[str, str]]:
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop_sequences must be a list of strings",
                       param="stop_sequences")
    raw = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body}
    return front.params(raw | ({"stop": stop} if stop else {}),
                        {"stop": "stop_sequences", "prompt": "messages"})


async def _prompt_ids(front: Front, prompt: str) -> list[int]:
    try:
        return await front.server.prompt_ids(prompt, None)
    except LimitError as e:
        raise ApiError(400, str(e), param=e.param) from None


# ------------------------------------------------------------------------ the request

def _template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs`, and Anthropic's `thinking` ({"type": "enabled" |
    "disabled"}) as the template's enable_thinking (budget_tokens is not enforced)."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object",
                       param="chat_template_kwargs")
    thinking = body.get("thinking")
    if thinking is None:
        return kwargs
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise ApiError(400, 'thinking must be {"type": "enabled" | "disabled"}',
                       param="thinking")
    return {"enable_thinking": kind == "enabled"} | kwargs


def tool_choice(body: dict) -> tools.ToolChoice | None:
    """`tools` (custom tools: name, description, input_schema) and `tool_choice`; None
    without tools. Raises ToolError."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    choice = {"type": "auto"} if choice is None else choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not (isinstance(kind, str) and kind in _CHOICES
            and isinstance(choice.get("disable_parallel_tool_use", False), bool)):
        raise tools.ToolError('tool_choice must be {"type": "auto" | "any" | "tool" (with '
                              'name) | "none"} (disable_parallel_tool_use a boolean)',
                              "tool_choice")
    if raw is None or raw == []:
        if kind in ("any", "tool"):
            raise tools.ToolError("tool_choice needs tools", "tool_choice")
        return None
    found = tools.tool_list(raw, _tool)
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind != "tool":
        return tools.ToolChoice(found, _CHOICES[kind], parallel=parallel)
    name = choice.get("name")
    if not isinstance(name, str) or name not in {t.name for t in found}:
        raise tools.ToolError("tool_choice.name must name one of the tools", "tool_choice")
    return tools.ToolChoice(found, "function", name, parallel)


def _tool(i: int, raw: Any) -> tools.Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type", "custom") not in ("custom", None):
        raise tools.ToolError(f"{where} must be a custom tool {{name, description, "
                              "input_schema}} (server tools are not served)", "tools")
    schema = raw.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise tools.ToolError(f"{where}.input_schema must be a JSON schema of type object",
                              "tools")
    return tools.new_tool(raw.get("name"), raw.get("description"), schema, where,
                          "input_schema")


def conversation(body: dict) -> list[dict]:
    """`system` and `messages` as chat messages in the form tools.check_messages returns."""
    out = []
    if body.get("system") is not None:
        system = _text(body["system"], "system", "system")
        out += [{"role": "system", "content": system}] if system else []
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(raw):
        out += _message(m, f"messages[{i}]")
    return out


def _message(m: Any, where: str) -> list[dict]:
    """One message: an assistant's text and calls as one chat message; a user's tool results
    each a tool message, the text around them user messages."""
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object with role and content", param="messages")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or role not in _BLOCKS:
        raise ApiError(400, f"{where}.role must be user or assistant", param="messages")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content blocks",
                       param="messages")
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    thought: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in _BLOCKS[role]:
            raise ApiError(400, f"{at} must be a {' or '.join(_BLOCKS[role])} block in a "
                                f"{role} message", param="messages")
        if kind == "text":
            text.append(_text([b], at, "messages"))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise ApiError(400, f"{at}.thinking must be a string", param="messages")
            thought.append(b["thinking"])
        elif kind == "tool_use":
            calls.append(_call(b, at))
        else:
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append(_result(b, at))
    if role == "assistant":
        return [{"role": "assistant", "content": "\n".join(text)}
                | ({"tool_calls": calls} if calls else {})
                | ({"reasoning_content": "\n".join(thought)} if thought else {})]
    return out + ([{"role": "user", "content": "\n".join(text)}] if text or not out else [])


def _text(value: Any, where: str, param: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        return "\n".join(b["text"] for b in value)
    raise ApiError(400, f"{where} must be a string or a list of text blocks", param=param)


def _call(block: dict, where: str) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, dict)):
        raise ApiError(400, f"{where} must be a tool_use block with a string id and name and "
                            "an object input", param="messages")
    return {"id": call_id, "name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _result(block: dict, where: str) -> dict:
    """A tool_result block as a tool message; one that `is_error` says so to the model."""
    use_id, is_error = block.get("tool_use_id"), block.get("is_error", False)
    if not isinstance(use_id, str):
        raise ApiError(400, f"{where}.tool_use_id must be a string", param="messages")
    if not isinstance(is_error, bool):
        raise ApiError(400, f"{where}.is_error must be a boolean", param="messages")
    text = _text(block.get("content", ""), f"{where}.content", "messages")
    return {"role": "tool", "tool_call_id": use_id,
            "content": f"Error: {text}" if is_error else text}
