"""What the HTTP front's API modules share: the error a route raises (each API writes it in its
own shape) and the encoding of a typed event stream."""

from __future__ import annotations

import json

from aiohttp import web


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


def typed_event(obj: dict) -> bytes:
    """An event of a typed stream (the Responses and Messages APIs): its type on the event
    line too."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()
