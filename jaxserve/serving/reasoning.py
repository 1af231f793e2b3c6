"""Reasoning output (vLLM's `--reasoning-parser`): a thinking model writes its reasoning between
`<think>` and `</think>`, then its answer; the fronts give the two apart.

The formats, by vLLM's names:
- `qwen3`: the output has reasoning only when it opens with `<think>` (after any whitespace,
  which is dropped). Output that does not (the template's `enable_thinking: false` wrote an
  empty block into the prompt) is all content.
- `deepseek_r1`: the template opened `<think>` in the prompt, so the output starts inside the
  reasoning; a `<think>` the model writes first anyway is dropped.
Either way the reasoning runs to the first `</think>`, and all that follows is content; an output
cut off before `</think>` is all reasoning.

`ReasoningSplitter` splits text as it streams, holding back only what may be the start of a tag;
`split` runs it over a whole text, so any way of cutting a text into deltas gives the same two
parts. `grammar_after` makes structured output apply to the content only.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any

from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.serving.tools import CallParser, partial_suffix, text_events

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser(enum.StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"

    @property
    def starts_inside(self) -> bool:
        """Does the output begin inside the reasoning (the prompt opened it)?"""
        return self is ReasoningParser.DEEPSEEK_R1


_HEAD, _REASONING, _CONTENT = range(3)  # before the first tag is known; in it; after


class ReasoningSplitter:
    """Fed an output's text deltas, returns (reasoning, content) deltas, either maybe empty.
    `has_reasoning`: whether the output has a reasoning part (so far)."""

    def __init__(self, parser: ReasoningParser | str):
        self.parser = ReasoningParser(parser)
        self.has_reasoning = self.parser.starts_inside
        self._state = _HEAD
        self._held = ""  # text not yet given out: maybe the start of a tag

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The deltas `text` adds; `final`: it is the output's last (what is held comes out)."""
        self._held += text
        reasoning = ""
        if self._state == _HEAD:
            lead = self._held.lstrip()
            if lead.startswith(OPEN):
                self._state, self._held, self.has_reasoning = _REASONING, lead[len(OPEN):], True
            elif OPEN.startswith(lead) and not final:
                return "", ""
            else:
                self._state = _REASONING if self.parser.starts_inside else _CONTENT
        if self._state == _REASONING:
            end = self._held.find(CLOSE)
            if end < 0:
                keep = 0 if final else partial_suffix(self._held, CLOSE)
                cut = len(self._held) - keep
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning, self._held = self._held[:end], self._held[end + len(CLOSE):]
            self._state = _CONTENT
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, at the output's end."""
        return self.feed("", final=True)


def splitter(parser: ReasoningParser | str | None) -> ReasoningSplitter | None:
    """The splitter of one output; None without a reasoning parser."""
    return ReasoningSplitter(parser) if parser is not None else None


def parts(splitter: ReasoningSplitter | None, text: str, final: bool) -> tuple[str, str]:
    """The (reasoning, content) deltas `text` adds to an output (`final`: its last); all of
    it content when there is no splitter."""
    return splitter.feed(text, final) if splitter is not None else ("", text)


def output_events(splitter: ReasoningSplitter | None, calls: CallParser | None, text: str,
                  final: bool) -> list[tuple[str, Any]]:
    """What `text` adds to an output, in order: ("reasoning", text), then the answer's events
    (tools.text_events: ("text", text), ("call", call))."""
    thought, content = parts(splitter, text, final)
    return ([("reasoning", thought)] if thought else []) + text_events(calls, content, final)


def split(parser: ReasoningParser | str, text: str) -> tuple[str | None, str | None]:
    """A whole output -> (its reasoning, None if it has none; its content, None if it is empty
    after a reasoning part)."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text, final=True)
    if not splitter.has_reasoning:
        return None, content
    return reasoning, content or None


def grammar_after(parser: ReasoningParser | str, spec: dict[str, Any],
                  tokenizer) -> dict[str, str]:
    """The `structured_outputs` value that applies `spec` to the content only: the reasoning
    before it is free text (bounded by max_tokens alone), then up to 8 whitespace characters
    may follow `</think>`. Under `qwen3` the reasoning part is optional, as the output may
    have none.

    A tag that is one token of `tokenizer` (Qwen3's and DeepSeek-R1's are added tokens, which
    llguidance matches by id, not by their text) is that token, and the reasoning may not spell
    it out in pieces; otherwise the tag is text. ValueError if `spec` is malformed."""
    parser = ReasoningParser(parser)
    inner = GrammarCompiler.grammar(spec)
    # llguidance's JSON form (JSON schemas, regexes) or a Lark grammar's text
    grammars = (json.loads(inner)["grammars"] if inner.lstrip().startswith("{")
                else [{"lark_grammar": inner}])
    grammars[0] = grammars[0] | {"name": "answer"}
    open_id, close_id = (_token_id(tokenizer, tag) for tag in (OPEN, CLOSE))
    opener = f"<[{open_id}]>" if open_id is not None else json.dumps(OPEN)
    if close_id is not None:
        avoid = re.escape(CLOSE).replace("/", "\\/")
        rules = [f"reasoning: REASONING <[{close_id}]>",
                 f"REASONING: /(?s:.*)/ & ~/(?s:.*){avoid}(?s:.*)/"]
    else:  # lazy: it ends at the first `</think>`
        rules = [f"reasoning[lazy]: /(?s:.*)/ {json.dumps(CLOSE)}"]
    if parser.starts_inside:
        start = f"start: {opener}? reasoning WS? @answer"
    else:
        start = f"start: ({opener} reasoning WS?)? @answer"
    # a little whitespace (Qwen3 and DeepSeek-R1 write "\n\n"), not enough to wander off in
    lark = "\n".join([start, *rules, "WS: /[ \\t\\r\\n]{1,8}/"]) + "\n"
    return {"grammar": json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark},
                                                *grammars]})}


def _token_id(tokenizer, tag: str) -> int | None:
    """The id of the one token that is `tag`, if `tokenizer` has one."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
