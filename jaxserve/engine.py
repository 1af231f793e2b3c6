"""LLMEngine: requests in, one continuous-batching step at a time, outputs back.

`step()` is schedule -> (swap) -> run the compiled forward -> postprocess. Postprocessing appends
the sampled tokens, detokenizes incrementally, applies the stop rules and returns finished
requests' KV blocks to the pool at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxserve.batch import build_step_inputs
from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerConfig, SwapSpace
from jaxserve.sequence import Sequence
from models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One step of the optional trace: who ran, with how many prefill and decode tokens."""

    index: int
    requests: list[tuple[str, int, int]]  # (request id, prefill tokens, decode tokens)
    duration_s: float
    bucket: tuple[int, int, int] | None

    @property
    def request_ids(self) -> list[str]:
        return [r for r, _, _ in self.requests]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(p for _, p, _ in self.requests)

    @property
    def num_decode_tokens(self) -> int:
        return sum(d for _, _, d in self.requests)


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; try again later."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        self.loaded = loaded or load_model(config.model)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(config, self.loaded)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=config.max_model_len, policy=config.scheduling_policy,
                            priority_aging_s=config.priority_aging_s,
                            prefill_chunk_alignment=config.prefill_chunk_alignment,
                            preemption_mode=config.preemption_mode),
            self.block_manager,
            SwapSpace(self.runner.num_host_blocks) if self.runner.num_host_blocks else None)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._prompts: dict[str, str | None] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._arrivals = 0
        self.num_steps = 0
        self.metrics = EngineMetrics()
        self.step_trace: list[StepRecord] | None = [] if config.enable_step_trace else None

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request. A bad field raises ValueError naming it; nothing else is touched.

        A full waiting queue raises QueueFullError."""
        try:
            self._add_request(request_id, prompt, params, prompt_token_ids, priority,
                              arrival_time)
        except (ValueError, QueueFullError):
            self.metrics.record_rejection()
            raise

    def _add_request(self, request_id, prompt, params, prompt_token_ids, priority, arrival_time):
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.config.max_logprobs)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_fits(len(ids), params)
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"waiting queue is full (max_waiting_requests={limit})")
        seed = params.seed if params.seed is not None else (
            (self.config.seed * 1_000_003 + self._arrivals) & 0xFFFFFFFF)
        seq = Sequence(request_id, ids, params, self._arrivals, seed, priority, arrival_time)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids)
        self._arrivals += 1
        self.requests[request_id] = seq
        self._prompts[request_id] = prompt
        self.scheduler.add(seq)

    def _prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = list(prompt_token_ids)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary "
                                     f"[0, {vocab})")
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
        need = self.block_manager.blocks_needed(prompt_len + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks, more than the whole "
                             f"pool (num_kv_blocks={self.block_manager.num_blocks})")

    def abort(self, request_id: str) -> bool:
        """Abort in any state; its blocks return at once. The next step() reports it."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        seq.finished_time = time.perf_counter()
        self.metrics.record_finished(seq)
        self._pending_outputs.append(self._output(seq, "", []))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def warmup(self) -> float:
        return self.runner.warmup()

    # ---------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        # The annotations name the phases of a step in XLA profiler traces (jax.profiler);
        # "forward" and "sample" are also named scopes inside the compiled step.
        t0 = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        with jax.profiler.TraceAnnotation("jaxserve.schedule"):
            sched = self.scheduler.schedule()
            for device_ids, host_ids in sched.swap_out:
                self.runner.swap_out(device_ids, host_ids)
            for device_ids, host_ids in sched.swap_in:
                self.runner.swap_in(device_ids, host_ids)
        if sched.is_empty:
            return outputs
        with jax.profiler.TraceAnnotation("jaxserve.prepare_inputs"):
            inp = build_step_inputs(sched.scheduled, self.runner.buckets, self.config.block_size,
                                    self.runner.num_blocks)
            want_lp = any(s.seq.params.logprobs is not None and s.samples
                          for s in sched.scheduled)
        with jax.profiler.TraceAnnotation("jaxserve.forward"):
            result = self.runner.execute(inp, want_lp)
        now = time.perf_counter()
        with jax.profiler.TraceAnnotation("jaxserve.postprocess"):
            for i, s in enumerate(sched.scheduled):
                seq = s.seq
                seq.num_computed_tokens = s.start + s.num_tokens
                if s.samples:
                    outputs.append(
                        self._append_token(seq, int(result["tokens"][i]), now, result, i))
        prefill = sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        decode = sched.num_tokens - prefill
        sampled = sum(s.samples for s in sched.scheduled)
        self.metrics.record_step(now - t0, prefill, decode, sampled,
                                 len(self.scheduler.running), len(self.scheduler.waiting),
                                 self.block_manager.num_used_blocks)
        if self.step_trace is not None:
            self.step_trace.append(StepRecord(
                self.num_steps,
                [(s.seq.request_id, s.num_tokens if s.is_prefill else 0,
                  0 if s.is_prefill else s.num_tokens) for s in sched.scheduled],
                now - t0, inp.bucket))
        self.num_steps += 1
        return outputs

    def metrics_snapshot(self) -> dict:
        """Engine-wide figures as a plain dict (what /metrics and the bench harness read)."""
        m, bm = self.metrics, self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "host_blocks_used": (self.scheduler.swap_space.num_used
                                 if self.scheduler.swap_space else 0),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_rejections": m.num_rejections,
            "num_requests_finished": m.num_requests_finished,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generation_tokens,
            "num_steps": m.num_steps,
            "num_compiles": self.runner.num_compiles,
        }

    def _append_token(self, seq: Sequence, token: int, now: float, result: dict,
                      row: int) -> RequestOutput:
        seq.append_token(token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.logprobs is not None:
            k = seq.params.logprobs
            seq.logprobs.append({
                "logprob": float(result["logprobs"][row]),
                "top": {int(t): float(lp) for t, lp in zip(result["top_ids"][row][:k],
                                                           result["top_logprobs"][row][:k],
                                                           strict=True)},
            })
        p = seq.params
        reason, stop_reason = None, None
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        new_text = "" if seq.detok is None or is_eos else seq.detok.add(token)
        if new_text:
            seq.text += new_text
        if is_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif new_text and p.stop:
            # Only the tail can hold a new match: the new text plus a stop string's length.
            window = len(new_text) + max(len(s) for s in p.stop)
            start = max(0, len(seq.text) - window)
            hits = [(seq.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop_reason = min(hits)
                new_text = new_text[:max(0, len(new_text) - (len(seq.text) - idx))]
                seq.text = seq.text[:idx]
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            seq.stop_reason = stop_reason
            seq.finished_time = now
            self.scheduler.finish(seq, reason)
            self.metrics.record_finished(seq)
            self.requests.pop(seq.request_id, None)
        return self._output(seq, new_text, [token])

    def _output(self, seq: Sequence, new_text: str, new_ids: list[int]) -> RequestOutput:
        comp = CompletionOutput(0, seq.text, list(seq.output_token_ids), seq.finish_reason,
                                seq.stop_reason, seq.logprobs, new_text, new_ids)
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                 seq.finished_time, seq.num_preemptions)
        prompt = (self._prompts.pop(seq.request_id, None) if seq.is_finished
                  else self._prompts.get(seq.request_id))
        return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids, [comp],
                             seq.is_finished, metrics)
