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
parts.
"""

from __future__ import annotations

import enum

from jaxserve.serving.tools import partial_suffix

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


def split(parser: ReasoningParser | str, text: str) -> tuple[str | None, str | None]:
    """A whole output -> (its reasoning, None if it has none; its content, None if it is empty
    after a reasoning part)."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text, final=True)
    if not splitter.has_reasoning:
        return None, content
    return reasoning, content or None
