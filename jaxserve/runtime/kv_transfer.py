"""Moving a request's KV blocks from one engine's pool to another's (disaggregated serving).

The prefill engine gathers the blocks into fresh arrays and offers them under a number (a
64-bit uuid; serving/engine_secret.py derives it from the offer's name) on its
`jax.experimental.transfer` server; the decode engine pulls them by that number from the
server's address, device to device, and scatters them into its own pool. Every pool of the
engine moves together (the target's and a draft model's), block i of each. A gather or
scatter of n blocks runs as one program per power of two in n's binary form, so few programs
ever compile and no padding is sent. docs/architecture.md says why this path rather than one
staged through host memory.

Under tensor parallelism a pool's kv heads are split over the engine's devices, and replicated
or padded where they do not divide (runtime/sharding.py's HeadLayout). Blocks travel in the
model's own heads, whole on the engine's first device: the sender gathers them from its
devices, the receiver lays them out over its own, so engines of any tensor_parallel_size
exchange blocks.
"""

from __future__ import annotations

import datetime

import jax
import numpy as np
from jax.experimental import transfer

from jaxserve.runtime.kv_cache import KVCache
from jaxserve.runtime.sharding import HeadLayout


def _pieces(n: int) -> list[tuple[int, int]]:
    """(start, size) runs covering range(n), sizes the powers of two of n, largest first."""
    out, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


class KVTransfer:
    def __init__(self, devices: list[jax.Device], heads: HeadLayout, host: str = "127.0.0.1"):
        """`devices`: the engine's; `heads`: how its target pool lays out the model's kv heads
        (a draft model's pool is never split)."""
        if any(d.process_index != devices[0].process_index for d in devices):
            raise ValueError("role: a prefill or decode engine runs in one process; its "
                             "devices span several")
        self.device = devices[0]
        self.server = transfer.start_transfer_server(self.device.client, f"{host}:0",
                                                     [f"{host}:0"])
        self._conns: dict[str, transfer.TransferConnection] = {}
        self._one = jax.sharding.SingleDeviceSharding(self.device)

        def each(fn, pools) -> list:  # fn for the target pool's arrays, a draft's kept as is
            return [fn if i == 0 else _same for i, pool in enumerate(pools)
                    for _ in jax.tree.leaves(pool)]

        self._gather = jax.jit(lambda pools, ids: [
            f(a[:, ids]) for f, a in zip(each(heads.model_heads, pools), jax.tree.leaves(pools),
                                         strict=True)])
        self._scatter = jax.jit(
            lambda pools, ids, blocks: jax.tree.unflatten(jax.tree.structure(pools), [
                a.at[:, ids].set(f(b)) for f, a, b in zip(
                    each(heads.laid_out, pools), jax.tree.leaves(pools), blocks, strict=True)]),
            donate_argnums=(0,))

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, pools: tuple[KVCache, ...], block_ids: list[int], uuid: int,
              timeout_s: float) -> int:
        """Offer copies of `block_ids` of every pool for one pull under `uuid`; an offer not
        pulled within `timeout_s` is dropped. Returns the bytes offered."""
        arrays = []
        for start, size in _pieces(len(block_ids)):
            ids = np.asarray(block_ids[start:start + size], np.int32)
            arrays.extend(jax.device_put(self._gather(pools, ids), self._one))
        self.server.await_pull(uuid, arrays, timeout=_deadline(timeout_s))
        return sum(a.nbytes for a in arrays)

    def pull(self, address: str, uuid: int, pools: tuple[KVCache, ...], num_blocks: int,
             timeout_s: float) -> list[jax.Array]:
        """Pull the `num_blocks` blocks offered under `uuid` at `address` (blocking: call it
        off the engine thread). Raises jax's runtime error when the peer is gone."""
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = self.server.connect(address)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._one)
                 for _, size in _pieces(num_blocks)
                 for a in jax.eval_shape(self._gather, pools,
                                         jax.ShapeDtypeStruct((size,), np.int32))]
        arrays = conn.pull(uuid, specs, timeout=_deadline(timeout_s))
        jax.block_until_ready(arrays)  # a lost peer shows here, not in the engine's step
        return arrays

    def drop(self, address: str) -> None:
        """Forget the connection to a peer that failed (the next pull reconnects)."""
        self._conns.pop(address, None)

    def install(self, pools: tuple[KVCache, ...], block_ids: list[int],
                arrays: list[jax.Array]) -> tuple[KVCache, ...]:
        """Scatter pulled blocks into `block_ids` of every pool."""
        per_piece = len(jax.tree.leaves(pools))
        for i, (start, size) in enumerate(_pieces(len(block_ids))):
            ids = np.asarray(block_ids[start:start + size], np.int32)
            blocks = arrays[i * per_piece:(i + 1) * per_piece]
            pools = self._scatter(pools, ids, [jax.device_put(b, _replicated(a))
                                               for a, b in zip(jax.tree.leaves(pools), blocks,
                                                               strict=True)])
        return pools


def _same(x):
    return x


def _replicated(pool: jax.Array) -> jax.sharding.Sharding:
    """Whole on every device of `pool`: the scatter's blocks live where its pages do."""
    sharding = pool.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _deadline(timeout_s: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
