"""An FP8 checkpoint (both conventions) serves the tokens of its dequantized twin, expanded
at load on a CPU and dequantized inside the step as on an accelerator."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.kernels import fp8
from jaxserve.models.loader import load_model
from jaxserve.testing.tiny import write_fp8_pair, write_tiny_llama
from tests.helpers import buckets_from_8

# hidden 192 and intermediate 320: partial 128-tiles, blocks of 64 inputs, wo's of 16 (a head)
SIZES = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4,
             num_key_value_heads=2)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=32)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fp8-src"), 512, seed=3, **SIZES)


def greedy(path) -> list[list[int]]:
    from jaxserve import LLM

    llm = LLM(path, **buckets_from_8(dict(ENGINE)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def step_weights(llm) -> dict:
    return llm.engine.runner.params["layers"]


@pytest.mark.parametrize("form", ["block", "channel"])
def test_fp8_checkpoint_gives_the_twins_tokens(tmp_path, tiny_src, form, caplog):
    from jaxserve import LLM

    quantized, twin = write_fp8_pair(tiny_src, tmp_path / "fp8", tmp_path / "twin", form)
    expect = greedy(twin)
    with caplog.at_level(logging.WARNING):
        assert greedy(quantized) == expect  # expanded at load
    warned = [r.getMessage() for r in caplog.records if "FP8 weights expanded" in r.getMessage()]
    assert len(warned) == 1 and "on a CPU" in warned[0] and "MB ->" in warned[0]
    with fp8.in_step_on_cpu():
        llm = LLM(quantized, **buckets_from_8(dict(ENGINE)))
        assert fp8.is_fp8(step_weights(llm)["wq"])  # kept FP8 on the device
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expect


def test_loader_matches_abstract_fp8(tmp_path, tiny_src):
    from jaxserve.bench.gpu_cost import abstract_model

    quantized, _ = write_fp8_pair(tiny_src, tmp_path / "fp8", tmp_path / "twin", "block")
    loaded = load_model(quantized)
    import json

    hf = json.loads((tmp_path / "fp8" / "config.json").read_text())
    hf.pop("architectures")
    abstract = fp8.abstract_fp8(abstract_model(hf).params)
    shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)  # noqa: E731
    assert shapes(loaded.params["layers"]) == shapes(abstract["layers"])


def test_fp8_weights_split_over_devices(tmp_path, tiny_src):
    """Under tensor parallelism: w_down's 5 blocks of 64 inputs split as 10 of 32."""
    from jaxserve import LLM

    quantized, twin = write_fp8_pair(tiny_src, tmp_path / "fp8", tmp_path / "twin", "block")
    engine = buckets_from_8(dict(ENGINE, tensor_parallel_size=2))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expect = [list(o.outputs[0].token_ids)
              for o in LLM(twin, **engine).generate(PROMPTS, params, use_tqdm=False)]
    with fp8.in_step_on_cpu():
        llm = LLM(quantized, **engine)
        assert step_weights(llm)["w_down"]["scale"].shape == (2, 10, 192)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expect
