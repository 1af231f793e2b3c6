"""Incremental detokenization that is correct across multi-byte characters.

Decoding one token at a time breaks characters whose UTF-8 bytes span several byte-level tokens
(they decode to U+FFFD until complete). We decode a short window of recent tokens, emit only the
text that is new relative to the window's previous decode, and hold back output that ends in an
incomplete character until the next token completes it.

The text of the window before the new token is the same from one token to the next while output
is held back, and after each emission it is usually one token's: both are kept rather than
decoded again, so a token costs one decode.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context (spacing depends on the previous token)


def _plain_fast_decode(tokenizer):
    """The Rust tokenizer's own decode where the transformers one adds nothing to it (a fast
    tokenizer whose decode is not overridden and that cleans up no spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    plain = (backend is not None and isinstance(tokenizer, PreTrainedTokenizerFast)
             and cls.decode is PreTrainedTokenizerFast.decode
             and cls._decode is PreTrainedTokenizerFast._decode
             and not tokenizer.clean_up_tokenization_spaces)
    return backend.decode if plain else None


class TokenDecoder:
    """One tokenizer's decode, shared by every sequence of an engine; single tokens' text is
    cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._fast = _plain_fast_decode(tokenizer)
        self._single: tuple[dict[int, str], dict[int, str]] = ({}, {})

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool) -> str:
        cache = self._single[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.decode([token_id], skip_special_tokens)
        return text


class IncrementalDetokenizer:
    __slots__ = ("decoder", "ids", "prefix_offset", "read_offset", "prefix_text",
                 "skip_special_tokens")

    def __init__(self, decoder: TokenDecoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text: str | None = None  # the text of ids[prefix_offset:read_offset]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (may be empty)."""
        ids, skip = self.ids, self.skip_special_tokens
        ids.append(token_id)
        before = self.prefix_text
        if before is None:
            window = ids[self.prefix_offset:self.read_offset]
            before = self.prefix_text = (self.decoder.decode_one(window[0], skip)
                                         if len(window) == 1 else
                                         self.decoder.decode(window, skip))
        after = self.decoder.decode(ids[self.prefix_offset:], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.prefix_text = None
        return after[len(before):]
