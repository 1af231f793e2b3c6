"""Structured output: a grammar every generated token must keep the text inside of.

llguidance compiles JSON schemas, regular expressions, choices and Lark grammars and, given the
tokens so far, writes the next token's allowed set as a bitmask through its numpy API (no
torch). The engine's step applies that bitmask to the logits on the device
(runtime/logits_processing.py); each request's matcher advances on the host as its tokens come
back (engine/logits_state.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from jaxserve.core import nesting
from jaxserve.core.sampling_params import check_structured

#: How JSON output is laid out: no free whitespace, so a small model cannot wander off into
#: blanks, and every answer is compact JSON.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarCompiler:
    """One per engine: the tokenizer's llguidance form is built once (about a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, str] = OrderedDict()  # spec -> its valid grammar

    CACHE_SIZE = 256

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size,
                                                         eos_token=self._eos[0])
            return self._tok

    @staticmethod
    def grammar(spec: dict[str, Any]) -> str:
        """The llguidance grammar of a `structured_outputs` value; ValueError if malformed."""
        from llguidance import LLMatcher

        check_structured(spec)  # the shape admission checks: a server compiles before it
        (kind, value), = spec.items()
        try:
            if kind == "json":
                schema = nesting.loads(value, "the schema") if isinstance(value, str) else value
                if not isinstance(schema, dict | bool):
                    raise ValueError("a JSON schema must be an object")
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if kind == "json_object":
                if value is not True:
                    raise ValueError("json_object must be true")
                return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                          defaults=JSON_OPTIONS)
            if kind == "regex":
                if not isinstance(value, str) or not value:
                    raise ValueError("regex must be a non-empty string")
                return LLMatcher.grammar_from_regex(value)
            if kind == "choice":
                if (not isinstance(value, list) or not value
                        or not all(isinstance(c, str) and c for c in value)):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})"
                                                             for c in value))
            if not isinstance(value, str) or not value:
                raise ValueError("grammar must be a non-empty string")
            if value.lstrip().startswith("{"):  # llguidance's JSON form: {"grammars": [...]}
                return value
            if "::=" in value:  # GBNF / EBNF, as llama.cpp writes it
                from llguidance.gbnf_to_lark import gbnf_to_lark

                value = gbnf_to_lark(value)
            return LLMatcher.grammar_from_lark(value)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"structured_outputs: invalid {kind}: {e}") from None
        except RecursionError:  # the GBNF converter walks nested parentheses recursively
            raise ValueError(f"structured_outputs: invalid {kind}: nests too deeply") from None

    def check(self, spec: dict[str, Any]) -> str:
        """The grammar of `spec`, validated against the tokenizer (and remembered, so the
        servers can check a request on another thread before the engine thread takes it);
        ValueError naming the problem."""
        from llguidance import LLMatcher

        try:
            key = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError):
            raise ValueError("structured_outputs: must be JSON values") from None
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return self._checked[key]
        grammar = self.grammar(spec)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs: invalid {next(iter(spec))}: "
                             f"{error.strip()[:500]}")
        with self._lock:
            self._checked[key] = grammar
            while len(self._checked) > self.CACHE_SIZE:
                self._checked.popitem(last=False)
        return grammar

    def matcher(self, spec: dict[str, Any]):
        """A fresh matcher for one request; ValueError naming the problem if the grammar
        does not compile."""
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, self.check(spec), log_level=0)
        kind = next(iter(spec))
        if m.is_error():
            raise ValueError(f"structured_outputs: invalid {kind}: {m.get_error()[:500]}")
        return m
