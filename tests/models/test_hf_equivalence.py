"""Greedy token ids equal HF transformers `generate` on the same weights (torch, CPU, float32):
the default model here, the tiny random models of each architecture in
test_hf_equivalence_tiny.py."""

from __future__ import annotations

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, check_lora_mix

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "What is 12 times 7?",
    "The quick brown fox",
    "Translate to French: I like apples.",
    "In 1492, Columbus",
]
NEW_TOKENS = 32


_HF_CACHE: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """HF's greedy ids, computed once per (model, prompt, n): several tests ask for the same."""
    key = (id(model), tuple(prompt_ids), n)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_generate(model, prompt_ids, n)
    return _HF_CACHE[key]


def _hf_generate(model, prompt_ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run_staggered(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams,
                  arrivals: list[int]) -> dict[str, list[int]]:
    """Add request i at step arrivals[i]; step until all finish; return token ids by id."""
    done, step = {}, 0
    pending = sorted(range(len(prompt_ids)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompt_token_ids=prompt_ids[i], params=params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling, spec", [(False, None), (True, None),
                                                    (False, "ngram"), (False, "draft_model")])
def test_smollm_matches_hf_greedy(smollm, hf_smollm, async_scheduling, spec, request):
    """... and with speculation: n-gram proposals, or a tiny random draft model's (which are
    almost never accepted: the target's own tokens must come out all the same)."""
    tok = smollm.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    draft = (request.getfixturevalue("tiny_draft_for_smollm") if spec == "draft_model"
             else None)
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=128,
                async_scheduling=async_scheduling, speculative_method=spec,
                speculative_model=draft, speculative_adaptive=False)
    # The plain runs keep the default buckets (from 1); speculation adds its own programs, at
    # two token buckets (a step of 8 rows with their proposals is 40 tokens).
    engine = LLMEngine(EngineConfig(**(args | dict(token_buckets=(16, 64)) if spec else args)),
                       loaded=smollm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Arrivals at different steps, with a 64-token budget so prefills chunk and mix with decodes.
    got = run_staggered(engine, ids, params, arrivals=[0, 0, 1, 2, 2, 5, 9, 14])
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if spec == "ngram":  # the verification ran, and kept some proposals
        assert engine.metrics_snapshot()["spec_accepted_tokens"] > 0
    if spec == "draft_model":  # every step proposed; what was kept is the target's choice
        assert engine.metrics_snapshot()["spec_proposed_tokens"] > 4 * NEW_TOKENS
    for i, prompt_ids in enumerate(ids):
        want = hf_greedy(hf_smollm, prompt_ids, NEW_TOKENS)
        assert got[f"r{i}"] == want, f"prompt {i} ({PROMPTS[i]!r}) differs from HF"


SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and say so when "
          "you do not know. Question: ")


@pytest.mark.slow
@pytest.mark.parametrize("pool, budget, mode", [
    (128, 64, "recompute"),  # room for everything: prefixes stay on the device
    (14, 16, "recompute"),  # preemption, 16-token chunks cutting through cached blocks, host tier
    (14, 16, "swap"),
])
def test_smollm_matches_hf_with_prefix_caching(smollm, hf_smollm, pool, budget, mode):
    """Prompts sharing a system prompt, prefix caching on (the default): every greedy token
    equals HF's, while later prompts take the shared blocks from the cache."""
    ids = [smollm.tokenizer(SYSTEM + p).input_ids for p in PROMPTS]
    args = dict(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                num_kv_blocks=pool, preemption_mode=mode)
    # The roomy pool shares the plain greedy run's programs; the others compile fewer.
    engine = LLMEngine(EngineConfig(**(args if pool == 128 else buckets_from_8(args))),
                       loaded=smollm)
    assert engine.config.enable_prefix_caching
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = run_staggered(engine, ids, params, arrivals=[0, 3, 3, 4, 6, 8, 9, 14])
    stats = engine.block_manager.stats
    assert stats.hits >= 6 * engine.config.block_size, stats  # later prompts share the prefix
    if pool < 128:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
    for i, prompt_ids in enumerate(ids):
        want = hf_greedy(hf_smollm, prompt_ids, NEW_TOKENS)
        assert got[f"r{i}"] == want, f"prompt {i} ({PROMPTS[i]!r}) differs from HF"


@pytest.mark.slow
def test_smollm_lora_adapters_match_hf_peft(smollm, hf_smollm, tmp_path):
    """Three PEFT adapters of different ranks and targets (r 4 on q, v; r 8 on every
    projection with rsLoRA; r 16 and 8 on o, down by rank_pattern and alpha_pattern) and the
    base model, mixed in one batch, over the GGUF's block matmul: tokens equal HF + PEFT's on
    the dequantized weights, logprobs within 2e-2 (the float16 pool, HF's float32)."""
    ids = [smollm.tokenizer(p).input_ids for p in PROMPTS[:2]]
    check_lora_mix(hf_smollm, tmp_path, ids, 8, 2e-2, 0.15, loaded=smollm,
                   max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   num_kv_blocks=64, token_buckets=(8, 64))
