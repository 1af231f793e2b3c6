"""LoRA adapters in the engine on a tiny Qwen3 with HF + PEFT as the oracle: more adapters than
device slots, under chunked prefill and preemption (recompute and swap); prefix-cache isolation
between adapters and the base model; n-gram speculation; bad adapters refused with nothing
changed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.lora import LoRARequest
from jaxserve.models.llama import LORA
from jaxserve.testing.oracle import LORA_CONFIGS, make_peft_adapter, make_tiny_hf_model
from jaxserve.testing.oracle import peft_greedy as oracle_greedy
from tests.helpers import run_all

N = 8
SMALL = dict(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128, block_size=8,
             kv_cache_dtype="float32", token_buckets=(16, 32), block_buckets=(16,),
             enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=16,
             enable_step_trace=True)  # one set of programs for every engine here


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(directory, HF model, {name: adapter directory}, [LoRARequest]) of a tiny Qwen3."""
    pytest.importorskip("peft")
    d = tmp_path_factory.mktemp("lora-qwen3")
    hf = make_tiny_hf_model("qwen3", str(d / "model"), seed=4)
    adapters = {f"a{i}": make_peft_adapter(hf, str(d / f"a{i}"), seed=i, **conf)
                for i, conf in enumerate(LORA_CONFIGS, 1)}
    requests = [LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)]
    return str(d / "model"), hf, adapters, requests


def peft_greedy(model, runs):
    _, hf, adapters, _ = model
    return [t for t, _ in oracle_greedy(hf, adapters, [(ids, r and r.lora_name)
                                                       for ids, r in runs], N)]


def prompts(seed: int, sizes) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=n).tolist() for n in sizes]


def run(engine, runs, params=None):
    params = params or SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    for i, (ids, lora) in enumerate(runs):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params, lora_request=lora)
    done = run_all(engine)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(runs))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_more_adapters_than_slots_under_preemption(model, mode):
    """Three adapters and the base in two slots, a pool that preempts and a budget that
    chunks: every request finishes with HF + PEFT's tokens, no step runs more adapters than
    slots, slots are reassigned, and no KV block is left in use."""
    path, _, _, loras = model
    runs = [(ids, [None, *loras][i % 4]) for i, ids in enumerate(prompts(1, [30, 12, 45, 20,
                                                                             38, 9, 26, 50]))]
    engine = LLMEngine(EngineConfig(model=path, preemption_mode=mode, **SMALL))
    got = run(engine, runs)
    assert got == peft_greedy(model, runs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.lora_slots.num_loads > 3  # a slot taken over, more than once
    lora_of = {f"r{i}": lora.lora_int_id for i, (_, lora) in enumerate(runs) if lora}
    for rec in engine.step_trace:
        assert len({lora_of[r] for r in rec.request_ids if r in lora_of}) <= 2
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()


def test_prefix_cache_is_keyed_by_adapter(model):
    """One prompt under adapter 1, then 2, then the base, then 1 again: only the last reads
    the cache, and every run has its own adapter's tokens. The base run's steps skip the
    adapters' updates, in a program compiled at warmup like the others."""
    path, _, _, loras = model
    engine = LLMEngine(EngineConfig(model=path, strict_compile=True, **SMALL))
    engine.warmup()
    compiles = engine.runner.num_compiles
    ids = prompts(2, [40])[0]
    stats = engine.block_manager.stats
    runs, hits = [(ids, loras[0]), (ids, loras[1]), (ids, None), (ids, loras[0])], []
    got = []
    for i, r in enumerate(runs):
        before = stats.hits
        engine.add_request(f"r{i}", prompt_token_ids=ids, lora_request=r[1], params=SamplingParams(
            temperature=0.0, max_tokens=N, ignore_eos=True))
        got.append(run_all(engine)[f"r{i}"].outputs[0].token_ids)
        hits.append(stats.hits - before)
    assert hits[:3] == [0, 0, 0] and hits[3] >= 32
    assert got == peft_greedy(model, runs)
    assert got[0] != got[2] and got[1] != got[2]
    assert engine.block_manager.num_used_blocks == 0
    assert [rec.lora for rec in engine.step_trace] == [rec.request_ids != ["r2"]
                                                       for rec in engine.step_trace]
    assert engine.runner.num_compiles == compiles


def test_ngram_speculation_with_adapters(model):
    """Repetitive prompts under adapters with n-gram proposals: the tokens are still HF +
    PEFT's."""
    path, _, _, loras = model
    base = prompts(3, [6, 5, 7])
    runs = [(p * 5, lora) for p, lora in zip(base, [loras[0], loras[1], None], strict=True)]
    engine = LLMEngine(EngineConfig(model=path, speculative_method="ngram",
                                    num_speculative_tokens=3, speculative_adaptive=False,
                                    **SMALL | dict(token_buckets=(32,))))
    assert run(engine, runs) == peft_greedy(model, runs)
    assert engine.metrics_snapshot()["spec_proposed_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_bad_adapters_are_refused_with_nothing_changed(model, tmp_path):
    path, _, adapters, loras = model
    engine = LLMEngine(EngineConfig(model=path, **SMALL))
    params = SamplingParams(max_tokens=2)
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "use_dora": '
                                                  'true, "target_modules": ["q_proj"]}')
    for lora, field in ((LoRARequest("x", 9, str(tmp_path)), "use_dora"),
                        (LoRARequest("x", 9, str(tmp_path / "no")), "lora_path"),
                        (LoRARequest("other", 1, adapters["a2"]), "lora_int_id"),
                        ("a1", "lora_request")):
        if field == "lora_int_id":
            engine.add_lora(loras[0])
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt_token_ids=[5, 6, 7], params=params,
                               lora_request=lora)
        assert not engine.requests and not engine.scheduler.waiting
    assert [r.lora_int_id for r in engine.list_loras()] == [1]
    plain = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, token_buckets=(16, 32)))
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_request("x", prompt_token_ids=[5, 6], params=params, lora_request=loras[0])
    engine.add_request("ok", prompt_token_ids=[5, 6, 7], params=params, lora_request=loras[0])
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora(1)
    run_all(engine)
    assert engine.remove_lora(1) and engine.list_loras() == []


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (forced) devices")
def test_adapters_at_tensor_parallel_2_give_the_tokens_of_one_device(model):
    """At TP 2 each device holds its share of A or B, split as the base weight is: the
    mixed batch's tokens are HF + PEFT's, and each device holds half of B for q."""
    path, _, _, loras = model
    runs = [(ids, [None, *loras][i % 4]) for i, ids in enumerate(prompts(5, [20, 9, 33, 14]))]
    engine = LLMEngine(EngineConfig(model=path, tensor_parallel_size=2, **SMALL))
    assert run(engine, runs) == peft_greedy(model, runs)
    b = engine.runner.params[LORA]["wq"]["b"]
    assert b.addressable_shards[0].data.shape[-1] == b.shape[-1] // 2
    assert engine.block_manager.num_used_blocks == 0
    if len(jax.devices()) >= 4:  # 2 kv heads over 4 devices: each replicated, refused
        with pytest.raises(ValueError, match="divides the kv heads"):
            LLMEngine(EngineConfig(model=path, tensor_parallel_size=4, **SMALL))
