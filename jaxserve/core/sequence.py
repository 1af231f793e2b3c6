"""Sequence: one request's tokens and progress, as the scheduler sees it (host only, no jax)."""

from __future__ import annotations

import enum
import time

from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # admitted for its prompt beyond the decode slots; waits for one
    SWAPPED = "swapped"
    FINISHED = "finished"


PENDING = -1  # token_at() of a position whose token is still being sampled on the device


class Sequence:
    """Prompt plus generated tokens. `num_computed_tokens` of them have K/V in the cache.

    With asynchronous scheduling a sequence can be scheduled again before the token its last
    step samples is back on the host: `num_pending` such tokens are counted in `num_tokens`
    (so the scheduler sees the sequence decoding) but are not yet in `output_token_ids`.
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "num_tokens", "params",
                 "arrival_index", "priority", "status", "num_computed_tokens", "block_table",
                 "stop_reason", "seed", "detok", "text", "logprobs", "num_swapped_blocks",
                 "metrics", "num_pending", "block_hashes", "num_cached_blocks", "cache_salt",
                 "logits_state", "waits_for", "prompt_logprobs", "prompt_logprobs_next",
                 "stop_ids", "samples_plainly", "needs_history", "pooling", "pooled",
                 "group_tables", "num_dropped", "lora_id", "lora_key", "lora_slot",
                 "speculation")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int, seed: int, priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + generated; kept, not computed
        self.params = params
        self.arrival_index = arrival_index
        self.priority = priority
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Changed in place only by appends; anything else assigns a new list (the step builder
        # copies only what is new while the list is the same: runtime/block_tables.py).
        self.block_table: list[int] = []
        # With layer groups (core/kv_layout.py), groups 1.. have block tables of their own,
        # as long as block_table; in a local group's, entries before num_dropped no longer
        # hold a block of its own (they fell out of the window).
        self.group_tables: list[list[int]] = []
        self.num_dropped = 0
        self.stop_reason: str | int | None = None
        self.seed = seed  # per-request RNG stream: (seed, number of tokens generated)
        self.detok = None  # incremental detokenizer state, owned by the engine
        self.text = ""
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # Entry i: prompt token i given those before it (the first has none, so None).
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprobs_next = 1  # the first entry no launched step computes yet
        self.num_swapped_blocks = 0
        self.num_pending = 0
        # Prefix caching (core/block_manager.py): the names of its full blocks, how many of its
        # blocks are registered (or were taken from the cache), and the tenant's salt.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.cache_salt = cache_salt
        # Its LoRA adapter (core/lora.py): the engine's id for it (0: none), what names its
        # weights (the prefix cache's namespace) and its device slot while admitted.
        self.lora_id = 0
        self.lora_key: str | None = None
        self.lora_slot = 0
        # The host side of its logit processing (engine/logits_state.py), or None.
        self.logits_state = None
        # The token ids that end it (SamplingParams.stop_ids, set by the engine, which knows
        # EOS): a step of several decode steps checks them on the device.
        self.stop_ids: tuple[int, ...] = ()
        # SamplingParams.samples_plainly and needs_history, read by every step (the params are
        # final by now)
        self.samples_plainly = params.samples_plainly
        self.needs_history = params.needs_history
        # An embedding request: "mean" or "last" (else None), and its pooled hidden state so
        # far (the engine's, a host array: the sum of its prompt's rows, or the last row).
        self.pooling: str | None = None
        self.pooled = None
        # A sibling (parallel sampling, n > 1) whose prompt this one reads from the prefix
        # cache: it is admitted once that sibling's prompt is computed.
        self.waits_for: Sequence | None = None
        # Its own record of how its proposals fared (core/speculative.py), once one verified.
        self.speculation = None
        self.metrics = RequestMetrics(
            request_id, time.perf_counter() if arrival_time is None else arrival_time,
            len(self.prompt_token_ids))

    def append_token(self, token: int) -> None:
        """Append a sampled token (it takes the place of the oldest pending one, if any)."""
        self.output_token_ids.append(token)
        if self.num_pending:
            self.num_pending -= 1
        else:
            self.num_tokens += 1

    def add_pending(self, n: int = 1) -> None:
        """A step that will sample this sequence's next `n` tokens has been launched."""
        self.num_pending += n
        self.num_tokens += n

    def drop_pending(self) -> None:
        """Forget tokens still being sampled (the sequence finished before they arrived)."""
        self.num_tokens -= self.num_pending
        self.num_pending = 0

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
        """Generated tokens on the host (pending ones not counted)."""
        return len(self.output_token_ids)

    def reaches_length(self, num_output: int, max_model_len: int) -> bool:
        """With `num_output` generated tokens, has the sequence hit max_tokens or
        max_model_len? (The scheduler counts pending tokens, the postprocess does not.)"""
        return (num_output >= self.params.max_tokens
                or len(self.prompt_token_ids) + num_output >= max_model_len)

    @property
    def num_sampled(self) -> int:
        """Tokens generated or being generated: the index of the next draw in its RNG stream."""
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling_prompt(self) -> bool:
        """Not finished, and its prompt not all computed (or launched) yet."""
        return not self.is_finished and self.num_computed_tokens < len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are still to be computed: its prompt rows
        must run, so it takes no blocks from the prefix cache (as vLLM does)."""
        return (self.prompt_logprobs is not None
                and self.prompt_logprobs_next < len(self.prompt_token_ids))

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks K/V: one query token this step."""
        return (self.num_tokens - self.num_computed_tokens == 1
                and self.num_tokens > len(self.prompt_token_ids))

    def token_at(self, i: int) -> int:
        """The token at position i, or PENDING while the device is still sampling it."""
        n = len(self.prompt_token_ids)
        if i < n:
            return self.prompt_token_ids[i]
        i -= n
        return self.output_token_ids[i] if i < len(self.output_token_ids) else PENDING

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
