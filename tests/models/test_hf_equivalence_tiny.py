"""Greedy token ids equal HF transformers `generate` on tiny random Llama, Qwen2 and Mistral
models (torch, CPU, float32), each with both layer loops (the default model's comparisons are in
test_hf_equivalence.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.models.test_hf_equivalence import NEW_TOKENS, hf_greedy, run_staggered


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
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
    assert engine.model_config.architecture.lower().startswith(arch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = run_staggered(engine, ids, params, arrivals=[0, 0, 1, 1, 3, 4, 8, 12])
    for i, prompt_ids in enumerate(ids):
        assert got[f"r{i}"] == hf_greedy(hf_model, prompt_ids, NEW_TOKENS), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
