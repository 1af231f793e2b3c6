"""SamplingParams: how one request picks its tokens and when it stops.

The dataclass fields are the one list of sampling parameters: the socket protocol, the clients
and the OpenAI front take their names and accepted types from here (`param_types()`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


@dataclasses.dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 (or -1) means no top-k cut
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # a seed makes the samples independent of what shares the batch
    logprobs: int | None = None  # return the sampled token's logprob and this many top ones

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    def validate(self, max_logprobs: int) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0, -1 (off) or a positive int, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= max_logprobs
        ):
            raise ValueError(
                f"logprobs must be an int in [0, {max_logprobs}], got {self.logprobs!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, allow_unknown: bool = False) -> SamplingParams:
        """Build from a request body's map of parameters, checking each value's type.

        A None value means "the default". Raises ValueError naming the field (an unknown name
        too, unless `allow_unknown`, when other keys are ignored)."""
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
