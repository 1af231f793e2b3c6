"""Sequence: one request's tokens and progress, as the scheduler sees it (host only, no jax)."""

from __future__ import annotations

import enum
import time

from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens. `num_computed_tokens` of them have K/V in the cache."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "num_tokens", "params",
                 "arrival_index", "priority", "status", "num_computed_tokens", "block_table",
                 "stop_reason", "seed", "detok", "text", "logprobs", "num_swapped_blocks",
                 "metrics")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int, seed: int, priority: int = 0,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + generated; kept, not computed
        self.params = params
        self.arrival_index = arrival_index
        self.priority = priority
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.stop_reason: str | int | None = None
        self.seed = seed  # per-request RNG stream: (seed, number of tokens generated)
        self.detok = None  # incremental detokenizer state, owned by the engine
        self.text = ""
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.num_swapped_blocks = 0
        self.metrics = RequestMetrics(
            request_id, time.perf_counter() if arrival_time is None else arrival_time,
            len(self.prompt_token_ids))

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def finish_reason(self) -> str | None:
        return self.metrics.finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks K/V: one query token this step."""
        return self.num_tokens - self.num_computed_tokens == 1 and bool(self.output_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, computed="
                f"{self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_table)})")
