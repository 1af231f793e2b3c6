"""Several decode steps per call of the step program (EngineConfig.decode_steps) on the real
default model: the tokens, text, logprobs and finish reasons of one decode step per call, with
greedy and seeded sampling, stop strings, EOS, stop ids, max_tokens and penalties,
synchronous and asynchronous, with an abort and a preemption landing inside a call; every KV
block comes back."""

from __future__ import annotations

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.sequence import PENDING
from tests.helpers import buckets_from_8, make_engine, run_all

pytestmark = pytest.mark.slow

K = 8


def _engine(smollm, **kw) -> LLMEngine:
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=64,
                log_stats_interval_s=0, enable_step_trace=True) | kw
    return LLMEngine(EngineConfig(**buckets_from_8(args)), smollm)


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


def _requests(tokenizer) -> list[tuple[str, str, SamplingParams]]:
    """Chat prompts (the greedy ones end at EOS), plain ones, and every stop rule."""
    period = tokenizer(".", add_special_tokens=False).input_ids[0]
    c = lambda text: _chat(tokenizer, text)  # noqa: E731
    return [
        ("eos", c("What is 2+2?"), SamplingParams(temperature=0, max_tokens=40)),
        ("stop_str", c("What is the capital of France?"),
         SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])),
        ("seeded", "The history of", SamplingParams(temperature=0.8, seed=1, max_tokens=23,
                                                    ignore_eos=True)),
        ("penalties", "List the planets:", SamplingParams(
            temperature=0, max_tokens=30, presence_penalty=0.6, frequency_penalty=0.4,
            repetition_penalty=1.3, logprobs=3)),
        ("sampled_rep", c("Tell me a joke."), SamplingParams(
            temperature=1.0, top_p=0.9, seed=7, repetition_penalty=1.2, max_tokens=17)),
        ("stop_id", c("Count to three."), SamplingParams(temperature=0, max_tokens=40,
                                                        stop_token_ids=[period])),
        ("short", "Once upon a time", SamplingParams(temperature=0, max_tokens=5)),
        ("logprobs", "def fib(n):", SamplingParams(temperature=0.7, top_k=20, min_p=0.05,
                                                   seed=3, max_tokens=31, logprobs=2)),
    ]


def _add(engine: LLMEngine, reqs) -> None:
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)


def _summary(done: dict) -> dict:
    out = {}
    for rid, o in done.items():
        c = o.outputs[0]
        assert PENDING not in c.token_ids
        out[rid] = (c.token_ids, c.text, c.finish_reason, c.stop_reason,
                    [round(e["logprob"], 4) for e in c.logprobs] if c.logprobs else None)
    return out


def _all_blocks_back(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


@pytest.fixture(scope="module")
def single_steps(smollm) -> dict:
    """The workload run with one decode step per call, synchronously."""
    engine = _engine(smollm, decode_steps=1, async_scheduling=False)
    _add(engine, _requests(smollm.tokenizer))
    done = _summary(run_all(engine))
    assert {"eos", "stop_str", "stop_id"} <= {r for r, v in done.items() if v[2] == "stop"}
    assert done["stop_str"][1].endswith("is ")  # trimmed before the stop string
    return done


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_several_decode_steps_give_the_tokens_of_single_steps(smollm, single_steps,
                                                               async_scheduling):
    engine = _engine(smollm, decode_steps=K, async_scheduling=async_scheduling)
    _add(engine, _requests(smollm.tokenizer))
    assert _summary(run_all(engine)) == single_steps
    calls = [r for r in engine.step_trace if r.decode_steps > 1]
    assert calls and all(r.decode_steps == K for r in calls)
    # a call streams several tokens per request, up to K
    assert max(r.num_decode_tokens for r in calls) > len(calls[0].requests)
    _all_blocks_back(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_inside_a_call(smollm, single_steps, async_scheduling):
    """Aborted while a call that runs it is in flight (asynchronous), or between two calls."""
    engine = _engine(smollm, decode_steps=K, async_scheduling=async_scheduling)
    _add(engine, _requests(smollm.tokenizer))
    done, aborted = {}, False

    def inside_a_call() -> bool:
        if async_scheduling:
            flight = engine._in_flight
            return flight is not None and flight.sched.decode_steps > 1 and (
                "seeded" in flight.rows)
        return bool(engine.step_trace) and engine.step_trace[-1].decode_steps > 1

    while engine.has_unfinished_requests():
        if not aborted and inside_a_call():
            assert engine.abort("seeded")
            aborted = True
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    got = _summary(done)
    cut = got.pop("seeded")
    assert cut[2] == "abort" and 0 < len(cut[0]) < len(single_steps["seeded"][0])
    assert cut[0] == single_steps["seeded"][0][:len(cut[0])]
    assert got == {r: v for r, v in single_steps.items() if r != "seeded"}
    _all_blocks_back(engine)


def _long_requests() -> list[tuple[str, str, SamplingParams]]:
    """Short prompts, long outputs: all fit in the pool at first, not at their ends."""
    starts = ["The history of", "List the planets:", "Once upon a time", "def fib(n):",
              "My favourite food", "In the year 3000", "Dear diary,", "The rules of chess"]
    return [(f"r{i}", text, SamplingParams(
        temperature=0 if i % 2 else 0.8, seed=i, max_tokens=60 + i, ignore_eos=True,
        stop=["Paris"] if i == 2 else None, presence_penalty=0.5 if i == 3 else 0.0))
        for i, text in enumerate(starts)]


@pytest.fixture(scope="module")
def long_single_steps(smollm) -> dict:
    engine = _engine(smollm, decode_steps=1, async_scheduling=False)
    _add(engine, _long_requests())
    return _summary(run_all(engine))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preemption_inside_a_call(smollm, long_single_steps, mode):
    """A pool too small for the workload: requests are preempted while a call that runs them
    is in flight (asynchronous scheduling), and still give their tokens."""
    engine = _engine(smollm, decode_steps=K, async_scheduling=True, num_kv_blocks=16,
                     preemption_mode=mode)
    schedule, landed = engine.scheduler.schedule, []

    def watched():
        out = schedule()
        flight = engine._in_flight
        if flight is not None and flight.sched.decode_steps > 1:
            landed.extend(s.request_id for s in out.preempted if s.request_id in flight.rows)
        return out

    engine.scheduler.schedule = watched
    _add(engine, _long_requests())
    assert _summary(run_all(engine)) == long_single_steps
    assert landed, "no preemption landed inside a call"
    _all_blocks_back(engine)


def test_a_grammar_runs_one_decode_step_per_call(smollm):
    engine = _engine(smollm, decode_steps=K)
    engine.add_request("json", _chat(smollm.tokenizer, "Give me a number."), SamplingParams(
        temperature=0, max_tokens=12, structured_outputs={"regex": "[0-9]{12}"}))
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    done = run_all(engine)
    assert len(done["json"].outputs[0].token_ids) == 12
    with_grammar = [r for r in engine.step_trace if "json" in r.request_ids]
    assert all(r.decode_steps == 1 for r in with_grammar)
    # once the grammar's request is done, the other one runs ahead
    assert any(r.decode_steps == K for r in engine.step_trace if r not in with_grammar)
    _all_blocks_back(engine)


def test_the_calls_programs_compile_at_warmup(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, decode_steps=4, strict_compile=True)
    engine.warmup()
    programs = engine.runner.all_programs()
    assert engine.runner.num_compiles == len(programs)
    loops = [p for p in programs if p.decode_steps > 1]  # the decode-only buckets' loops
    assert loops and all(p.tokens <= 8 and p.decode_steps == 4 for p in loops)
    for i in range(6):
        engine.add_request(f"r{i}", prompt_token_ids=list(range(3 + i, 20 + 3 * i)),
                           params=SamplingParams(temperature=0.5, seed=i, max_tokens=20 + i))
    run_all(engine)
    assert any(r.decode_steps == 4 for r in engine.step_trace)
    assert engine.runner.num_compiles == len(programs)
    _all_blocks_back(engine)
