"""Tensor parallelism on forced CPU devices: the same greedy tokens as one device, params and
KV pool split by the TP factor, heads replicated or padded when they do not divide."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.kernels import fp8
from jaxserve.models.config import ModelConfig
from jaxserve.runtime import sharding
from jaxserve.runtime.step_inputs import Program
from tests.helpers import buckets_from_8
from tests.models.test_hf_equivalence import PROMPTS, run_staggered

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced) devices")

NEW_TOKENS = 16


def _engine(tp: int, **kw) -> LLMEngine:
    # Token buckets from 8: the comparison is across TP sizes, and the buckets under 8 (tested
    # elsewhere) would add a program per size and layout to compile.
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=64,
                tensor_parallel_size=tp)
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)))


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = run_staggered(engine, prompts, params, arrivals=[0, 0, 1, 2, 3, 5, 6, 9][:len(prompts)])
    assert engine.block_manager.num_used_blocks == 0
    return got


def _device_bytes(engine: LLMEngine) -> tuple[int, int]:
    dev = jax.devices()[0]
    r = engine.runner
    return sharding.bytes_on_device(r.params, dev), sharding.bytes_on_device(r.kv, dev)


# Each architecture once and each layer loop at least once (Gemma 3 scanned: its local and
# global layers pass a traced window into the per-device attention): the loop and the
# architecture are independent of the split (every pairing is checked against HF at tp 1 in
# test_hf_equivalence_tiny).
@pytest.mark.parametrize("arch, layer_loop", [("llama", "scan"), ("qwen2", "unroll"),
                                              ("mistral", "scan"), ("gemma3", "scan")])
def test_tiny_models_give_the_same_tokens_at_tp_1_2_4(arch, layer_loop, tiny_models):
    """4 query / 2 kv heads: tp 2 splits evenly, tp 4 replicates each kv head twice."""
    path, _ = tiny_models[arch]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in rng.integers(5, 70, 6)]
    got, size = {}, {}
    for tp in (1, 2, 4):
        # Two token buckets and one block width (prompts up to 86 tokens with their outputs):
        # each is a program per size and layout.
        engine = _engine(tp, model=path, layer_loop=layer_loop, max_model_len=128,
                         token_buckets=(16, 64), block_buckets=(8,))
        got[tp] = _generate(engine, prompts)
        size[tp] = _device_bytes(engine)
    assert got[2] == got[1] and got[4] == got[1]
    params1, kv1 = size[1]
    assert size[2][1] == kv1 // 2 and size[4][1] == kv1 // 2  # tp 4: kv heads doubled
    assert size[2][0] < params1 * 0.6 and size[4][0] < size[2][0]


@pytest.mark.parametrize("tp", [2, 4])
def test_relayout_of_shapes_is_that_of_the_weights(tp):
    """A deviceless runner's relayout_shapes gives the shapes relayout gives real weights: q
    heads padded (9 / 3 at tp 2 or 4), and FP8 scale blocks along a split axis made fine
    enough to divide (w_down's 384 inputs, 3 blocks of 128, split in 2 or 4)."""
    cfg = ModelConfig("llama", 100, 64, 384, 2, num_heads=9, num_kv_heads=3, head_dim=64)
    rng = np.random.default_rng(tp)
    fp8_of = lambda shape, scale: {"fp8": rng.standard_normal(shape).astype(fp8.CODE_DTYPE),
                                   "scale": rng.random(scale, np.float32)}
    params = {"embed": rng.random((100, 64), np.float32), "layers": {
        "wq": rng.random((2, 64, 9, 64), np.float32),
        "wk": rng.random((2, 64, 3, 64), np.float32), "wv": rng.random((2, 64, 3, 64), np.float32),
        "wo": fp8_of((2, 9, 64, 64), (2, 9, 1, 64)),
        "w_down": fp8_of((2, 384, 64), (2, 3, 64))}}
    layout = sharding.HeadLayout.plan(cfg, tp)
    got_cfg, got = sharding.relayout(cfg, params, layout, tp)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    want_cfg, want = sharding.relayout_shapes(cfg, shapes, layout, tp)
    assert got_cfg == want_cfg and got_cfg.num_heads == 12
    assert got["layers"]["w_down"]["scale"].shape == (2, 3 * (2 if tp == 2 else 4), 64)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want)


def test_head_layouts():
    cfg = ModelConfig("llama", 100, 64, 128, 2, num_heads=9, num_kv_heads=3, head_dim=8)
    assert sharding.HeadLayout.plan(cfg, 3) == sharding.HeadLayout(9, 3, 1, 0)
    assert sharding.HeadLayout.plan(cfg, 2) == sharding.HeadLayout(12, 4, 1, 1)
    assert sharding.HeadLayout.plan(cfg, 4) == sharding.HeadLayout(12, 4, 1, 1)
    gqa = ModelConfig("llama", 100, 64, 128, 2, num_heads=8, num_kv_heads=2, head_dim=8)
    assert sharding.HeadLayout.plan(gqa, 4) == sharding.HeadLayout(8, 4, 2, 0)
    assert sharding.HeadLayout.plan(gqa, 8) == sharding.HeadLayout(8, 8, 4, 0)


@pytest.mark.parametrize("kv_heads,tp", [(3, 2), (3, 4), (2, 4), (2, 8), (3, 3), (3, 1)])
def test_pages_move_between_head_layouts_in_the_models_own_heads(kv_heads, tp):
    """model_heads takes a pool laid out for tp back to the model's kv heads, and laid_out
    rebuilds exactly what relayout's weights would have computed: each head replicated, or
    zero heads appended (the K/V of a zero group)."""
    cfg = ModelConfig("llama", 100, 64, 128, 2, num_heads=4 * kv_heads, num_kv_heads=kv_heads,
                      head_dim=8)
    layout = sharding.HeadLayout.plan(cfg, tp)
    pages = np.random.default_rng(kv_heads * tp).standard_normal((2, 5, 4, kv_heads, 8)).astype(
        np.float32)
    mine = np.asarray(layout.laid_out(pages))
    assert mine.shape[-2] == layout.num_kv_heads and layout.model_kv_heads == kv_heads
    want = np.concatenate([np.repeat(pages, layout.kv_replicas, axis=-2),
                           np.zeros((2, 5, 4, layout.pad_groups, 8), np.float32)], axis=-2)
    np.testing.assert_array_equal(mine, want)
    np.testing.assert_array_equal(np.asarray(layout.model_heads(mine)), pages)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [3, 2])
def test_default_model_same_tokens_at_tp(smollm, tp, caplog):
    """9 query / 3 kv heads: tp 3 splits evenly; tp 2 pads to 4 groups (12 / 4 heads)."""
    import logging

    caplog.set_level(logging.INFO, logger="jaxserve.runtime.runner")
    ids = [smollm.tokenizer(p).input_ids for p in PROMPTS[:4]]
    args = buckets_from_8(dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                               num_kv_blocks=64))
    base = LLMEngine(EngineConfig(**args), loaded=smollm)
    want = _generate(base, ids)
    engine = LLMEngine(EngineConfig(**args, tensor_parallel_size=tp), loaded=smollm)
    assert _generate(engine, ids) == want
    params1, kv1 = _device_bytes(base)
    params_tp, kv_tp = _device_bytes(engine)
    groups = engine.runner.model_config.num_kv_heads
    assert kv_tp == kv1 * groups // 3 // tp  # padded groups cost their share
    assert params_tp < params1 / tp * 1.2
    log = " ".join(r.getMessage() for r in caplog.records)
    assert "tensor parallel: mesh" in log
    assert ("padded" in log) == (tp == 2)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_every_backend_runs_per_device_and_nothing_compiles_after_warmup(backend, tiny_models):
    path, _ = tiny_models["llama"]
    prompts = [[5 + i, 17, 3 * i + 1, 40] * (i + 2) for i in range(4)]
    # one set of buckets for both sizes: each bucket is a program per size to compile
    kw = dict(model=path, attention_backend=backend, max_model_len=128, token_buckets=(16, 64),
              block_buckets=(4, 8))
    want = _generate(_engine(1, **kw), prompts)
    engine = _engine(2, strict_compile=True, **kw)
    engine.warmup()
    compiles = engine.runner.num_compiles
    assert _generate(engine, prompts) == want
    assert engine.runner.num_compiles == compiles
    assert engine.runner.kv.k.sharding.spec == sharding.KV_SPEC


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_copies_keep_the_pool_split(mode, tiny_models):
    """A small pool: preemption (swap copies) and the prefix cache's host tier move blocks
    between the split pool and the host, and the tokens stay those of one device."""
    path, _ = tiny_models["llama"]
    shared = [(11 * j) % 900 + 3 for j in range(40)]
    prompts = [shared + [7 + i] * (i + 1) for i in range(6)]
    # prompts and outputs of up to 62 tokens: one block width at max_model_len 64
    kw = dict(model=path, num_kv_blocks=10, max_num_batched_tokens=32, max_model_len=64,
              token_buckets=(16, 32), preemption_mode=mode)
    want = _generate(_engine(1, **kw), prompts)
    engine = _engine(2, **kw)
    assert _generate(engine, prompts) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.kv.k.sharding.spec == sharding.KV_SPEC


def test_a_step_moves_activations_never_weights(tiny_models):
    """The compiled TP step's collectives, from the layout: two all-reduces of the (T, D)
    activations in the (scanned) layer body plus one after the split embedding lookup, and one
    all-gather of the (S, V) logits (and of the (T, V) ones in the branch that runs only for
    prompt logprobs); no weight is ever gathered."""
    import re

    path, _ = tiny_models["llama"]
    engine = _engine(2, model=path, token_buckets=(16,), block_buckets=(4,), seq_buckets=(8,),
                     max_num_batched_tokens=16)
    cfg, r = engine.runner.model_config, engine.runner
    text = r._lower(Program(16, 8, 4)).compile().as_text()
    ops = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather)(?:-start)?\(", text)
    shapes = sorted((kind, dims) for _, dims, kind in ops)
    d, v = cfg.hidden_size, cfg.vocab_size
    assert shapes == sorted([("all-reduce", f"16,{d}")] * 3 + [("all-gather", f"8,{v}"),
                                                                ("all-gather", f"16,{v}")]), shapes
