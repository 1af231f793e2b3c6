"""Sliding-window blocks freed (core/kv_layout.py): a long sequence on a Gemma 3 layout holds
only its window's pages in the local layers' groups, with HF's tokens; and the engine's features
(chunked prefill, preemption, prefix caching, n-gram speculation, several decode steps per
call, held prefills) give the same tokens with the blocks freed as with them kept."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import run_all
from tests.models.test_hf_equivalence import hf_greedy

WINDOW, BLOCK, CHUNK = 256, 16, 512


@pytest.fixture(scope="module")
def gemma3_window_256(tmp_path_factory):
    pytest.importorskip("torch")
    from jaxserve.testing.oracle import make_tiny_hf_model

    path = str(tmp_path_factory.mktemp("gemma3-w256"))
    return path, make_tiny_hf_model("gemma3", path, seed=3, sliding_window=WINDOW,
                                    max_position_embeddings=4096)


def test_a_4000_token_sequence_holds_its_window_in_the_local_groups(gemma3_window_256):
    """3,936 prompt tokens + 64 generated on a window of 256, blocks of 16: each local group
    holds at most window / block + 2 pages at a decode step (and the window plus one chunk's
    pages at a prefill step) while the global group holds every block; greedy tokens equal
    HF's; every page comes back. The same pool kept whole holds a page of every layer for
    every block."""
    path, hf_model = gemma3_window_256
    prompt = np.random.default_rng(0).integers(3, 1000, 3936).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    held = {}
    for free in (True, False):
        engine = LLMEngine(EngineConfig(
            model=path, max_model_len=4096, block_size=BLOCK, max_num_batched_tokens=CHUNK,
            num_kv_blocks=300, kv_cache_dtype="float32", free_window_blocks=free,
            token_buckets=(16, CHUNK), block_buckets=(256,)))
        layout, bm = engine.runner.kv_layout, engine.block_manager
        assert layout.frees == free
        engine.add_request("long", prompt_token_ids=prompt, params=params)
        seq = engine.requests["long"]
        most = {"decode": 0, "prefill": 0}
        layer_pages = 0
        while engine.has_unfinished_requests():
            decoding = seq.is_decoding
            outs = engine.step()
            if seq.block_table:
                pages = [sum(g == k for g, _, _ in bm.held_pages(seq))
                         for k in range(layout.num_groups)]
                layer_pages = max(layer_pages, sum(pages) * layout.rows)
                if free:
                    local = max(pages[g] for g in bm.local_groups)
                    phase = "decode" if decoding else "prefill"
                    most[phase] = max(most[phase], local)
                    assert pages[0] == len(seq.block_table)  # the global group: every block
            for o in outs:
                if o.finished:
                    got = o.outputs[0].token_ids
        assert bm.num_used_blocks == 0
        held[free] = layer_pages
        if free:
            assert layout.windows == (None, WINDOW, WINDOW)
            assert most["decode"] <= WINDOW // BLOCK + 2
            assert most["prefill"] <= (WINDOW + CHUNK) // BLOCK + 2
            assert got == hf_greedy(hf_model, prompt, 64)
    # 250 blocks: 3 layers each kept whole, 1 + 2 x 18 freed (pages of one layer)
    assert held[False] == 3 * 250 and held[True] <= 250 + 2 * ((WINDOW + CHUNK) // BLOCK + 2)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_freed_blocks_give_the_kept_blocks_tokens_under_every_feature(arch, tiny_models):
    """Shared prompt prefixes (cache hits), a pool small enough to preempt, chunked prompts,
    held prefills, n-gram proposals and three decode steps per call: the same greedy tokens
    with the window's blocks freed as kept (Gemma 3: local, global, local layers; Mistral:
    every layer slides), fewer preemptions in the same bytes, and every page back."""
    path, _ = tiny_models[arch]
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 1000, 24).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(3, 1000, int(n)).tolist()
               for i, n in enumerate(rng.integers(8, 40, 10))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results, preemptions = {}, {}
    for free in (False, True):
        engine = LLMEngine(EngineConfig(
            model=path, max_num_seqs=4, max_held_seqs=2, max_num_batched_tokens=48,
            max_model_len=96, block_size=4, num_kv_blocks=26, kv_cache_dtype="float32",
            token_buckets=(16, 48), block_buckets=(24,), free_window_blocks=free,
            speculative_method="ngram", num_speculative_tokens=2, decode_steps=3))
        assert engine.runner.kv_layout.frees == free
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
        bm, done = engine.block_manager, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            bm.check_integrity(engine.scheduler.admitted)
        assert bm.num_used_blocks == 0
        results[free], preemptions[free] = done, engine.scheduler.num_preemptions
        assert bm.stats.hits > 0 and engine.scheduler.num_preemptions > 0, free
    assert results[True] == results[False]
    assert preemptions[True] < preemptions[False]


def test_free_window_blocks_on_is_refused_where_whole_tables_are_needed(tiny_models):
    path, _ = tiny_models["gemma3"]
    with pytest.raises(ValueError, match="free_window_blocks.*swap"):
        LLMEngine(EngineConfig(model=path, max_model_len=64, num_kv_blocks=32,
                               free_window_blocks=True, preemption_mode="swap"))
    kept = LLMEngine(EngineConfig(model=path, max_model_len=64, num_kv_blocks=32,
                                  preemption_mode="swap"))
    assert not kept.runner.kv_layout.frees
    kept.add_request("r", prompt_token_ids=[5, 6, 7, 8] * 5,
                     params=SamplingParams(temperature=0.0, max_tokens=4))
    assert len(run_all(kept)["r"].outputs[0].token_ids) == 4
