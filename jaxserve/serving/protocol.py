"""The socket protocol: length-prefixed msgpack frames over TCP.

A frame is a 4-byte big-endian unsigned length N followed by N bytes of msgpack encoding one map
with a string "type". Client frames:

    {"type": "auth", "api_key": str}                              (first, when a key is set)
    {"type": "generate", "id": str, "prompt": str | "prompt_token_ids": [int],
     "params": {...SamplingParams fields, by name...}, "priority": int, "stream": bool,
     "cache_salt": str (prefix-cache blocks are shared only under the same salt),
     "lora_name": str (a loaded LoRA adapter it runs under; absent: the base model),
     "lora_int_id": int, "lora_path": str (with lora_name: the adapter named in full, as a
                   disaggregated front names it to its prefill and decode engines only)}
    {"type": "abort", "id": str}
    {"type": "health"}        {"type": "stats"}

Server frames:

    {"type": "token", "id", "index": sample, "text": new text, "token_ids": new ids,
     "logprobs": [entry per new token] (params.logprobs set)}             (stream=True only)
    {"type": "done", "id", "finish_reason", "stop_reason", "text", "token_ids",
     "prompt_tokens", "completion_tokens", "ttft", "e2e",
     "logprobs": [entry per token] (params.logprobs set),
     "prompt_logprobs": [null, entry per later prompt token] (params.prompt_logprobs set),
     "choices": [{"index", "finish_reason", "stop_reason", "text", "token_ids",
                  "logprobs"?}] (n > 1)}

An entry is {"logprob": float, "top": [[token id, logprob], ...] best first}; a prompt
entry adds "rank" (1 + how many tokens were more likely). With params.n > 1 the top-level
fields are sample 0's, and completion_tokens counts every sample's tokens.
    {"type": "error", "id"?: str, "code": str, "message": str}
    {"type": "health", "status": "ok"}        {"type": "stats", ...engine figures...}

Ids are the client's own; they must be unique among that connection's live requests. Error
codes: bad_frame, frame_too_large (then the connection closes, after the error frame even
when the client half-closed mid-frame), unknown_type, unauthorized,
invalid_field, invalid_request, limit_exceeded, queue_full, duplicate_id, not_found (also: no
LoRA adapter of that lora_name is loaded),
shutting_down, and internal_error (the request failed inside the engine; others go on).
Closing the connection, or only its sending half, aborts every request on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from typing import Any

import msgpack

from jaxserve.core.block_hash import check_salt
from jaxserve.core.sampling_params import SamplingParams

HEADER = struct.Struct(">I")
CLIENT_TYPES = ("auth", "generate", "abort", "health", "stats")


class ProtocolError(Exception):
    """A problem with one frame: reported to the client as an error frame."""

    def __init__(self, code: str, message: str, request_id: str | None = None,
                 fatal: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.fatal = fatal  # the byte stream cannot be trusted any more: close the connection


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is the client's
        raise ProtocolError("bad_frame", f"malformed msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("bad_frame", "a frame must be a map with a string 'type'")
    return msg


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> dict[str, Any] | None:
    """The next frame, or None at a clean end of stream. Raises ProtocolError."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("bad_frame", "truncated frame header", fatal=True) from None
        return None
    (n,) = HEADER.unpack(header)
    if n > max_bytes:
        raise ProtocolError("frame_too_large",
                            f"frame of {n} bytes exceeds max_frame_bytes ({max_bytes})",
                            fatal=True)
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ProtocolError("bad_frame", "truncated frame body", fatal=True) from None
    return decode_body(body)


@dataclasses.dataclass
class GenerateRequest:
    id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    stream: bool
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_int_id: int | None = None  # with lora_path: the adapter as a front names it
    lora_path: str | None = None


def parse_generate(msg: dict[str, Any]) -> GenerateRequest:
    rid = msg.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise ProtocolError("invalid_field", "id: must be a non-empty string (<= 256 chars)")

    def bad(field: str, what: str):
        return ProtocolError("invalid_field", f"{field}: {what}", rid)

    prompt, ids = msg.get("prompt"), msg.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise bad("prompt", "give exactly one of prompt and prompt_token_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("prompt", "must be a string")
    if ids is not None and (not isinstance(ids, list)
                            or not all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in ids)):
        raise bad("prompt_token_ids", "must be a list of ints")
    raw = msg.get("params", {})
    if not isinstance(raw, dict):
        raise bad("params", "must be a map")
    try:
        params = SamplingParams.from_dict(raw)
    except ValueError as e:  # the message starts with the field's name
        raise ProtocolError("invalid_field", f"params.{e}", rid) from None
    priority = msg.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise bad("priority", "must be an int")
    stream = msg.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be a bool")
    salt = msg.get("cache_salt")
    try:
        check_salt(salt)
    except ValueError as e:  # the message starts with the field's name
        raise ProtocolError("invalid_field", str(e), rid) from None
    lora_name = msg.get("lora_name")
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise bad("lora_name", "must be a non-empty string")
    lora_id, lora_path = msg.get("lora_int_id"), msg.get("lora_path")
    if (lora_id is None) != (lora_path is None) or (lora_path is not None and lora_name is None):
        raise bad("lora_path", "lora_name, lora_int_id and lora_path come together")
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)
                                or lora_id < 1):
        raise bad("lora_int_id", "must be a positive int")
    if lora_path is not None and (not isinstance(lora_path, str) or not lora_path):
        raise bad("lora_path", "must be a non-empty string")
    return GenerateRequest(rid, prompt, ids, params, priority, stream, salt, lora_name,
                           lora_id, lora_path)


def logprob_from_wire(entry: dict | None) -> dict | None:
    """A logprob entry as the engine keeps it, from its frame form ("top" as pairs)."""
    if entry is None:
        return None
    return entry | {"top": {int(t): lp for t, lp in entry["top"]}}
