"""The decoder's parameter layouts compute the same step: scanned or unrolled layers, and the
fused q/k/v and gate/up projections (fuse_projections) against the separate ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import FUSED, Transformer, fuse_projections, layout_params

CFG = ModelConfig("LlamaForCausalLM", vocab_size=97, hidden_size=48, intermediate_size=80,
                  num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, attention_bias=True)
BLOCK, PAGES = 4, 16


def mixed_step():
    """A prefill chunk of 5 tokens (sequence 0) and a decode at position 6 (sequence 1)."""
    pos = np.array([0, 1, 2, 3, 4, 6], np.int32)
    seq = np.array([0, 0, 0, 0, 0, 1], np.int32)
    tables = np.array([[3, 7], [5, 9]], np.int32)
    slots = tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK
    md = AttentionMetadata(pos, seq, slots.astype(np.int32), tables,
                           np.array([5, 7], np.int32), np.array([0, 5, 6], np.int32))
    ids = np.array([5, 17, 3, 88, 41, 60], np.int32)
    return ids, md, np.array([4, 5], np.int32)


def pools(rng):
    shape = (CFG.num_layers, PAGES, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


@pytest.mark.parametrize("scan", [True, False])
def test_fused_projections_compute_the_same_step(scan):
    rng = np.random.default_rng(0)
    ids, md, rows = mixed_step()
    k, v = pools(rng)
    stacked = Transformer(CFG, jnp.float32, scan_layers=True).init(
        jax.random.key(0), ids, k, v, md, rows)["params"]
    # biases away from zero, so a q/k/v split off by one head would show
    stacked = jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape), stacked)
    params = layout_params(stacked, CFG.num_layers, scan)
    fused = fuse_projections(params, scan)

    layer = fused["layers"] if scan else fused["layers_1"]
    for names, name in FUSED.items():
        assert name in layer and not any(n in layer for n in names)
    assert layer["wqkv"].shape[-2] == CFG.num_heads + 2 * CFG.num_kv_heads

    model = Transformer(CFG, jnp.float32, scan_layers=scan)
    want = model.apply({"params": params}, ids, k, v, md, rows)
    got = model.apply({"params": fused}, ids, k, v, md, rows)
    for a, b in zip(want, got, strict=True):  # pools, logits, hidden
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(got[1])).max() > 0.1  # the logits are not trivially equal


# kernel-sized: every projection's inputs whole blocks of 32, its outputs whole panels of 32
BLOCK_CFG = ModelConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
PROJECTIONS = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 0, "w_up": 0, "w_down": 0}


def as_blocks(rng, a: np.ndarray, axis: int) -> dict:
    """Int8 codes in blocks of 32 along `axis` with a float32 scale each (kernels/quant.py)."""
    q = rng.integers(-127, 128, a.shape).astype(np.int8)
    scale_shape = list(a.shape)
    scale_shape[axis] //= 32
    scale = (0.02 * rng.random(scale_shape) + 0.001).astype(np.float32)
    return {"q": q, "scale": scale, "min": np.zeros_like(scale)}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU block matmul kernel")
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_projections_fuse_and_compute_their_float_weights(block):
    """FP8 weights (kernels/fp8.py: scales per block of inputs, 8 in wo, or per output)
    dequantized in the step, fused or not, give the step of their float32 weights."""
    import ml_dtypes

    from jaxserve.kernels import fp8

    rng = np.random.default_rng(1)
    ids, md, rows = mixed_step()
    k, v = pools(rng)
    stacked = Transformer(CFG, jnp.float32, scan_layers=True).init(
        jax.random.key(0), ids, k, v, md, rows)["params"]
    shapes = fp8.abstract_fp8(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                           stacked), block)
    layers = dict(stacked["layers"])
    for name, w in shapes["layers"].items():
        if fp8.is_fp8(w):
            layers[name] = {
                "fp8": np.clip(rng.standard_normal(w["fp8"].shape) * 100, -448, 448).astype(
                    ml_dtypes.float8_e4m3fn),
                "scale": rng.uniform(1e-4, 1e-3, w["scale"].shape).astype(np.float32)}
    quantized = {**stacked, "layers": layers}
    floats = {**stacked, "layers": {n: fp8.dequantize_np(w) if fp8.is_fp8(w) else w
                                    for n, w in layers.items()}}
    fused = fuse_projections(quantized, True)
    assert fp8.is_fp8(fused["layers"]["wqkv"]) and fp8.is_fp8(fused["layers"]["w_gate_up"])

    model = Transformer(CFG, jnp.float32)
    want = model.apply({"params": floats}, ids, k, v, md, rows)[1]
    for params in (quantized, fused):
        got = model.apply({"params": params}, ids, k, v, md, rows)[1]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_the_block_matmul_skips_a_steps_padding_rows():
    """Padding rows after a step's real tokens go through no projection: they leave every layer
    as they came in (the residual alone), while the real rows' numbers equal the unpadded
    step's bit for bit. The plain dots, for contrast, compute every row."""
    from jaxserve.kernels import cpu_matmul

    if cpu_matmul.available():
        pytest.skip(cpu_matmul.available())
    rng = np.random.default_rng(3)
    ids, md, rows = mixed_step()
    k, v = (jnp.asarray(rng.standard_normal((BLOCK_CFG.num_layers, PAGES, BLOCK, 1, 32)),
                        jnp.float32) for _ in range(2))
    model = Transformer(BLOCK_CFG, jnp.float32, scan_layers=False,
                        block_matmul=cpu_matmul.block_matmul_or_none)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), ids, k, v, md,
                                                 rows)["params"])
    for i in range(BLOCK_CFG.num_layers):
        layer = params[f"layers_{i}"]
        for name, axis in PROJECTIONS.items():
            layer[name] = as_blocks(rng, layer[name], axis)

    pad = 4  # a padding sequence of no tokens and 4 padding rows, as step_inputs builds them
    out_of_range = PAGES * BLOCK
    padded_md = AttentionMetadata(
        np.concatenate([md.positions, np.zeros(pad, np.int32)]),
        np.concatenate([md.token_seq, np.zeros(pad, np.int32)]),
        np.concatenate([md.slot_mapping, np.full(pad, out_of_range, np.int32)]),
        np.concatenate([md.block_tables, np.zeros((1, 2), np.int32)]),
        np.concatenate([md.context_lens, [0]]).astype(np.int32),
        np.concatenate([md.query_start_loc, [6]]).astype(np.int32))
    padded_ids = np.concatenate([ids, np.zeros(pad, np.int32)])

    def run(block_matmul, ids, md):
        m = Transformer(BLOCK_CFG, jnp.float32, scan_layers=False, block_matmul=block_matmul)
        k2, v2, logits, hidden = m.apply({"params": params}, ids, k, v, md, rows)
        return np.asarray(k2), np.asarray(logits), np.asarray(hidden)

    k_real, logits_real, hidden_real = run(cpu_matmul.block_matmul_or_none, ids, md)
    k_pad, logits_pad, hidden_pad = run(cpu_matmul.block_matmul_or_none, padded_ids, padded_md)
    np.testing.assert_array_equal(k_pad, k_real)
    np.testing.assert_array_equal(logits_pad, logits_real)
    np.testing.assert_array_equal(hidden_pad[:6], hidden_real)

    # A padding row's final hidden state is its embedding, normalized: no layer added to it.
    embed = params["embed"][0]
    norm = embed / np.sqrt(np.mean(embed ** 2) + BLOCK_CFG.rms_norm_eps)
    untouched = norm * params["final_norm"]["weight"]
    np.testing.assert_allclose(hidden_pad[6:], np.tile(untouched, (pad, 1)), rtol=1e-5,
                               atol=1e-6)
    _, _, hidden_dots = run(None, padded_ids, padded_md)
    assert np.abs(hidden_dots[6:] - untouched).max() > 1e-2
