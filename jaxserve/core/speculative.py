"""Speculative decoding on the host (no jax): the n-gram proposer and the load-adaptive policy.

A speculating sequence runs 1 + k query rows in a step: its last token and k proposed ones.
The step's verification (runtime/speculative.py) keeps the longest prefix of the proposal the
target model agrees with, plus one token of its own, so a step gives 1 to k + 1 tokens.

**n-gram (prompt lookup).** The proposal is what followed the latest earlier occurrence of the
context's last n tokens, trying n from `prompt_lookup_max` down to `prompt_lookup_min`: output
that copies spans of its input (summaries, edits, answers quoting a context, code) is proposed
for free.

**Draft model.** A smaller model proposes by running ahead of the target; it runs on the device,
inside the step (runtime/speculative.py), so the host only reserves the rows: the proposer
returns k placeholder tokens that the step replaces with the draft's.

**Load-adaptive k.** A step's time is that of its program, chosen by its padded token count
and whether it verifies: the policy keeps each token bucket's recent decode step times, apart
for steps that verify, measured by the engine itself; a bucket's time is their median, and a
program's first run (it pays for loading the program) counts only until a second one comes.
Each sequence keeps its own acceptance rate a (per proposed token that is tried: a row that
accepts m of n proposals tried m + 1 of them, m if it accepted all), its counts fading with
each verification and seeded from the engine-wide rate, so one request that copies its input
is not averaged away by others that do not. A sequence proposing n tokens with rate a adds
a + ... + a^n tokens to the step. An accepted token is worth what a token costs when every
decoding sequence makes one per step, est(D) / D for D decodes: it is one the sequences will
not have to make later. The extra rows cost est_verify(base + rows) - est(base) more. The step
takes, over the cut k (each proposal shortened to at most k) and the sequences ranked by
their worth per row, the choice with the largest worth minus cost, if its worth beats its cost
by 10% (else none). It is priced first on proposals of the most tokens for every sequence, to
skip proposing when even that does not pay, then on the proposals made. Marginal, not
per-step rates: a step that also carries prompt tokens is slow for them, which must not make
its extra rows look cheap.

**Exploring.** Estimates the policy declines to act on would never change: a sequence that has
verified fewer than twice or not for a while, or a verifying bucket measured fewer than three
times or not for a while, is unsure. A step that declines an unsure sequence's proposal may
verify it anyway (and, when every proposal is declined and the cheapest verifying bucket is
unsure, the most promising one), within at most the step's own rows more; such steps take a
credit that comes back at one per 32 steps, so at most about 3% of the steps explore.

est(tokens) is the bucket's measured decode-step time; between and past measured buckets, the
line through the nearest two; with fewer than two measured, the time of steps that also
prefilled, else a cost in proportion to the tokens (as a compute-bound device would pay).
est_verify(tokens) is the bucket's measured verifying-step time, else est(tokens) times the
mean ratio of the two where both are measured (a verifying program computes logits for every
query row, not one per sequence), and no less than a smaller verifying bucket measured. At low
load a step's time is mostly streaming the weights, larger buckets cost little more, and
sequences speculate; when the batch is compute-bound extra rows cost what the tokens they save
would, and k drops to 0.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import statistics

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class NgramProposer:
    k: int  # most tokens proposed
    n_min: int
    n_max: int

    def propose(self, context: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default self.k) tokens that followed the latest earlier occurrence of
        the longest suffix of `context` (of n_min..n_max tokens) found before its end."""
        k = self.k if k is None else k
        size = len(context)
        if k <= 0 or size <= self.n_min:
            return []
        ctx = np.asarray(context, np.int64)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            suffix = ctx[size - n:]
            # windows that start at i < size - n and equal the suffix, latest first
            starts = np.flatnonzero(ctx[:size - n] == suffix[0])
            for i in starts[::-1]:
                if i + n <= size - 1 and np.array_equal(ctx[i:i + n], suffix):
                    follow = ctx[i + n:min(i + n + k, size)]
                    if len(follow):
                        return follow.tolist()
        return []


@dataclasses.dataclass(frozen=True, slots=True)
class DraftModelProposer:
    """Reserves k rows for a draft model's proposals, made on the device in the step."""

    k: int
    PLACEHOLDER = 0  # the step writes the draft's token over it

    def propose(self, context: list[int], k: int | None = None) -> list[int]:
        return [self.PLACEHOLDER] * (self.k if k is None else max(0, k))


Proposer = NgramProposer | DraftModelProposer


@dataclasses.dataclass(slots=True)
class SpecStats:
    """What speculation did: proposed and accepted tokens, and the steps that verified."""

    num_proposed: int = 0
    num_accepted: int = 0
    num_spec_steps: int = 0  # steps with at least one proposal
    num_spec_rows: int = 0  # sequence rows that verified a proposal
    num_cut_by_grammar: int = 0  # proposed tokens a grammar refused before they ran

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying row gained per step: its accepted proposals plus its own one."""
        rows = self.num_spec_rows
        return (self.num_accepted + rows) / rows if rows else 0.0


WINDOW = 8  # recent step times a bucket keeps; their median is its time
MIN_SAMPLES = 3  # a verifying bucket measured fewer times is unsure
STALE_STEPS = 256  # data not refreshed for this many steps is unsure
EXPLORE_EVERY = 32  # steps per exploration credit
PRIOR_WEIGHT = 2.0  # tried proposals the engine-wide rate counts for in a sequence's own
SEQ_DECAY = 0.8  # a sequence's counts fade by this at each of its verifications
GLOBAL_DECAY = 0.98  # the engine-wide counts, at each verifying row


class _Times:
    """A bucket's recent step times, the first (a cold run) dropped once another came."""

    __slots__ = ("samples", "num", "last_step")

    def __init__(self):
        self.samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.num = 0
        self.last_step = 0

    def add(self, seconds: float, step: int) -> float:
        if self.num == 1:
            self.samples.clear()
        self.samples.append(seconds)
        self.num += 1
        self.last_step = step
        return statistics.median(self.samples)


@dataclasses.dataclass(slots=True)
class SeqAcceptance:
    """One sequence's record of its proposals: fading counts of accepted and tried ones."""

    accepted: float = 0.0
    tried: float = 0.0
    num_verified: int = 0
    last_step: int = 0  # the policy's step count at its last verification


class AdaptivePolicy:
    """Chooses which sequences speculate each step and their k, from the token budget, each
    sequence's acceptance rate and the measured time of each token bucket (see the module
    docstring)."""

    def __init__(self, max_k: int, token_buckets: tuple[int, ...], adaptive: bool = True,
                 margin: float = 1.1):
        self.max_k = max_k
        # a choice's tokens must be worth this much more than its extra time: the estimates
        # are noisy, and proposing and verifying cost host work the estimate does not hold
        self.margin = margin
        self.buckets = tuple(sorted(token_buckets))
        self._bucket_arr = np.asarray(self.buckets)
        self.adaptive = adaptive
        # engine-wide rate per tried proposal, what a sequence's own starts from; neutral
        self.acceptance = 0.5
        self._accepted = self._tried = 0.0
        self.step_time: dict[int, float] = {}  # token bucket -> median of decode steps
        self.verify_time: dict[int, float] = {}  # ... of decode steps that verified proposals
        self.mixed_time: dict[int, float] = {}  # ... of steps that also prefilled
        self._times: dict[tuple[str, int], _Times] = {}  # (table, bucket) -> its samples
        self.num_steps = 0
        self.num_explored = 0  # steps that verified proposals the estimates declined
        self._credit = 1.0  # explorations allowed now; one more every EXPLORE_EVERY steps

    def bucket(self, tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def record_step(self, num_tokens: int, seconds: float | None, decode_only: bool = True,
                    verified: bool = False) -> None:
        """A step's time (its program is chosen by its padded token count and whether it
        verifies). Decode steps are what k is chosen for; steps that also prefill only stand
        in for a bucket no decode step has measured. `seconds` None: a step whose time is not
        known (it overlapped the one before) still counts towards staleness and exploring."""
        self.num_steps += 1
        self._credit = min(1.0, self._credit + 1 / EXPLORE_EVERY)
        if seconds is None:
            return
        kind = "mixed" if not decode_only else "verify" if verified else "step"
        b = self.bucket(num_tokens)
        times = self._times.setdefault((kind, b), _Times())
        getattr(self, f"{kind}_time")[b] = times.add(seconds, self.num_steps)

    def record_row(self, seq, proposed: int, accepted: int) -> None:
        """A sequence verified `proposed` tokens and accepted the first `accepted`."""
        if not proposed:
            return
        tried = accepted + (accepted < proposed)  # the rejection that ended the row
        self._accepted = self._accepted * GLOBAL_DECAY + accepted
        self._tried = self._tried * GLOBAL_DECAY + tried
        self.acceptance = (self._accepted + 1.0) / (self._tried + 2.0)
        own = seq.speculation
        if own is None:
            own = seq.speculation = SeqAcceptance()
        own.accepted = own.accepted * SEQ_DECAY + accepted
        own.tried = own.tried * SEQ_DECAY + tried
        own.num_verified += 1
        own.last_step = self.num_steps

    def acceptance_of(self, seq) -> float:
        """`seq`'s rate per tried proposal: its own counts, plus PRIOR_WEIGHT tries at the
        engine-wide rate."""
        own = seq.speculation
        if own is None:
            return self.acceptance
        return ((own.accepted + PRIOR_WEIGHT * self.acceptance)
                / (own.tried + PRIOR_WEIGHT))

    def is_unsure(self, seq) -> bool:
        own = seq.speculation
        return (own is None or own.num_verified < 2
                or self.num_steps - own.last_step > STALE_STEPS)

    def cost_is_unsure(self, tokens: int) -> bool:
        times = self._times.get(("verify", self.bucket(tokens)))
        return (times is None or times.num < MIN_SAMPLES
                or self.num_steps - times.last_step > STALE_STEPS)

    def may_explore(self) -> bool:
        return self.adaptive and self._credit >= 1.0

    def explored(self) -> None:
        self._credit -= 1.0
        self.num_explored += 1

    def estimate(self, tokens: int) -> float:
        """The expected time of a plain step of `tokens` (see the module docstring); 0 when
        nothing is known yet."""
        b = self.bucket(tokens)
        if b in self.step_time:
            return self.step_time[b]
        if len(self.step_time) >= 2:
            xs = sorted(self.step_time)
            # the segment through the nearest two measured buckets, extended past the ends
            i = min(max(bisect.bisect_left(xs, b), 1), len(xs) - 1)
            x0, x1 = xs[i - 1], xs[i]
            y0, y1 = self.step_time[x0], self.step_time[x1]
            return max(0.0, y0 + (y1 - y0) * (b - x0) / (x1 - x0))
        if b in self.mixed_time:
            return self.mixed_time[b]
        below = [x for x in (*self.step_time, *self.mixed_time) if x < b]
        if not below:
            return 0.0
        x = max(below)
        return self.step_time.get(x, self.mixed_time.get(x)) * b / x

    def estimate_verifying(self, tokens: int) -> float:
        """The expected time of a decode step of `tokens` that verifies proposals: measured
        for its bucket, else the plain estimate times the verifying programs' measured
        overhead (their logits and verification), the mean ratio over buckets measured both
        ways (1 until then), and no less than a smaller verifying bucket measured."""
        b = self.bucket(tokens)
        if b in self.verify_time:
            return self.verify_time[b]
        both = [x for x in self.verify_time if x in self.step_time and self.step_time[x] > 0]
        ratio = (sum(self.verify_time[x] / self.step_time[x] for x in both) / len(both)
                 if both else 1.0)
        below = [t for x, t in self.verify_time.items() if x < b]  # a larger one costs no less
        return max([self.estimate(tokens) * max(ratio, 1.0), *below])

    def choose(self, proposals: list[tuple[int, float]], base: int, budget: int,
               num_decodes: int) -> tuple[list[int], int]:
        """Which of `proposals` ((length, acceptance rate) per sequence) to verify in a step
        of `base` tokens without them, `budget` in all, and the cut k: the indices (ascending)
        and k, or ([], 0) when nothing pays by the margin (see the module docstring). Not
        adaptive: every proposal, uncut."""
        top = max((n for n, _ in proposals), default=0)
        if not self.adaptive or top == 0:
            return [i for i, (n, _) in enumerate(proposals) if n], top
        lengths = np.array([n for n, _ in proposals])
        a = np.clip(np.array([r for _, r in proposals], dtype=np.float64), 0.0, 0.99)
        decodes = max(num_decodes, 1)
        worth = self.estimate(decodes) / decodes  # of one token
        t0 = self.estimate(base)
        best_net, best, best_k = 0.0, np.empty(0, np.int64), 0
        for k in range(top, 0, -1):  # on ties (rows free within a bucket) the larger k
            rows = np.minimum(lengths, k)
            gain = (a - a ** (rows + 1)) / (1 - a)  # a + ... + a^rows
            live = np.flatnonzero((rows > 0) & (gain > 0))
            order = live[np.argsort(-gain[live] / rows[live], kind="stable")]
            total_rows = np.cumsum(rows[order])
            total_gain = np.cumsum(gain[order])
            fits = int(np.searchsorted(total_rows, budget - base, side="right"))
            if not fits:
                continue
            # within a bucket more rows cost no more: the longest choice in each bucket
            at = np.searchsorted(self._bucket_arr, base + total_rows[:fits])
            for end in np.flatnonzero(np.diff(at, append=at[-1] + 1)):
                saved = total_gain[end] * worth
                cost = max(0.0, self.estimate_verifying(base + int(total_rows[end])) - t0)
                if saved > self.margin * cost and saved - cost > best_net:
                    best_net, best, best_k = saved - cost, order[:end + 1], k
        return sorted(best.tolist()), best_k

    def choose_k(self, num_seqs: int, other_tokens: int, budget: int,
                 num_decodes: int | None = None) -> int:
        """The cut k for `num_seqs` sequences at the engine-wide rate, each proposing as many
        tokens as the budget leaves room for, in a step whose other rows hold `other_tokens`
        tokens; `num_decodes`: the decoding sequences (default `num_seqs`)."""
        if num_seqs <= 0:
            return 0
        base = other_tokens + num_seqs
        top = max(0, min(self.max_k, (budget - base) // num_seqs))
        _, k = self.choose([(top, self.acceptance)] * num_seqs, base, budget,
                           num_decodes or num_seqs)
        return k


def _last_verified(seq) -> int:
    return -1 if seq.speculation is None else seq.speculation.last_step


class Speculator:
    """The scheduler's side of speculative decoding: which decodes speculate this step, and
    what they propose."""

    def __init__(self, proposer: Proposer, policy: AdaptivePolicy):
        self.proposer = proposer
        self.policy = policy
        self.stats = SpecStats()
        # A grammar can check proposals made on the host (cut at the first token it refuses,
        # then a mask per position); a draft model's are made on the device, unseen.
        self.checks_grammar = isinstance(proposer, NgramProposer)

    def eligible(self, seq) -> bool:
        """Its tokens are all on the host (a proposal continues them) and its logits are not
        processed (penalties, bias and token masks hold for one position at a time), or only
        by a grammar that can check the proposal."""
        return not seq.num_pending and self._allows(seq.params)

    def _allows(self, p) -> bool:
        return not p.processes_logits or (self.checks_grammar and p.grammar_only)

    def may_pay(self, seqs: list, budget: int) -> bool:
        """Whether a step of these decodes might verify proposals: the check `plan` makes
        before proposing, on the sequences' own rates, with no tokens needed (those of a step
        still on the device are not on the host yet). The engine steps synchronously when it
        holds, so that the step's proposals can continue every sequence's last token."""
        seqs = [s for s in seqs if self._allows(s.params)]
        if not seqs:
            return False
        return (not self.policy.adaptive
                or self._outlook(seqs, len(seqs), budget, len(seqs)) is not None)

    def plan(self, seqs: list, other_tokens: int, budget: int, max_model_len: int,
             num_decodes: int | None = None) -> dict[str, list[int]]:
        """request id -> proposed tokens, for the eligible `seqs` that get a proposal."""
        policy = self.policy
        if not seqs:
            return {}
        base = other_tokens + len(seqs)
        decodes = num_decodes or len(seqs)
        if not policy.adaptive:  # every sequence, as many as the budget leaves room for
            top = max(0, min(policy.max_k, (budget - base) // len(seqs)))
            return {seqs[i].request_id: d for i, d in self._propose(seqs, top, max_model_len)}
        outlook = self._outlook(seqs, base, budget, decodes)
        if outlook is None:
            return {}
        top, rates, explore = outlook
        found = self._propose(seqs, top, max_model_len)
        chosen, cut = policy.choose([(len(d), rates[i]) for i, d in found], base, budget,
                                    decodes)
        plans = {found[j][0]: found[j][1][:cut] for j in chosen}
        if explore and len(plans) < len(found):
            self._explore(seqs, found, plans, rates, base, budget)
        return {seqs[i].request_id: d for i, d in plans.items()}

    def _outlook(self, seqs: list, base: int, budget: int,
                 decodes: int) -> tuple[int, list[float], bool] | None:
        """Before proposing, in a step of `base` tokens without proposals: (the most tokens a
        sequence may propose, each sequence's rate, whether the step explores), or None when
        it has no room or not even the most tokens from every sequence would pay."""
        policy = self.policy
        top = max(0, min(policy.max_k, budget - base))
        if top == 0:
            return None
        rates = [policy.acceptance_of(s) for s in seqs]
        explore = policy.may_explore() and (any(map(policy.is_unsure, seqs))
                                            or policy.cost_is_unsure(base + top))
        if not explore and not policy.choose([(top, a) for a in rates], base, budget,
                                             decodes)[0]:
            return None
        return top, rates, explore

    def _propose(self, seqs: list, k: int, max_model_len: int) -> list[tuple[int, list[int]]]:
        """(index in `seqs`, proposal) of each sequence that proposes up to `k` tokens."""
        if k <= 0:
            return []
        found = []
        for i, seq in enumerate(seqs):
            # no more tokens than the request may still produce, nor positions past the end
            room = min(k, seq.params.max_tokens - seq.num_sampled - 1,
                       max_model_len - seq.num_tokens)
            drafts = self.proposer.propose(seq.prompt_token_ids + seq.output_token_ids, room)
            if drafts and seq.logits_state is not None:  # proposals the grammar refuses go
                valid = seq.logits_state.valid_prefix(drafts)
                self.stats.num_cut_by_grammar += len(drafts) - valid
                drafts = drafts[:valid]
            if drafts:
                found.append((i, drafts))
        return found

    def _explore(self, seqs: list, found: list[tuple[int, list[int]]],
                 plans: dict[int, list[int]], rates: list[float], base: int,
                 budget: int) -> None:
        """Add to `plans` declined proposals whose estimates are unsure (see the module
        docstring), least recently verified first, within the step's own rows more."""
        policy = self.policy
        declined = [(i, d) for i, d in found if i not in plans]
        picks = sorted(((i, d) for i, d in declined if policy.is_unsure(seqs[i])),
                       key=lambda p: _last_verified(seqs[p[0]]))
        if not picks and not plans:  # the cheapest verifying step, if its time is unsure
            i, d = max(declined, key=lambda p: rates[p[0]])
            if policy.cost_is_unsure(base + len(d)):
                picks = [(i, d)]
        rows = sum(map(len, plans.values()))
        room = min(budget - base, rows + max(base, policy.max_k))
        added = False
        for i, d in picks:
            d = d[:room - rows]
            if not d:
                break
            plans[i] = d
            rows += len(d)
            added = True
        if added:
            policy.explored()

    def record(self, rows: list[tuple]) -> None:
        """A step's verification: (sequence, tokens it proposed, tokens accepted) per row."""
        if not rows:
            return
        st = self.stats
        st.num_spec_steps += 1
        st.num_spec_rows += len(rows)
        for seq, proposed, accepted in rows:
            st.num_proposed += proposed
            st.num_accepted += accepted
            self.policy.record_row(seq, proposed, accepted)
