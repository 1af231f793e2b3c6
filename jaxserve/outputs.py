"""RequestOutput / CompletionOutput: what the engine returns for a request after a step."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # all text so far (stop strings trimmed)
    token_ids: list[int]  # all generated token ids so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # Per token: {"logprob": float, "top": {token_id: logprob}} when logprobs were requested.
    logprobs: list[dict] | None = None
    new_text: str = ""  # what this step added, for streaming
    new_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
