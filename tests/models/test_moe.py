"""The mixture-of-experts block: routing's normalisations, the grouped experts against the
reference (every expert on every token), and the configs and checkpoints of both families."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import expected_hf_shapes


def _case(t=13, d=16, f=8, e=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ws = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((e, d, f), (e, d, f),
                                                                      (e, f, d))]
    logits = rng.standard_normal((t, e)).astype(np.float32)
    return x, ws, logits, k


def test_route_normalisations():
    _, _, logits, k = _case()
    w, ids = moe.route(jnp.asarray(logits), k, normalize=False)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = np.argsort(-probs, axis=-1)[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(probs, want, -1), rtol=1e-6)
    # renormalised (Mixtral, Qwen3-MoE with norm_topk_prob): a softmax over the k chosen logits
    w, ids = moe.route(jnp.asarray(logits), k, normalize=True)
    top = np.take_along_axis(logits, want, -1)
    np.testing.assert_allclose(np.asarray(w), np.exp(top) / np.exp(top).sum(-1, keepdims=True),
                               rtol=1e-6)


@pytest.mark.parametrize("first, num_local", [(0, 8), (4, 4), (2, 2)])
def test_grouped_experts_match_the_reference(first, num_local):
    """All experts, or a device's range of them (the others' pairs give zeros)."""
    x, (wg, wu, wd), logits, k = _case()
    weights, ids = moe.route(jnp.asarray(logits), k, normalize=True)
    local = [w[first:first + num_local] for w in (wg, wu, wd)]
    got = jax.jit(moe.grouped_experts)(x, weights, ids, *local, first)
    want = moe.grouped_experts_reference(x, weights, ids, *local, first)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_expert_ranges_sum_to_all_experts():
    """Expert parallelism's sum: the partial outputs of the ranges add up to the whole."""
    x, ws, logits, k = _case(t=31, seed=1)
    weights, ids = moe.route(jnp.asarray(logits), k, normalize=False)
    whole = moe.grouped_experts(x, weights, ids, *ws)
    parts = sum(moe.grouped_experts(x, weights, ids, *[w[i:i + 2] for w in ws], i)
                for i in range(0, 8, 2))
    np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-6)


def test_every_pair_computed_when_all_tokens_pick_one_expert():
    """No capacity limit: 40 tokens all routed to experts 3 and 5 are all computed."""
    x, ws, _, _ = _case(t=40)
    ids = jnp.tile(jnp.asarray([[3, 5]], jnp.int32), (40, 1))
    weights = jnp.full((40, 2), 0.5, jnp.float32)
    got = moe.grouped_experts(x, weights, ids, *ws)
    want = moe.grouped_experts_reference(x, weights, ids, *ws)
    assert np.all(np.abs(np.asarray(got)).sum(-1) > 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU block kernel")
@pytest.mark.parametrize("form", ["int8", "nibbles"])
def test_block_experts_read_quantized_experts_in_one_kernel_call(form):
    """Experts in GGUF blocks through the grouped CPU kernel: the reference's output on the
    expanded weights (within the int16 scaling of x), and no ragged_dot or expanded weight
    in the program, only the kernel's custom calls."""
    from jaxserve.kernels import cpu_matmul, quant
    from tests.kernels.test_cpu_matmul import make_weight

    rng = np.random.default_rng(4)
    t, d, f, e, k = 13, 64, 32, 8, 2
    ws = [make_weight(rng, s, 1, "Q4_1") for s in ((e, d, f), (e, d, f), (e, f, d))]
    expanded = [quant.dequantize_np({p: np.asarray(a) for p, a in w.items()}) for w in ws]
    if form == "nibbles":
        ws = [cpu_matmul.pack({p: np.asarray(a) for p, a in w.items()}, 1) for w in ws]
        assert all(quant.is_nibbles(w) for w in ws)
    x = rng.standard_normal((t, d)).astype(np.float32)
    weights, ids = moe.route(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k, True)
    run = jax.jit(moe.block_experts)
    text = run.lower(x, weights, ids, *ws).as_text()
    assert text.count("jaxserve_grouped_block_matmul") == 2 and "ragged" not in text
    got = run(x, weights, ids, *ws)
    want = moe.grouped_experts_reference(x, weights, ids, *expanded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=2e-3 * np.abs(np.asarray(want)).max())


@pytest.fixture(scope="module", params=[("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def moe_q4_gguf(request, tmp_path_factory, tiny_models):
    """A tiny MoE GGUF whose experts are Q4_1 (gate, up) and Q8_0 (down)."""
    from jaxserve.models.loader import load_model
    from tests.models.test_loader import write_moe_gguf

    arch, gguf_arch = request.param
    path = tmp_path_factory.mktemp(f"moe-{arch}") / "moe-q4.gguf"
    write_moe_gguf(path, tiny_models[arch][0], load_model(tiny_models[arch][0]).config,
                   {"experts.gate_proj": "Q4_1", "experts.up_proj": "Q4_1",
                    "experts.down_proj": "Q8_0"}, gguf_arch)
    return str(path)


def test_engine_on_quantized_experts_gives_the_expanded_experts_outputs(moe_q4_gguf):
    """A MoE GGUF served with its experts in blocks (the grouped kernel on a CPU) and with
    them expanded at load (quantization=none): the same greedy tokens, logprobs within the
    int16 scaling's reach (as the dense projections, tests/kernels/test_quant.py), every
    block back; the kept experts take a fraction of the expanded ones' bytes."""
    from jaxserve.kernels import quant
    from tests.kernels.test_quant import _run

    kept, got = _run(moe_q4_gguf)
    expanded, want = _run(moe_q4_gguf, quantization="none")
    assert [g[0] for g in got.values()] == [w[0] for w in want.values()]
    for (_, got_lp), (_, want_lp) in zip(got.values(), want.values(), strict=True):
        for g, w in zip(got_lp, want_lp, strict=True):
            np.testing.assert_allclose(g["logprob"], w["logprob"], atol=2e-3)
    from jaxserve.models.llama import LAYER_BLOCKS

    # the scanned step reads the experts' stacks whole at each layer's entry, held apart
    held = kept.runner.params.get(LAYER_BLOCKS, {}).get("moe", {})
    kept_moe = {**kept.runner.params["layers"]["moe"], **held}
    assert not quant.is_quantized(expanded.runner.params["layers"]["moe"]["w_up"])
    on_cpu = jax.default_backend() == "cpu"
    assert set(held) == ({"w_gate", "w_up", "w_down"} if on_cpu else set())
    assert (kept.runner.model.experts_fn is moe.block_experts) == on_cpu
    assert quant.is_nibbles(kept_moe["w_up"]) == on_cpu
    assert quant.is_pairs(kept_moe["w_down"]) == on_cpu
    nbytes = lambda p: sum(a.nbytes for a in jax.tree.leaves(p))  # noqa: E731
    experts = lambda m: [m[n] for n in ("w_gate", "w_up", "w_down")]  # noqa: E731
    ratio = nbytes(experts(kept_moe)) / nbytes(experts(expanded.runner.params["layers"]["moe"]))
    assert ratio < (0.22 if on_cpu else 0.32)


def _as_dense(cfg: ModelConfig) -> ModelConfig:
    """cfg with its experts as one dense MLP of E x F columns."""
    return dataclasses.replace(cfg, num_experts=0,
                               intermediate_size=cfg.num_experts * cfg.moe_intermediate_size)


def _hf(arch, **kw):
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    return {"architectures": [arch], **base, **kw}


def test_configs_of_both_families():
    mix = ModelConfig.from_hf(_hf("MixtralForCausalLM", num_local_experts=8))
    assert (mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size,
            mix.norm_topk_prob) == (8, 2, 96, True)
    qwen = ModelConfig.from_hf(_hf("Qwen3MoeForCausalLM", num_experts=8, moe_intermediate_size=32,
                                   head_dim=32))
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == (
        8, 32, False, True)
    # the active weights: router plus k experts per layer, not all E
    assert qwen.projection_weights < _as_dense(qwen).projection_weights
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf(_hf("Qwen3MoeForCausalLM", num_experts=8, moe_intermediate_size=32,
                                mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_hf(_hf("Qwen3MoeForCausalLM", num_experts=8, moe_intermediate_size=32,
                                decoder_sparse_step=2))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(_hf("MixtralForCausalLM", num_local_experts=8) |
                            {"num_experts_per_tok": 9})


def test_mixtral_and_fused_checkpoint_names_load_alike():
    """Mixtral's w1/w3/w2 names and the fused (E, 2F, D) gate_up layout read as Qwen's."""
    cfg = ModelConfig.from_hf(_hf("Qwen3MoeForCausalLM", num_experts=4, moe_intermediate_size=8,
                                  head_dim=16))
    rng = np.random.default_rng(0)
    per_expert = {n: rng.standard_normal(s).astype(np.float32)
                  for n, s in expected_hf_shapes(cfg).items()}
    p = "model.layers.0."
    mixtral = {n.replace(".mlp.", ".block_sparse_moe.").replace("gate_proj", "w1")
               .replace("up_proj", "w3").replace("down_proj", "w2"): t
               for n, t in per_expert.items() if n.startswith(p + "mlp.")}
    gate_up = np.stack([np.concatenate([per_expert[f"{p}mlp.experts.{j}.gate_proj.weight"],
                                        per_expert[f"{p}mlp.experts.{j}.up_proj.weight"]])
                        for j in range(4)])
    down = np.stack([per_expert[f"{p}mlp.experts.{j}.down_proj.weight"] for j in range(4)])
    fused = {p + "mlp.gate.weight": per_expert[p + "mlp.gate.weight"],
             p + "mlp.experts.gate_up_proj": gate_up, p + "mlp.experts.down_proj": down}
    for other in (mixtral, fused):
        got = moe.canonical_expert_names(cfg, other)
        want = {n: t for n, t in per_expert.items() if n.startswith(p + "mlp.")}
        assert sorted(got) == sorted(want)
        for n in want:
            np.testing.assert_array_equal(got[n], want[n])
