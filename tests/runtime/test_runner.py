"""The runner's hand-over of the loaded weights: converted and put on the device a weight at a
time, freeing the host copy where it is the runner's to free, never touching a caller's."""

from __future__ import annotations

import os
import tracemalloc
import weakref

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.config import EngineConfig
from jaxserve.kernels import cpu_matmul, quant
from jaxserve.models import layer_stack
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.runtime.runner import ModelRunner
from jaxserve.testing.tiny import write_tiny_llama
from tests.models.test_loader import _write_tiny_gguf


def _q4k_model(tmp_path) -> str:
    (tmp_path / "hf").mkdir()
    d = write_tiny_llama(tmp_path / "hf", 512, seed=4, hidden_size=512,
                         intermediate_size=2048, num_hidden_layers=8)
    path = tmp_path / "k.gguf"
    _write_tiny_gguf(path, load_file(os.path.join(d, "model.safetensors")),
                     load_model(d).config, {"proj.weight": "Q4_K"})
    return str(path)


def test_runner_takes_the_params_and_frees_them_as_it_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", "")
    path = _q4k_model(tmp_path)
    config = EngineConfig(model=path, num_kv_blocks=16, max_num_seqs=2, swap_space_bytes=0,
                          max_num_batched_tokens=32).on_platform("cpu")

    # A caller's model is left as it was: the same arrays, not packed, not moved.
    loaded = load_model(path)
    up = loaded.params["layers"]["w_up"]
    ModelRunner(config, loaded)
    assert loaded.params["layers"]["w_up"] is up and set(up) == set(quant.PLANES)

    tracemalloc.start()  # before the load: the loaded arrays' frees count too
    try:
        start = tracemalloc.get_traced_memory()[0]
        loaded = load_model(path)
        held = sum(a.nbytes for a in jax.tree.leaves(loaded.params))
        codes = [weakref.ref(w["q"]) for w in jax.tree.leaves(loaded.params,
                                                              is_leaf=quant.is_quantized)
                 if isinstance(w, dict)]
        tracemalloc.reset_peak()
        runner = ModelRunner(config, loaded, take_params=True)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert loaded.params is None
    # converting the weights and moving them to the device never held a second copy of the
    # model beside the first
    assert peak < 1.5 * held, (peak, held)
    params = runner.params
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(params))
    if cpu_matmul.available() is None:  # the kernel's panels were made on the way...
        assert any(isinstance(w, dict) and quant.is_packed(w)
                   for w in jax.tree.leaves(params, is_leaf=quant.is_quantized))
        # ... and the loaded codes they were made from are gone
        assert len(codes) == 7 and all(ref() is None for ref in codes)
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["weight"]), 1.0)


def _float_model(tmp_path) -> str:
    (tmp_path / "hf").mkdir(exist_ok=True)
    return write_tiny_llama(tmp_path / "hf", 512, seed=5, hidden_size=256,
                            intermediate_size=1024, num_hidden_layers=8)


@pytest.mark.parametrize("scan,tp", [(True, 1), (False, 1), (True, 2)])
def test_a_mapped_checkpoint_is_placed_as_its_stacked_twin(tmp_path, monkeypatch, scan, tp):
    """Layer by layer from the mapped file (models/layer_stack.py), the step's params equal
    those placed from the whole stacked tree, scanned or unrolled, under TP too."""
    path = _float_model(tmp_path)
    config = EngineConfig(model=path, num_kv_blocks=16, max_num_seqs=2, swap_space_bytes=0,
                          max_num_batched_tokens=32, layer_loop="scan" if scan else "unroll",
                          tensor_parallel_size=tp).on_platform("cpu")
    loaded = load_model(path)
    assert layer_stack.holds_stacks(loaded.params)
    twin = LoadedModel(loaded.config, layer_stack.built(loaded.params), None, path)
    streamed, whole = ModelRunner(config, loaded).params, ModelRunner(config, twin).params
    assert jax.tree.structure(streamed) == jax.tree.structure(whole)
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(whole), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_mapped_checkpoint_never_holds_its_layers_on_the_host(tmp_path):
    """Placing a mapped checkpoint's weights holds a layer or two on the host at a time, not
    the stacked model (numpy's allocations, which tracemalloc sees; the device's are XLA's)."""
    path = _float_model(tmp_path)
    config = EngineConfig(model=path, num_kv_blocks=16, max_num_seqs=2, swap_space_bytes=0,
                          max_num_batched_tokens=32).on_platform("cpu")
    layers = sum(a.nbytes for a in jax.tree.leaves(load_model(path).params["layers"]))
    tracemalloc.start()  # loading and placing
    try:
        start = tracemalloc.get_traced_memory()[0]
        runner = ModelRunner(config, load_model(path), take_params=True)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    placed = sum(a.nbytes for a in jax.tree.leaves(runner.params["layers"]))
    assert placed >= layers  # all eight layers are on the device...
    assert peak < 2 * layers / 8, (peak, layers)  # ... from about a layer on the host
