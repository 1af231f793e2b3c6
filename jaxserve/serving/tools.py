"""Tool calling for the OpenAI fronts: a request's `tools` and `tool_choice` checked, the
conversation rendered for the model's chat template, the grammar that forces a call, and the
calls parsed out of what the model writes (streamed or whole).

A call is written in the Hermes form, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`. A chat template that takes `tools` itself (it names the variable) gets them and
the conversation in Hugging Face's form; any other (the default model's) gets the tools
described in the system message, earlier calls written back in that form and tool results as
`<tool_response>` blocks in a user turn. Under `required` or a named function the output is
constrained by a Lark grammar with one `%json` rule per function, so every call parses and its
arguments validate; under `auto` a block that does not parse or validate stays text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.core import nesting

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad `tools`, `tool_choice` or message field; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def spec(self) -> dict:
        """OpenAI's (and Hugging Face templates') form of the tool."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    tools: tuple[Tool, ...]
    mode: str  # none, auto, required, or "function" (one named function must be called)
    forced: str | None = None  # the named function
    parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "function")

    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def grammar(self) -> str:
        """The Lark grammar of one call (several, newline-separated, when parallel) to the
        allowed functions."""
        allowed = [t for t in self.tools if self.forced in (None, t.name)]
        rules = []
        for i, t in enumerate(allowed):
            schema = {"type": "object", "properties": {"name": {"const": t.name},
                                                       "arguments": t.parameters},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": {"whitespace_flexible": False}}
            rules.append(f"fn{i}: %json {json.dumps(schema)}")
        many = self.parallel and self.mode == "required"
        head = 'start: call ("\\n" call)*' if many else "start: call"
        body = " | ".join(f"fn{i}" for i in range(len(allowed)))
        return "\n".join([head, f'call: "{OPEN}\\n" ({body}) "\\n{CLOSE}"', *rules]) + "\n"


def _schema_checked(schema: Any, where: str) -> dict:
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema object", "tools")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolError(f"{where} is not a valid JSON schema: {e.message}", "tools") from None
    except RecursionError:  # jsonschema recurses: a guard behind the body's nesting bound
        raise ToolError(f"{where} nests too deeply", "tools") from None
    return schema


def _tool(i: int, raw: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise ToolError(f"{where} must be {{type: function, function: {{name, ...}}}}", "tools")
    # OpenAI's chat form nests the function; the Responses API's form is flat
    fn = raw.get("function", raw)
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function must be an object", "tools")
    return new_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                    f"{where}.function")


def new_tool(name: Any, description: Any, schema: Any, where: str,
             schema_field: str = "parameters") -> Tool:
    """A tool from a request's fields, each checked; errors name `where`.<field>."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.name must be 1-64 letters, digits, _ . or -", "tools")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description must be a string", "tools")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    return Tool(name, description, _schema_checked(schema, f"{where}.{schema_field}"))


def tool_list(raw: Any, make) -> tuple[Tool, ...]:
    """`tools`, each item made by `make(index, item)`: a list of at most 128 distinct names."""
    if not isinstance(raw, list) or len(raw) > 128:
        raise ToolError("tools must be a list of at most 128 functions", "tools")
    tools = tuple(make(i, t) for i, t in enumerate(raw))
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("tools must have distinct names", "tools")
    return tools


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """The request's tools and choice; None when it has no tools. Raises ToolError."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    tools = tool_list(raw, _tool)
    if choice is None or choice in _CHOICES:
        return ToolChoice(tools, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)  # chat nests it; the Responses API does not
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in {t.name for t in tools}:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools",
                            "tool_choice")
        return ToolChoice(tools, "function", name, parallel)
    raise ToolError("tool_choice must be none, auto, required or {type: function, function: "
                    "{name}}", "tool_choice")


# ------------------------------------------------------------------------ the conversation

def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's array form)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ToolError(f"{where}.content must be a string or a list of text parts", "messages")


def _calls(raw: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls -> [{id, name, arguments (a JSON string)}]."""
    if not isinstance(raw, list) or not raw:
        raise ToolError(f"{where}.tool_calls must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str)):
            raise ToolError(f"{where}.tool_calls[{j}] must be {{id, type, function: {{name, "
                            "arguments (a JSON string)}}}}", "messages")
        try:  # the template gets them parsed: bounded like the body's own JSON
            _arguments(fn.get("arguments", "{}"))
        except nesting.TooDeep as e:
            raise ToolError(f"{where}.tool_calls[{j}].function.{e}", "messages") from None
        out.append({"id": c.get("id"), "name": fn["name"],
                    "arguments": fn.get("arguments", "{}")})
    return out


def check_messages(messages: Any) -> list[dict]:
    """Chat messages -> [{role, content (str), tool_calls?, tool_call_id?,
    reasoning_content?}]. An assistant's reasoning (`reasoning_content`, or vLLM's newer
    `reasoning`) goes to the template, which decides whether to show it. Raises ToolError
    naming `messages`."""
    if not isinstance(messages, list) or not messages:
        raise ToolError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolError(f"{where} must be an object with a string role", "messages")
        role = m["role"]
        msg = {"role": "system" if role == "developer" else role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _calls(m["tool_calls"], where)
            msg["content"] = "" if m.get("content") is None else _text(m["content"], where)
        else:
            msg["content"] = _text(m.get("content"), where)
        thought = m.get("reasoning_content", m.get("reasoning"))
        if role == "assistant" and thought is not None:
            if not isinstance(thought, str):
                raise ToolError(f"{where}.reasoning_content must be a string", "messages")
            msg["reasoning_content"] = thought
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def takes_tools(template: str) -> bool:
    """Whether a chat template renders `tools` and tool calls itself."""
    return re.search(r"\btools\b", template) is not None


def _arguments(text: str) -> Any:
    """A call's arguments parsed; text that is not JSON stays text. Raises nesting.TooDeep."""
    try:
        return nesting.loads(text, "arguments")
    except nesting.TooDeep:
        raise
    except ValueError:
        return text


def _written(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def _system_prompt(choice: ToolChoice) -> str:
    lines = "\n".join(json.dumps(t.spec()["function"], separators=(",", ":"))
                      for t in choice.tools)
    return (f"You may call these functions:\n<tools>\n{lines}\n</tools>\nTo call one, write "
            f'{OPEN}\n{{"name": <name>, "arguments": <JSON object>}}\n{CLOSE}')


def render(messages: list[dict], choice: ToolChoice | None, native: bool) -> tuple[list, dict]:
    """(messages, extra apply_chat_template arguments) for a template that takes tools
    (`native`) or one that does not. Under tool_choice none the tools are not shown."""
    shown = choice if choice is not None and choice.mode != "none" else None
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                m["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": _arguments(c["arguments"])}}
                    for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": [t.spec() for t in shown.tools]} if shown else {})
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif "tool_calls" in m:
            parts = [m["content"]] if m["content"] else []
            parts += [_written(c["name"], _arguments(c["arguments"])) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if shown is not None:
        prompt = _system_prompt(shown)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


# ------------------------------------------------------------------------ parsing the output

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallParser:
    """Splits what the model writes into text and tool calls as it arrives.

    `feed(text)` and `finish()` return events: ("text", str) or ("call", {id, name,
    arguments}), `arguments` a JSON string that validated against the function's schema. A
    `<tool_call>` block that does not parse or validate comes back as text. Trailing
    whitespace is held until more text follows it (a call drops it; at the end it is dropped
    if there were calls), so any split of the same text gives the same events.
    Without `parallel` only the first call is taken (later blocks stay text). Under a forced
    choice the grammar allows nothing but calls: what is left (a call cut short by max_tokens,
    the newlines between calls) is dropped."""

    def __init__(self, choice: ToolChoice):
        self._tools = choice.by_name()
        self._parallel = choice.parallel
        self._forced = choice.is_forced
        self._buf = ""
        self._in_call = False
        self._blank = ""  # whitespace-only text, held
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    events += self._say(OPEN + body + CLOSE)
                else:
                    self._blank = ""
                    self.num_calls += 1
                    events.append(("call", call))
                continue
            start = self._buf.find(OPEN) if self._parallel or not self.num_calls else -1
            if start >= 0:
                events += self._say(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(OPEN):], True
                continue
            keep = partial_suffix(self._buf, OPEN) if self._parallel or not self.num_calls else 0
            events += self._say(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return events

    def finish(self) -> list[tuple[str, Any]]:
        rest = (OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        events = self._say(rest)
        if self._blank and not self.num_calls:
            events.append(("text", self._blank))
        self._blank = ""
        return events

    def _say(self, text: str) -> list[tuple[str, Any]]:
        if self._forced:
            return []
        text = self._blank + text
        said = text.rstrip()
        self._blank = text[len(said):]
        return [("text", said)] if said else []

    def _call(self, body: str) -> dict | None:
        import jsonschema
        from referencing.exceptions import Unresolvable

        try:  # a block that nests too deeply is text, like one that is not JSON
            obj = nesting.loads(body, "a call")
            if not isinstance(obj, dict) or obj.get("name") not in self._tools:
                return None
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                args = _arguments(args)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        try:
            jsonschema.validate(args, self._tools[obj["name"]].parameters)
        except (jsonschema.ValidationError, RecursionError, Unresolvable):
            return None  # RecursionError: a $ref cycle; Unresolvable: a $ref to nowhere
        return {"id": new_call_id(), "name": obj["name"],
                "arguments": json.dumps(args, ensure_ascii=False)}


def call_parser(choice: ToolChoice | None) -> CallParser | None:
    """The parser of a request's output; None when it cannot call (no tools, or `none`)."""
    return CallParser(choice) if choice is not None and choice.mode != "none" else None


def text_events(parser: CallParser | None, text: str, final: bool) -> list[tuple[str, Any]]:
    """What `text` adds to the output: the parser's events (finished when `final`), or all of
    it as text when there is no parser."""
    if parser is None:
        return [("text", text)] if text else []
    return parser.feed(text) + (parser.finish() if final else [])


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag maybe on its way)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_calls(text: str, choice: ToolChoice) -> tuple[str | None, list[dict]]:
    """A whole answer -> (its text, None if only calls; its calls)."""
    events = text_events(CallParser(choice), text, final=True)
    calls = [e for kind, e in events if kind == "call"]
    content = "".join(e for kind, e in events if kind == "text")
    if calls:
        return content.strip() or None, calls
    return content, calls
