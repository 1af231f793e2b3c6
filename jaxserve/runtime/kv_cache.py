"""The KV pool's device memory: the paged K/V arrays, their sizing, and the host pool that swap
preemption and the prefix cache's host tier copy blocks to and from. (Which block belongs to
whom is the core's BlockManager and SwapSpace; this module holds only arrays.)"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The device block pool: every layer's K and V pages."""

    k: jax.Array  # (L, P, B, K, H)
    v: jax.Array  # (L, P, B, K, H)

    @staticmethod
    def create(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
               sharding=None) -> KVCache:
        """Zeroed pages, made in place on `sharding`'s devices when given (never whole on one)."""
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(k=jnp.zeros(shape, dtype, device=sharding),
                       v=jnp.zeros(shape, dtype, device=sharding))


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def pool_bytes(memory_bytes: int, memory_fraction: float | None,
               device: jax.Device | None = None) -> int:
    """Bytes for the KV pool on `device` (default: the first): `memory_fraction` of its memory
    (less what is in use, i.e. the params) when asked and the device reports memory
    statistics, else `memory_bytes`."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if memory_fraction is not None else None
    if not stats or "bytes_limit" not in stats:
        if memory_fraction is not None:
            logger.warning("device reports no memory statistics; using "
                           "kv_cache_memory_bytes=%d", memory_bytes)
        return memory_bytes
    free = int(stats["bytes_limit"] * memory_fraction) - stats.get("bytes_in_use", 0)
    if free <= 0:
        raise ValueError(f"kv_cache_memory_fraction={memory_fraction} leaves no memory for the "
                         f"KV pool after the params ({stats.get('bytes_in_use', 0)} bytes)")
    return free


class HostSwapPool:
    """A preallocated host copy target, (L, host blocks, B, K, H), and the jitted block copies.

    A copy moves at most MAX_COPY_BLOCKS blocks per call, its id list padded to a power of two,
    so the gather/scatter programs are few and all compiled at warmup; padding ids point past
    the pool (gathers clamp, scatters drop them)."""

    MAX_COPY_BLOCKS = 64

    def __init__(self, cfg: ModelConfig, num_blocks: int, num_device_blocks: int, block_size: int,
                 dtype):
        self.num_device_blocks = num_device_blocks
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self._gather = jax.jit(lambda kv, ids: (kv.k[:, ids], kv.v[:, ids]))
        self._pending: list[tuple[list[int], jax.Array, jax.Array]] = []  # copies in flight
        self._scatter = jax.jit(
            lambda kv, ids, k, v: KVCache(kv.k.at[:, ids].set(k, mode="drop"),
                                          kv.v.at[:, ids].set(v, mode="drop")),
            donate_argnums=(0,))

    def _sizes(self):
        n = 1
        while n < min(self.num_device_blocks, self.MAX_COPY_BLOCKS):
            yield n
            n *= 2
        yield n

    def _padded(self, ids: list[int]) -> np.ndarray:
        n = next(s for s in self._sizes() if s >= len(ids))
        out = np.full(n, self.num_device_blocks, np.int32)
        out[:len(ids)] = ids
        return out

    @classmethod
    def _chunks(cls, device_ids: list[int], host_ids: list[int]):
        for i in range(0, len(device_ids), cls.MAX_COPY_BLOCKS):
            yield (device_ids[i:i + cls.MAX_COPY_BLOCKS], host_ids[i:i + cls.MAX_COPY_BLOCKS])

    def warmup(self, kv: KVCache) -> KVCache:
        """Compile the copies for every size."""
        for n in self._sizes():
            ids = np.full(n, self.num_device_blocks, np.int32)
            kv = self._scatter(kv, ids, *self._gather(kv, ids))
        return kv

    def swap_out(self, kv: KVCache, device_ids: list[int], host_ids: list[int]) -> None:
        """Copy device blocks to the host pool (before the step that may reuse them). The
        gather is launched now, ahead of that step; the host waits for its result only at
        `flush()`, so a spill does not stall the scheduling of a step."""
        for dev, host in self._chunks(device_ids, host_ids):
            k, v = self._gather(kv, self._padded(dev))
            k.copy_to_host_async()
            v.copy_to_host_async()
            self._pending.append((host, k, v))

    def flush(self) -> None:
        """Land the launched device->host copies in the host arrays, in launch order."""
        for host, k, v in self._pending:
            self.k[:, host] = np.asarray(k)[:, :len(host)]
            self.v[:, host] = np.asarray(v)[:, :len(host)]
        self._pending.clear()

    def swap_in(self, kv: KVCache, device_ids: list[int], host_ids: list[int]) -> KVCache:
        self.flush()  # a block may come back in the step that spilled it
        for dev, host in self._chunks(device_ids, host_ids):
            ids = self._padded(dev)
            shape = (self.k.shape[0], len(ids), *self.k.shape[2:])
            k, v = np.zeros(shape, self.k.dtype), np.zeros(shape, self.k.dtype)
            k[:, :len(host)] = self.k[:, host]
            v[:, :len(host)] = self.v[:, host]
            kv = self._scatter(kv, ids, k, v)
        return kv
