"""The parts of OpenAI's Responses API (responses.py): `input` items turned into chat messages,
the answer turned into output items (reasoning, a message's text, function calls) and the typed
event stream, and the bounded store that `previous_response_id` reads.

One builder makes both answers: fed the model's text as it comes, it returns the stream's
events (response.output_item.added, response.output_text.delta, ...) and keeps the output
items, so a plain response is the streamed one's last state.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from jaxserve.serving import reasoning, tools


class ResponseStore:
    """Responses kept for `previous_response_id` and GET, the least recently used evicted once
    there are more than `max_count` or their JSON passes `max_bytes` (0 keeps none)."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, record: dict) -> None:
        size = len(json.dumps(record))
        if size > self.max_bytes or self.max_count <= 0:
            return
        with self._lock:
            self._items[response_id] = (record, size)
            self.num_bytes += size
            while len(self._items) > self.max_count or self.num_bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.num_bytes -= dropped
                self.num_evicted += 1

    def get(self, response_id: str) -> dict | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                return None
            self._items.move_to_end(response_id)
            return item[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self.num_bytes -= item[1]
            return item is not None


def input_messages(raw: Any) -> list[dict]:
    """`input` (a string, or a list of message, reasoning, function_call and
    function_call_output items) as chat messages in the form `tools.check_messages` takes; a
    reasoning item goes with the assistant turn after it. Raises ToolError naming `input`."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise tools.ToolError("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            _add_turn(out, {"role": item.get("role"), "content": item.get("content")})
        elif kind == "reasoning" and _reasoning_text(item) is not None:
            out.append({"role": "assistant", "content": "",
                        "reasoning_content": _reasoning_text(item)})
        elif kind == "function_call" and isinstance(item.get("call_id"), str):
            _add_call(out, {"id": item["call_id"], "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise tools.ToolError(f"input[{i}] must be a message, reasoning (content a list of "
                                  "reasoning_text parts), function_call (with call_id) or "
                                  "function_call_output (with call_id) item", "input")
    try:
        return tools.check_messages(out)
    except tools.ToolError as e:
        raise tools.ToolError(str(e).replace("messages[", "input["), "input") from None


def _reasoning_text(item: dict) -> str | None:
    """A reasoning item's text (its reasoning_text parts), None if its content is malformed."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(
            p.get("text"), str) for p in parts):
        return None
    return "".join(p["text"] for p in parts)


def _thought_only(messages: list[dict]) -> bool:
    """Is the last message an assistant turn with reasoning and nothing else yet?"""
    last = messages[-1] if messages else {}
    return (last.get("role") == "assistant" and "reasoning_content" in last
            and not last["content"] and "tool_calls" not in last)


def _add_turn(messages: list[dict], message: dict) -> None:
    """`message` after `messages`; an assistant's joins the reasoning before it."""
    if message["role"] == "assistant" and _thought_only(messages):
        messages[-1]["content"] = message["content"]
    else:
        messages.append(message)


def _add_call(messages: list[dict], call: dict) -> None:
    """A tool call joins the assistant turn before it when that one calls or only reasoned."""
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and ("tool_calls" in last or _thought_only(messages)):
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def text_format(body: dict) -> dict | None:
    """`text.format` as a `structured_outputs` value (None for plain text)."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else False
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"json": fmt["schema"]}
    raise tools.ToolError("text.format must be {type: text}, {type: json_object} or {type: "
                          "json_schema, name, schema}", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


#: What an item of text is written as: its part's type and its stream events' prefix
_PARTS = {"reasoning": ("reasoning_text", "response.reasoning_text"),
          "message": ("output_text", "response.output_text")}


class ResponseBuilder:
    """A response's output items and stream events, fed the model's text as it arrives. Under a
    reasoning parser the reasoning comes first as a `reasoning` item (its text a
    `reasoning_text` part); tool calls are parsed from the answer after it."""

    def __init__(self, response: dict, choice: tools.ToolChoice | None,
                 parser: reasoning.ReasoningParser | None = None):
        self.response = response  # the skeleton: id, model, the request's settings
        self._parser = tools.call_parser(choice)
        self._splitter = reasoning.splitter(parser)
        self._seq = 0
        self._open: dict | None = None  # the reasoning or message item being written
        self.output: list[dict] = []

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[dict]:
        snapshot = self.response | {"status": "in_progress", "output": []}
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, text: str, final: bool = False) -> list[dict]:
        out = []
        for kind, value in reasoning.output_events(self._splitter, self._parser, text, final):
            out += (self._call(value) if kind == "call" else
                    self._text("message" if kind == "text" else kind, value))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        """`text` added to the open item of `kind` (reasoning or message), opened first when
        another is."""
        events = self._close("completed") if self._open and self._open["type"] != kind else []
        part_type, prefix = _PARTS[kind]
        if self._open is None:
            self._open = ({"id": new_id("msg"), "type": "message", "role": "assistant"}
                          if kind == "message" else
                          {"id": new_id("rs"), "type": "reasoning", "summary": []})
            self._open |= {"status": "in_progress", "content": []}
            self.output.append(self._open)
            events.append(self._event("response.output_item.added", item=self._item(),
                                      output_index=len(self.output) - 1))
            self._open["content"].append({"type": part_type, "text": ""} | (
                {"annotations": [], "logprobs": []} if kind == "message" else {}))
            events.append(self._event("response.content_part.added", **self._where(),
                                      part=dict(self._open["content"][0])))
        self._open["content"][0]["text"] += text
        return events + [self._event(f"{prefix}.delta", **self._where(), delta=text,
                                     **self._logprobs())]

    def _logprobs(self) -> dict:
        """The empty logprobs an output_text event carries (a reasoning_text one has none)."""
        return {"logprobs": []} if self._open["type"] == "message" else {}

    def _item(self) -> dict:
        return self._open | {"content": [dict(c) for c in self._open["content"]]}

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1,
                "content_index": 0}

    def _close(self, status: str) -> list[dict]:
        if self._open is None:
            return []
        part, where = self._open["content"][0], self._where()
        self._open["status"] = status
        prefix = _PARTS[self._open["type"]][1]
        events = [self._event(f"{prefix}.done", **where, text=part["text"], **self._logprobs()),
                  self._event("response.content_part.done", **where, part=dict(part)),
                  self._event("response.output_item.done", item=self._item(),
                              output_index=where["output_index"])]
        self._open = None
        return events

    def _call(self, call: dict) -> list[dict]:
        events = self._close("completed")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": call["name"], "arguments": call["arguments"], "status": "completed"}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return events + [
            self._event("response.output_item.added", output_index=where["output_index"],
                        item=item | {"arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", **where,
                        delta=call["arguments"]),
            self._event("response.function_call_arguments.done", **where, name=call["name"],
                        arguments=call["arguments"]),
            self._event("response.output_item.done", output_index=where["output_index"],
                        item=item)]

    def error(self, message: str) -> dict:
        """The event of a request that failed in the engine."""
        return self._event("error", code="server_error", message=message, param=None)

    def finish(self, out) -> list[dict]:
        """The last events; `out` is the request's final output. self.response is then the
        whole response."""
        comp = out.outputs[0]
        cut = comp.finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        n_in, n_out = len(out.prompt_token_ids), len(comp.token_ids)
        self.response |= {
            "status": "incomplete" if cut else "completed", "output": self.output,
            "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out}}
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self.response)]

    def conversation(self) -> list[dict]:
        """The output as chat messages (checked form), to append to the stored conversation."""
        messages: list[dict] = []
        for item in self.output:
            if item["type"] == "reasoning":
                messages.append({"role": "assistant", "content": "",
                                 "reasoning_content": item["content"][0]["text"]})
            elif item["type"] == "message":
                _add_turn(messages, {"role": "assistant", "content": item["content"][0]["text"]})
            else:
                _add_call(messages, {"id": item["call_id"], "name": item["name"],
                                     "arguments": item["arguments"]})
        for m in messages:  # the checked form's content is a string
            m["content"] = m["content"] or ""
        return messages
