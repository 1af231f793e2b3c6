"""EngineConfig: one validated, frozen set of engine arguments."""

from __future__ import annotations

import dataclasses


def _pow2_range(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the bundled SmolLM2-135M
    dtype: str = "auto"  # "float32", "bfloat16", or "auto" (bf16 on GPU/TPU, f32 on CPU)
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the memory settings below
    kv_cache_memory_bytes: int = 1 << 30
    # Fraction of the accelerator's memory the engine may use in all (params included); the KV
    # pool gets what is left of it after the params. Needs device memory statistics (GPUs
    # report them); elsewhere kv_cache_memory_bytes applies.
    kv_cache_memory_fraction: float | None = None
    # Buckets; None derives them from the limits above.
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    block_buckets: tuple[int, ...] | None = None
    strict_compile: bool = False  # any compile after warmup() raises
    attention_backend: str = "auto"
    max_logprobs: int = 20
    seed: int = 0
    enable_step_trace: bool = False
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" | "static" (a baseline)
    priority_aging_s: float | None = None  # every this many seconds waited = one level higher
    preemption_mode: str = "recompute"  # "recompute" | "swap" (falls back to recompute when full)
    swap_space_bytes: int = 256 << 20  # host pool for swap preemption
    prefill_chunk_alignment: int = 1  # cut prompt chunks to multiples of this (not the last one)
    max_waiting_requests: int | None = None  # None: unbounded waiting queue

    def __post_init__(self):
        positive = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "kv_cache_memory_bytes")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), "
                             f"got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running sequence needs a token slot")
        if self.attention_backend not in ("auto", "reference", "pallas", "triton"):
            raise ValueError(f"attention_backend must be auto, reference, pallas or triton, "
                             f"got {self.attention_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "static"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or static, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, "
                             f"got {self.preemption_mode!r}")
        if self.priority_aging_s is not None and self.priority_aging_s <= 0:
            raise ValueError(f"priority_aging_s must be positive, got {self.priority_aging_s}")
        if self.prefill_chunk_alignment < 1:
            raise ValueError(f"prefill_chunk_alignment must be >= 1, "
                             f"got {self.prefill_chunk_alignment}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        for name in ("token_buckets", "seq_buckets", "block_buckets"):
            b = getattr(self, name)
            if b is not None and (not b or any(x <= 0 for x in b)):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {b!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def buckets(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(token, sequence, blocks-per-sequence) buckets; each ends at its limit."""
        tokens = self.token_buckets or _pow2_range(16, self.max_num_batched_tokens)
        seqs = self.seq_buckets or _pow2_range(min(4, self.max_num_seqs), self.max_num_seqs, 4)
        blocks = self.block_buckets or _pow2_range(min(4, self.max_blocks_per_seq),
                                                   self.max_blocks_per_seq, 4)
        tokens = tuple(sorted(set(tokens) | {self.max_num_batched_tokens}))
        seqs = tuple(sorted(set(seqs) | {self.max_num_seqs}))
        blocks = tuple(sorted(set(blocks) | {self.max_blocks_per_seq}))
        return tokens, seqs, blocks
