"""Backend selection, and the engine giving identical tokens across backends."""

from __future__ import annotations

import jax
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from kernels import select_attention
from tests.helpers import run_all


def test_auto_is_xla_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("this checks the CPU choice")
    assert select_attention("auto")[0] == "xla"


def test_unavailable_backend_fails_at_engine_start(tiny_llama_dir):
    if jax.default_backend() == "gpu":
        pytest.skip("triton may be available on a GPU")
    with pytest.raises(ValueError, match="triton"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, attention_backend="triton",
                               max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128))


def test_engine_output_identical_across_cpu_backends(tiny_llama_dir):
    # 32 token rows for 4 sequences: the xla backend's query tiles run in the prefill steps
    outs = {}
    for backend in ("reference", "pallas", "xla"):
        engine = LLMEngine(EngineConfig(model=tiny_llama_dir, attention_backend=backend,
                                        max_num_seqs=4, max_num_batched_tokens=32,
                                        max_model_len=128, num_kv_blocks=32,
                                        token_buckets=(32,), seq_buckets=(4,),
                                        block_buckets=(8,)))
        assert engine.runner.attention_backend == backend
        for i, plen in enumerate([3, 20, 45, 9]):
            engine.add_request(f"r{i}", prompt_token_ids=[5 + (j * 7 + i) % 400
                                                          for j in range(plen)],
                               params=SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True))
        outs[backend] = {k: v.outputs[0].token_ids for k, v in run_all(engine).items()}
    assert outs["pallas"] == outs["reference"] == outs["xla"]
