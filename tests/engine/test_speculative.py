"""Speculative decoding through the engine: the same greedy tokens with it on and off, under
chunked prefill, preemption (both modes), prefix caching and aborts, every block back; and
sampled outputs that keep the distribution of plain sampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.testing.oracle import make_tiny_hf_model
from tests.helpers import buckets_from_8, run_all


def _engine(path, **kw) -> LLMEngine:
    """Two token buckets and one block width: every bucket is a program per proposal count
    (and per pool size and draft) to compile, and the subject here is what speculation gives,
    not the choice of buckets (test_engine and tests/runtime check those)."""
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
                num_kv_blocks=128, log_stats_interval_s=0, token_buckets=(8, 32),
                block_buckets=(8,))
    return LLMEngine(EngineConfig(**(args | kw)))


def _spec_engine(path, method: str, **kw) -> LLMEngine:
    """Speculating at the most tokens every step: the load-adaptive choice of k follows
    measured step times (tests/core covers it with given times), and a test of exactness must
    not depend on how fast the machine happens to be."""
    return _engine(path, speculative_method=method, speculative_adaptive=False, **kw)


def _copying_prompts(seed: int) -> list[list[int]]:
    """Prompts with repeated spans, so that prompt lookup finds something to propose."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 9, 4, 12, 7, 5):
        span = rng.integers(3, 1000, n).tolist()
        out.append(rng.integers(3, 1000, 3).tolist() + span * 3 + span[:2])
    return out


def _greedy(engine: LLMEngine, prompts, max_tokens=40, abort_at: int | None = None):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if step == abort_at:
            engine.abort("r1")
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        engine.block_manager.check_integrity(engine.scheduler.admitted)
    return done


@pytest.mark.parametrize("kw", [
    dict(),  # plenty of blocks; prompts chunked (32-token budget)
    dict(num_kv_blocks=14, preemption_mode="recompute"),
    dict(num_kv_blocks=14, preemption_mode="swap"),
    dict(enable_prefix_caching=False),
    dict(tensor_parallel_size=2),
], ids=["chunked", "recompute", "swap", "no-prefix-cache", "tp2"])
def test_greedy_tokens_are_the_same_with_speculation(tiny_models, kw):
    path, _ = tiny_models["llama"]
    prompts = _copying_prompts(1)
    want = _greedy(_engine(path, **kw), prompts)
    engine = _spec_engine(path, "ngram", **kw)
    got = _greedy(engine, prompts)
    assert got == want
    snap = engine.metrics_snapshot()
    assert snap["spec_proposed_tokens"] > 0 and snap["spec_accepted_tokens"] > 0
    assert 1 < snap["spec_mean_accepted_length"] <= 5
    if "num_kv_blocks" in kw:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_priority_preempts_a_speculating_request_and_keeps_every_output_exact(tiny_models):
    """Under priority scheduling a late urgent request takes a running (speculating) one's
    place: it is served first, the preempted one resumes, and every output is the one
    speculation off gives."""
    path, _ = tiny_models["llama"]
    prompts = _copying_prompts(4)

    def run(**kw):
        engine = (_spec_engine(path, "ngram", **kw) if kw.pop("spec", False)
                  else _engine(path, **kw))
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"low{i}", prompt_token_ids=p, params=params, priority=5)
        first, done, step = {}, {}, 0
        while engine.has_unfinished_requests():
            if step == 6:
                engine.add_request("high", prompt_token_ids=prompts[3], params=params,
                                   priority=0)
            for out in engine.step():
                if out.outputs[0].token_ids:
                    first.setdefault(out.request_id, step)
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
            engine.block_manager.check_integrity(engine.scheduler.admitted)
        return engine, first, done

    # no held prefills: low2's first token would come before high arrives
    kw = dict(max_num_seqs=2, scheduling_policy="priority", async_scheduling=False,
              max_held_seqs=0)
    _, _, want = run(**kw)
    engine, first, got = run(spec=True, **kw)
    assert got == want
    assert first["high"] < first["low2"]  # ahead of a request that waited before it came
    assert engine.scheduler.num_preemptions > 0
    assert engine.metrics_snapshot()["spec_accepted_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_the_load_adaptive_engine_measures_its_steps_and_stays_exact(tiny_models):
    """With the adaptive choice on (the default), whatever k each step takes, the tokens are
    speculation-off's, and the policy has the step times it chose from."""
    path, _ = tiny_models["llama"]
    prompts = _copying_prompts(1)
    want = _greedy(_engine(path), prompts)
    engine = _engine(path, speculative_method="ngram")
    assert engine.speculator.policy.adaptive
    assert _greedy(engine, prompts) == want
    policy = engine.speculator.policy
    assert policy.step_time and all(t > 0 for t in policy.step_time.values())
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kw", [
    dict(),
    dict(num_kv_blocks=14, preemption_mode="recompute"),
    dict(num_kv_blocks=14, preemption_mode="swap"),
], ids=["chunked", "recompute", "swap"])
def test_a_draft_model_gives_the_same_greedy_tokens(tiny_models, tmp_path, kw):
    """The target as its own draft: every proposal is accepted, which holds only if the
    draft's KV pool has followed the target's through chunked prefill, rejected slots,
    preemption and swapping. Then a random draft of the same vocabulary: (almost) nothing is
    accepted, and the tokens are the target's all the same."""
    path, _ = tiny_models["llama"]
    stranger = str(tmp_path / "draft")
    make_tiny_hf_model("llama", stranger, seed=7)
    prompts = _copying_prompts(1)
    want = _greedy(_engine(path, **kw), prompts)
    for draft, accepted in ((path, 1.0), (stranger, 0.2)):
        engine = _spec_engine(path, "draft_model", speculative_model=draft, **kw)
        assert _greedy(engine, prompts) == want
        snap = engine.metrics_snapshot()
        assert snap["spec_proposed_tokens"] > 0
        if draft == path:
            assert snap["spec_acceptance_rate"] == accepted
        else:
            assert snap["spec_acceptance_rate"] < accepted
        if "num_kv_blocks" in kw:
            assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_used_blocks == 0


def test_an_abort_mid_run_leaves_the_others_exact(tiny_models):
    path, _ = tiny_models["qwen2"]
    prompts = _copying_prompts(2)
    want = _greedy(_engine(path), prompts)
    engine = _spec_engine(path, "ngram", num_speculative_tokens=3)
    got = _greedy(engine, prompts, abort_at=12)
    assert "r1" not in got and {k: v for k, v in want.items() if k != "r1"} == got
    assert engine.block_manager.num_used_blocks == 0


def test_fewer_steps_when_the_output_copies_its_input(tiny_models):
    """A model that repeats its prompt's span: proposals are accepted and a step yields
    several tokens (the steps counted against the same run without speculation)."""
    path, _ = tiny_models["llama"]
    # the tiny model's own greedy continuation, fed back as the prompt: it then copies it
    seed_prompt = _copying_prompts(3)[0]
    first = _greedy(_engine(path), [seed_prompt], max_tokens=48)["r0"]
    prompt = seed_prompt + first
    plain, spec = _engine(path), _spec_engine(path, "ngram")
    assert _greedy(plain, [prompt], 40) == _greedy(spec, [prompt], 40)
    assert spec.metrics_snapshot()["num_steps"] < plain.metrics_snapshot()["num_steps"]


def test_sampled_tokens_keep_their_distribution(tmp_path):
    """2,048 seeded samples of a small-vocabulary model's second and third tokens (the first
    speculated ones: the first comes from the prompt's step), with and without speculation:
    a two-sample chi-square test finds no difference, and proposals were both accepted and
    rejected. The prompt ends with the model's own greedy continuation, so that lookup finds
    proposals it sometimes agrees with. The same for a draft model's proposals."""
    path, draft = str(tmp_path / "m"), str(tmp_path / "draft")
    make_tiny_hf_model("llama", path, seed=4, vocab_size=24, initializer_range=0.6)
    # a draft that agrees with the target only sometimes: its proposals (the draft's argmax)
    # are accepted at some positions and rejected at others
    make_tiny_hf_model("llama", draft, seed=9, vocab_size=24, initializer_range=0.6)
    base = list(range(3, 24))
    prompt = base + _greedy(_engine(path), [base], 30)["r0"]
    waves, size = 32, 64

    def samples(**kw):
        engine = _engine(path, max_num_seqs=size, **buckets_from_8(dict(
            max_num_batched_tokens=256)), **kw)
        got = []
        for w in range(waves):  # a wave at a time: no prompt waits for the budget
            for i in range(size):
                engine.add_request(f"s{i}", prompt_token_ids=prompt, params=SamplingParams(
                    temperature=0.8, seed=w * size + i, max_tokens=3, ignore_eos=True))
            done = run_all(engine)
            got += [tuple(done[f"s{i}"].outputs[0].token_ids[1:3]) for i in range(size)]
        return got, engine

    plain, _ = samples()
    for method in (dict(speculative_method="ngram", prompt_lookup_min=1),
                   dict(speculative_method="draft_model", speculative_model=draft)):
        spec, engine = samples(num_speculative_tokens=2, speculative_adaptive=False, **method)
        snap = engine.metrics_snapshot()
        assert 0 < snap["spec_accepted_tokens"] < snap["spec_proposed_tokens"]
        assert snap["spec_verify_rows"] > waves * size // 2
        for pick in (lambda t: t[0], lambda t: t):  # the second token, and the pair
            a, b = [pick(t) for t in plain], [pick(t) for t in spec]
            cells = sorted(set(a) | set(b))
            table = np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]])
            keep = table.sum(0) >= 10  # sparse cells pooled
            table = np.column_stack([table[:, keep], table[:, ~keep].sum(1)])
            table = table[:, table.sum(0) > 0]
            assert stats.chi2_contingency(table).pvalue > 1e-3, (method, table)


def test_speculation_is_checked():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    for kw in (dict(speculative_method="draft_model"),
               dict(speculative_method="ngram", speculative_model="draft")):
        with pytest.raises(ValueError, match="speculative_model"):
            EngineConfig(**kw)


def test_a_draft_model_must_share_the_vocabulary(tiny_models, tmp_path):
    path, _ = tiny_models["llama"]
    draft = str(tmp_path / "draft")
    make_tiny_hf_model("llama", draft, seed=1, vocab_size=100)
    with pytest.raises(ValueError, match="speculative_model: its vocabulary has 100 tokens"):
        _engine(path, speculative_method="draft_model", speculative_model=draft)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        _engine(path, speculative_method="draft_model", speculative_model=path,
                tensor_parallel_size=2)


def test_llm_takes_vllms_speculative_config(tiny_models):
    """LLM(speculative_config={...}), vLLM's spelling: the same engine as the flat fields."""
    from jaxserve import LLM

    path, _ = tiny_models["llama"]
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=128, log_stats_interval_s=0, token_buckets=(8, 32),
              block_buckets=(8,), speculative_adaptive=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    cfg = llm.engine.config
    assert (cfg.speculative_method, cfg.spec_tokens, cfg.speculative_config) == ("ngram", 4, None)
    prompts = _copying_prompts(0)[:2]
    assert _greedy(llm.engine, prompts) == _greedy(_engine(path), prompts)
    with pytest.raises(ValueError, match="unknown key 'draft_tensor_parallel_size'"):
        LLM(path, speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1})
