"""ModelRunner: owns the params and the KV pool on the device and runs compiled steps.

`step(params, kv, inputs) -> (kv, sampler_output)` is jitted with the KV pool donated, so XLA
updates the pages in place. One executable exists per (tokens, sequences, blocks-per-sequence)
bucket; `warmup()` compiles them all ahead of time, and `num_compiles` counts every compile so a
test can prove nothing compiles after warmup (`strict_compile` turns that into an error).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import StepInputs, dummy_step_inputs
from jaxserve.config import EngineConfig
from jaxserve.sampling import SamplerOutput, sample
from kernels import select_attention
from models.llama import KVCache, Transformer
from models.loader import LoadedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class RecompileError(RuntimeError):
    """A step needed a program that warmup() did not compile (strict_compile=True)."""


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.model_config = mc = loaded.config
        self.dtype = resolve_dtype(config.dtype)
        self.attention_backend, attn_fn = select_attention(config.attention_backend)
        self.model = Transformer(mc, self.dtype, attn_fn)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, self.dtype), loaded.params)
        self.block_size = config.block_size
        per_block = KVCache.bytes_per_block(mc, config.block_size, self.dtype)
        self.num_blocks = config.num_kv_blocks or max(1, self.kv_pool_bytes() // per_block)
        self.kv = KVCache.create(mc, self.num_blocks, self.block_size, self.dtype)
        self.num_host_blocks = (config.swap_space_bytes // per_block
                                if config.preemption_mode == "swap" else 0)
        # The host pool for swap preemption: (L, host blocks, B, K, H), preallocated.
        host_shape = (mc.num_layers, self.num_host_blocks, self.block_size, mc.num_kv_heads,
                      mc.head_dim)
        self.host_k = np.zeros(host_shape, self.dtype)
        self.host_v = np.zeros(host_shape, self.dtype)
        self._gather_blocks = jax.jit(lambda kv, ids: (kv.k[:, ids], kv.v[:, ids]))
        self._scatter_blocks = jax.jit(
            lambda kv, ids, k, v: KVCache(kv.k.at[:, ids].set(k, mode="drop"),
                                          kv.v.at[:, ids].set(v, mode="drop")),
            donate_argnums=(0,))
        self.buckets = config.buckets()
        self._jitted = jax.jit(functools.partial(self._step, max_logprobs=config.max_logprobs),
                               donate_argnums=(1,))
        self._executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        self.num_compiles = 0
        self.is_warm = False

    def kv_pool_bytes(self) -> int:
        """Bytes for the KV pool: a fraction of device memory when asked and known, else the
        configured byte budget."""
        frac = self.config.kv_cache_memory_fraction
        stats = jax.devices()[0].memory_stats() if frac is not None else None
        if not stats or "bytes_limit" not in stats:
            if frac is not None:
                logger.warning("device reports no memory statistics; using "
                               "kv_cache_memory_bytes=%d", self.config.kv_cache_memory_bytes)
            return self.config.kv_cache_memory_bytes
        # The params are already on the device, so bytes_in_use counts them.
        free = int(stats["bytes_limit"] * frac) - stats.get("bytes_in_use", 0)
        if free <= 0:
            raise ValueError(f"kv_cache_memory_fraction={frac} leaves no memory for the KV "
                             f"pool after the params ({stats.get('bytes_in_use', 0)} bytes)")
        return free

    def _step(self, params, kv: KVCache, inp: StepInputs, max_logprobs: int):
        with jax.named_scope("forward"):
            kv, logits = self.model.apply({"params": params}, inp.input_ids, kv, inp.attn,
                                          inp.logits_indices)
        with jax.named_scope("sample"):
            return kv, sample(logits, inp.sampling, max_logprobs)

    # -------------------------------------------------------------------------------- compile

    def all_buckets(self) -> list[tuple[int, int, int]]:
        tok, seq, blk = self.buckets
        return [(t, s, b) for t, s, b in itertools.product(tok, seq, blk) if s <= t]

    def _compile(self, bucket: tuple[int, int, int]) -> jax.stages.Compiled:
        if self.is_warm and self.config.strict_compile:
            raise RecompileError(f"bucket {bucket} was not compiled at warmup")
        dummy = dummy_step_inputs(*bucket, self.block_size, self.num_blocks)
        exe = self._jitted.lower(self.params, self.kv, dummy).compile()
        self.num_compiles += 1
        self._executables[bucket] = exe
        return exe

    def warmup(self) -> float:
        """Compile every bucket; returns seconds spent."""
        t0 = time.perf_counter()
        for bucket in self.all_buckets():
            if bucket not in self._executables:
                self._compile(bucket)
        if self.num_host_blocks:
            n = 1
            while True:  # the swap copies, one program per power-of-two block count
                self._swap_programs(n)
                if n >= self.num_blocks:
                    break
                n *= 2
        self.is_warm = True
        dt = time.perf_counter() - t0
        logger.info("warmup: %d programs in %.1fs", len(self._executables), dt)
        return dt

    # ----------------------------------------------------------------------------------- swap

    def _padded_ids(self, ids: list[int]) -> np.ndarray:
        n = 1
        while n < len(ids):
            n *= 2
        # Padding ids point past the pool: gathers clamp (rows ignored), scatters drop them.
        out = np.full(n, self.num_blocks, np.int32)
        out[:len(ids)] = ids
        return out

    def _swap_programs(self, n: int) -> None:
        ids = np.full(n, self.num_blocks, np.int32)
        k, v = self._gather_blocks(self.kv, ids)
        self.kv = self._scatter_blocks(self.kv, ids, k, v)

    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device blocks to the host pool (before the step that may reuse them)."""
        k, v = self._gather_blocks(self.kv, self._padded_ids(device_ids))
        n = len(device_ids)
        self.host_k[:, host_ids] = np.asarray(k)[:, :n]
        self.host_v[:, host_ids] = np.asarray(v)[:, :n]

    def swap_in(self, device_ids: list[int], host_ids: list[int]) -> None:
        ids = self._padded_ids(device_ids)
        shape = (self.host_k.shape[0], len(ids), *self.host_k.shape[2:])
        k, v = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        k[:, :len(host_ids)] = self.host_k[:, host_ids]
        v[:, :len(host_ids)] = self.host_v[:, host_ids]
        self.kv = self._scatter_blocks(self.kv, ids, k, v)

    # -------------------------------------------------------------------------------- execute

    def execute(self, inp: StepInputs, want_logprobs: bool = False) -> dict[str, np.ndarray]:
        exe = self._executables.get(inp.bucket) or self._compile(inp.bucket)
        self.kv, out = exe(self.params, self.kv, inp)
        out: SamplerOutput
        result = {"tokens": np.asarray(out.tokens)}  # the one host sync of a step
        if want_logprobs:
            result |= {"logprobs": np.asarray(out.logprobs), "top_ids": np.asarray(out.top_ids),
                       "top_logprobs": np.asarray(out.top_logprobs)}
        return result
