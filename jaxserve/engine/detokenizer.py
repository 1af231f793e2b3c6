"""Incremental detokenization that is correct across multi-byte characters.

Decoding one token at a time breaks characters whose UTF-8 bytes span several byte-level tokens
(they decode to U+FFFD until complete). We decode a short window of recent tokens, emit only the
text that is new relative to the window's previous decode, and hold back output that ends in an
incomplete character until the next token completes it.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context (spacing depends on the previous token)


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "skip_special_tokens")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (may be empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]
