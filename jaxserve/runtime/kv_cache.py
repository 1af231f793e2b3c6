"""The KV pool's device memory: the paged K/V arrays, their sizing, and the host pool that swap
preemption and the prefix cache's host tier copy blocks to and from. (Which block belongs to
whom is the core's BlockManager and SwapSpace; this module holds only arrays.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The device block pool: every layer's K and V pages."""

    k: jax.Array  # (L, P, B, K, H)
    v: jax.Array  # (L, P, B, K, H)

    @staticmethod
    def create(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
               sharding=None, rows: int | None = None) -> KVCache:
        """Zeroed pages, made in place on `sharding`'s devices when given (never whole on one).
        `rows`: layers per page (KVLayout.rows; default every layer)."""
        shape = (rows or cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(k=jnp.zeros(shape, dtype, device=sharding),
                       v=jnp.zeros(shape, dtype, device=sharding))


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype, rows: int | None = None) -> int:
    """Bytes of one page of the pool: `rows` layers' K and V (default every layer)."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * (rows or cfg.num_layers) * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


class HostSwapPool:
    """A preallocated host copy target for each device pool (the target's, and a draft model's
    when speculation has one): per pool K and V of (L, host blocks, B, K, H), and the jitted
    block copies, which move block i of every pool together.

    A copy moves at most MAX_COPY_BLOCKS blocks per call, its id list padded to a power of two,
    so the gather/scatter programs are few and all compiled at warmup; padding ids point past
    the pool (gathers clamp, scatters drop them)."""

    MAX_COPY_BLOCKS = 64

    def __init__(self, pools: tuple[KVCache, ...], num_blocks: int, num_device_blocks: int):
        self.num_device_blocks = num_device_blocks
        leaves, treedef = jax.tree.flatten(pools)
        self.host = [np.zeros((a.shape[0], num_blocks, *a.shape[2:]), a.dtype) for a in leaves]
        self._gather = jax.jit(lambda pools, ids: [a[:, ids] for a in jax.tree.leaves(pools)])
        self._pending: list[tuple[list[int], list[jax.Array]]] = []  # copies in flight
        self._scatter = jax.jit(
            lambda pools, ids, blocks: jax.tree.unflatten(treedef, [
                a.at[:, ids].set(b, mode="drop")
                for a, b in zip(jax.tree.leaves(pools), blocks, strict=True)]),
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

    def warmup(self, pools: tuple[KVCache, ...]) -> tuple[KVCache, ...]:
        """Compile the copies for every size."""
        for n in self._sizes():
            ids = np.full(n, self.num_device_blocks, np.int32)
            pools = self._scatter(pools, ids, self._gather(pools, ids))
        return pools

    def swap_out(self, pools: tuple[KVCache, ...], device_ids: list[int],
                 host_ids: list[int]) -> None:
        """Copy device blocks to the host pool (before the step that may reuse them). The
        gather is launched now, ahead of that step; the host waits for its result only at
        `flush()`, so a spill does not stall the scheduling of a step."""
        for dev, host in self._chunks(device_ids, host_ids):
            blocks = self._gather(pools, self._padded(dev))
            for b in blocks:
                b.copy_to_host_async()
            self._pending.append((host, blocks))

    def flush(self) -> None:
        """Land the launched device->host copies in the host arrays, in launch order."""
        for host, blocks in self._pending:
            for dst, b in zip(self.host, blocks, strict=True):
                dst[:, host] = np.asarray(b)[:, :len(host)]
        self._pending.clear()

    def swap_in(self, pools: tuple[KVCache, ...], device_ids: list[int],
                host_ids: list[int]) -> tuple[KVCache, ...]:
        self.flush()  # a block may come back in the step that spilled it
        for dev, host in self._chunks(device_ids, host_ids):
            ids = self._padded(dev)
            blocks = []
            for src in self.host:
                b = np.zeros((src.shape[0], len(ids), *src.shape[2:]), src.dtype)
                b[:, :len(host)] = src[:, host]
                blocks.append(b)
            pools = self._scatter(pools, ids, blocks)
        return pools
