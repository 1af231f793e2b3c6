"""vLLM's POST /tokenize (a prompt, or messages through the chat template, as token ids) and
POST /detokenize (token ids as text)."""

from __future__ import annotations

import functools

from aiohttp import web

from jaxserve.serving.openai import chat_template
from jaxserve.serving.openai.errors import ApiError
from jaxserve.serving.openai.front import Front


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post("/tokenize", functools.partial(tokenize, front))
    app.router.add_post("/detokenize", functools.partial(detokenize, front))


async def tokenize(front: Front, request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt": text} (add_special_tokens, default true) or
    {"messages": [...]} through the chat template -> the token ids and their count."""
    body = await front.body(request)
    tok = front.server.engine.tokenizer
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
        text = await front.server.off_loop(tok.apply_chat_template, messages,
                                          tokenize=False,
                                          **chat_template.template_options(front, body, messages))
        add_special = False  # the template wrote them
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
    if len(text) > front.server.max_prompt_chars:
        raise ApiError(400, "prompt is longer than the prompt limit", param="prompt")
    ids = await front.server.off_loop(
        lambda: tok(text, add_special_tokens=add_special).input_ids)
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": front.server.engine.config.max_model_len})


async def detokenize(front: Front, request: web.Request) -> web.Response:
    body = await front.body(request)
    tok = front.server.engine.tokenizer
    ids = body.get("tokens")
    vocab = front.server.engine.model_config.vocab_size
    if tok is None:
        raise ApiError(400, "this model has no tokenizer")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})",
                       param="tokens")
    return web.json_response({"prompt": tok.decode(ids)})
