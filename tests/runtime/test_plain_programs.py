"""Plain programs (StepInputs.plain: no runtime branches) give the tokens the branching
program gives, and run exactly the steps that qualify."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from tests.helpers import make_engine, run_all

NEW = 10


def _tokens(engine, prompts, params) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=sp)
    done = run_all(engine)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_plain_programs_sample_the_branching_programs_tokens(tiny_models, decode_steps):
    """With decode_steps > 1 the decode loop is plain too (and runs all its steps: no early
    exit), and only steps whose rows all sample plainly run ahead."""
    path, _ = tiny_models["llama"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in (7, 19, 12, 25)]
    plain = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=1, max_tokens=NEW, ignore_eos=True),
             SamplingParams(temperature=1.3, seed=2, max_tokens=NEW + 3, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=NEW - 4, ignore_eos=True)]
    # the same requests, two of them now asking for what only the branching program does
    mixed = plain[:2] + [SamplingParams(temperature=1.3, seed=2, max_tokens=NEW + 3,
                                        ignore_eos=True, top_p=0.9),
                         SamplingParams(temperature=0, max_tokens=NEW - 4, ignore_eos=True,
                                        logprobs=2)]
    with_plain = make_engine(path, plain_programs=True, decode_steps=decode_steps)
    without = make_engine(path, plain_programs=False, decode_steps=1)
    assert _tokens(with_plain, prompts, plain) == _tokens(without, prompts, plain)
    ran = set(with_plain.runner._executables)
    assert any(p.plain for p in ran) and not any(p.plain for p in without.runner._executables)
    assert {p.decode_steps for p in ran} == {1, decode_steps}
    assert all(p.plain for p in ran if p.decode_steps > 1)

    got = _tokens(with_plain, prompts, mixed)
    assert got == _tokens(without, prompts, mixed)
    assert got[:2] == _tokens(without, prompts[:2], plain[:2])  # their rows did not change
    assert all(p.plain for p in with_plain.runner._executables if p.decode_steps > 1)
    for engine in (with_plain, without):
        assert engine.block_manager.num_used_blocks == 0
    assert {p for p in with_plain.runner.all_programs() if p.decode_steps == 1} == (
        {p._replace(plain=True) for p in without.runner.all_programs()}
        | set(without.runner.all_programs()))
