"""LLMEngine: requests in, one continuous-batching step at a time, outputs back.

`step()` is schedule -> (swap) -> the runner prepares and launches the step -> postprocess
(engine/postprocess.py: append the sampled tokens, detokenize, apply the stop rules, return
finished requests' KV blocks to the pool at once) -> one RequestOutput per request that
produced something. With asynchronous scheduling (the default with an accelerator) the
postprocess of step N runs after step N+1 is launched.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.config import POOLINGS, EngineConfig, Role
from jaxserve.core import admission
from jaxserve.core.block_hash import check_salt
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.lora import LoRARequest, LoRASlots
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import SamplingParams, fold_seed
from jaxserve.core.scheduler import (
    PromptRows,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    prompt_rows,
)
from jaxserve.core.sequence import Sequence
from jaxserve.core.speculative import (
    AdaptivePolicy,
    DraftModelProposer,
    NgramProposer,
    SpecStats,
    Speculator,
)
from jaxserve.core.swap_space import SwapSpace
from jaxserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from jaxserve.engine.handover import Handover
from jaxserve.engine.logits_state import LogitsState
from jaxserve.engine.lora import LoRARegistry
from jaxserve.engine.metrics import EngineMetrics, StatLogger
from jaxserve.engine.overlap import OverlapChooser
from jaxserve.engine.postprocess import Postprocessor, SeqUpdate
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.runtime.runner import ModelRunner, RecompileError, StepResult
from jaxserve.runtime.step_inputs import StepInputs

logger = logging.getLogger(__name__)


# The cyclic collector's thresholds once start-up is over (settle_heap): a young pass every
# this many container allocations, then CPython's counts of young passes per older one.
GC_THRESHOLDS = (50_000, 20, 100)


def settle_heap() -> int:
    """Start-up is over (the server's, a benchmark's): collect once, then move every object
    alive (the model, the tokenizer, the programs, jax's own) out of the cyclic collector's
    reach, and let it run less often (GC_THRESHOLDS). A step makes and drops thousands of
    small objects (its rows and outputs), which reference counting frees; at the default
    thresholds a young pass ran several times a step, each walking the step's live rows.
    For a process that lives as long as its engine; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_freeze_count()


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One step of the optional trace: who ran, with how many prefill and decode tokens."""

    index: int
    requests: list[tuple[str, int, int]]  # (request id, prefill tokens, decode tokens)
    duration_s: float  # from its scheduling to its tokens on the host (steps overlap when async)
    bucket: tuple[int, int, int] | None
    finished_at: float = 0.0  # perf_counter when its tokens were postprocessed
    decode_steps: int = 1  # the decode steps it ran in one call (SchedulerOutput.decode_steps)
    lora: bool = False  # its program added LoRA updates (a row ran an adapter)

    @property
    def request_ids(self) -> list[str]:
        return [r for r, _, _ in self.requests]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(p for _, p, _ in self.requests)

    @property
    def num_decode_tokens(self) -> int:
        return sum(d for _, _, d in self.requests)


@dataclasses.dataclass(slots=True)
class _Launched:
    """A step on the device whose tokens the host has not read yet."""

    sched: SchedulerOutput
    inputs: StepInputs
    output: StepResult | concurrent.futures.Future  # device arrays (a Future: being launched)
    rows: dict[str, int]  # request id -> its row, for the rows that sample
    prompt_rows: list[PromptRows]  # the query rows whose prompt logprobs it computes
    t0: float  # when its scheduling began
    overlapped: bool  # launched asynchronously: a step launched after it may read its rows


def _prompt_logprobs(seqs: list[Sequence]) -> list[dict | None] | None:
    """An n > 1 request's prompt logprobs: those of a sample that has scored all its prompt
    (whichever got there first when each computes its own)."""
    size = len(seqs[0].prompt_token_ids)
    return next((s.prompt_logprobs for s in seqs
                 if s.prompt_logprobs is not None and len(s.prompt_logprobs) == size),
                seqs[0].prompt_logprobs)


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; try again later."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 devices: list[jax.Device] | None = None, runner: ModelRunner | None = None,
                 **kwargs):
        """`devices`: the device group this engine runs on (default: the first
        tensor_parallel_size devices); engine/data_parallel.py gives each replica its own.
        `runner`: one built elsewhere with ModelRunner's interface (bench/host_overhead.py's
        stand-in that runs no model); `loaded` then gives the model's config and tokenizer."""
        config = config or EngineConfig(**kwargs)
        platform = devices[0].platform if devices else jax.default_backend()
        self.config = config = config.on_platform(platform)
        take = loaded is None  # loaded here: the runner may free its host copy as it goes
        self.loaded = loaded or load_model(config.model)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.decoder = TokenDecoder(self.tokenizer) if self.tokenizer is not None else None
        draft = (load_model(config.speculative_model)
                 if config.speculative_method == "draft_model" else None)
        self.runner = runner or ModelRunner(config, self.loaded, devices, draft,
                                            take_params=take)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching,
                                          self.runner.kv_layout.windows)
        # speculative decoding (core/speculative.py): the scheduler asks it for proposals
        self.speculator = (Speculator(
            DraftModelProposer(config.num_speculative_tokens) if draft is not None else
            NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                          config.prompt_lookup_max),
            AdaptivePolicy(config.num_speculative_tokens, self.runner.buckets[0],
                           config.speculative_adaptive))
            if config.speculative_method else None)
        self.scheduler = Scheduler(
            # Steps end on a token bucket rather than pad past it (Scheduler._fit_bucket)
            # where padded rows cost in proportion, on a CPU; on an accelerator rows below its
            # compute-bound size are nearly free, and the extra step is not.
            config.scheduler_config(self.runner.buckets[0] if platform == "cpu" else ()),
            self.block_manager,
            SwapSpace(self.runner.num_host_blocks) if self.runner.num_host_blocks else None,
            speculator=self.speculator,
            lora_slots=LoRASlots(config.max_loras) if config.enable_lora else None)
        # LoRA adapters known to the engine and their host copies (engine/lora.py)
        self.loras = (LoRARegistry(self.model_config, config.max_lora_rank,
                                   config.max_cpu_loras or config.max_loras)
                      if config.enable_lora else None)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.postprocessor = Postprocessor(self.scheduler, config.max_model_len, frozenset(eos))
        # what admission checks a request against; a server narrows it (max_tokens_limit)
        self.limits = admission.Limits(config.max_model_len, config.max_logprobs)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._prompts: dict[str, str | None] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._groups: dict[str, list[Sequence]] = {}  # n > 1: request id -> its samples
        self._group_of: dict[str, tuple[str, int]] = {}  # sample -> (request id, index)
        self._arrivals = 0
        self.metrics = EngineMetrics()
        self.step_trace: list[StepRecord] | None = [] if config.enable_step_trace else None
        self.stat_logger = (StatLogger(config.log_stats_interval_s, time.perf_counter)
                            if config.log_stats_interval_s > 0 else None)
        self._in_flight: _Launched | None = None
        # structured output: the tokenizer's grammar form is built at the first use
        self.grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                         self.eos_token_ids)
                         if self.tokenizer is not None else None)
        # disaggregated serving (engine/handover.py); a prefill engine parks a request as its
        # first token comes back, so no later step may have been launched for it
        self.handover = (Handover(self, config.handover_host) if config.role is not Role.BOTH
                         else None)
        self._set_up_overlap(config)

    def _set_up_overlap(self, config: EngineConfig) -> None:
        """Asynchronous scheduling: pinned by the config, or chosen step by step from measured
        step times (engine/overlap.py), starting on with an accelerator."""
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else jax.default_backend() != "cpu")
        self._overlap: OverlapChooser | None = None
        if config.role is Role.PREFILL:
            self.async_scheduling = False
        if self.async_scheduling and self.speculator is not None:
            # a proposal continues the tokens on the host, so a speculating sequence could
            # only run every other step: pinned on, speculation keeps the steps synchronous
            logger.info("speculative decoding: asynchronous scheduling is off")
            self.async_scheduling = False
        multi_process = getattr(self.runner, "broadcast", None) is not None
        # Left unset, the mode is chosen step by step; under n-gram speculation a step is
        # synchronous whenever proposals might pay (_choose_overlap). A draft model's
        # proposals are made on the device from the step's rows: those stay synchronous. A
        # prefill or decode engine keeps the device kind's default: a decode engine's
        # handovers pull into the pool beside its steps.
        if (config.async_scheduling is None and config.role is Role.BOTH
                and config.speculative_method in (None, "ngram") and not multi_process):
            self._overlap = OverlapChooser(start=self.async_scheduling)
        # Launching a step holds the calling thread while the runtime issues its kernels: under
        # asynchronous scheduling a thread of its own does it, beside this one's postprocessing
        # of the step before (one process only: several launch in lockstep).
        self._launcher = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxserve-launch")
            if (self.async_scheduling or self._overlap is not None) and not multi_process
            else None)

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    pooling: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. A bad field raises ValueError naming it; nothing else is touched.
        `pooling`: an embedding request instead (add_embedding_request; `params` unused).
        `lora_request`: the LoRA adapter it runs under (enable_lora), read and checked here
        the first time one names it (a bad adapter raises ValueError naming the field).

        Given both, `prompt_token_ids` is what runs and `prompt` is the text it came from (a
        front that tokenized the prompt already passes both). `cache_salt`: prefix-cache
        blocks are shared only between requests with the same salt (tenant isolation).

        A full waiting queue raises QueueFullError."""
        try:
            if pooling is not None:
                if pooling not in POOLINGS:
                    raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, "
                                     f"got {pooling!r}")
                params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                        output_kind="final_only")
            seqs = self._add_request(request_id, prompt, params, prompt_token_ids, priority,
                                     arrival_time, cache_salt, lora_request=lora_request)
        except (ValueError, QueueFullError):
            self.metrics.record_rejection()
            raise
        seqs[0].pooling = pooling

    def add_embedding_request(self, request_id: str, prompt: str | None = None, *,
                              prompt_token_ids: list[int] | None = None,
                              pooling: str | None = None, priority: int = 0,
                              arrival_time: float | None = None,
                              cache_salt: str | None = None) -> None:
        """Queue a prompt-only request whose finished output carries `embedding`: the final
        hidden states of its prompt pooled by `pooling` ("mean" or "last"; default: the
        engine's), unnormalized. It is scheduled like any prompt (chunked, batched with
        generation) and ends after its prompt, its one sampled token unused."""
        self.add_request(request_id, prompt, prompt_token_ids=prompt_token_ids,
                         priority=priority, arrival_time=arrival_time, cache_salt=cache_salt,
                         pooling=self.config.pooling if pooling is None else pooling)

    def _pool(self, scheduled: list[ScheduledSeq], result) -> None:
        """Add a step's rows to its embedding requests' pooled states (a mean sums its
        chunks; a row starting at 0 starts again, after a recompute preemption)."""
        for i, s in enumerate(scheduled):
            seq = s.seq
            if seq.pooling is None or seq.is_finished or not s.is_prefill:
                continue
            if seq.pooling == "last":
                if s.samples:
                    seq.pooled = result.pooled.last[i].copy()
            elif s.start == 0 or seq.pooled is None:
                seq.pooled = result.pooled.sums[i].astype(np.float64)
            else:
                seq.pooled = seq.pooled + result.pooled.sums[i]

    def _add_request(self, request_id, prompt, params, prompt_token_ids, priority, arrival_time,
                     cache_salt, admit: bool = True,
                     lora_request: LoRARequest | None = None) -> list[Sequence]:
        """Validate and build the request's sequences; `admit`: queue them for scheduling
        (else the caller places them: engine/handover.py)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        check_salt(cache_salt)
        ids = self.prompt_ids(prompt, prompt_token_ids)
        params = admission.admit(params, len(ids), self.limits, most_tokens_held=(
            self.block_manager.most_tokens_held(self.config.max_num_batched_tokens)))
        adapter = None
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request: this engine serves no adapters (enable_lora "
                                 "is off)")
            adapter = self.loras.add(lora_request)
        self._check_fits(len(ids), params)
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"waiting queue is full (max_waiting_requests={limit})")
        n = params.n
        if n > 1 and self.handover is not None:
            raise ValueError(f"n: a {self.config.role} engine takes one sample per request "
                             f"(the front splits n), got {n}")
        seqs = []
        for i in range(n):  # n > 1: one sequence per sample, named "<request_id>#<i>"
            # (a sample that reads the prompt from the cache cannot score it: the first does)
            shared = i > 0 and self.block_manager.enable_caching
            child = params if n == 1 else dataclasses.replace(
                params, n=1, prompt_logprobs=None if shared else params.prompt_logprobs)
            seed = ((fold_seed(params.seed) + i) & 0xFFFFFFFF if params.seed is not None else
                    (self.config.seed * 1_000_003 + self._arrivals) & 0xFFFFFFFF)
            seq = Sequence(request_id if n == 1 else f"{request_id}#{i}", ids, child,
                           self._arrivals, seed, priority, arrival_time, cache_salt)
            seq.stop_ids = child.stop_ids(self.eos_token_ids)
            if adapter is not None:  # its prefix blocks are named under its weights'
                seq.lora_id, seq.lora_key = lora_request.lora_int_id, adapter.digest
            if child.processes_logits:  # built once; the other samples share its parts
                seq.logits_state = (self._logits_state(child, ids) if i == 0 else
                                    seqs[0].logits_state.sibling(self._matcher(child)))
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.decoder, ids, child.skip_special_tokens)
            self._arrivals += 1
            seqs.append(seq)
        if n > 1:
            # The first sample computes the prompt; the others wait for it and then take its
            # blocks from the prefix cache, so the prompt is computed once (without caching,
            # each computes its own).
            if self.block_manager.enable_caching:
                for seq in seqs[1:]:
                    seq.waits_for = seqs[0]
            self._groups[request_id] = seqs
            self._group_of.update({s.request_id: (request_id, i) for i, s in enumerate(seqs)})
        self._prompts[request_id] = prompt
        for seq in seqs:
            self.requests[seq.request_id] = seq
            if admit:
                self.scheduler.add(seq)
        return seqs

    # ------------------------------------------------------------------------------- adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (ValueError naming the field)."""
        if self.loras is None:
            raise ValueError("lora_request: this engine serves no adapters (enable_lora is "
                             "off)")
        self.loras.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` and free its device slot; False if unknown. Refused
        (ValueError) while an unfinished request runs it: its rows would lose their weights."""
        if self.loras is None:
            return False
        if self.is_lora_in_use(lora_id):
            raise ValueError(f"lora_int_id: adapter {lora_id} is in use by unfinished "
                             f"requests")
        self.scheduler.lora_slots.release(lora_id)
        return self.loras.remove(lora_id)

    def is_lora_in_use(self, lora_id: int) -> bool:
        """Whether an unfinished request runs adapter `lora_id`."""
        return any(s.lora_id == lora_id for s in self.requests.values())

    def list_loras(self) -> list[LoRARequest]:
        """The adapters known to the engine, by id."""
        return [] if self.loras is None else [self.loras.requests[i]
                                              for i in sorted(self.loras.requests)]

    def _load_loras(self, sched: SchedulerOutput) -> None:
        """Write the adapters the schedule placed in new slots there. One whose files can no
        longer be read fails its requests, which leave the step."""
        for load in sched.lora_loads:
            try:
                adapter = self.loras.adapter(self.loras.requests[load.lora_id])
            except ValueError as e:
                self.scheduler.lora_slots.release(load.lora_id)
                for s in sched.scheduled:
                    if s.seq.lora_id == load.lora_id:
                        self.fail(s.seq.request_id, f"its LoRA adapter failed to load: {e}")
                sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
                continue
            self.runner.load_lora(load.slot, adapter)

    def _logits_state(self, params: SamplingParams, prompt_ids: list[int]) -> LogitsState:
        """Check the fields that need the vocabulary and build the request's host state for
        processing its logits (compiling its grammar)."""
        for name in ("logit_bias", "allowed_token_ids"):
            self._check_vocab(name, getattr(params, name) or ())
        bad_words = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer")
            for word in params.bad_words:  # as vLLM: the word alone and after a space
                for text in dict.fromkeys((word, " " + word.lstrip())):
                    ids = self.tokenizer(text, add_special_tokens=False).input_ids
                    if ids and ids not in bad_words:
                        bad_words.append(ids)
        return LogitsState(params, prompt_ids, self.model_config.vocab_size,
                           self.eos_token_ids, bad_words, self._matcher(params))

    def _matcher(self, params: SamplingParams):
        """A fresh grammar matcher for the request's structured output, or None."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs: this model has no tokenizer")
        return self.grammars.matcher(params.structured_outputs)

    def _check_vocab(self, name: str, token_ids) -> bool:
        """Raise ValueError naming `name` unless every one of `token_ids` is a token id; returns
        whether all of them are plain ints already (else some are numpy integers)."""
        vocab = self.model_config.vocab_size
        # the usual case, at C speed: plain ints, all in range
        if (token_ids and set(map(type, token_ids)) == {int} and min(token_ids) >= 0
                and max(token_ids) < vocab):
            return True
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise ValueError(f"{name}: token id {t!r} is outside the vocabulary "
                                 f"[0, {vocab})")
        return False

    def prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        """The token ids a request runs (its prompt tokenized, or its ids checked); raises
        ValueError naming the field."""
        if prompt is None and prompt_token_ids is None:
            raise ValueError("give prompt or prompt_token_ids")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if prompt_token_ids is None:
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = list(prompt_token_ids)
            if not self._check_vocab("prompt_token_ids", ids):
                ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt must not be empty (no tokens)")
        return ids

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if prompt_len > max_len:
            raise ValueError(f"prompt has {prompt_len} tokens, longer than max_model_len "
                             f"({max_len})")
        if prompt_len + params.max_tokens > max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        need = self.block_manager.most_pages_held(prompt_len + params.max_tokens,
                                                  self.config.max_num_batched_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks, more than the whole "
                             f"pool (num_kv_blocks={self.block_manager.num_blocks})")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.postprocessor.eos_token_ids

    def abort(self, request_id: str) -> bool:
        """Abort in any state; its blocks return at once. The next step() reports it."""
        return self._end(request_id, "abort")

    def fail(self, request_id: str, error: str) -> bool:
        """Fail one request: something inside the engine went wrong for it alone. It finishes
        with finish_reason "error" (the message in `metrics.error`), its blocks return at
        once, the next step() reports it, and every other request goes on."""
        logger.error("request %s failed: %s", request_id, error)
        return self._end(request_id, "error", error)

    def _end(self, request_id: str, reason: str, error: str | None = None) -> bool:
        if request_id in self._groups:  # every sample still running
            return any([self._end(s.request_id, reason, error)
                        for s in self._groups[request_id] if not s.is_finished])
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if self.handover is not None:
            self.handover.forget(request_id)
        seq.metrics.finished_time = time.perf_counter()
        seq.metrics.error = error
        if error is not None:  # what its blocks hold may be wrong: keep no names for them
            self.block_manager.forget(seq)
        self.scheduler.finish(seq, reason)
        self.metrics.record_finished(seq)
        self._pending_outputs.append(self._output(SeqUpdate(seq, [], "", True)))
        return True

    def fail_all(self, error: str) -> int:
        """Fail every unfinished request (a failure that cannot be pinned on one of them);
        the engine is then empty and ready for new requests."""
        self._in_flight = None
        return sum(self.fail(r, error) for r in list(self.requests))

    def take_pending_outputs(self) -> list[RequestOutput]:
        """The outputs of aborts and failures not yet reported by a step()."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return self._grouped(outputs)

    def _grouped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request: the samples of an n > 1 request merged into one (each at
        its index; those that did not move in this step repeated, marked not updated)."""
        if not self._groups:
            return outputs
        result, moved = [], {}
        for out in outputs:
            group = self._group_of.get(out.request_id)
            if group is None:
                result.append(out)
            else:
                moved.setdefault(group[0], {})[group[1]] = out.outputs[0]
        for rid, comps in moved.items():
            seqs = self._groups[rid]
            outs = [dataclasses.replace(comps[i], index=i) if i in comps else CompletionOutput(
                i, s.text, s.output_token_ids, s.finish_reason, s.stop_reason, s.logprobs,
                updated=False, num_token_ids=len(s.output_token_ids))
                for i, s in enumerate(seqs)]
            finished = all(s.is_finished for s in seqs)
            if not finished and seqs[0].params.output_kind == "final_only":
                continue
            prompt = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
            result.append(RequestOutput(rid, prompt, seqs[0].prompt_token_ids, outs, finished,
                                        seqs[0].metrics, _prompt_logprobs(seqs)))
            if finished:
                del self._groups[rid]
                for s in seqs:
                    del self._group_of[s.request_id]
        return result

    def has_unfinished_requests(self) -> bool:
        """Work for step(): requests held for a handover alone are none."""
        held = self.handover.num_held if self.handover is not None else 0
        return (len(self.requests) > held or bool(self._pending_outputs)
                or self._in_flight is not None)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def idle(self) -> None:
        """Called by a loop with nothing to step (see runtime/distributed.py)."""
        self.runner.keepalive()

    def warmup(self) -> float:
        return self.runner.warmup()

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step; return the outputs of the step that completed.

        Synchronous: the step launched is the step completed. Asynchronous (the default with
        an accelerator): the next step is scheduled and launched first, its decode rows reading
        the tokens of the step still in flight on the device; then that earlier step's tokens
        are read back and postprocessed while the new one runs. Sequences that stop in the
        earlier step waste their row of the new one; nothing else differs, and the tokens are
        the same."""
        # The annotations name the phases of a step in XLA profiler traces (jax.profiler);
        # "forward" and "sample" are also named scopes inside the compiled step.
        outputs = self.take_pending_outputs()
        self._choose_overlap()
        if self._in_flight is not None and not (self.async_scheduling
                                                and self._in_flight.overlapped):
            # left by step_overlapped, or launched before the mode changed: no step launched
            # now may read its rows, so its tokens come back first
            outputs += self._complete(self._in_flight)
            self._in_flight = None
        launched = self._launch()
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            self._in_flight = None
            outputs += self._complete(launched)
        self._idle_check(launched)
        return self._finish_step(outputs)

    def step_overlapped(self, before_launch: Callable[[], None] | None = None
                        ) -> list[RequestOutput]:
        """step() for a caller that hands the outputs on (the server's engine loop): complete
        the step in flight, launch the next one with every token known (the same tokens and
        rows as step()), then return the completed step's outputs, so that handing them on
        overlaps the device's next step instead of delaying its launch. `before_launch` runs
        between the two (the server applies new requests and aborts there). A step of prompts
        alone returns before the next launch: its first tokens go out at once. Under
        asynchronous scheduling this is step(), `before_launch` first."""
        self._choose_overlap()
        if self.async_scheduling:
            if before_launch is not None:
                before_launch()
            return self.step()
        outputs = self.take_pending_outputs()
        done, self._in_flight = self._in_flight, None
        if done is not None:
            outputs += self._complete(done)
            if all(s.is_prefill for s in done.sched.scheduled):
                return self._finish_step(outputs)
        if before_launch is not None:
            before_launch()
            outputs += self.take_pending_outputs()  # aborts it applied
        self._in_flight = self._launch()
        self._idle_check(self._in_flight)
        return self._finish_step(outputs)

    def _choose_overlap(self) -> None:
        if self._overlap is None:
            return
        running = self.scheduler.running
        mode = self._overlap.choose(len(running))
        if mode and self.speculator is not None and self.speculator.may_pay(
                running, self.config.max_num_batched_tokens):
            mode = False  # its proposals continue every sequence's last token, on the host
        self.async_scheduling = mode

    def _idle_check(self, launched: _Launched | None) -> None:
        if self._overlap is not None and launched is None:  # out of work: no step runs now
            self._overlap.idle()

    def _finish_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self.runner.flush_host_copies()  # land its spills (their gathers ran before the step)
        if self.stat_logger is not None and (line := self.stat_logger.poll(
                self.metrics_snapshot)):
            logger.info("%s", line)
        return self._grouped(outputs)

    def _launch(self) -> _Launched | None:
        t0 = time.perf_counter()
        if self._in_flight is not None and isinstance(self._in_flight.output,
                                                      concurrent.futures.Future):
            # the runner (its pools, the last tokens) is this thread's again
            concurrent.futures.wait([self._in_flight.output])
        with jax.profiler.TraceAnnotation("jaxserve.schedule"):
            sched = self.scheduler.schedule()
            self.run_copies(sched.copies)
            if sched.lora_loads:
                self._load_loras(sched)
        if sched.is_empty:
            return None
        with jax.profiler.TraceAnnotation("jaxserve.prepare_inputs"):
            prev = self._in_flight
            try:
                inp = self.runner.prepare_step(sched, prev.rows if prev else None)
            except Exception as e:  # noqa: BLE001 - find whose values broke the step
                self._fail_culprits(sched.scheduled, e)
                return None  # nothing was computed: the others are scheduled again next step
        with jax.profiler.TraceAnnotation("jaxserve.launch"):
            try:
                out = (self.runner.dispatch(inp)
                       if self._launcher is None or not self.async_scheduling
                       else self._launcher.submit(self.runner.dispatch, inp))
            except RecompileError:  # strict_compile: a configuration error, the caller's to see
                raise
            except Exception as e:  # noqa: BLE001 - the device step failed for all of its rows
                self._fail_seqs(sched.scheduled, e)
                return None
            self.postprocessor.launched(sched.scheduled)
        prompt = prompt_rows(sched.scheduled) if (inp.prompt_targets >= 0).any() else []
        for r in prompt:
            r.seq.prompt_logprobs_next = r.first + r.count
        # the rows the next step reads pending tokens from: only one launched before this
        # step's tokens are back (asynchronous scheduling) has any
        rows = ({s.seq.request_id: i for i, s in enumerate(sched.scheduled) if s.samples}
                if self.async_scheduling else {})
        return _Launched(sched, inp, out, rows, prompt, t0, self.async_scheduling)

    def run_copies(self, copies: list) -> None:
        """Make the scheduler's block copies between the device and the host pool."""
        for c in copies:  # in order: a copy may read what a later one overwrites
            (self.runner.swap_out if c.to_host else self.runner.swap_in)(c.device_ids,
                                                                        c.host_ids)

    def _fail_culprits(self, scheduled: list[ScheduledSeq], error: Exception) -> None:
        """Building a step's inputs raised: fail the sequences whose rows fail on their own
        (a value that does not fit a step array), or all of them if none does."""
        culprits = []
        for s in scheduled:
            try:
                self.runner.prepare_alone(s)
            except Exception as e:  # noqa: BLE001
                culprits.append((s, e))
        for s, e in culprits or [(s, error) for s in scheduled]:
            self.fail(s.seq.request_id, f"preparing its step failed: {type(e).__name__}: {e}")

    def _fail_seqs(self, scheduled: list[ScheduledSeq], error: Exception) -> None:
        for s in scheduled:
            self.fail(s.seq.request_id, f"its step failed: {type(error).__name__}: {error}")

    def _complete(self, step: _Launched) -> list[RequestOutput]:
        want_lp = bool(step.inputs.sampling.want_logprobs)
        with jax.profiler.TraceAnnotation("jaxserve.wait_tokens"):
            try:
                output = step.output
                if isinstance(output, concurrent.futures.Future):
                    output = output.result()  # its launch's error, if any, is raised here
                result = self.runner.fetch(output, want_lp, bool(step.prompt_rows),
                                           any(s.seq.pooling for s in step.sched.scheduled))
            except RecompileError:  # strict_compile: a configuration error, the caller's to see
                raise
            except Exception as e:  # noqa: BLE001 - the device step failed for all of its rows
                self._fail_seqs(step.sched.scheduled, e)
                return []
        now = time.perf_counter()
        scheduled = step.sched.scheduled
        outputs = []
        with jax.profiler.TraceAnnotation("jaxserve.postprocess"):
            for r in step.prompt_rows:  # in step order, so each list grows in prompt order
                if not r.seq.is_finished:
                    k = r.seq.params.prompt_logprobs
                    r.seq.prompt_logprobs.extend(result.prompt_entry(r.row + j, k)
                                                 for j in range(r.count))
            if result.pooled is not None:
                self._pool(scheduled, result)
            updates = self.postprocessor.resolve(scheduled, result.rows(len(scheduled)), now,
                                                 result.logprob_entry if want_lp else None)
            generated, parks = 0, self.config.role is Role.PREFILL
            for u in updates:
                generated += len(u.new_token_ids)
                if u.error is not None:
                    self.fail(u.seq.request_id, f"postprocessing its tokens failed: {u.error}")
                    continue
                if u.finished:
                    self.metrics.record_finished(u.seq)
                    self.requests.pop(u.seq.request_id, None)
                elif parks:  # a prefill engine's: its first token, held for a handover
                    self.handover.park(u.seq)
                elif u.seq.params.output_kind == "final_only":
                    continue
                outputs.append(self._output(u))
        prefill = sum(s.num_tokens for s in scheduled if s.is_prefill)
        if self.speculator is not None:
            # an overlapped step's span also holds the step before it: not a step's time
            self._record_speculation(scheduled, result, prefill,
                                     None if step.overlapped else now - step.t0)
        self.metrics.record_step(now - step.t0, prefill, generated,
                                 len(self.scheduler.running), len(self.scheduler.waiting),
                                 self.block_manager.num_used_blocks)
        self.metrics.num_overlapped_steps += step.overlapped
        if self._overlap is not None:
            plain = not prefill and not any(s.drafts for s in scheduled)  # no verification
            self._overlap.completed(now, len(scheduled), plain, step.overlapped,
                                    step.sched.decode_steps)
        if self.step_trace is not None:
            self.step_trace.append(StepRecord(
                self.metrics.num_steps - 1,
                [(s.seq.request_id, s.num_tokens if s.is_prefill else 0,
                  0 if s.is_prefill else s.end - s.start) for s in scheduled],
                now - step.t0, step.inputs.bucket, now, step.sched.decode_steps,
                step.inputs.lora_slots is not None))
        return outputs

    def _record_speculation(self, scheduled: list[ScheduledSeq], result, prefill: int,
                            seconds: float | None) -> None:
        """What the step's proposals gained; the step's time (None: unknown) feeds the
        policy."""
        gained = result.num_tokens
        rows = [(s.seq, len(s.drafts), max(0, int(gained[i]) - 1))
                for i, s in enumerate(scheduled) if s.drafts]
        self.speculator.record(rows)
        self.speculator.policy.record_step(sum(s.num_tokens for s in scheduled), seconds,
                                           decode_only=not prefill, verified=bool(rows))

    def metrics_snapshot(self) -> dict:
        """Engine-wide figures as a plain dict (what /metrics and the bench harness read)."""
        m, bm, swap = self.metrics, self.block_manager, self.scheduler.swap_space
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_held": len(self.scheduler.held),  # prefilled, waiting for a decode slot
            "num_swapped": len(self.scheduler.swapped),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "host_blocks_used": swap.num_used if swap else 0,  # held by swapped requests
            "num_preemptions": self.scheduler.num_preemptions,
            "num_rejections": m.num_rejections,
            "num_requests_finished": m.num_requests_finished,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generation_tokens,
            "num_steps": m.num_steps,
            "num_overlapped_steps": m.num_overlapped_steps,  # asynchronous scheduling's
            "num_compiles": self.runner.num_compiles,
            "prefix_cache_queries": bm.stats.queries,  # prompt tokens looked up
            "prefix_cache_hits": bm.stats.hits,  # of them, found computed
            "prefix_cache_hit_rate": bm.stats.hit_rate,
            "prefix_cache_host_hits": bm.stats.host_hits,  # of the hits, from the host tier
            "prefix_cache_blocks": bm.num_cached_blocks,
            "prefix_cache_evictions": bm.stats.evictions,
            "prefix_cache_host_blocks": swap.num_cached if swap else 0,
            "prefix_cache_host_evictions": swap.num_evictions if swap else 0,
        } | self._spec_snapshot() | (self.handover.snapshot() if self.handover else {})

    def _spec_snapshot(self) -> dict:
        st = self.speculator.stats if self.speculator is not None else SpecStats()
        return {"spec_proposed_tokens": st.num_proposed,
                "spec_accepted_tokens": st.num_accepted,
                "spec_acceptance_rate": st.acceptance_rate,
                "spec_verify_rows": st.num_spec_rows,  # sequence rows that verified
                "spec_emitted_tokens": st.num_accepted + st.num_spec_rows,  # by those rows
                "spec_mean_accepted_length": st.mean_accepted_length,  # their tokens per row
                "spec_steps": st.num_spec_steps,
                "spec_cut_by_grammar_tokens": st.num_cut_by_grammar}

    def _output(self, u: SeqUpdate) -> RequestOutput:
        seq = u.seq
        ids = seq.output_token_ids
        comp = CompletionOutput(0, seq.text, ids, seq.finish_reason, seq.stop_reason,
                                seq.logprobs, u.new_text, u.new_token_ids, True, len(ids))
        done = u.finished
        prompt = (self._prompts.pop(seq.request_id, None) if done
                  else self._prompts.get(seq.request_id))
        embedding = None
        if seq.pooling is not None and seq.finish_reason == "length" and seq.pooled is not None:
            n = len(seq.prompt_token_ids) if seq.pooling == "mean" else 1
            embedding = (seq.pooled / n).astype(np.float32)
        return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids, [comp], done,
                             seq.metrics, seq.prompt_logprobs, embedding)
