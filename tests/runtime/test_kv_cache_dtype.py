"""kv_cache_dtype: a half-precision KV pool under a float32 model (the CPU kernel and the jnp
backends widen it as they read), its memory sizing, and clear refusals."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.kernels.attention import registry
from jaxserve.kernels.attention.base import AttentionBackend

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
             token_buckets=(4, 32), seq_buckets=(4,), block_buckets=(8,),
             kv_cache_memory_bytes=1 << 20)


def generate(model, **kw):
    e = LLMEngine(EngineConfig(model=model, **SMALL, **kw))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 50))]):
        e.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks  # nothing leaks
    return e, done


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_half_precision_pool_serves_close_to_the_float32_one(tiny_llama_dir, kv, backend):
    """The pool is of kv_cache_dtype, holds twice the blocks in the same bytes, and the
    tokens' logprobs stay within its rounding of the float32 pool's."""
    want_e, want = generate(tiny_llama_dir, attention_backend=backend, kv_cache_dtype="float32")
    got_e, got = generate(tiny_llama_dir, attention_backend=backend, kv_cache_dtype=kv)
    assert got_e.runner.kv.k.dtype == np.dtype(kv) and want_e.runner.kv.k.dtype == np.float32
    assert got_e.block_manager.num_blocks == 2 * want_e.block_manager.num_blocks
    for rid, w in want.items():
        g = got[rid]
        pairs = list(zip(g.token_ids, w.token_ids, strict=True))
        n = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        assert n >= 4, (rid, g.token_ids, w.token_ids)  # a late near-tie may flip
        np.testing.assert_allclose([d["logprob"] for d in g.logprobs[:n]],
                                   [d["logprob"] for d in w.logprobs[:n]],
                                   atol=0.05 if kv == "bfloat16" else 0.01)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    if jax.default_backend() == "cpu":
        why = registry.backend("pallas").unavailable(dtype="float32", kv_dtype="float16")
        assert why is not None and "kv_cache_dtype" in why
        assert registry.backend("xla").unavailable(dtype="float32", kv_dtype="float16") is None


def test_auto_is_float16_under_a_float32_model_on_the_cpu_kernel_only(tiny_llama_dir):
    """The cpu kernel widens a float16 pool as it reads, so auto takes it there (half the bytes
    a decode streams); the other backends keep the model's dtype."""
    from jaxserve.runtime.runner import auto_kv_dtype

    assert auto_kv_dtype("float32", AttentionBackend.CPU) == np.float16
    for backend in (AttentionBackend.XLA, AttentionBackend.PALLAS, AttentionBackend.MOSAIC):
        assert auto_kv_dtype("float32", backend) == np.float32
    assert auto_kv_dtype("bfloat16", AttentionBackend.CPU) == jax.numpy.bfloat16
    e = LLMEngine(EngineConfig(model=tiny_llama_dir, **SMALL))
    want = np.float16 if e.runner.attention_backend is AttentionBackend.CPU else np.float32
    assert e.runner.kv.k.dtype == want
