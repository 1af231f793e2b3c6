"""Admission: the one place a request's SamplingParams are checked and their defaults filled.

The fronts (library, socket, OpenAI HTTP, Responses, Anthropic Messages) only translate their
wire format into a prompt and a SamplingParams; whatever takes the request in (`RequestQueue`)
admits it here: LLMEngine for a request that runs in this process, DisaggSet for one a
disaggregated front hands to engines elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jaxserve.core.lora import LoRARequest
from jaxserve.core.sampling_params import SamplingParams


class LimitError(ValueError):
    """A request over one of the server's limits; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    max_logprobs: int
    max_tokens_limit: int | None = None  # the server's cap on max_tokens (None: none)


def admit(params: SamplingParams, num_prompt_tokens: int, limits: Limits, *,
          most_tokens_held: int | None = None, pool_elsewhere: bool = False) -> SamplingParams:
    """`params` checked (ValueError naming the field: ParamError, or LimitError over the cap),
    with max_tokens None filled by the room the context leaves (`most_tokens_held`: the KV
    pool's own bound, None if any length fits), at most the cap. `pool_elsewhere`: the engine
    that holds the pool admits the request again; without a cap, max_tokens None stays None
    for it to fill. The caller's object is never changed."""
    params.validate(limits.max_logprobs)
    cap = limits.max_tokens_limit
    if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
        raise LimitError(f"max_tokens {params.max_tokens} exceeds the server's "
                         f"max_tokens_limit ({cap})", "max_tokens")
    if params.max_tokens is not None or (pool_elsewhere and cap is None):
        return params
    fits = limits.max_model_len if most_tokens_held is None else min(limits.max_model_len,
                                                                     most_tokens_held)
    room = fits - num_prompt_tokens
    if room < 1:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens: no room left for max_tokens "
                         f"in max_model_len ({limits.max_model_len})")
    return dataclasses.replace(params, max_tokens=room if cap is None else min(cap, room))


class RequestQueue(Protocol):
    """What takes a request in. LLMEngine queues it at once (and returns None); the serving
    core's AsyncEngine, ReplicaSet and DisaggSet are coroutines returning its stream. Each
    admits it (`admit`) or hands it to one that does."""

    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    cache_salt: str | None = None, pooling: str | None = None,
                    lora_request: LoRARequest | None = None) -> Any:
        """`prompt_token_ids` run when given (`prompt` is then their text); `pooling`: an
        embedding request; `lora_request`: the adapter it runs under. Raises ValueError naming
        a bad field, QueueFullError when the waiting queue is full."""
