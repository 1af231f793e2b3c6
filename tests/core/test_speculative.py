"""The host side of speculative decoding: n-gram proposals and the load-adaptive choice of k."""

from __future__ import annotations

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import Sequence
from jaxserve.core.speculative import (
    STALE_STEPS,
    AdaptivePolicy,
    NgramProposer,
    Speculator,
)

BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(k=3, n_min=2, n_max=3)
    # "7 8 9" occurs twice before the end; the latest is followed by 4 5 6
    ctx = [1, 7, 8, 9, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert p.propose(ctx) == [4, 5, 6]
    assert p.propose(ctx, k=2) == [4, 5]
    # only a 2-token suffix matches: [3, 8] -> what followed it
    assert p.propose([3, 8, 5, 1, 2, 3, 8]) == [5, 1, 2]
    # the match may run up to the end: what follows is cut there
    assert p.propose([5, 6, 5, 6]) == [5, 6]
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert p.propose([1, 2], k=0) == [] and p.propose([4]) == []


def _policy(cost, acceptance=0.6) -> AdaptivePolicy:
    policy = AdaptivePolicy(4, BUCKETS)
    for t in BUCKETS:
        policy.record_step(t, cost(t))
    policy.acceptance = acceptance
    return policy


def test_policy_speculates_when_steps_cost_the_same_and_stops_when_they_scale():
    # a memory-bound device: every bucket costs about the same
    light = _policy(lambda t: 0.020 + t * 1e-6)
    assert light.choose_k(num_seqs=1, other_tokens=0, budget=512) == 4
    assert light.choose_k(num_seqs=64, other_tokens=0, budget=512) == 4
    # compute-bound: time grows with the tokens, and extra rows cost what they would save
    heavy = _policy(lambda t: 0.002 + t * 2e-3)
    assert heavy.choose_k(num_seqs=64, other_tokens=0, budget=512) == 0
    assert heavy.choose_k(num_seqs=1, other_tokens=0, budget=512) == 4  # within bucket 8
    # the budget bounds k: 64 rows plus 64 * k proposals within 256 tokens
    assert light.choose_k(num_seqs=64, other_tokens=0, budget=256) == 3
    assert light.choose_k(num_seqs=4, other_tokens=510, budget=512) == 0


def test_prompt_tokens_in_the_step_do_not_make_extra_rows_look_cheap():
    """64 decodes and 192 prompt tokens on a compute-bound device: per step, 64 + 4 * 64 rows
    look like more tokens per second (the prompt's time is paid either way), but each extra row
    costs more than the tokens it is expected to save would cost in plain decode steps."""
    heavy = _policy(lambda t: 0.002 + t * 2e-3)
    assert heavy.choose_k(num_seqs=64, other_tokens=192, budget=512, num_decodes=64) == 0
    # the same step on a device where rows are nearly free: speculate
    light = _policy(lambda t: 0.020 + t * 1e-6)
    assert light.choose_k(num_seqs=64, other_tokens=192, budget=512, num_decodes=64) == 4


def test_policy_prices_unmeasured_buckets_by_measured_decode_steps_first():
    policy = AdaptivePolicy(4, BUCKETS)
    policy.acceptance = 0.7
    assert policy.choose_k(64, 0, 512) == 0  # nothing measured: no token has a worth yet
    policy.record_step(64, 0.10)  # 64 decodes alone
    # 64 + 64 * k rows: buckets no step has measured, priced in proportion to their tokens
    assert policy.choose_k(64, 0, 512) == 0
    # a step that prefilled 512 tokens took about what 64 decodes take (a memory-bound
    # device): the bucket is cheap, so speculating pays
    policy.record_step(500, 0.11, decode_only=False)
    assert policy.choose_k(64, 0, 512) == 4
    # two decode buckets measured: the line through them prices the others (prefill steps no
    # longer do), here 0.1 s + 1.25 ms per token past 64: extra rows cost more than they save
    policy.record_step(128, 0.18)
    assert abs(policy.estimate(512) - 0.66) < 1e-9 and abs(policy.estimate(8) - 0.03) < 1e-9
    assert policy.choose_k(64, 0, 512) == 0


def test_verifying_steps_are_priced_by_their_own_measured_time():
    """A verifying program computes more than a plain one of the same bucket (logits for every
    query row): once measured, its time is what a proposal costs, and buckets it has not
    measured are priced at the plain time times the measured ratio."""
    policy = _policy(lambda t: 0.100 + t * 1e-4, acceptance=0.8)  # plain steps: nearly flat
    assert policy.choose_k(num_seqs=64, other_tokens=0, budget=512) == 4
    policy.record_step(128, 0.30, verified=True)  # 2.7x the plain step of bucket 128
    assert abs(policy.estimate_verifying(128) - 0.30) < 1e-9
    ratio = 0.30 / policy.estimate(128)
    assert abs(policy.estimate_verifying(256) - policy.estimate(256) * ratio) < 1e-9
    assert policy.estimate(128) < 0.12  # plain steps keep their own time
    assert policy.choose_k(num_seqs=64, other_tokens=0, budget=512) == 0
    # a verifying step that costs what a plain one does leaves the choice to the plain times
    cheap = _policy(lambda t: 0.100 + t * 1e-4, acceptance=0.8)
    cheap.record_step(128, cheap.estimate(128), verified=True)
    assert cheap.choose_k(num_seqs=64, other_tokens=0, budget=512) == 4


def test_a_fixed_policy_always_takes_the_most():
    policy = AdaptivePolicy(4, BUCKETS, adaptive=False)
    for t in BUCKETS:
        policy.record_step(t, t * 1e-2)
    assert policy.choose_k(64, 0, 512) == 4


def test_proposals_are_priced_again_on_what_the_proposer_found():
    """k is chosen as if every speculating sequence proposed k tokens. Four sequences with 4
    proposals each fill bucket 32 and pay for it; when only one finds a match, its 4 tokens
    still need bucket 8, twice the plain step's time, for a quarter of the gain: dropped."""
    times = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.020, 16: 0.025, 32: 0.030}
    policy = AdaptivePolicy(4, tuple(times))
    for t, sec in times.items():
        policy.record_step(t, sec)
    policy.acceptance = 0.9
    spec = Speculator(NgramProposer(k=4, n_min=2, n_max=2), policy)
    repeats = [5, 6, 1, 2, 3, 4, 5, 6]  # "5 6" recurs: 1 2 3 4 follows
    plain = [[10 + 7 * i, 11 + 7 * i, 12 + 7 * i, 13 + 7 * i] for i in range(4)]

    def seqs(prompts):
        return [Sequence(f"r{i}", p, SamplingParams(max_tokens=64), i, 0)
                for i, p in enumerate(prompts)]

    assert policy.choose_k(4, 0, 512) == 4
    every = spec.plan(seqs([repeats] * 4), 0, 512, 2048)
    assert every == {f"r{i}": [1, 2, 3, 4] for i in range(4)}
    assert policy.choose([(4, 0.9)], 4, 512, 4) == ([], 0)
    policy.explored()  # its exploration credit spent: the estimates alone decide
    assert spec.plan(seqs([repeats, *plain[1:]]), 0, 512, 2048) == {}
    # a fixed policy proposes what it finds
    fixed = Speculator(NgramProposer(k=4, n_min=2, n_max=2),
                       AdaptivePolicy(4, tuple(times), adaptive=False))
    assert fixed.plan(seqs([repeats, *plain[1:]]), 0, 512, 2048) == {"r0": [1, 2, 3, 4]}


def test_a_programs_first_run_counts_only_until_a_second_and_buckets_keep_medians():
    """A cold first run (the program loading) must not stand for the bucket once another
    run measured it; after that, a bucket's time is the median of its recent steps."""
    policy = AdaptivePolicy(4, BUCKETS)
    policy.record_step(5, 0.018, verified=True)
    assert policy.verify_time[8] == 0.018  # all that is known
    policy.record_step(5, 0.010, verified=True)
    assert policy.verify_time[8] == 0.010
    for t in (0.011, 0.050, 0.009):  # one slow outlier moves the median little
        policy.record_step(5, t, verified=True)
    assert abs(policy.verify_time[8] - 0.0105) < 1e-12
    assert 8 not in policy.step_time  # plain steps are a table of their own


def _seq(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=64), 0, 0)


def test_each_sequence_keeps_its_own_acceptance_seeded_from_the_engine_wide_rate():
    policy = AdaptivePolicy(4, BUCKETS)
    copying, other, fresh = _seq("a", [1]), _seq("b", [1]), _seq("c", [1])
    assert policy.acceptance_of(fresh) == 0.5 and policy.is_unsure(fresh)
    for _ in range(6):
        policy.record_row(copying, 4, 4)  # every proposal accepted
        policy.record_row(other, 4, 0)  # the first rejected: one tried
    # tried proposals: the copying one tried 4 and accepted 4 each time, the other tried 1
    assert policy.acceptance_of(copying) > 0.9 > 0.3 > policy.acceptance_of(other)
    assert not policy.is_unsure(copying)
    # a new sequence starts from the engine-wide rate, between the two
    assert 0.5 < policy.acceptance_of(fresh) == policy.acceptance < 0.85
    # one copying sequence among three that do not: it alone is chosen
    policy.step_time = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.012, 16: 0.020}
    policy.verify_time = {8: 0.013, 16: 0.030}
    rates = [policy.acceptance_of(s) for s in (copying, other, other, other)]
    assert policy.choose([(4, a) for a in rates], 4, 64, 4) == ([0], 4)
    for _ in range(STALE_STEPS + 1):  # not verified for a while: unsure again, to explore
        policy.record_step(4, 0.010)
    assert policy.is_unsure(copying)


def test_exploration_is_bounded_and_refreshes_what_the_policy_declines():
    """Verifying costs more than any proposal gains: the policy declines, but an unsure
    sequence is verified on at most one step in 32 (plus the first)."""
    policy = AdaptivePolicy(4, BUCKETS)
    spec = Speculator(NgramProposer(k=4, n_min=2, n_max=2), policy)
    seq = _seq("r0", [5, 6, 1, 2, 3, 4, 5, 6])
    explored = 0
    for _ in range(320):
        plans = spec.plan([seq], 0, 64, 2048)
        policy.record_step(1 + sum(map(len, plans.values())), 0.1 if plans else 0.01,
                           verified=bool(plans))
        if plans:
            explored += 1
            spec.record([(seq, 4, 0)])  # every proposal wrong
    assert explored == policy.num_explored and 2 <= explored <= 1 + 320 // 32
    assert policy.verify_time[8] == 0.1 and not policy.is_unsure(seq)
