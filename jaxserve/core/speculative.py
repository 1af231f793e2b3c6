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
and whether it verifies: the policy keeps a running mean of each token bucket's decode step
time, apart for steps that verify, measured by the engine itself. With B speculating
sequences, k proposed tokens each and a per-token acceptance rate a (a running mean), the step
yields B * (a + ... + a^k) tokens more than without proposals, and costs
est_verify(rows + B * k) - est(rows) more. An accepted token is worth what a token costs when
every decoding sequence makes one per step, est(D) / D for D decodes: it is one the sequences
will not have to make later. Each step takes the k in [1, num_speculative_tokens] (within the
step's token budget) with the largest worth minus cost, if its worth beats its cost by 10%
(else 0). That k assumes every speculating sequence proposes k tokens; the n-gram proposer
finds fewer (a context without a match proposes nothing), so the proposals made are priced
again by the same sums over their own lengths, and cut shorter or dropped where the fewer
tokens no longer pay for the larger program. Marginal, not per-step rates: a step that also
carries prompt tokens is slow for them, which must not make its extra rows look cheap.

est(tokens) is the bucket's measured decode-step time; between and past measured buckets, the
line through the nearest two; with fewer than two measured, the time of steps that also
prefilled, else a cost in proportion to the tokens (as a compute-bound device would pay).
est_verify(tokens) is the bucket's measured verifying-step time, else est(tokens) times the
mean ratio of the two where both are measured (a verifying program computes logits for every
query row, not one per sequence). At low
load a step's time is mostly streaming the weights, larger buckets cost little more, and k goes
up; when the batch is compute-bound extra rows cost what the tokens they save would, and k drops
to 0.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

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


class AdaptivePolicy:
    """Chooses each step's k from the batch size, the token budget, the measured acceptance
    rate and the measured time of each token bucket (see the module docstring)."""

    def __init__(self, max_k: int, token_buckets: tuple[int, ...], adaptive: bool = True,
                 smoothing: float = 0.2, margin: float = 1.1):
        self.max_k = max_k
        # a k > 0's tokens must be worth this much more than its extra time: the estimates are
        # noisy, and proposing and verifying cost host work the estimate does not hold
        self.margin = margin
        self.buckets = tuple(sorted(token_buckets))
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.acceptance = 0.5  # per proposed token, a running mean; a neutral start
        self.step_time: dict[int, float] = {}  # token bucket -> running mean of decode steps
        self.verify_time: dict[int, float] = {}  # ... of decode steps that verified proposals
        self.mixed_time: dict[int, float] = {}  # ... of steps that also prefilled

    def bucket(self, tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def record_step(self, num_tokens: int, seconds: float, decode_only: bool = True,
                    verified: bool = False) -> None:
        """A step's time (its program is chosen by its padded token count and whether it
        verifies). Decode steps are what k is chosen for; steps that also prefill only stand
        in for a bucket no decode step has measured."""
        table = (self.mixed_time if not decode_only
                 else self.verify_time if verified else self.step_time)
        b = self.bucket(num_tokens)
        old = table.get(b)
        table[b] = seconds if old is None else old + self.smoothing * (seconds - old)

    def record_acceptance(self, proposed: int, accepted: int) -> None:
        if proposed:
            w = min(1.0, proposed / 64)  # a step's evidence, weighted by its size
            self.acceptance += w * (accepted / proposed - self.acceptance)

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
        ways (1 until then)."""
        b = self.bucket(tokens)
        if b in self.verify_time:
            return self.verify_time[b]
        both = [x for x in self.verify_time if x in self.step_time and self.step_time[x] > 0]
        ratio = (sum(self.verify_time[x] / self.step_time[x] for x in both) / len(both)
                 if both else 1.0)
        return self.estimate(tokens) * max(ratio, 1.0)

    def choose_k(self, num_seqs: int, other_tokens: int, budget: int,
                 num_decodes: int | None = None) -> int:
        """k for each of `num_seqs` speculating sequences in a step whose other rows hold
        `other_tokens` tokens, with `budget` tokens in all; `num_decodes`: the decoding
        sequences (default `num_seqs`), whose plain step prices a token."""
        if num_seqs <= 0:
            return 0
        room = (budget - other_tokens - num_seqs) // num_seqs
        top = max(0, min(self.max_k, room))
        return self.best_cut({top: num_seqs}, other_tokens + num_seqs, num_decodes or num_seqs)

    def best_cut(self, lengths: dict[int, int], base: int, num_decodes: int) -> int:
        """The most proposed tokens a sequence keeps, for proposals of `lengths` (proposal
        length -> sequences that propose that many) in a step of `base` tokens without them:
        the cut k (each proposal shortened to at most k) with the largest worth minus cost, if
        its worth beats its cost by the margin; else 0 (see the module docstring). Not
        adaptive: no cut."""
        top = max((n for n, count in lengths.items() if count), default=0)
        if not self.adaptive or top == 0:
            return top
        a = min(max(self.acceptance, 0.0), 0.99)
        decodes = max(num_decodes, 1)
        worth = self.estimate(decodes) / decodes  # of one token
        t0 = self.estimate(base)

        gains = {}  # k -> (worth of the extra tokens, extra time)
        for k in range(top, 0, -1):
            cut = [(min(n, k), count) for n, count in lengths.items()]
            # a + ... + a^n for each sequence proposing n
            extra = sum(count * (a - a ** (n + 1)) / (1 - a) for n, count in cut)
            rows = sum(n * count for n, count in cut)
            gains[k] = extra * worth, max(0.0, self.estimate_verifying(base + rows) - t0)
        # on ties (rows free within the bucket) the larger k, which gains more tokens
        best = max(gains, key=lambda k: gains[k][0] - gains[k][1])
        saved, cost = gains[best]
        return best if saved > 0 and saved > self.margin * cost else 0


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
        p = seq.params
        return not seq.num_pending and (not p.processes_logits
                                        or (self.checks_grammar and p.grammar_only))

    def plan(self, seqs: list, other_tokens: int, budget: int, max_model_len: int,
             num_decodes: int | None = None) -> dict[str, list[int]]:
        """request id -> proposed tokens, for the eligible `seqs` that get a proposal."""
        k = self.policy.choose_k(len(seqs), other_tokens, budget, num_decodes)
        if k == 0:
            return {}
        plans = {}
        for seq in seqs:
            # no more tokens than the request may still produce, nor positions past the end
            room = min(k, seq.params.max_tokens - seq.num_sampled - 1,
                       max_model_len - seq.num_tokens)
            drafts = self.proposer.propose(seq.prompt_token_ids + seq.output_token_ids, room)
            if drafts and seq.logits_state is not None:  # proposals the grammar refuses go
                valid = seq.logits_state.valid_prefix(drafts)
                self.stats.num_cut_by_grammar += len(drafts) - valid
                drafts = drafts[:valid]
            if drafts:
                plans[seq.request_id] = drafts
        # k assumed every sequence proposes k tokens; priced again on those it found
        lengths = collections.Counter(len(d) for d in plans.values())
        if lengths == {k: len(seqs)}:  # as assumed: the same price
            return plans
        cut = self.policy.best_cut(lengths, other_tokens + len(seqs), num_decodes or len(seqs))
        return {rid: drafts[:cut] for rid, drafts in plans.items()} if cut else {}

    def record(self, proposed: int, accepted: int, rows: int) -> None:
        """A step's verification: `rows` sequences proposed `proposed` tokens in all."""
        if rows:
            self.stats.num_proposed += proposed
            self.stats.num_accepted += accepted
            self.stats.num_spec_steps += 1
            self.stats.num_spec_rows += rows
            self.policy.record_acceptance(proposed, accepted)
