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
