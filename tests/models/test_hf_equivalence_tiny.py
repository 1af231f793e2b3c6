"""Greedy token ids equal HF transformers `generate` on tiny random Llama, Qwen2, Mistral, Qwen3,
Phi-3, Gemma 3, Mixtral and Qwen3-MoE models (torch, CPU, float32), with both layer loops, and
log-probabilities equal HF's (the default model's comparisons are in test_hf_equivalence.py).
Mistral's window (24) and Gemma 3's (16, on two local layers around a global one) are shorter than
most prompts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import check_lora_mix, run_all
from tests.models.test_hf_equivalence import NEW_TOKENS, hf_greedy, run_staggered


# Every loop with the first three architectures; the others once (the loop is independent of
# the architecture: each loop runs the same layer).
@pytest.mark.parametrize("arch, layer_loop", [
    (arch, loop) for arch in ("llama", "qwen2", "mistral") for loop in ("scan", "unroll")]
    + [("qwen3", "scan"), ("phi3", "unroll"), ("gemma3", "scan"), ("gemma3", "unroll"),
       ("mixtral", "scan"), ("qwen3_moe", "unroll")])
def test_tiny_random_models_match_hf(arch, layer_loop, tiny_models):
    """A float32 pool: random weights leave near-ties between logits that a float16 pool's
    rounding (the CPU default, kept by the default model's tests) may flip."""
    path, hf_model = tiny_models[arch]
    rng = np.random.default_rng(7)
    ids = [rng.integers(3, 1000, size=int(n)).tolist() for n in rng.integers(5, 90, size=8)]
    # Two token buckets and one block width: the prompts chunk and mix with decodes all the
    # same, in fewer programs to compile per architecture and layer loop.
    engine = LLMEngine(EngineConfig(
        model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        num_kv_blocks=96, layer_loop=layer_loop, kv_cache_dtype="float32",
        token_buckets=(16, 64), block_buckets=(8,)))
    assert engine.model_config.architecture.lower().startswith(arch.replace("_", ""))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = run_staggered(engine, ids, params, arrivals=[0, 0, 1, 1, 3, 4, 8, 12])
    for i, prompt_ids in enumerate(ids):
        assert got[f"r{i}"] == hf_greedy(hf_model, prompt_ids, NEW_TOKENS), f"prompt {i}"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe"])
def test_tiny_models_logprobs_match_hf_under_chunking_and_preemption(arch, tiny_models):
    """Each generated token's top log-probabilities equal HF's log-softmax of its logits at
    that position (float32 tolerance), in a pool small enough that sequences are preempted
    and a budget that chunks the prompts."""
    import torch

    path, hf_model = tiny_models[arch]
    rng = np.random.default_rng(11)
    ids = [rng.integers(3, 1000, size=int(n)).tolist() for n in rng.integers(20, 60, size=6)]
    engine = LLMEngine(EngineConfig(
        model=path, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128,
        num_kv_blocks=14, block_size=8, kv_cache_dtype="float32", token_buckets=(16, 32),
        block_buckets=(8, 16), max_logprobs=5, enable_step_trace=True))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    done = {rid: out.outputs[0] for rid, out in run_all(engine).items()}
    assert engine.scheduler.num_preemptions > 0
    assert any(rec.num_prefill_tokens and rec.num_decode_tokens for rec in engine.step_trace)
    for i, prompt in enumerate(ids):
        comp = done[f"r{i}"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + comp.token_ids])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]  # (new tokens, vocab)
        assert comp.token_ids == want.argmax(-1).tolist(), f"prompt {i}"
        for j, entry in enumerate(comp.logprobs):
            for token, lp in entry["top"].items():
                assert abs(lp - float(want[j, token])) < 2e-4, (i, j, token)
    assert engine.block_manager.num_used_blocks == 0


def test_tiny_qwen3_lora_adapters_match_hf_peft(tiny_models, tmp_path):
    """Three PEFT adapters of different ranks and targets and the base model, mixed in one
    batch (tests/helpers.py check_lora_mix): tokens equal HF + PEFT's, logprobs within 2e-4
    (a float32 pool, as above)."""
    path, hf_model = tiny_models["qwen3"]
    rng = np.random.default_rng(5)
    ids = [rng.integers(3, 1000, size=int(n)).tolist() for n in (9, 23, 40)]
    check_lora_mix(hf_model, tmp_path, ids, 8, 2e-4, 0.1, model=path, max_num_seqs=12,
                   max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=64,
                   kv_cache_dtype="float32", token_buckets=(16, 64), block_buckets=(8,))
