"""auto's self-test on the device (kernels/attention/selftest.py), run here on a CPU by naming
the CPU's candidates: broken candidates are passed over with their reason, the result is cached,
and a step program that fails to compile for its kernel's sake falls back once."""

from __future__ import annotations

import functools
import json
import os

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.kernels import cpu_library
from jaxserve.kernels.attention import selftest
from jaxserve.kernels.attention.base import AttentionBackend
from jaxserve.kernels.attention.choose import choose_attention
from jaxserve.kernels.attention.pallas import ragged_paged_attention
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from tests.helpers import run_all

SHAPES = dict(dtype="float32", head_dim=16, groups=2, block_size=16)  # the tiny Llama's

# A real kernel forced to fail its lowering: Pallas' Triton lowering, without its interpreter,
# on a CPU.
FAILS_TO_LOWER = selftest.Candidate(
    "pallas-compiled", functools.partial(ragged_paged_attention, interpret=False))


def _off_by_one(q, k, v, layer, md, **kw):
    return ragged_paged_attention_reference(q, k, v, layer, md, **kw) + 1


WRONG_VALUES = selftest.Candidate("off-by-one", _off_by_one)


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """A fresh cache for the self-test's results; the C++ kernels load from the usual one
    first (once per process), not built again in it."""
    cpu_library.library()
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                num_kv_blocks=32, token_buckets=(16, 64), block_buckets=(8,),
                compilation_cache_dir="")
    return LLMEngine(EngineConfig(**(args | kw)))


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    for i, plen in enumerate([3, 20, 45, 9]):
        engine.add_request(f"r{i}", prompt_token_ids=[5 + (j * 7 + i) % 400 for j in range(plen)],
                           params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    done = run_all(engine)
    assert all(out.outputs[0].finish_reason == "length" for out in done.values())
    return {k: v.outputs[0].token_ids for k, v in done.items()}


def test_broken_candidates_are_passed_over_and_requests_succeed(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(selftest.CANDIDATES, "cpu",
                        (FAILS_TO_LOWER, WRONG_VALUES, AttentionBackend.XLA))
    with pytest.warns(UserWarning) as caught:
        engine = _engine(tiny_llama_dir)
    said = [str(w.message) for w in caught]
    assert any("'pallas-compiled'" in m and "lowering failed" in m and "interpret" in m
               for m in said), said
    assert any("'off-by-one'" in m and "differs from the reference" in m for m in said), said
    assert engine.runner.attention_backend == "xla"
    result = engine.runner.attention.selftest
    assert [t.name for t in result.trials] == ["pallas-compiled", "off-by-one", "xla"]
    assert [t.passed for t in result.trials] == [False, False, True]
    assert result.trials[1].max_error == pytest.approx(1.0, abs=1e-5)
    assert result.trials[2].decode_s > 0 and result.trials[2].mixed_s > 0
    got = _generate(engine)
    assert got == _generate(_engine(tiny_llama_dir, attention_backend="xla"))


def test_the_fastest_that_passes_is_chosen():
    """The GPU's candidates, tried here: mosaic and triton cannot run on a CPU and say why;
    pallas (interpreted) and xla both pass, and the faster is chosen."""
    with pytest.warns(UserWarning) as caught:
        result = selftest.run(selftest.CANDIDATES["gpu"], **SHAPES, reuse=False)
    said = [str(w.message) for w in caught]
    assert any("'mosaic'" in m and "Hopper" in m for m in said), said
    assert any("'triton'" in m and "unavailable" in m for m in said), said
    times = {t.name: t.seconds for t in result.trials if t.passed}
    assert set(times) == {"pallas", "xla"}
    assert result.chosen == min(times, key=times.get)
    assert result.ranking == tuple(sorted(times, key=times.get))


def test_a_second_selection_reads_the_cache(cache_home, monkeypatch):
    traced = []

    def counted(q, k, v, layer, md, **kw):  # counts its traces: each self-test traces it
        traced.append(q.shape)
        return ragged_paged_attention_reference(q, k, v, layer, md, **kw)

    monkeypatch.setitem(selftest.CANDIDATES, "cpu",
                        (WRONG_VALUES, selftest.Candidate("counted", counted)))
    with pytest.warns(UserWarning, match="'off-by-one'"):
        first = choose_attention("auto", **SHAPES)
    assert first.backend == "counted" and first.fn is counted and not first.selftest.cached
    assert first.fallback is AttentionBackend.XLA
    runs = len(traced)
    assert runs > 0
    files = os.listdir(cache_home / "autotune")
    assert len(files) == 1
    second = choose_attention("auto", **SHAPES)
    assert len(traced) == runs  # nothing was compiled or run again
    assert second.selftest.cached and second.backend == "counted"
    assert second.selftest.trials == first.selftest.trials
    # another dtype is another entry; caching off runs the test every time
    with pytest.warns(UserWarning, match="'off-by-one'"):
        choose_attention("auto", **(SHAPES | {"dtype": "bfloat16"}))
    assert len(os.listdir(cache_home / "autotune")) == 2
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", "")
    with pytest.warns(UserWarning, match="'off-by-one'"):
        assert not choose_attention("auto", **SHAPES).selftest.cached
    entry = json.loads((cache_home / "autotune" / files[0]).read_text())
    assert entry["key"]["candidates"] == ["off-by-one", "counted"]
    assert entry["result"]["chosen"] == "counted"


def _small_steps_only(q, k, v, layer, md, **kw):
    """Passes the self-test (at most 80 query rows) but not in a 128-row step program, where
    it fails to lower as FAILS_TO_LOWER does."""
    if q.shape[0] >= 128:
        return FAILS_TO_LOWER.fn(q, k, v, layer, md, **kw)
    return ragged_paged_attention_reference(q, k, v, layer, md, **kw)


@pytest.mark.parametrize("warmup", [False, True])
def test_a_step_program_that_fails_to_compile_falls_back_once(tiny_llama_dir, monkeypatch,
                                                              warmup):
    monkeypatch.setitem(selftest.CANDIDATES, "cpu",
                        (selftest.Candidate("small-steps-only", _small_steps_only),))
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=128, token_buckets=(16, 128),
                     strict_compile=warmup)
    assert engine.runner.attention_backend == "small-steps-only"
    assert engine.runner.attention.fallback is AttentionBackend.XLA
    with pytest.warns(UserWarning, match="step program .*128.* failed to build with "
                                         "small-steps-only.*falling back to 'xla'"):
        if warmup:
            engine.warmup()
        got = _generate(engine)
    assert engine.runner.attention_backend == "xla"
    assert got == _generate(_engine(tiny_llama_dir, max_num_batched_tokens=128,
                                    token_buckets=(16, 128), attention_backend="xla"))
