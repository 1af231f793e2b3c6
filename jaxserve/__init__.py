"""jaxserve: an LLM inference engine on JAX/XLA with continuous batching over a paged KV cache.

Packages, lowest layer first; each imports only from its own layer and the ones before it
(tests/test_layering.py checks the module graph):

    jaxserve   this file: the version and the public names, which load lazily, by name
    core/      sequences, block manager, swap space, scheduler, sampling params, outputs (no jax)
    kernels/   attention backends (one contract, one module each), CPU kernels, quantized weights
    models/    the Flax decoder, ModelConfig, weight loading and its cache
    config     EngineConfig and the command-line options derived from it
    runtime/   the device side: KV pool arrays, step inputs, sampling, the compiled model runner
    engine/    LLMEngine (schedule -> run -> postprocess), the offline LLM, metrics, profiling
    testing/   the scheduler simulator and the HF transformers oracle
    serving/   one serving core; the socket and OpenAI HTTP fronts on it; clients, Prometheus
    bench/     workloads, drivers (in process, socket, HF baselines), reports, plots
    __main__, launch   the command line

kernels/ and models/ sit beside this folder in a checkout and install as jaxserve.kernels and
jaxserve.models; imported by their folder names from a checkout's root, they give those names
to other distributions (checkout.py). The public names below load lazily, so
`import jaxserve.core.scheduler` does not import jax.
"""

from __future__ import annotations

import importlib
import importlib.metadata

try:  # the one version number is pyproject.toml's
    __version__ = importlib.metadata.version("jaxserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "jaxserve.engine.llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "EngineConfig": "jaxserve.config",
    "SamplingParams": "jaxserve.core.sampling_params",
    "RequestOutput": "jaxserve.core.outputs",
    "CompletionOutput": "jaxserve.core.outputs",
    "RequestMetrics": "jaxserve.core.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
