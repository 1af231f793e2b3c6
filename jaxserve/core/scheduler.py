"""Scheduler: iteration-level (continuous) batching over the paged KV pool. Host only, no jax.

Every step it decides which sequences run and how many of their tokens, within `max_num_seqs`,
`max_num_batched_tokens` and the free KV blocks:

1. running sequences that are decoding (one token each), in policy order;
2. waiting sequences past the TTFT target, if one is set, oldest first;
3. running (then held) sequences part-way through their prompt (chunked prefill);
4. waiting sequences, admitted in policy order while sequences, tokens and blocks last.

Held prefills: `max_num_seqs` counts decode slots. With the slots full and token budget to
spare, waiting requests are still admitted, up to `max_held_seqs` of them: their prompts run
and their first token is sampled, then they hold their blocks (status HELD) until a slot frees
and they join the running set, best first. A held admission leaves one free block per running
sequence for its next token, and a sequence short of a block preempts held ones before any
running one, so held prompts never cost the running ones their progress.

A prompt larger than what is left of the token budget is cut into a chunk that shares the step
with the decodes; the rest follows in later steps. When a running sequence cannot get a block for
its next token, the policy's victim (the lowest-priority, latest-arriving running sequence) is
preempted (its blocks are freed, or copied to the host pool in swap mode) and resumes later
exactly where it was.

The policy (core/policies.py, named by `policy`) orders every queue: who decodes and is admitted
first, who is preempted, whether a waiting request may preempt a running one it outranks, and
whether requests are admitted as a batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import time
from collections.abc import Callable

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.lora import LoRASlots, SlotLoad
from jaxserve.core.policies import policy_class
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.speculative import Speculator
from jaxserve.core.swap_space import SwapSpace


def pick_bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    """The smallest of the ascending `buckets` that holds `n` (`what` names n in the error)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


# A step's fixed cost in token rows, for Scheduler._fit_bucket: on a CPU, where the cut is made,
# a step streams every weight once whatever its rows, about what 8 prompt rows cost.
_STEP_ROWS = 8


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"  # free the blocks; prefill prompt + generated tokens again later
    SWAP = "swap"  # copy the blocks to the host pool and back (recompute when it is full)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # a name in core/policies.py's POLICIES
    priority_aging_s: float | None = None
    prefill_chunk_alignment: int = 1
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    # The padded token counts the step is compiled for (ascending; empty: none known). A step
    # with more prompt tokens on offer than a bucket holds stops at that bucket instead of
    # padding to the next one: see Scheduler._fit_bucket.
    token_buckets: tuple[int, ...] = ()
    # The most decode steps one step may run when every running sequence decodes (1: one);
    # see Scheduler._run_ahead.
    decode_steps: int = 1
    # Such a step takes only sequences that sample plainly (SamplingParams.samples_plainly):
    # the runner's program for it is plain (EngineConfig.plain_programs).
    decode_steps_plain: bool = False
    # Requests admitted beyond the max_num_seqs decode slots (see the module docstring).
    max_held_seqs: int = 0
    # Seconds a request may wait before its prefill starts ahead of everything but decodes.
    ttft_target_s: float | None = None

    def __post_init__(self):  # plain strings are accepted and normalized
        policy_class(self.policy, "policy")
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache before this step
    num_tokens: int  # query tokens this step
    samples: bool = False  # the step reaches the sequence's end, so a token is sampled
    is_prefill: bool = True  # prompt (or recompute) tokens rather than one decode token
    # speculative decoding: tokens proposed after its last one (its rows 1..), to verify
    drafts: list[int] | None = None
    # decode steps it runs in a step of several (SchedulerOutput.decode_steps), one token each
    num_steps: int = 1

    @property
    def end(self) -> int:
        """Tokens with K/V once the step has run (each decode step after the first computes
        the token the one before sampled)."""
        return self.start + self.num_tokens + self.num_steps - 1

    @staticmethod
    def of(seq: Sequence, num_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, num_tokens, start + num_tokens == seq.num_tokens,
                            not seq.is_decoding)


# The stop ids (EOS included) of a sequence that a step of several decode steps checks on the
# device; a sequence with more runs one decode step per step.
MAX_LOOP_STOP_IDS = 8


def _runs_ahead(s: ScheduledSeq, plain_only: bool) -> bool:
    """Can the device decode several tokens of `s` without the host between them? Not with a
    grammar or bad words (each token changes the next one's mask), below min_tokens (its stop
    ids are banned until then), with more stop ids than the device checks, or, where the
    loop's program is plain (`plain_only`), unless it samples plainly."""
    seq, p = s.seq, s.seq.params
    return (not s.is_prefill and not s.drafts and p.structured_outputs is None
            and not p.bad_words and seq.num_sampled >= p.min_tokens
            and len(seq.stop_ids) <= MAX_LOOP_STOP_IDS
            and (not plain_only or seq.samples_plainly))


@dataclasses.dataclass(frozen=True, slots=True)
class PromptRows:
    """A run of one sequence's query rows whose prompt logprobs the step computes: rows
    row .. row+count-1 give its prompt entries first .. first+count-1 (entry i: token i given
    those before it, computed from the row of token i-1)."""

    seq: Sequence
    row: int
    first: int
    count: int


def prompt_rows(scheduled: list[ScheduledSeq]) -> list[PromptRows]:
    """The prompt-logprob rows of a step: entries no earlier step was launched to compute."""
    rows, row = [], 0
    for s in scheduled:
        seq = s.seq
        if seq.prompt_logprobs is not None and seq.needs_prompt_logprobs:
            first = max(seq.prompt_logprobs_next, s.start + 1)
            end = min(s.start + s.num_tokens + 1, len(seq.prompt_token_ids))
            if end > first:
                rows.append(PromptRows(seq, row + first - 1 - s.start, first, end - first))
        row += s.num_tokens
    return rows


@dataclasses.dataclass(slots=True)
class KVCopy:
    to_host: bool  # device -> host (else host -> device)
    device_ids: list[int]
    host_ids: list[int]


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # Block copies between the device and the host pool, which the engine makes in this order
    # before the forward: swap-outs and host-tier spills (to_host), swap-ins and host-tier hits.
    # A block may be reassigned later in the same schedule: the copies that read it are recorded
    # first, so they run before whatever writes it.
    copies: list[KVCopy] = dataclasses.field(default_factory=list)
    # Decode steps the step runs in one call of the program (every sequence decodes; each
    # takes up to its num_steps of them); 1: a plain step.
    decode_steps: int = 1
    # LoRA adapters to write into their device slots before the step (core/lora.py)
    lora_loads: list[SlotLoad] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 swap_space: SwapSpace | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 speculator: Speculator | None = None, lora_slots: LoRASlots | None = None):
        self.config = config
        self.policy = policy_class(config.policy, "policy")(aging_s=config.priority_aging_s)
        # the device's LoRA slots (None: no adapters); a sequence holds its adapter's slot
        # while admitted, and one whose adapter finds no slot free waits
        self.lora_slots = lora_slots
        self.speculator = speculator  # speculative decoding's proposals (None: off)
        self.block_manager = block_manager
        self.swap_space = swap_space
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.held: list[Sequence] = []  # prefilled beyond the decode slots, waiting for one
        # taken over by a decode engine, their K/V still arriving (engine/handover.py): their
        # adapters keep their slots
        self.arriving: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # The prefix cache's host tier: evicted cached blocks spill to the host pool (not with
        # layer groups, whose pages it does not track apart).
        self.host_tier = (swap_space is not None and block_manager.enable_caching
                          and block_manager.window is None)

    # ---------------------------------------------------------------------------- queue state

    @property
    def admitted(self) -> list[Sequence]:
        """The running and held sequences: those that hold device blocks."""
        return self.running + self.held

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # -------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        now = self.clock()
        out = SchedulerOutput(scheduled=[])
        budget = cfg.max_num_batched_tokens
        if self.held and len(self.running) < cfg.max_num_seqs:
            self._promote_held(now)
        self.policy.sort(self.running, now)
        self._preempt_outranked(now, budget, out)
        self._admit_batch(now, out)
        num_rank_preemptions = len(out.preempted)

        if bm.window is not None:  # pages no query of this step sees go back first
            for s in itertools.chain(self.running, self.held):
                bm.drop(s, s.num_computed_tokens)
        decodes, partial = [], []
        for s in self.running:
            (decodes if s.is_decoding else partial).append(s)
        if not num_rank_preemptions:  # else the slot freed goes to the one it was for
            partial += [s for s in self.held if not s.is_decoding]
        block_size = bm.block_size
        running = SequenceStatus.RUNNING
        plans = self._speculate(decodes, partial, budget) if self.speculator else {}
        num_finishing = 0
        for seq in decodes:  # the hot path: one token each, a new block only at a boundary
            if budget <= 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            if seq.num_pending and (
                    (done := seq.reaches_length(seq.num_sampled, cfg.max_model_len))
                    or seq.needs_history):
                # Its token is on the way (asynchronous scheduling): its last one (done then),
                # or one its next token's mask or penalties depend on (it sits out a step).
                num_finishing += done
                continue
            start = seq.num_computed_tokens
            if start >= len(seq.block_table) * block_size:
                if not self._make_room(seq, start + 1, out):
                    continue
                self._allocate(seq, start + 1, out)
            drafts = plans.get(seq.request_id) if plans else None
            if drafts:  # its proposals' slots, from free blocks only (no one is preempted)
                drafts = drafts[:max(0, budget - 1)]
                if not bm.can_allocate(seq, start + 1 + len(drafts)):
                    drafts = drafts[:len(seq.block_table) * block_size - start - 1]
                self._allocate(seq, start + 1 + len(drafts), out)
            n = 1 + len(drafts) if drafts else 1
            out.scheduled.append(ScheduledSeq(seq, start, n, True, False, drafts or None))
            budget -= n
        if cfg.ttft_target_s is not None and self.waiting and budget > 0 and not out.preempted:
            budget = self._admit(self._overdue(now), budget, now, out)
        budget = self._fit_bucket(cfg.max_num_batched_tokens - budget, budget, partial)
        for seq in partial:
            if seq.status not in (SequenceStatus.RUNNING, SequenceStatus.HELD):
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                continue  # seq itself was preempted
            self._allocate(seq, seq.num_computed_tokens + n, out)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n

        if len(out.preempted) > num_rank_preemptions:
            return out  # memory is short for the running ones: admit nothing new this step
        self._admit(self.policy.admission_order(self.waiting, self.swapped, now), budget, now,
                    out)
        if cfg.decode_steps > 1:
            self._run_ahead(out, len(self.running) - num_finishing)
        return out

    def _admit(self, candidates: list[Sequence], budget: int, now: float,
               out: SchedulerOutput) -> int:
        """Admit `candidates` in order, as decode slots, held slots, tokens and blocks last;
        the budget left."""
        cfg, bm = self.config, self.block_manager
        for seq in candidates:
            held = len(self.running) >= cfg.max_num_seqs
            if budget <= 0 or held and (len(self.held) >= cfg.max_held_seqs
                                        or seq.status is SequenceStatus.SWAPPED):
                break
            if seq.waits_for is not None:
                if seq.waits_for.is_prefilling_prompt:
                    continue  # its sibling computes the prompt; this one then reads it
                seq.waits_for = None
            # A sequence with nothing computed (new, or preempted by recompute) first takes
            # whatever prefix of it the cache holds: on the device, then in the host tier.
            fresh = bm.enable_caching and seq.num_computed_tokens == 0
            cached = bm.match_prefix(seq) if fresh else []
            loaded = self.match_host(seq, len(cached)) if fresh else []
            computed = (len(cached) + len(loaded)) * bm.block_size or seq.num_computed_tokens
            n = self._chunk(seq, budget, computed)
            need = (bm.blocks_needed(computed + n) - len(cached) - len(seq.block_table)
                    + bm.num_blocks_taken_from_free(cached))
            # a held prompt leaves each running sequence a block for its next token
            if n == 0 or need > bm.num_free_blocks - (len(self.running) if held else 0):
                break  # head-of-line: later arrivals do not jump the queue
            if seq.lora_id and not self._take_lora_slot(seq, out):
                continue  # every slot runs another adapter: it waits, the others go on
            if fresh:
                bm.take_prefix(seq, cached, seq.num_tokens)
                if loaded:
                    self._load_from_host(seq, loaded, out)
            if seq.status is SequenceStatus.SWAPPED:
                self.swapped.remove(seq)
                self._allocate(seq, seq.num_computed_tokens + n, out)
                # Its first blocks get their K/V back; the host ids are free again only after
                # this copy is recorded, so a later spill that reuses them runs after it.
                host_ids = self.swap_space.held_ids(seq)
                self._copy(out, False, seq.block_table[:len(host_ids)], host_ids)
                self.swap_space.release(seq)
            else:
                self.waiting.remove(seq)
                self._allocate(seq, seq.num_computed_tokens + n, out)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            seq.status = SequenceStatus.HELD if held else SequenceStatus.RUNNING
            (self.held if held else self.running).append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
        return budget

    def _overdue(self, now: float) -> list[Sequence]:
        """Waiting requests with no token yet that have waited past the TTFT target, oldest
        first (under priority, best first: the order priority preemption frees slots in, so
        the slot freed for a request goes to it and not to an older, lesser one)."""
        target = self.config.ttft_target_s
        late = [s for s in self.waiting if s.num_tokens == s.num_prompt_tokens
                and now - s.arrival_time >= target]
        self.policy.sort(late, now)
        return late

    def _promote_held(self, now: float) -> None:
        """Held sequences take the decode slots that are free, best first. (Under priority a
        waiting request that outranks one then preempts it as it would any running one:
        held sequences never keep their blocks from a free slot.)"""
        self.policy.sort(self.held, now)
        n = self.config.max_num_seqs - len(self.running)
        for seq in self.held[:n]:
            seq.status = SequenceStatus.RUNNING
        self.running += self.held[:n]
        del self.held[:n]

    def _run_ahead(self, out: SchedulerOutput, num_active: int) -> None:
        """Make a step in which all `num_active` running sequences decode (and none waits or
        is swapped out: it would wait the whole call) run up to `decode_steps` decode steps in
        one call (runtime/decode_loop.py), each sequence up to its max_tokens and
        max_model_len. The blocks for its later tokens come from free blocks only, as a
        proposal's do (its first token's block was taken as in any step, preempting if need
        be); where they run short, so does the sequence's part of the call."""
        if (self.waiting or self.swapped or self.held or len(out.scheduled) != num_active
                or not all(_runs_ahead(s, self.config.decode_steps_plain)
                           for s in out.scheduled)):
            return
        cfg, bm = self.config, self.block_manager
        k, max_len, block_size = cfg.decode_steps, cfg.max_model_len, bm.block_size
        longest = 1
        for s in out.scheduled:  # the hot path of a loaded server: a new block now and then
            seq = s.seq
            n = max(1, min(k, seq.params.max_tokens - seq.num_sampled,
                           max_len - seq.num_tokens))
            room = len(seq.block_table) * block_size - s.start
            if n > room:
                if not bm.can_allocate(seq, s.start + n):
                    n = min(n, room + bm.num_free_blocks * block_size)
                self._allocate(seq, s.start + n, out)
            s.num_steps = n
            longest = max(longest, n)
        if longest > 1:
            out.decode_steps = cfg.decode_steps

    # --------------------------------------------------------------------- blocks and copies

    def _speculate(self, decodes: list[Sequence], partial: list[Sequence],
                   budget: int) -> dict[str, list[int]]:
        """The proposals of this step's decodes (core/speculative.py). The policy weighs them
        against the other rows the step would hold: the decodes that cannot speculate and
        the prompt tokens waiting for the budget."""
        spec = self.speculator
        eligible = [s for s in decodes if spec.eligible(s)]
        if not eligible:
            return {}
        demand = len(decodes) - len(eligible)
        for seq in itertools.chain(partial, self.waiting, self.swapped):
            if demand >= budget:
                break
            demand += seq.num_uncomputed_tokens
        return spec.plan(eligible, min(demand, budget), budget, self.config.max_model_len,
                         num_decodes=len(decodes))

    def _allocate(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        """Grow `seq`'s blocks; cached blocks evicted for it spill to the host tier."""
        evicted: list | None = [] if self.host_tier else None
        self.block_manager.allocate(seq, num_tokens, evicted)
        if evicted:
            spills = [(b, hid) for b, name in evicted
                      if (hid := self.swap_space.spill(name)) is not None]
            if spills:
                device_ids, host_ids = map(list, zip(*spills, strict=True))
                self._copy(out, True, device_ids, host_ids)

    def take_over(self, seq: Sequence, cached: list[int],
                  loaded: list[int]) -> SchedulerOutput | None:
        """Blocks for a sequence whose prompt was computed elsewhere (a decode engine's
        handover): `cached` (match_prefix), then new blocks for the host-tier blocks `loaded`
        (copied in) and for the rest of its prompt (to be filled by the caller), and its
        adapter's slot. Returns the copies and slot loads to make before any step reads
        them; None (nothing taken) when every slot runs another adapter."""
        out = SchedulerOutput([])
        if seq.lora_id and not self._take_lora_slot(seq, out):
            return None
        bm, num_prompt = self.block_manager, seq.num_prompt_tokens
        bm.take_prefix(seq, cached, num_prompt)
        if loaded:
            self._load_from_host(seq, loaded, out)
        self._allocate(seq, num_prompt, out)
        return out

    def match_host(self, seq: Sequence, num_cached: int) -> list[int]:
        """Host-tier blocks holding `seq`'s prompt blocks past its first `num_cached`."""
        if not self.host_tier:
            return []
        return self.swap_space.match(self.block_manager.matchable_names(seq)[num_cached:])

    def _load_from_host(self, seq: Sequence, host_ids: list[int], out: SchedulerOutput) -> None:
        """Give `seq` (holding its device-cached prefix) new blocks for the host-tier blocks
        that follow it, copied in from the host."""
        start = len(seq.block_table)
        names = self.swap_space.pin(host_ids)  # the allocation's spills must not take them
        self._allocate(seq, (start + len(host_ids)) * self.block_manager.block_size, out)
        self._copy(out, False, seq.block_table[start:], host_ids)
        self.swap_space.unpin(host_ids, names)
        self.block_manager.register_loaded(seq, start)

    @staticmethod
    def _copy(out: SchedulerOutput, to_host: bool, device_ids: list[int],
              host_ids: list[int]) -> None:
        if not device_ids:
            return
        last = out.copies[-1] if out.copies else None
        if last is not None and last.to_host == to_host:  # one copy per run of one direction
            # A destination written twice (a tiny host pool cycling within one schedule) keeps
            # the later write, as running the two copies in turn would.
            new_dst = set(host_ids if to_host else device_ids)
            old_dst = last.host_ids if to_host else last.device_ids
            keep = [i for i, d in enumerate(old_dst) if d not in new_dst]
            last.device_ids = [last.device_ids[i] for i in keep] + list(device_ids)
            last.host_ids = [last.host_ids[i] for i in keep] + list(host_ids)
        else:
            out.copies.append(KVCopy(to_host, list(device_ids), list(host_ids)))

    def _admit_batch(self, now: float, out: SchedulerOutput) -> None:
        """The batch the policy admits at once (static batching), up to max_num_seqs of it,
        whatever this step's token budget; their prompts are then prefilled (in chunks) like
        any other."""
        candidates = self.policy.batch(self.waiting, len(self.running) + len(self.swapped), now)
        if not candidates:
            return
        batch = []
        for seq in candidates:
            if len(batch) == self.config.max_num_seqs:
                break
            if not seq.lora_id or self._take_lora_slot(seq, out, batch):
                batch.append(seq)
        self.waiting = [s for s in self.waiting if s not in batch]
        for seq in batch:
            seq.status = SequenceStatus.RUNNING
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        self.running.extend(batch)

    def _take_lora_slot(self, seq: Sequence, out: SchedulerOutput,
                        admitting: list[Sequence] = ()) -> bool:
        """Give `seq` its adapter's device slot (recording the weights to write there when
        the slot is new to it); False when every slot holds an adapter an admitted sequence
        (or one of `admitting`) runs."""
        in_use = {s.lora_id for s in itertools.chain(self.running, self.held,
                                                      self.arriving.values(), admitting)}
        got = self.lora_slots.acquire(seq.lora_id, in_use)
        if got is None:
            return False
        seq.lora_slot, load = got
        if load:
            out.lora_loads.append(SlotLoad(seq.lora_slot, seq.lora_id))
        return True

    def _fit_bucket(self, used: int, budget: int, partial: list[Sequence]) -> int:
        """The budget left for prompt tokens once `used` decode tokens are in, cut to end the
        step on a token bucket where that computes fewer rows: a step of 20 decodes and a
        140-token prompt pads 160 rows to 256, where one of 128 rows and the prompt's last 32
        tokens beside the next step's decodes (52 rows, padded to 64 instead of 24) compute
        88 fewer. Weighed on the two steps, each counted as its padded rows plus a step's
        fixed cost, so a short remainder is not dribbled out over several steps.

        Cutting only happens when every prompt token on offer fits this step (else the step
        is full: the budget is a bucket). The estimate of what waits ignores prefix-cache
        hits: an overestimate only ends the step below the bucket it pads to anyway. Aligned
        chunks (prefill_chunk_alignment) keep their own cuts."""
        buckets = self.config.token_buckets
        if not buckets or budget <= 0 or self.config.prefill_chunk_alignment > 1:
            return budget
        cfg = self.config
        demand = 0
        slots = cfg.max_num_seqs + cfg.max_held_seqs - len(self.running) - len(self.held)
        for seq in partial:
            demand += seq.num_uncomputed_tokens
        for seq in itertools.chain(self.swapped, self.waiting):
            if demand >= budget or slots <= 0:
                break
            demand += seq.num_uncomputed_tokens
            slots -= 1
        total = used + min(demand, budget)
        below = bisect.bisect_right(buckets, total)
        fit = buckets[below - 1] if below else 0
        if not used < fit < total:
            return budget

        def rows(n: int) -> int:  # a step of n tokens: its padded rows and fixed cost
            return pick_bucket(buckets, n, "tokens in step") + _STEP_ROWS if n else 0

        cut = fit + rows(used + total - fit)
        return fit - used if cut < rows(total) - _STEP_ROWS + rows(used) else budget

    def _chunk(self, seq: Sequence, budget: int, computed: int | None = None) -> int:
        """Tokens of `seq` to run this step; `computed`: its computed tokens if not yet set
        (a prefix about to come from the cache)."""
        left = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        n = min(left, budget)
        align = self.config.prefill_chunk_alignment
        if n < left and align > 1:
            n = n // align * align  # a prompt's last chunk keeps its odd size
        return n

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt until `seq` can hold `num_tokens`, held sequences first, never one this
        step has scheduled already; False if `seq` itself had to go."""
        bm = self.block_manager
        if bm.can_allocate(seq, num_tokens):
            return True
        now = self.clock()
        taken = {s.seq for s in out.scheduled}
        while not bm.can_allocate(seq, num_tokens):
            candidates = ([s for s in self.held if s not in taken]
                          or [s for s in self.running if s not in taken])
            victim = self.policy.victim(candidates, now)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt_outranked(self, now: float, budget: int, out: SchedulerOutput) -> None:
        """Preempt running requests that a waiting one outranks (the policy says who does),
        when seqs or blocks are full."""
        if not self.running or not (self.waiting or self.swapped):
            return
        bm, policy = self.block_manager, self.policy
        free, num_running = bm.num_free_blocks, len(self.running)
        for cand in policy.admission_order(self.waiting, self.swapped, now):
            n = min(cand.num_uncomputed_tokens, budget)
            need = bm.num_new_blocks(cand, cand.num_computed_tokens + n)
            while (num_running >= self.config.max_num_seqs or need > free) and self.running:
                worst = policy.victim(self.running, now)
                if not policy.outranks(cand, worst, now):
                    return  # nobody running is outranked by the best candidate left
                free += len(worst.block_table)
                num_running -= 1
                self._preempt(worst, out)
            if num_running >= self.config.max_num_seqs or need > free:
                return
            num_running += 1
            free -= need

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        (self.held if seq.status is SequenceStatus.HELD else self.running).remove(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        swap = self.swap_space
        if (self.config.preemption_mode is PreemptionMode.SWAP and swap is not None
                and seq.num_computed_tokens > 0 and swap.can_hold(len(seq.block_table))):
            self._copy(out, True, list(seq.block_table), swap.reserve(seq))
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0  # recompute: prompt + generated tokens are prefilled again
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(0, seq)

    # ---------------------------------------------------------------------------- completion

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove `seq` from whichever queue holds it and return its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.held:
            self.held.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        if seq.status is SequenceStatus.SWAPPED and self.swap_space is not None:
            self.swap_space.release(seq)
        self.block_manager.free(seq)
        seq.drop_pending()
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finish_reason = reason
