"""What the HTTP front's routes share to fail and to stream: the error a route raises (each API
writes it in its own shape), the 400 that names the body's own field, and the encodings of an
event stream."""

from __future__ import annotations

import json
import re

from aiohttp import web

from jaxserve.serving.loras import LoRAError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                       kind, code)

    def body(self) -> dict:
        """OpenAI's shape."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def field_error(message: str, names: dict[str, str], param: str | None = None) -> ApiError:
    """A 400 for an error that names a field by the engine's name (`param`, else the message's
    first word), naming the body's field (`names`: {internal name: body field}) instead, in
    the message too when it starts with the name."""
    param = param or message.split()[0].rstrip(":")
    field = names.get(param, param)
    if field != param and re.match(rf"{re.escape(param)}\b", message):
        message = field + message[len(param):]
    return ApiError(400, message, param=field)


def lora_error(e: LoRAError) -> ApiError:
    if e.status == 404:
        return ApiError(404, str(e), param=e.param, kind="not_found_error",
                        code="model_not_found")
    return ApiError(e.status, str(e), param=e.param)


def event(obj: dict) -> bytes:
    """An event of OpenAI's untyped stream (completions, chat)."""
    return f"data: {json.dumps(obj)}\n\n".encode()


def typed_event(obj: dict) -> bytes:
    """An event of a typed stream (the Responses and Messages APIs): its type on the event
    line too."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()
