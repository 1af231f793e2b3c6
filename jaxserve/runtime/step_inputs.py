"""StepInputs: one step's device inputs, built on the host as numpy and padded to buckets;
StepPreparer: a runner's building of them from the scheduler's output."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from jaxserve.core.kv_layout import KVLayout
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput, pick_bucket, prompt_rows
from jaxserve.core.sequence import PENDING
from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.runtime import decode_loop, logits_processing
from jaxserve.runtime.block_tables import BlockTableRows, GroupTableRows, table_rows
from jaxserve.runtime.decode_loop import DecodeLoopInputs
from jaxserve.runtime.logits_processing import LogitsInputs, LogitsShape
from jaxserve.runtime.sampling import SamplingInputs
from jaxserve.runtime.speculative import SpecInputs

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig


class Program(NamedTuple):
    """What a step program is compiled for: its bucket, K (proposal slots per row: 0 in a step
    that verifies nothing), `plain` (StepInputs.plain), the decode steps it runs and `lora`:
    whether it adds LoRA updates (a step whose rows all run the base model skips them)."""

    tokens: int
    seqs: int
    blocks: int
    spec_k: int = 0
    plain: bool = False
    decode_steps: int = 1
    lora: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # (T,) int32
    # (T,) int32: the row of the previous step's sampled tokens that is this row's input token
    # (its token was still pending on the device when this step was built), or -1
    prev_rows: np.ndarray
    attn: AttentionMetadata
    logits_indices: np.ndarray  # (S,) int32: last query row of each sequence
    # (T,) int32: the prompt token after each row whose logprob a request asked for, or -1
    prompt_targets: np.ndarray
    sampling: SamplingInputs
    processing: LogitsInputs  # per-request logit processing (runtime/logits_processing.py)
    spec: SpecInputs  # proposed tokens to verify (runtime/speculative.py); K = 0 without
    # several decode steps in one call (runtime/decode_loop.py); None: one step
    decode: DecodeLoopInputs | None = None
    # (T,) int32: each row's LoRA slot (0: the base model; models/lora.py); None: the runner
    # serves no adapters
    lora_slots: np.ndarray | None = None
    # Static: every row is greedy or samples from the temperature alone, and nothing else is
    # asked (logprobs, logit processing, min_p, prompt logprobs, proposals): its program has no
    # runtime branches, each of which on a GPU waits for the device (plain_programs).
    plain: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def bucket(self) -> tuple[int, int, int]:
        return (self.input_ids.shape[0], self.logits_indices.shape[0],
                self.attn.block_tables.shape[-1])

    @property
    def program(self) -> Program:
        """The compiled program that runs it."""
        return Program(*self.bucket, self.spec.draft_tokens.shape[1], self.plain,
                       1 if self.decode is None else self.decode.num_steps,
                       self.lora_slots is not None)


def seq_bucket(seq_buckets: tuple[int, ...], t_pad: int, num_seqs: int = 0,
               slots: int | None = None) -> int:
    """The sequence bucket of a step of token bucket `t_pad` and `num_seqs` sequences: a step
    of at most t_pad tokens has at most min(t_pad, S) sequences, so tying the two keeps one
    program per (tokens, blocks), two where held prefills can join: S is `slots` (the decode
    slots, max_num_seqs) for a step within them, else the last seq bucket (slots + held)."""
    within = slots is not None and num_seqs <= slots
    return pick_bucket(seq_buckets, min(t_pad, slots if within else seq_buckets[-1]),
                       "sequences in step")


def build_step_inputs(
    scheduled: list[ScheduledSeq],
    buckets: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    block_size: int,
    num_blocks: int,
    logits_shape: LogitsShape,
    prev_rows: Mapping[str, int] | None = None,
    spec_k: int = 0,
    tables: BlockTableRows | GroupTableRows | None = None,
    plain_programs: bool = False,
    decode_steps: int = 1,
    slots: int | None = None,
    num_groups: int = 1,
    lora: bool = False,
) -> StepInputs:
    """`prev_rows`: request id -> its row in the step still in flight, for sequences whose
    input token that step is sampling (asynchronous scheduling). `spec_k`: the most tokens a
    row may propose (speculative decoding); a step without proposals gets K = 0. `tables`:
    the block tables kept from earlier steps (else each is copied whole). `plain_programs`:
    the runner has plain programs (a step that qualifies gets `plain`). `decode_steps`: the
    step's decode steps (SchedulerOutput.decode_steps). `slots`: the decode slots (see
    seq_bucket). `num_groups`: the pool's layer groups (core/kv_layout.py): past one, the
    block tables are (G, S, MB) and the slots (G, T), a table and a slot per group. `lora`:
    the runner serves adapters, so where a row runs one each row carries its LoRA slot."""
    tok_b, seq_b, blk_b = buckets
    num_seqs = len(scheduled)
    # This runs on the host every step while the device waits: one Python pass over the
    # sequences gathers what each row needs; the per-token rows (positions, owners, slots)
    # and the per-sequence constants (gathered from the rows kept between steps) are numpy.
    ns_l, starts_l, steps_l, samples_l, ids = [], [], [], [], []
    pending, drafted, processed = [], [], []  # (row, its prev row), rows that propose, (row, seq)
    most_blocks, want_logprobs, plainly, scores_prompt = 0, False, True, False
    for i, s in enumerate(scheduled):
        seq, n, start = s.seq, s.num_tokens, s.start
        ns_l.append(n)
        starts_l.append(start)
        steps_l.append(seq.num_sampled)
        samples_l.append(s.samples)
        if len(seq.block_table) > most_blocks:
            most_blocks = len(seq.block_table)
        if s.samples:
            want_logprobs = want_logprobs or seq.params.logprobs is not None
            plainly = plainly and seq.samples_plainly
            if seq.logits_state is not None:
                processed.append((i, seq))
        if seq.prompt_logprobs is not None:
            scores_prompt = True
        if n == 1 or s.drafts:  # a decode: its last token, then any proposals
            token = seq.token_at(start)
            if token == PENDING:  # the device has it: this row reads it from the last step
                pending.append((i, prev_rows[seq.request_id]))
                token = 0
            ids.append(token)
            if s.drafts:
                ids.extend(s.drafts)
                drafted.append(i)
        else:  # a prompt chunk (or a recompute): every token is on the host
            ids.extend(seq.tokens(start, start + n))
    ns = np.array(ns_l, np.int32)
    starts = np.array(starts_l, np.int32)
    num_tokens = sum(ns_l)
    t_pad = pick_bucket(tok_b, num_tokens, "tokens in step")
    s_pad = seq_bucket(seq_b, t_pad, num_seqs, slots)
    mb_pad = pick_bucket(blk_b, most_blocks, "blocks per seq")
    if not drafted:
        spec_k = 0

    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    token_seq = np.zeros(t_pad, np.int32)
    # Out-of-range slots make the scatter drop the padding rows' K/V.
    grouped = (num_groups,) if num_groups > 1 else ()
    slot_mapping = np.full((*grouped, t_pad), num_blocks * block_size, np.int32)
    block_tables = np.zeros((*grouped, s_pad, mb_pad), np.int32)
    context_lens = np.zeros(s_pad, np.int32)
    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    temperature = np.zeros(s_pad, np.float32)
    top_p = np.ones(s_pad, np.float32)
    top_k = np.zeros(s_pad, np.int32)
    seeds = np.zeros(s_pad, np.uint32)
    steps = np.zeros(s_pad, np.int32)
    samples = np.zeros(s_pad, bool)

    qsl = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(ns, out=qsl[1:])
    query_start_loc[:num_seqs] = qsl[:-1]
    context_lens[:num_seqs] = starts + ns
    logits_indices[:num_seqs] = qsl[1:] - 1
    if tables is None:  # a one-off step: rows of its own
        tables = table_rows(num_seqs, mb_pad, num_groups)
    rows = tables.fill(scheduled, block_tables)
    temperature[:num_seqs] = tables.temperature[rows]
    top_p[:num_seqs] = tables.top_p[rows]
    top_k[:num_seqs] = tables.top_k[rows]
    seeds[:num_seqs] = tables.seeds[rows]
    seq_of_row = np.repeat(np.arange(num_seqs, dtype=np.int32), ns)  # (num_tokens,)
    pos = starts[seq_of_row] + (np.arange(num_tokens, dtype=np.int32) - qsl[:-1][seq_of_row])
    positions[:num_tokens] = pos
    token_seq[:num_tokens] = seq_of_row
    slot_mapping[..., :num_tokens] = (block_tables[..., seq_of_row, pos // block_size]
                                      * block_size + pos % block_size)
    input_ids[:num_tokens] = ids
    lora_slots = None
    if lora and any(s.seq.lora_slot for s in scheduled):  # else the program without updates
        lora_slots = np.zeros(t_pad, np.int32)
        lora_slots[:num_tokens] = np.repeat(
            np.array([s.seq.lora_slot for s in scheduled], np.int32), ns)
    from_prev = np.full(t_pad, -1, np.int32)
    for i, prev in pending:
        from_prev[qsl[i]] = prev
    spec = empty_spec_inputs(s_pad, spec_k, logits_shape.mask_words)
    spec.verify_rows[:num_seqs] = logits_indices[:num_seqs, None]  # a row without proposals
    if drafted:
        constrained_drafts = []  # (row, sequence, proposals) whose grammar masks the proposals
        for i in drafted:
            s = scheduled[i]
            nd = len(s.drafts)
            spec.draft_tokens[i, :nd] = s.drafts
            spec.num_drafts[i] = nd
            spec.verify_rows[i] = qsl[i] + np.minimum(np.arange(spec_k + 1), nd)
            if s.seq.logits_state is not None:  # a grammar's (the only processing)
                constrained_drafts.append((i, s.seq, s.drafts))
        if constrained_drafts:
            mask = np.full(spec.mask.shape, -1, np.int32)
            constrained_drafts[0][1].logits_state.fill_proposal_masks(constrained_drafts, mask)
            spec = dataclasses.replace(spec, mask=mask, masked=np.bool_(True))
    prompt_targets = np.full(t_pad, -1, np.int32)
    for r in prompt_rows(scheduled) if scores_prompt else ():
        prompt_targets[r.row:r.row + r.count] = r.seq.prompt_token_ids[r.first:r.first + r.count]
    steps[:num_seqs] = steps_l
    samples[:num_seqs] = samples_l
    processing = logits_processing.build(processed, logits_shape, s_pad)
    plain = (plain_programs and spec_k == 0 and plainly
             and not (scores_prompt and (prompt_targets >= 0).any()))

    return StepInputs(
        input_ids=input_ids,
        prev_rows=from_prev,
        attn=AttentionMetadata(positions=positions, token_seq=token_seq,
                               slot_mapping=slot_mapping, block_tables=block_tables,
                               context_lens=context_lens, query_start_loc=query_start_loc),
        logits_indices=logits_indices,
        prompt_targets=prompt_targets,
        sampling=SamplingInputs(temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds,
                                steps=steps, samples=samples,
                                want_logprobs=np.bool_(want_logprobs)),
        processing=processing,
        spec=spec,
        plain=plain,
        decode=(decode_loop.build(scheduled, s_pad, decode_steps) if decode_steps > 1
                else None),
        lora_slots=lora_slots,
    )


class StepPreparer:
    """A runner prepares its own steps: the engine hands over the scheduler's output (and the
    rows of the step in flight) and gets the step's inputs, built from the runner's buckets,
    pool and logits shape and the rows it keeps between steps. A runner (ModelRunner, the
    host-overhead bench's stand-in) mixes it in and sets the attributes below; its `buckets`
    change if its attention falls back, so each step reads them afresh."""

    config: EngineConfig  # spec_tokens (K), max_num_seqs (the decode slots), max_step_seqs
    buckets: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    block_size: int
    num_blocks: int
    logits_shape: LogitsShape
    kv_layout: KVLayout  # its layer groups: a block table per group
    plain_programs: bool  # it has plain programs (StepInputs.plain)
    lora_enabled: bool  # it serves adapters: rows that run one carry their LoRA slots

    @functools.cached_property
    def step_rows(self) -> BlockTableRows | GroupTableRows:
        """The block tables and sampling constants kept between steps (block_tables.py)."""
        return table_rows(self.config.max_step_seqs, self.buckets[2][-1],
                          self.kv_layout.num_groups)

    def prepare_step(self, sched: SchedulerOutput,
                     prev_rows: Mapping[str, int] | None = None) -> StepInputs:
        """The device inputs of the step `sched` schedules. `prev_rows`: request id -> its
        row in the step still in flight, for sequences whose input token that step is
        sampling (asynchronous scheduling)."""
        return build_step_inputs(sched.scheduled, self.buckets, self.block_size,
                                 self.num_blocks, self.logits_shape, prev_rows,
                                 self.config.spec_tokens, self.step_rows, self.plain_programs,
                                 sched.decode_steps, self.config.max_num_seqs,
                                 self.kv_layout.num_groups, self.lora_enabled)

    def prepare_alone(self, s: ScheduledSeq) -> StepInputs:
        """`s` as a step of its own, on rows of its own (a pending input token read from row
        0): after a step failed to build, whether `s`'s values fail it on their own."""
        return build_step_inputs([s], self.buckets, self.block_size, self.num_blocks,
                                 self.logits_shape, {s.seq.request_id: 0},
                                 self.config.spec_tokens, num_groups=self.kv_layout.num_groups,
                                 lora=self.lora_enabled)


def empty_spec_inputs(s: int, k: int, mask_words: int) -> SpecInputs:
    """No proposals: each row verifies only its own last row."""
    return SpecInputs(draft_tokens=np.zeros((s, k), np.int32), num_drafts=np.zeros(s, np.int32),
                      verify_rows=np.zeros((s, k + 1), np.int32),
                      mask=_all_allowed(s, k, mask_words), masked=np.bool_(False))


@functools.lru_cache(maxsize=32)
def _all_allowed(s: int, k: int, mask_words: int) -> np.ndarray:
    """A proposal mask that allows everything, shared by every step of its shape (read-only:
    a step that needs masks makes its own)."""
    mask = np.full((s, k, mask_words), -1, np.int32)
    mask.flags.writeable = False
    return mask


def dummy_step_inputs(t: int, s: int, mb: int, block_size: int, num_blocks: int,
                      logits_shape: LogitsShape, spec_k: int = 0,
                      plain: bool = False, decode_steps: int = 1,
                      num_groups: int = 1, lora: bool = False) -> StepInputs:
    """Shape-only stand-in for compiling a program at warmup (all rows are padding)."""
    i32 = lambda n: np.zeros(n, np.int32)
    grouped = (num_groups,) if num_groups > 1 else ()
    return StepInputs(
        input_ids=i32(t),
        prev_rows=np.full(t, -1, np.int32),
        attn=AttentionMetadata(positions=i32(t), token_seq=i32(t),
                               slot_mapping=np.full((*grouped, t), num_blocks * block_size,
                                                    np.int32),
                               block_tables=np.zeros((*grouped, s, mb), np.int32),
                               context_lens=i32(s),
                               query_start_loc=i32(s + 1)),
        logits_indices=i32(s),
        prompt_targets=np.full(t, -1, np.int32),
        sampling=SamplingInputs(temperature=np.zeros(s, np.float32),
                                top_p=np.ones(s, np.float32), top_k=i32(s),
                                seeds=np.zeros(s, np.uint32), steps=i32(s),
                                samples=np.zeros(s, bool), want_logprobs=np.bool_(False)),
        processing=logits_shape.unused(s),
        spec=empty_spec_inputs(s, spec_k, logits_shape.mask_words),
        plain=plain,
        decode=(decode_loop.build([], s, decode_steps) if decode_steps > 1 else None),
        lora_slots=i32(t) if lora else None,
    )
