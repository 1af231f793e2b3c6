"""SamplingParams: how one request picks its tokens and when it stops.

The dataclass fields are the one list of sampling parameters: the socket protocol, the clients
and the OpenAI front take their names and accepted types from here (`param_types()`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from jaxserve.core import nesting

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 1e4  # beyond it every token is equally likely in float32 anyway
MAX_STOP_STRINGS = 16  # every step checks each one against the new text (OpenAI allows 4)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit); the step holds this many per row
MAX_BAD_WORDS = 64
MAX_N = 64  # parallel samples of one prompt
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
OUTPUT_KINDS = ("cumulative", "final_only")  # SamplingParams.output_kind


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:  # NaN and infinities are refused
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _clip(v) -> str:  # a refused value, quoted without echoing megabytes of it back
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


class ParamError(ValueError):
    """A bad sampling parameter; the message starts with the field's name."""


def check_structured(spec) -> None:
    """Raise ParamError unless `spec` holds exactly one of STRUCTURED_KINDS."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise ParamError(f"structured_outputs must hold exactly one of "
                         f"{', '.join(STRUCTURED_KINDS)}, got {_clip(spec)}")


def fold_seed(seed: int) -> int:
    """A request seed in [0, 2^64) as the 32-bit seed the step arrays hold (identity below
    2^32, so small seeds keep their streams)."""
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


@dataclasses.dataclass(slots=True)
class SamplingParams:
    n: int = 1  # samples of the prompt (they share its KV blocks; see LLMEngine.add_request)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 (or -1) means no top-k cut
    max_tokens: int | None = 16  # None: up to the context's end (max_model_len)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # a seed makes the samples independent of what shares the batch
    logprobs: int | None = None  # return the sampled token's logprob and this many top ones
    # Return each prompt token's logprob (given the tokens before it), its rank, and this many
    # top ones. Such a request computes its whole prompt (it takes nothing from the prefix cache).
    prompt_logprobs: int | None = None
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    # Penalties, with vLLM's (and OpenAI's) definitions: presence subtracts once from every
    # token the output holds, frequency once per occurrence; repetition divides a positive
    # logit (multiplies a negative one) of every token in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (a multi-token word: its last token
    # is banned after the others)
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many are generated
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # One of {"json": schema (dict or string)}, {"json_object": true}, {"regex": str},
    # {"choice": [str, ...]}, {"grammar": Lark/EBNF str, or llguidance's JSON grammar}: every
    # output matches it.
    structured_outputs: dict[str, Any] | None = None
    # "cumulative": an output at every step that moves the request, holding all of it so far;
    # "final_only": only the finished one (what LLM.generate and a request that does not
    # stream want: the engine builds and delivers nothing per step).
    output_kind: str = "cumulative"

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):  # JSON writes the token ids as strings
            self.logit_bias = {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                               for k, v in self.logit_bias.items()}

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def stop_ids(self, eos_token_ids) -> tuple[int, ...]:
        """The token ids that end the request: its stop_token_ids, and EOS unless ignore_eos."""
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos
                                                        else set(eos_token_ids))))

    @property
    def needs_history(self) -> bool:
        """Does picking the next token depend on the tokens generated so far (so the host
        must hold them before the step is built)?"""
        return (self.penalized or bool(self.bad_words) or self.min_tokens > 0
                or self.structured_outputs is not None)

    @property
    def grammar_only(self) -> bool:
        """Is a grammar (structured output) all its logit processing?"""
        return (self.structured_outputs is not None and not self.penalized
                and not self.bad_words and self.min_tokens == 0 and not self.logit_bias
                and self.allowed_token_ids is None)

    @property
    def samples_plainly(self) -> bool:
        """Greedy, or drawn from the temperature alone, with nothing asked of the logits
        beside the token: a plain program's rows (runtime/step_inputs.StepInputs.plain)."""
        return (not self.processes_logits and self.logprobs is None
                and (self.temperature == 0 or (self.top_k <= 0 and self.top_p >= 1)))

    @property
    def processes_logits(self) -> bool:
        return (self.needs_history or bool(self.logit_bias)
                or self.allowed_token_ids is not None or self.min_p > 0)

    def validate(self, max_logprobs: int) -> None:
        """Raise ParamError naming the first bad field.

        Every request goes through here once (core/admission.py), so every value that reaches
        a step array is known to fit it: int32 for top_k, a 64-bit seed folded to 32 bits."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ParamError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ParamError(f"top_k must be 0, -1 (off) or a positive int below 2^31, "
                             f"got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or not 1 <= self.max_tokens <= INT32_MAX):
            raise ParamError(f"max_tokens must be an int in [1, 2^31), got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ParamError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at "
                             f"most {MAX_STOP_CHARS} characters, got {_clip(self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ParamError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative "
                             f"ints, got {_clip(self.stop_token_ids)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ParamError(f"seed must be an int in [0, 2^64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= max_logprobs):
                raise ParamError(f"{name} must be an int in [0, {max_logprobs}], got {v!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise ParamError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ParamError(f"repetition_penalty must be in (0, 10], got "
                             f"{self.repetition_penalty!r}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS
                or any(not _is_int(k) or k < 0 or not _is_real(v) or not -100 <= v <= 100
                       for k, v in self.logit_bias.items())):
            raise ParamError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to "
                             f"numbers in [-100, 100], got {_clip(self.logit_bias)}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise ParamError(f"allowed_token_ids must be a non-empty list of token ids, got "
                             f"{_clip(self.allowed_token_ids)}")
        if self.bad_words is not None and (
                len(self.bad_words) > MAX_BAD_WORDS
                or any(not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_CHARS
                       for w in self.bad_words)):
            raise ParamError(f"bad_words must be at most {MAX_BAD_WORDS} non-empty strings of "
                             f"at most {MAX_STOP_CHARS} characters, got {_clip(self.bad_words)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise ParamError(f"min_tokens must be a non-negative int, got {self.min_tokens!r}")
        if (self.max_tokens is not None and _is_int(self.min_tokens)
                and self.min_tokens > self.max_tokens):
            raise ParamError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ParamError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                             f"{_clip(self.output_kind)}")
        if self.structured_outputs is not None:
            check_structured(self.structured_outputs)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, allow_unknown: bool = False) -> SamplingParams:
        """Build from a request body's map of parameters, checking each value's type.

        A None value means "the default". Raises ValueError naming the field (an unknown name
        too, unless `allow_unknown`, when other keys are ignored; a value nested deeper than
        nesting.MAX_DEPTH, which code walking it could not finish)."""
        known = param_types()
        kwargs = {}
        for name, value in raw.items():
            if name not in known:
                if allow_unknown:
                    continue
                raise ValueError(f"{name}: unknown sampling parameter (known: {sorted(known)})")
            if value is None:
                continue
            # bool is an int subclass: accept it only where the field is a bool.
            if not isinstance(value, known[name]) or (isinstance(value, bool)
                                                      and bool not in known[name]):
                raise ValueError(f"{name}: wrong type {type(value).__name__}")
            nesting.check(value, name)
            kwargs[name] = value
        return cls(**kwargs)


@functools.cache
def param_types() -> dict[str, tuple[type, ...]]:
    """{field name: the Python types a request may give it}, from the type hints above."""
    out = {}
    for name, hint in typing.get_type_hints(SamplingParams).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        accepted = []
        for a in args:
            origin = typing.get_origin(a) or a
            if origin is type(None):
                continue
            accepted.append(origin)
            if origin is float:
                accepted.append(int)  # JSON and msgpack write 1.0 as 1
        out[name] = tuple(dict.fromkeys(accepted))
    return out


def param_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(SamplingParams))
