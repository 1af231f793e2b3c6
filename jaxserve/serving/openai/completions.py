"""POST /v1/completions: one prompt (text or token ids), its `n` choices plain or streamed;
`echo` puts the prompt before each choice's text (and, with logprobs, its scores)."""

from __future__ import annotations

import functools
import time
import uuid

from aiohttp import web

from jaxserve.serving.openai import outputs
from jaxserve.serving.openai.errors import ApiError
from jaxserve.serving.openai.front import Front


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post("/v1/completions", functools.partial(completions, front))


async def completions(front: Front, request: web.Request) -> web.StreamResponse:
    body = await front.body(request)
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
    params, names = front.params(body, {"prompt_token_ids": "prompt"})
    if echo and params.logprobs is not None and params.prompt_logprobs is None:
        # OpenAI's echo with logprobs scores the prompt's tokens too
        params.prompt_logprobs = params.logprobs
    include_usage = front.include_usage(body)
    engine_id, stream = await front.submit(prompt, prompt_ids, params, "cmpl", names,
                                           body.get("cache_salt"), model=body.get("model"))
    created, model = int(time.time()), front.model(body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    tok = front.server.engine.tokenizer
    echoed = ""
    if echo:  # the prompt's text, before each choice's
        echoed = prompt if prompt is not None else (tok.decode(prompt_ids) if tok else "")

    def logprobs(out, comp, new_only: bool, lead: bool) -> dict | None:
        """The choice's logprobs (this chunk's when `new_only`); `lead`: they start with
        the echoed prompt's, as OpenAI's echo does (text offsets count the echo too)."""
        lp = outputs.completion_logprobs(tok, comp, new_only, shift=len(echoed))
        if not (lead and echo and params.logprobs is not None):
            return lp
        pairs = list(zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True))
        head = outputs.completion_logprobs_of(tok, pairs, 0, first=out.prompt_token_ids[0])
        return head if lp is None else {k: head[k] + lp[k] for k in head}

    def extra(out) -> dict:  # vLLM's prompt_logprobs field, on a choice's first chunk
        return ({"prompt_logprobs": outputs.prompt_logprobs(tok, out)}
                if body.get("prompt_logprobs") is not None else {})

    if body.get("stream"):
        unstarted = set(range(params.n))

        def chunk(out):
            choices = []
            for comp in outputs.moved(out):
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
        return await front.sse(request, engine_id, stream, chunk,
                               end=outputs.usage_chunk(base) if include_usage else None)
    out = await front.collect(request, engine_id, stream)
    return web.json_response({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": echoed + c.text,
                     "logprobs": logprobs(out, c, False, True),
                     "finish_reason": c.finish_reason} | extra(out) for c in out.outputs],
        "usage": outputs.usage(out)})
