"""Engine behaviour on a tiny model: step trace, budgets, invariance, compiles, blocks, errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, SamplingParams
from jaxserve.runtime.runner import RecompileError
from tests.helpers import buckets_from_8, make_engine, run_all


def test_random_workload_respects_limits_and_never_recompiles(tiny_llama_dir):
    # The default buckets, from 1: tokens 1, 2, 4, 6 (max_num_seqs), 8 and 16, sequences 1, 2,
    # 4, 6, 8 and 12 (6 decode slots and 6 held prefills), blocks 8 (the cpu kernel's one
    # table width; 4 and 8 for a backend whose cost grows with it). Each is a program
    # compiled at warmup, so the limits are small.
    engine = make_engine(tiny_llama_dir, max_num_seqs=6, max_num_batched_tokens=16,
                         max_model_len=128, num_kv_blocks=40, strict_compile=True,
                         token_buckets=None)
    widths = (8,) if engine.runner.attention_backend == "cpu" else (4, 8)
    assert engine.runner.buckets == ((1, 2, 4, 6, 8, 16), (1, 2, 4, 6, 8, 12), widths)
    engine.warmup()
    compiled = engine.runner.num_compiles
    assert compiled == len(engine.runner.all_programs())
    rng = np.random.default_rng(3)
    arrivals = np.sort(rng.integers(0, 60, size=50))
    pending = list(range(50))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            plen = int(rng.integers(1, 88))  # prompt + output < max_model_len
            params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])),
                                    max_tokens=int(rng.integers(1, 40)), seed=i, ignore_eos=True)
            engine.add_request(f"r{i}", prompt_token_ids=rng.integers(3, 500, plen).tolist(),
                               params=params)
        engine.step()
        engine.block_manager.check_integrity()
        assert len(engine.scheduler.running) <= 6
        step += 1
    assert engine.runner.num_compiles == compiled
    for rec in engine.step_trace:
        assert rec.num_prefill_tokens + rec.num_decode_tokens <= 16
        assert len(rec.requests) <= 12
    assert max(len(rec.requests) for rec in engine.step_trace) > 6  # held prefills ran
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_strict_compile_raises_for_unwarmed_bucket(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, strict_compile=True, token_buckets=(16, 64),
                         seq_buckets=(8,), block_buckets=(16,))
    engine.runner.is_warm = True  # pretend warmup ran but compiled nothing
    engine.add_request("x", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    with pytest.raises(RecompileError):
        engine.step()


def _tokens_alone_and_mixed(path, params_for, target_prompt):
    alone = make_engine(path)
    alone.add_request("t", prompt_token_ids=target_prompt, params=params_for("t"))
    want = run_all(alone)["t"].outputs[0].token_ids

    mixed = make_engine(path, max_num_batched_tokens=32)
    rng = np.random.default_rng(11)
    step = 0
    added = False
    while not added or mixed.has_unfinished_requests():
        if step in (0, 1, 3, 4, 6):
            n = int(rng.integers(2, 70))
            mixed.add_request(f"x{step}", prompt_token_ids=rng.integers(3, 500, n).tolist(),
                              params=params_for(f"x{step}"))
        if step == 2:
            mixed.add_request("t", prompt_token_ids=target_prompt, params=params_for("t"))
            added = True
        for out in mixed.step():
            if out.request_id == "t" and out.finished:
                got = out.outputs[0].token_ids
        step += 1
    return want, got


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_batch_invariance(tiny_llama_dir, sampling):
    def params_for(rid):
        n = 24 if rid == "t" else 5 + hash(rid) % 30
        if sampling == "greedy":
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234 if rid == "t"
                              else abs(hash(rid)) % 1000, max_tokens=n, ignore_eos=True)

    prompt = list(range(40, 77))
    want, got = _tokens_alone_and_mixed(tiny_llama_dir, params_for, prompt)
    assert len(want) == 24
    assert got == want


def test_seed_changes_samples(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    for s in (1, 2):
        engine.add_request(f"s{s}", prompt_token_ids=[5, 6, 7],
                           params=SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                                 ignore_eos=True))
    done = run_all(engine)
    assert done["s1"].outputs[0].token_ids != done["s2"].outputs[0].token_ids


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "mid_decode", "finished"])
def test_every_block_returns(tiny_llama_dir, state):
    engine = make_engine(tiny_llama_dir, max_num_seqs=2, max_num_batched_tokens=32)
    bm = engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=list(range(3, 103)), params=params)  # 100 tokens
    engine.add_request("b", prompt_token_ids=[5, 6], params=params)
    engine.add_request("c", prompt_token_ids=[5, 6, 7], params=params)  # waits: max_num_seqs=2
    engine.step()
    seqs = engine.requests
    target = {"waiting": "c", "mid_prefill": "a", "finished": None}.get(state)
    if state == "mid_decode":
        for _ in range(5):
            engine.step()
        target = "b"
        assert seqs["b"].is_decoding
    if state == "mid_prefill":
        assert 0 < seqs["a"].num_computed_tokens < 100
    if state == "waiting":
        assert seqs["c"].num_computed_tokens == 0 and not seqs["c"].block_table
    if target:
        assert engine.abort(target)
        bm.check_integrity()
    done = run_all(engine)
    if target:
        assert done[target].outputs[0].finish_reason == "abort"
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(prompt_token_ids=list(range(3, 300))), "max_model_len"),
    (dict(prompt_token_ids=[5, 999999]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5, -1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5], params=SamplingParams(temperature=-0.5)), "temperature"),
    (dict(prompt_token_ids=[5], params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(prompt_token_ids=[5], params=SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[5], params=SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt_token_ids=[5], params=SamplingParams(top_k=-3)), "top_k"),
    (dict(prompt_token_ids=[5], params=SamplingParams(max_tokens=300)), "max_tokens"),
    (dict(prompt="hello"), "tokenizer"),
])
def test_bad_input_names_field_and_others_keep_running(tiny_llama_dir, kwargs, field):
    engine = make_engine(tiny_llama_dir)
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("good", prompt_token_ids=[5, 6, 7], params=good)
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", **kwargs)
    assert "bad" not in engine.requests
    done = run_all(engine)
    assert len(done["good"].outputs[0].token_ids) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_duplicate_request_id_is_refused(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("same", prompt_token_ids=[5, 6], params=p)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("same", prompt_token_ids=[7, 8], params=p)
    done = run_all(engine)
    assert done["same"].prompt_token_ids == [5, 6]


def test_final_only_requests_get_one_output_and_the_same_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = [5, 17, 3, 40, 9]
    for kind in ("cumulative", "final_only"):
        for n in (1, 3):
            p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=n,
                               output_kind=kind)
            engine.add_request(f"{kind}-{n}", prompt_token_ids=prompt, params=p)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for n in (1, 3):
        assert len(seen[f"cumulative-{n}"]) >= 6  # an output per step of tokens
        (only,) = seen[f"final_only-{n}"]
        assert only.finished and len(only.outputs) == n
        want = seen[f"cumulative-{n}"][-1]
        assert ([c.token_ids for c in only.outputs] == [c.token_ids for c in want.outputs]
                and [c.text for c in only.outputs] == [c.text for c in want.outputs])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_ids_and_eos(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("free", prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    free = run_all(engine)["free"].outputs[0].token_ids
    stop_tok = free[4]
    first = free.index(stop_tok)
    engine.add_request("stopped", prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(temperature=0, max_tokens=12,
                                             stop_token_ids=[stop_tok]))
    out = run_all(engine)["stopped"].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # The same token as EOS stops too, unless ignore_eos.
    engine.postprocessor.eos_token_ids = frozenset({stop_tok})
    engine.add_request("eos", prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(temperature=0, max_tokens=12))
    out = run_all(engine)["eos"].outputs[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None


def test_logprobs_are_consistent(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("lp", prompt_token_ids=[5, 6, 7],
                       params=SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                             ignore_eos=True))
    out = run_all(engine)["lp"].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        top = lp["top"]
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one, with the top logprob.
        assert max(top, key=top.get) == tok
        assert lp["logprob"] == pytest.approx(top[tok])
        assert lp["logprob"] <= 0


def test_llm_generate_is_all_or_nothing_on_bad_input(tiny_llama_dir):
    from jaxserve import LLM

    # make_engine's configuration: its programs, compiled by the tests above, serve this one
    llm = LLM(tiny_llama_dir, **buckets_from_8(dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=128)))
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt 1: .*temperature"):
        llm.generate([[5, 6], [7, 8]], [good, SamplingParams(temperature=-1)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == 128
    outs = llm.generate([[5, 6], [7, 8]], good, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_kv_pool_sizing(tiny_llama_dir):
    from jaxserve.runtime.kv_cache import bytes_per_block

    e = make_engine(tiny_llama_dir, num_kv_blocks=None, kv_cache_memory_bytes=1 << 20)
    per_block = bytes_per_block(e.model_config, 16, e.runner.kv_dtype)
    assert e.runner.num_blocks == (1 << 20) // per_block == e.block_manager.num_blocks
    assert e.runner.kv.k.shape[1] == e.runner.num_blocks
    # A memory fraction needs device memory statistics; a CPU has none, so the byte budget holds.
    f = make_engine(tiny_llama_dir, num_kv_blocks=None, kv_cache_memory_bytes=1 << 20,
                    kv_cache_memory_fraction=0.5)
    assert f.runner.num_blocks == e.runner.num_blocks
    plan = f.runner.memory_plan  # what the server prints at start
    assert plan.num_blocks == f.runner.num_blocks and plan.device_bytes is None
    assert plan.max_seqs_at_max_model_len == plan.num_blocks // -(-f.config.max_model_len // 16)
    assert plan.weights_bytes == sum(a.nbytes for a in jax.tree.leaves(f.runner.params))
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_prefills_give_the_unheld_tokens_with_first_tokens_sooner(tiny_llama_dir,
                                                                       async_scheduling):
    """With 3 decode slots, 3 held prefills and 10 requests at once, 6 first tokens come in
    the first steps; the tokens are those of the unheld engine, a request aborted while
    held returns its blocks, and every block comes back."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(5, 40, 10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(held, abort=False):
        engine = make_engine(tiny_llama_dir, max_num_seqs=3, max_held_seqs=held,
                             async_scheduling=async_scheduling)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
        first, done, most_held, step, aborted = {}, {}, 0, 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids:
                    first.setdefault(out.request_id, step)
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            most_held = max(most_held, engine.metrics_snapshot()["num_held"])
            engine.block_manager.check_integrity(engine.scheduler.admitted)
            if abort and aborted is None and engine.scheduler.held:
                aborted = engine.scheduler.held[-1].request_id
                assert engine.abort(aborted)
            step += 1
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return done, first, most_held, aborted

    want, unheld_first, none_held, _ = run(0)
    got, first, most_held, _ = run(3)
    assert none_held == 0 and most_held == 3
    assert got == want
    # 3 in the decode slots and 3 held get their first token in the first steps, not 3 alone
    soon = sorted(first.values())[5]
    assert soon <= 5 and sum(v <= soon for v in unheld_first.values()) == 3
    got, _, _, aborted = run(3, abort=True)
    assert aborted is not None and got[aborted] == want[aborted][:len(got[aborted])]
    assert {r: t for r, t in got.items() if r != aborted} == {
        r: t for r, t in want.items() if r != aborted}


def test_settle_heap_takes_what_lives_out_of_the_collectors_walk():
    """Objects alive at start-up leave the collector's generations (a full pass no longer
    walks them); the collector then runs less often, and what serving makes later is still
    collected on its own, cycles included."""
    import gc
    import weakref

    from jaxserve.engine.llm_engine import GC_THRESHOLDS, settle_heap

    class Node:
        pass

    thresholds = gc.get_threshold()
    try:
        kept = Node()
        kept.self = kept  # a cycle alive at start-up
        frozen = settle_heap()
        # (a frozen object another thread drops leaves the count, so it may only shrink)
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is kept for o in gc.get_objects())  # out of every generation
        assert gc.get_threshold() == GC_THRESHOLDS != thresholds
        later = Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        made = [[] for _ in range(2 * GC_THRESHOLDS[0])]  # past a young pass's threshold
        assert ref() is None and len(made) == 2 * GC_THRESHOLDS[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
