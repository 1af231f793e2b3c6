"""Data parallelism: `data_parallel_size` independent engine replicas on disjoint device groups.

Each replica is a whole LLMEngine (scheduler, block manager, prefix cache, KV pool, compiled
steps) on its own `tensor_parallel_size` devices; replicas share nothing but the host copy of the
loaded weights, and each steps on its own thread, so a long prefill on one never holds back the
decodes of another. The fronts (the LLM library class, the server's socket and HTTP fronts) put
a core/router.py Router in front of them.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.router import Router
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


def device_groups(data_parallel_size: int, tensor_parallel_size: int) -> list[list[jax.Device]]:
    """Replica i runs on devices [i * tp, (i + 1) * tp) of this process's devices."""
    dp, tp = data_parallel_size, tensor_parallel_size
    devices = jax.devices()
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} "
                         f"devices; this process sees {len(devices)} ({devices[0].platform})")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def build_replicas(config: EngineConfig, loaded: LoadedModel | None = None) -> list[LLMEngine]:
    """One engine per replica, the model loaded once (by the engine itself where there is
    one replica, so that its host copy frees as it goes to the device)."""
    groups = device_groups(config.data_parallel_size,
                           config.tensor_parallel_size * config.expert_parallel_size)
    if loaded is None and len(groups) > 1:
        loaded = load_model(config.model)
    engines = [LLMEngine(config, loaded, devices=g) for g in groups]
    if len(engines) > 1:
        logger.info("data parallel: %d replicas on %s, %d KV blocks each", len(engines),
                    [[str(d) for d in g] for g in groups], engines[0].runner.num_blocks)
    return engines


def make_router(engines: list[LLMEngine]) -> Router:
    """A router whose per-replica memory of prefixes is about the size of a replica's cache
    (device pool plus host tier)."""
    e = engines[0]
    return Router(len(engines), e.config.block_size,
                  prefix_aware=e.config.enable_prefix_caching,
                  max_names=e.runner.num_blocks + e.runner.num_host_blocks)


def warmup(engines: list[LLMEngine]) -> float:
    """Compile every replica's programs (the second loads most from the compilation cache)."""
    return sum(e.warmup() for e in engines)


_RATIOS = {"kv_usage": ("kv_blocks_used", "kv_blocks_total"),
           "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries"),
           "spec_acceptance_rate": ("spec_accepted_tokens", "spec_proposed_tokens"),
           "spec_mean_accepted_length": ("spec_emitted_tokens", "spec_verify_rows")}


def merge_snapshots(snaps: list[dict]) -> dict:
    """The replicas' metrics_snapshot() dicts as one: counts summed, ratios recomputed from
    the sums, and with several replicas each one's own figures under "replicas"."""
    if len(snaps) == 1:
        return snaps[0]
    merged = {k: sum(s[k] for s in snaps) for k in snaps[0] if k not in _RATIOS}
    for k, (num, den) in _RATIOS.items():
        merged[k] = merged[num] / merged[den] if merged[den] else 0.0
    merged["replicas"] = snaps
    return merged
