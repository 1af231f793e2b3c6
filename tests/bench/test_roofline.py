"""The decode step against its two floors: weight streaming and arithmetic."""

from __future__ import annotations

import pytest

from jaxserve import SamplingParams
from jaxserve.bench import roofline
from jaxserve.engine.llm_engine import StepRecord
from jaxserve.models.config import ModelConfig
from tests.bench.test_bench import engine


def test_projection_weights_are_the_layers_linear_weights(tiny_models):
    """The multiply-adds a row costs in the layers are the weights of Hugging Face's own
    Linear modules there (biases aside), for every architecture; the head's are D x V."""
    import torch

    for arch, (_, model) in tiny_models.items():
        cfg = ModelConfig.from_hf(model.config)
        linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        # q, k, v, o, gate, up, down (Phi-3's checkpoint fuses q/k/v and gate/up; a mixture of
        # experts holds its router and experts as plain parameters)
        assert len(linears) == (4 if arch == "phi3" or cfg.is_moe else 7) * cfg.num_layers, arch
        weights = sum(m.weight.numel() for m in linears)
        if cfg.is_moe:  # the router, and k of the E experts
            moe = {n: p.numel() for n, p in model.model.layers.named_parameters()
                   if ".mlp." in n or ".block_sparse_moe." in n}
            weights += sum(v for n, v in moe.items() if ".experts." not in n)
            weights += (sum(v for n, v in moe.items() if ".experts." in n)
                        * cfg.num_experts_per_tok // cfg.num_experts)
        assert cfg.projection_weights == weights, arch
        assert model.lm_head.weight.numel() == cfg.hidden_size * cfg.vocab_size, arch


def record(i, prefill, bucket, at):
    return StepRecord(i, [("a", prefill, 0 if prefill else 1)], 0.0, bucket, at)


def test_steady_decode_step_is_the_commonest_decode_bucket():
    """The median gap between consecutive decode-only steps, in the bucket most of them ran
    in; a gap after a prefill step is not a decode step's."""
    trace = [record(0, 5, (16, 8, 4), 0.0), record(1, 0, (8, 8, 4), 1.0),
             record(2, 0, (8, 8, 4), 1.1), record(3, 0, (8, 8, 4), 1.3),
             record(4, 0, (8, 8, 4), 1.4), record(5, 3, (16, 8, 4), 2.0),
             record(6, 0, (4, 4, 4), 5.0), record(7, 0, (4, 4, 4), 9.0)]
    step_s, bucket, n = roofline.steady_decode_step(trace)
    assert bucket == (8, 8, 4) and n == 3 and step_s == pytest.approx(0.1)
    assert roofline.steady_decode_step(trace[:1]) is None


def test_a_decode_step_against_both_floors(tiny_llama_dir):
    """The arithmetic floor counts the steady bucket's rows through the projections and its
    logits rows through the head at the matmul rate measured in the run; the step is then
    compared with each floor and with the larger."""
    e = engine(tiny_llama_dir)
    for i in range(4):
        e.add_request(f"r{i}", prompt_token_ids=[1, 5 + i, 9],
                      params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    f = roofline.decode_vs_floor(e)
    cfg = e.runner.model_config
    tokens, rows, _ = f["decode_bucket"]
    assert f["step_multiply_adds"] == (tokens * cfg.projection_weights
                                       + rows * cfg.hidden_size * cfg.vocab_size)
    assert f["arithmetic_s"] == pytest.approx(f["step_multiply_adds"] / f["matmul_rate"])
    assert f["matmul_rate"] > 1e8  # a machine's float32 matmul, multiply-adds a second
    assert f["step_over_arithmetic"] == pytest.approx(f["decode_step_s"] / f["arithmetic_s"])
    larger = max(f["weight_stream_s"], f["arithmetic_s"])
    assert f["step_over_both"] == pytest.approx(f["decode_step_s"] / larger)
    text = roofline.format_floor(f)
    assert "weight-streaming floor" in text and "arithmetic floor" in text
    assert f"{f['step_over_arithmetic']:.2f}x" in text
