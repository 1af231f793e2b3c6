"""The answer of Anthropic's Messages API (messages.py): its content blocks (thinking, text,
tool_use) and stream events, fed the model's text as it arrives, and its error bodies."""

from __future__ import annotations

import json
import uuid

from jaxserve.serving import reasoning, tools

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict:
    """An error in Anthropic's shape, {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessageBuilder:
    """A message's content blocks and stream events, fed the model's text as it arrives; the
    plain answer is the streamed one's last state."""

    def __init__(self, message: dict, choice: tools.ToolChoice | None,
                 parser: reasoning.ReasoningParser | None = None):
        self.message = message  # the skeleton: id, model, usage.input_tokens
        self._parser = tools.call_parser(choice)
        self._splitter = reasoning.splitter(parser)
        self._open: str | None = None  # the kind of the last block while it is written

    @property
    def content(self) -> list[dict]:
        return self.message["content"]

    def start(self) -> list[dict]:
        snapshot = self.message | {"content": [], "usage": dict(self.message["usage"])}
        return [{"type": "message_start", "message": snapshot}, {"type": "ping"}]

    def feed(self, text: str, final: bool = False) -> list[dict]:
        out = []
        for kind, value in reasoning.output_events(self._splitter, self._parser, text, final):
            out += (self._call(value) if kind == "call" else
                    self._text("thinking" if kind == "reasoning" else kind, value))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        """`text` added to the open block of `kind` (thinking or text), opened first."""
        events = self._close() if self._open != kind else []
        if self._open is None:
            self._open = kind
            block = ({"type": "text", "text": ""} if kind == "text" else
                     {"type": "thinking", "thinking": "", "signature": ""})
            self.content.append(block)
            events.append({"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": dict(block)})
        self.content[-1][kind] += text
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": f"{kind}_delta", kind: text}}]

    def _close(self) -> list[dict]:
        """The open block's end; a thinking block's signature is empty (nothing signs it)."""
        if self._open is None:
            return []
        i, kind = len(self.content) - 1, self._open
        self._open = None
        signed = ([{"type": "content_block_delta", "index": i,
                    "delta": {"type": "signature_delta", "signature": ""}}]
                  if kind == "thinking" else [])
        return signed + [{"type": "content_block_stop", "index": i}]

    def _call(self, call: dict) -> list[dict]:
        events = self._close()
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                 "name": call["name"], "input": json.loads(call["arguments"])}
        self.content.append(block)
        i = len(self.content) - 1
        return events + [
            {"type": "content_block_start", "index": i, "content_block": block | {"input": {}}},
            {"type": "content_block_delta", "index": i,
             "delta": {"type": "input_json_delta", "partial_json": call["arguments"]}},
            {"type": "content_block_stop", "index": i}]

    def error(self, message: str) -> dict:
        """The event of a request that failed in the engine."""
        return error_body(500, message)

    def finish(self, out) -> list[dict]:
        """The last events; `out` is the request's final output. self.message is then the
        whole message."""
        comp = out.outputs[0]
        if comp.finish_reason == "length":
            reason = "max_tokens"
        elif self._parser is not None and self._parser.num_calls:
            reason = "tool_use"
        elif isinstance(comp.stop_reason, str):
            reason = "stop_sequence"
        else:
            reason = "end_turn"
        sequence = comp.stop_reason if reason == "stop_sequence" else None
        self.message |= {"stop_reason": reason, "stop_sequence": sequence}
        self.message["usage"]["output_tokens"] = len(comp.token_ids)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": len(comp.token_ids)}},
            {"type": "message_stop"}]
