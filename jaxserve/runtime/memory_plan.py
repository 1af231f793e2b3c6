"""How a device's memory is split: the weights, the step programs' temporaries, the KV pool.

On a device that reports its memory (a GPU), `kv_cache_memory_fraction` (vLLM's
`--gpu-memory-utilization`) is the share of it the engine may use: the KV pool gets what that
share leaves after the weights and the largest step program's temporaries, which are read from
the compiled program (`memory_analysis()`), not guessed. Elsewhere the pool is
`kv_cache_memory_bytes`. Either way the plan is what the server prints at start, and what the
deviceless GPU report (jaxserve/bench/gpu_cost.py) gives for a target it has no device of.
Every figure is per device: under tensor parallelism each holds its share of the weights and of
every block."""

from __future__ import annotations

import dataclasses

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int  # the step's params on one device
    temporaries_bytes: int | None  # the largest step program's scratch; None: not measured
    kv_bytes: int  # the pool: num_blocks whole blocks
    block_bytes: int  # one block of every layer's K and V on one device
    block_size: int
    max_model_len: int
    device_bytes: int | None = None  # the device's memory, where the plan was made from it
    utilization: float | None = None  # the share of it the engine may use

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    @property
    def max_seqs_at_max_model_len(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once."""
        return self.num_blocks // -(-self.max_model_len // self.block_size)

    def as_dict(self) -> dict:
        return {"weights_bytes_per_device": self.weights_bytes,
                "temporaries_bytes_per_device": self.temporaries_bytes,
                "kv_bytes_per_device": self.kv_bytes, "block_bytes_per_device": self.block_bytes,
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len,
                "max_seqs_at_max_model_len": self.max_seqs_at_max_model_len,
                "device_bytes": self.device_bytes, "utilization": self.utilization}

    def describe(self) -> str:
        gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        head = ("" if self.device_bytes is None else
                f"{self.utilization:g} of {gib(self.device_bytes)}: ")
        temps = ("not measured" if self.temporaries_bytes is None
                 else gib(self.temporaries_bytes))
        return (f"memory plan per device: {head}weights {gib(self.weights_bytes)}, step "
                f"temporaries {temps}, KV pool {gib(self.kv_bytes)} = {self.num_blocks} blocks "
                f"of {self.block_size} tokens, {self.max_seqs_at_max_model_len} sequences of "
                f"max_model_len {self.max_model_len}")


def from_device(device_bytes: int, utilization: float, weights_bytes: int,
                temporaries_bytes: int, block_bytes: int, block_size: int,
                max_model_len: int) -> MemoryPlan:
    """The plan that gives the pool what `utilization` of `device_bytes` leaves after the
    weights and temporaries; raises when nothing is left for one sequence."""
    free = int(device_bytes * utilization) - weights_bytes - temporaries_bytes
    one_seq = block_bytes * -(-max_model_len // block_size)
    plan = MemoryPlan(weights_bytes, temporaries_bytes, max(0, free) // block_bytes * block_bytes,
                      block_bytes, block_size, max_model_len, device_bytes, utilization)
    if plan.num_blocks < -(-max_model_len // block_size):
        raise ValueError(
            f"kv_cache_memory_fraction={utilization}: {utilization:g} of the device's "
            f"{device_bytes / GIB:.2f} GiB less the weights ({weights_bytes / GIB:.2f} GiB) and "
            f"the step's temporaries ({temporaries_bytes / GIB:.2f} GiB) leaves "
            f"{max(0, free) / GIB:.2f} GiB for the KV pool, less than one sequence of "
            f"max_model_len {max_model_len} needs ({one_seq / GIB:.2f} GiB); "
            f"raise the fraction or lower max_model_len")
    return plan


def from_blocks(num_blocks: int, weights_bytes: int, block_bytes: int, block_size: int,
                max_model_len: int, temporaries_bytes: int | None = None) -> MemoryPlan:
    """The plan of a pool of `num_blocks` (num_kv_blocks, or kv_cache_memory_bytes' share)."""
    return MemoryPlan(weights_bytes, temporaries_bytes, num_blocks * block_bytes, block_bytes,
                      block_size, max_model_len)
