"""The host side of speculative decoding: n-gram proposals and the load-adaptive choice of k."""

from __future__ import annotations

from jaxserve.core.speculative import AdaptivePolicy, NgramProposer

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


def test_policy_speculates_when_steps_cost_the_same_and_stops_when_they_scale():
    light = AdaptivePolicy(4, BUCKETS)
    for t in BUCKETS:  # a memory-bound device: every bucket costs about the same
        light.record_step(t, 0.020 + t * 1e-6)
    light.acceptance = 0.6
    assert light.choose_k(num_seqs=1, other_tokens=0, budget=512) == 4
    heavy = AdaptivePolicy(4, BUCKETS)
    for t in BUCKETS:  # compute-bound: time grows with the tokens
        heavy.record_step(t, 0.002 + t * 2e-3)
    heavy.acceptance = 0.6
    assert heavy.choose_k(num_seqs=64, other_tokens=0, budget=512) == 0
    # the budget bounds k: 64 rows plus 64 * k proposals within 256 tokens
    assert light.choose_k(num_seqs=64, other_tokens=0, budget=256) == 3
    assert light.choose_k(num_seqs=4, other_tokens=510, budget=512) == 0


def test_policy_prices_an_unmeasured_bucket_from_prefill_steps_or_by_its_tokens():
    policy = AdaptivePolicy(4, BUCKETS)
    policy.acceptance = 0.7
    assert policy.choose_k(64, 0, 512) == 4  # nothing known: every step costs the same
    policy.record_step(64, 0.10)  # 64 decodes alone
    # 64 + 64 * k rows: buckets no step has measured, priced in proportion to their tokens
    assert policy.choose_k(64, 0, 512) == 0
    # a step that prefilled 512 tokens took about what 64 decodes take (a memory-bound
    # device): the bucket is cheap, so speculating pays
    policy.record_step(500, 0.11, decode_only=False)
    assert policy.choose_k(64, 0, 512) == 4
    # verifying steps measured at that bucket cost far more: back to no speculation
    policy.record_step(320, 0.50)
    assert policy.choose_k(64, 0, 512) == 0


def test_a_fixed_policy_always_takes_the_most():
    policy = AdaptivePolicy(4, BUCKETS, adaptive=False)
    for t in BUCKETS:
        policy.record_step(t, t * 1e-2)
    assert policy.choose_k(64, 0, 512) == 4
