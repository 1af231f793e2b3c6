"""Expert parallelism on forced CPU devices: a mixture-of-experts model's experts split over a
mesh axis, alone and beside tensor parallelism, give one device's greedy tokens; each device
holds its share of the expert weights; bad splits are refused naming the field."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime import sharding
from tests.models.test_hf_equivalence import run_staggered

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced) devices")


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, max_num_seqs=6, max_num_batched_tokens=64,
                                  max_model_len=128, num_kv_blocks=64, kv_cache_dtype="float32",
                                  token_buckets=(16, 64), block_buckets=(8,), **kw))


def _expert_bytes(engine: LLMEngine) -> list[int]:
    """Bytes of the experts' weights (router excluded) on each of the engine's devices."""
    experts = [{k: w for k, w in layer["moe"].items() if k != "router"}
               for name, layer in engine.runner.params.items() if name.startswith("layers")]
    return [sharding.bytes_on_device(experts, d) for d in engine.runner.devices]


@pytest.mark.parametrize("arch, layer_loop", [("mixtral", "scan"), ("qwen3_moe", "unroll")])
def test_ep_2_and_ep_2_x_tp_2_give_one_devices_tokens(arch, layer_loop, tiny_models):
    path, _ = tiny_models[arch]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 1000, size=int(n)).tolist() for n in rng.integers(5, 70, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got, size = {}, {}
    for ep, tp in ((1, 1), (2, 1), (2, 2)):
        engine = _engine(path, expert_parallel_size=ep, tensor_parallel_size=tp,
                         layer_loop=layer_loop)
        got[ep, tp] = run_staggered(engine, prompts, params, arrivals=[0, 0, 1, 2, 4, 7])
        size[ep, tp] = _expert_bytes(engine)
        assert engine.block_manager.num_used_blocks == 0
    assert got[2, 1] == got[1, 1] and got[2, 2] == got[1, 1]
    (whole,) = size[1, 1]
    assert size[2, 1] == [whole // 2] * 2
    assert size[2, 2] == [whole // 4] * 4
    mesh = engine.runner.mesh
    assert dict(mesh.shape) == {sharding.EXPERT_AXIS: 2, sharding.AXIS: 2}


def test_bad_expert_splits_name_the_field(tiny_models):
    with pytest.raises(ValueError, match="expert_parallel_size"):
        EngineConfig(expert_parallel_size=0)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts"):
        _engine(tiny_models["llama"][0], expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide"):
        _engine(tiny_models["mixtral"][0], expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size=4 needs 8 devices"):
        _engine(tiny_models["mixtral"][0], expert_parallel_size=4, tensor_parallel_size=2)
