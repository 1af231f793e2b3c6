"""Backend selection, and the engine giving identical tokens across backends (auto's self-test:
test_selftest.py)."""

from __future__ import annotations

import jax
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.kernels.attention import registry
from jaxserve.kernels.attention.base import AttentionBackend, Backend
from jaxserve.kernels.attention.choose import select_attention
from jaxserve.kernels.attention.mosaic import supports
from tests.helpers import run_all


def test_every_name_but_auto_is_one_backend_of_the_contract():
    for name in AttentionBackend:
        if name is AttentionBackend.AUTO:
            with pytest.raises(ValueError, match="auto names no one backend"):
                registry.backend(name)
            continue
        backend = registry.backend(name.value)
        assert isinstance(backend, Backend) and backend.name is name
        assert callable(backend.fn())


def test_auto_is_the_cpu_kernel_on_cpu():
    """This machine has a C++ compiler, so auto builds and takes the C++ kernel (the fallback
    without one is tested in test_cpu_attention.py)."""
    if jax.default_backend() != "cpu":
        pytest.skip("this checks the CPU choice")
    assert select_attention("auto", dtype="float32", head_dim=64, groups=3)[0] == "cpu"
    assert select_attention("auto", dtype="bfloat16", head_dim=64, groups=3)[0] == "xla"


@pytest.mark.parametrize("backend, why", [("triton", "jax-triton|GPU"),
                                          ("mosaic", "Hopper GPU")])
def test_unavailable_backend_fails_at_engine_start(tiny_llama_dir, backend, why):
    if jax.default_backend() == "gpu":
        pytest.skip("these may be available on a GPU")
    with pytest.raises(ValueError, match=f"attention_backend '{backend}' cannot run here: .*"
                                         f"({why})"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, attention_backend=backend,
                               max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128))


def test_mosaic_shape_limits_name_the_field():
    assert supports("bfloat16", 128, 8, 16) is None
    assert "dtype" in supports("float32", 64, 3, 16)
    assert "head_dim" in supports("float16", 96, 3, 16)
    assert "query heads per kv head" in supports("bfloat16", 64, 128, 16)
    assert "block_size" in supports("bfloat16", 64, 3, 12)


def test_engine_output_identical_across_cpu_backends(tiny_llama_dir):
    # 32 token rows for 4 sequences: the xla backend's query tiles run in the prefill steps
    outs = {}
    for backend in ("reference", "pallas", "xla", "cpu"):
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
    assert outs["pallas"] == outs["reference"] == outs["xla"] == outs["cpu"]
