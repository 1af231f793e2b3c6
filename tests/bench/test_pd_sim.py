"""The colocated/disaggregated step-cost simulation: one request's timings follow the cost
model exactly; prompts arriving during a decode slow a colocated engine's decode steps and not
a decode engine's; the fit recovers the cost it was measured from."""

from __future__ import annotations

import pytest

from jaxserve.bench.pd_sim import StepCost, fit, simulate

COST = StepCost(fixed_s=0.01, per_prompt_token_s=0.001, per_decode_seq_s=0.002)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_one_request_alone_follows_the_cost_model(disaggregated):
    (m,) = simulate([(1.0, 1000, 5)], COST, disaggregated, budget=512, handover_s=0.5)
    # two chunks of the prompt (512 + 488 tokens), then 4 decode steps of one sequence
    assert m.ttft == pytest.approx(2 * 0.01 + 1000 * 0.001)
    assert m.tpot == pytest.approx((0.5 if disaggregated else 0) / 4 + 0.012)
    assert len(m.token_times) == 5


def test_prompts_slow_colocated_decodes_but_not_a_decode_engine():
    reqs = [(0.0, 100, 50)] + [(0.2 + 0.05 * i, 2000, 2) for i in range(8)]
    tpot = {d: next(m.tpot for m in simulate(reqs, COST, d, engines=2) if m.request_id == "0")
            for d in (False, True)}
    assert tpot[True] == pytest.approx(0.012)  # decode steps of one sequence, every one
    assert tpot[False] > 2 * tpot[True]


def test_fit_recovers_the_cost():
    steps = [(p, d, COST(p, d)) for p in (0, 16, 256, 512) for d in (0, 1, 8, 16)]
    got = fit(steps)
    assert got.fixed_s == pytest.approx(0.01)
    assert got.per_prompt_token_s == pytest.approx(0.001)
    assert got.per_decode_seq_s == pytest.approx(0.002)
