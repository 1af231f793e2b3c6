"""POST /v1/embeddings: the request's inputs read and checked, each queued as an embedding
request (LLMEngine.add_request with `pooling`, batched with generation in the same steps), and
the response built.

An input is a string, a list of strings, a list of token ids or a list of such lists; each
gives one vector, the engine's pooling of its final hidden states (`--pooling`), L2-normalized
unless the body says `"normalize": false`. `encoding_format` "float" gives lists of floats,
"base64" the little-endian float32 bytes (what OpenAI's client asks for and decodes).
`dimensions` is refused unless it is the model's hidden size: vectors are not truncated.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any

import numpy as np
from aiohttp import web

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm import normalized
from jaxserve.serving.openai.errors import ApiError
from jaxserve.serving.openai.front import Front
from jaxserve.serving.replicas import ReplicaSet

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows


def add_routes(app: web.Application, front: Front) -> None:
    app.router.add_post("/v1/embeddings", functools.partial(embeddings, front))


class EmbeddingsError(ValueError):
    """A bad field of the body; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _is_ids(x: Any) -> bool:
    return (isinstance(x, list) and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x))


def parse_inputs(body: dict) -> list[str | list[int]]:
    """The body's inputs, each a non-empty string or a non-empty list of token ids."""
    raw = body.get("input")
    if isinstance(raw, str) or _is_ids(raw):
        items = [raw]
    elif isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                             or all(_is_ids(x) for x in raw)):
        items = raw
    else:
        raise EmbeddingsError("input must be a string, a list of strings, a list of token ids "
                              "or a list of lists of token ids (none empty)", "input")
    if len(items) > MAX_INPUTS:
        raise EmbeddingsError(f"input has {len(items)} items, more than {MAX_INPUTS}", "input")
    if any(x == "" for x in items):
        raise EmbeddingsError("input must not contain an empty string", "input")
    return items


def parse_options(body: dict, hidden_size: int) -> tuple[str, bool]:
    """(encoding_format, normalize) from the body; `dimensions` checked."""
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise EmbeddingsError(f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                              "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                             or dims != hidden_size):
        raise EmbeddingsError(f"dimensions: this model's embeddings have {hidden_size} "
                              f"dimensions and cannot be shortened; got {dims!r}", "dimensions")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise EmbeddingsError("normalize must be a boolean", "normalize")
    return fmt, normalize


def encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    v = np.asarray(vec, dtype="<f4")
    return base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()


def response(vectors: list[np.ndarray], num_tokens: int, fmt: str, model: str) -> dict:
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, fmt)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def embeddings(front: Front, request: web.Request) -> web.Response:
    """Each input queued as an embedding request; all answered together, or an error (the
    others then aborted)."""
    body = await front.body(request)
    hidden = front.server.engine.model_config.hidden_size
    try:
        items = parse_inputs(body)
        fmt, normalize = parse_options(body, hidden)
    except EmbeddingsError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if not isinstance(front.server.replicas, ReplicaSet):
        raise ApiError(400, "embeddings are served by an engine in this process only, "
                            "not through a disaggregated front", param="input")
    if front.model(body) != front.server.config.model_name:
        raise ApiError(400, "embeddings come from the base model only, not a LoRA adapter",
                       param="model")
    params = SamplingParams(max_tokens=1)  # unused: the engine pools the prompt instead
    names = {"prompt": "input", "prompt_token_ids": "input"}
    submitted = []
    try:
        for item in items:
            text, ids = (item, None) if isinstance(item, str) else (None, item)
            submitted.append(await front.submit(text, ids, params, "embd", names,
                                                body.get("cache_salt"),
                                                front.server.engine.config.pooling))
        outs = await asyncio.gather(*(front.collect(request, eid, stream)
                                      for eid, stream in submitted))
    finally:
        for eid, stream in submitted:
            front.server.client_left(eid, stream)  # a no-op for those that finished
    if any(o.embedding is None for o in outs):  # aborted (a shutdown)
        raise ApiError(503, "the request ended before its embedding", kind="server_error")
    vectors = [normalized(o.embedding) if normalize else o.embedding for o in outs]
    return web.json_response(response(
        vectors, sum(len(o.prompt_token_ids) for o in outs), fmt,
        front.server.config.model_name))
