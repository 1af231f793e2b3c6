"""Incremental detokenization that is correct across multi-byte characters.

Decoding one token at a time breaks characters whose UTF-8 bytes span several byte-level tokens
(they decode to U+FFFD until complete). We decode a short window of recent tokens, emit only the
text that is new relative to the window's previous decode, and hold back output that ends in an
incomplete character until the next token completes it.

The text of the window before the new token is the same from one token to the next while output
is held back, and after each emission it is usually one token's: both are kept rather than
decoded again, so a token costs one decode.

Byte-level tokenizers (GPT-2's `ByteLevel` decoder) decode a list of ids to the UTF-8 text of
their bytes put together, so for them each token's bytes are worked out once per tokenizer
(`ByteLevelTable`) and the same rule runs on bytes: a token whose bytes are whole characters
costs a list lookup, and only pending partial characters are decoded.
"""

from __future__ import annotations

import json
import weakref

from jaxserve.models.gguf_tokenizer import byte_alphabet

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


class ByteLevelTable:
    """A byte-level tokenizer's decode as a table: token id -> the bytes its decoder gives it
    (each character through the byte-level map, or the token's own UTF-8 where a character is
    not in the map), special tokens empty when skipped. `texts[skip][id]` is that token's text
    where it decodes on its own to whole characters (not empty, no trailing U+FFFD), else None."""

    def __init__(self, tokens: dict[int, str], special: set[int]):
        size = max(tokens, default=-1) + 1
        # byte-level characters -> latin-1 characters of their bytes; any other character
        # encodes as U+0100, which latin-1 refuses
        table = {ord(c): b for b, c in byte_alphabet().items()}
        table.update((c, 0x100) for c in range(0x100) if c not in table)
        raw = [b""] * size
        for i, token in tokens.items():
            try:
                raw[i] = token.translate(table).encode("latin-1")
            except UnicodeEncodeError:
                raw[i] = token.encode()
        skipped = list(raw)
        for i in special:
            skipped[i] = b""
        self.size = size
        self.raw = (raw, skipped)  # [skip_special_tokens]
        self.texts = (_whole_texts(raw), _whole_texts(skipped))

    @classmethod
    def of(cls, tokenizer) -> ByteLevelTable | None:
        """The table of a tokenizer whose decode it reproduces exactly, else None; built once
        per tokenizer."""
        try:
            known = tokenizer in _TABLES
        except TypeError:  # not hashable or not weakly referable: built each time
            return cls._build(tokenizer)
        if not known:
            _TABLES[tokenizer] = cls._build(tokenizer)
        return _TABLES[tokenizer]

    @classmethod
    def _build(cls, tokenizer) -> ByteLevelTable | None:
        decode = _plain_fast_decode(tokenizer)
        if decode is None:
            return None
        backend = tokenizer.backend_tokenizer
        spec = json.loads(backend.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        tokens = {i: t for t, i in backend.get_vocab(with_added_tokens=False).items()}
        added = spec.get("added_tokens") or []
        tokens.update((a["id"], a["content"]) for a in added)  # an added token's id wins
        table = cls(tokens, {a["id"] for a in added if a.get("special")})
        # The whole vocabulary through the tokenizer itself must come out the same.
        ids = list(range(table.size))
        for skip in (False, True):
            if decode(ids, skip_special_tokens=skip) != table.decode(ids, skip):
                return None
        return table

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.bytes_of(ids, skip_special_tokens).decode("utf-8", "replace")

    def bytes_of(self, ids: list[int], skip_special_tokens: bool) -> bytes:
        """The ids' bytes; ids past the vocabulary have none, as in the tokenizer."""
        raw, size = self.raw[skip_special_tokens], self.size
        if any(i < 0 for i in ids):
            raise OverflowError("token ids cannot be negative")
        return b"".join(raw[i] for i in ids if i < size)


def _whole_texts(raw: list[bytes]) -> list[str | None]:
    texts = [b.decode("utf-8", "replace") for b in raw]
    return [t if t and t[-1] != "\ufffd" else None for t in texts]


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TokenDecoder:
    """One tokenizer's decode, shared by every sequence of an engine; single tokens' text is
    cached. `table`: its byte-level table, where the tokenizer has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._fast = _plain_fast_decode(tokenizer)
        self._single: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self.table = ByteLevelTable.of(tokenizer)

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
    """A sequence's text, token by token: a window of token ids, or with a byte-level table its
    bytes: `pending`, those not emitted yet (at first the prompt context's as well, whose
    `head` characters of text are not emitted)."""

    __slots__ = ("decoder", "ids", "prefix_offset", "read_offset", "prefix_text",
                 "skip_special_tokens", "texts", "raw", "size", "pending", "head")

    def __init__(self, decoder: TokenDecoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        table = decoder.table
        if table is not None:
            self.texts = table.texts[skip_special_tokens]
            self.raw = table.raw[skip_special_tokens]
            self.size = table.size
            self.pending = table.bytes_of(context, skip_special_tokens)
            text = self.pending.decode("utf-8", "replace")
            if not text or text[-1] != "\ufffd":  # ends on a whole character: later text is its own
                self.pending = b""
            self.head = len(text) if self.pending else 0
            return
        self.texts = None
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text: str | None = None  # the text of ids[prefix_offset:read_offset]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (may be empty)."""
        texts = self.texts
        if texts is None:
            return self._add_window(token_id)
        if 0 <= token_id < self.size:
            if not self.pending:
                text = texts[token_id]
                if text is not None:  # whole characters after a clean boundary
                    return text
            data = self.raw[token_id]
        elif token_id < 0:
            raise OverflowError("token ids cannot be negative")
        else:
            data = b""
        # The window's rule on bytes: emit the text past the held head unless it ends in an
        # incomplete (or invalid) character.
        pending = self.pending = self.pending + data
        after = pending.decode("utf-8", "replace")
        if len(after) <= self.head or after[-1] == "\ufffd":
            return ""
        self.pending, head, self.head = b"", self.head, 0
        return after[head:]

    def _add_window(self, token_id: int) -> str:
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
