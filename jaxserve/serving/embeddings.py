"""/v1/embeddings: the request's inputs read and checked, and the response built (the HTTP
front, openai_http.py, queues each input as an embedding request: LLMEngine.add_request with
`pooling`, batched with generation in the same steps).

An input is a string, a list of strings, a list of token ids or a list of such lists; each
gives one vector, the engine's pooling of its final hidden states (`--pooling`), L2-normalized
unless the body says `"normalize": false`. `encoding_format` "float" gives lists of floats,
"base64" the little-endian float32 bytes (what OpenAI's client asks for and decodes).
`dimensions` is refused unless it is the model's hidden size: vectors are not truncated.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows


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
