"""Ragged paged attention as a C++ kernel for CPUs, called through XLA's FFI: auto's choice on a
CPU wherever it can run.

The kernel (`cpu/paged_attention.cc`) reads every key and value row in place in the pool, once
per query tile (a decode row, or up to `block_q` rows of one prompt chunk), and only up to the
tile's own positions, where the jnp backends gather each row's padded context into a new array
and read it twice more (transpose, dots).

It reads float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 pools; narrower ones are
widened to float32 as they load (exactly), so attention streams half or a quarter of the bytes.
An fp8 pool's k_scale is folded into the softmax scale and its v_scale into the output (the
same products as scaling each key and value, one multiply per score and output). It is built
with the other CPU kernels by `kernels/cpu_library.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.attention.base import NO_WINDOW, AttentionBackend, Backend, platform_of
from jaxserve.kernels.attention.metadata import AttentionMetadata, check_attention_inputs
from jaxserve.kernels.cpu_library import library

TARGET = "jaxserve_ragged_paged_attention"
MAX_GROUPS = 16  # query heads per kv head
# Pool dtypes it reads: narrower pools are widened to float32 as they load.
PAGE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)


@functools.cache
def head_dims() -> tuple[int, ...]:
    """The head dims the built kernel has code for (the list lives in the C++ source)."""
    import ctypes

    lib = library()
    if isinstance(lib, str):
        return ()
    out = (ctypes.c_int64 * 64)()
    lib.RaggedPagedAttentionHeadDims.restype = ctypes.c_int64
    count = lib.RaggedPagedAttentionHeadDims(out, 64)
    return tuple(out[:count])


def ragged_paged_attention_cpu(
    q: jax.Array,  # (T, N, H) float32
    k_pool: jax.Array,  # (L, P, B, K, H) of PAGE_DTYPES (both pools alike)
    v_pool: jax.Array,  # (L, P, B, K, H)
    layer: jax.Array | int,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    window: jax.Array | int | None = None,
    block_q: int = 16,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # (T, N, H) float32; padding rows are zeros
    """Same contract as `ragged_paged_attention_reference`; query tiles of `block_q` rows.
    A tile reads its keys from its first row's window on, not from the sequence's start."""
    check_attention_inputs(q, k_pool, v_pool, md, PAGE_DTYPES)
    why = BACKEND.unavailable(dtype=q.dtype, head_dim=q.shape[-1],
                              groups=q.shape[1] // k_pool.shape[3])
    if why:
        raise ValueError(f"the cpu attention kernel cannot run: {why}")
    if not 1 <= block_q <= 64:
        raise ValueError(f"block_q must be in [1, 64], got {block_q}")
    scale = (q.shape[-1] ** -0.5 if scale is None else scale) * k_scale
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    out = call(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), md.block_tables,
               md.positions, md.query_start_loc, window, scale=np.float32(scale),
               block_q=np.int64(block_q))
    return out if v_scale == 1.0 else out * v_scale


class CpuBackend(Backend):
    name = AttentionBackend.CPU
    table_width_free = True  # it walks each row's pages up to its position

    def unavailable(self, *, dtype=None, head_dim=None, groups=None, kv_dtype=None, device=None,
                    **_):
        if device is not None and platform_of(device) != "cpu":
            return f"it runs on CPUs; the step is compiled for {platform_of(device)!r}"
        if dtype is not None and jnp.dtype(dtype) != jnp.float32:
            return f"it reads float32 pages; the model's dtype is {jnp.dtype(dtype).name}"
        if groups is not None and groups > MAX_GROUPS:
            return f"{groups} query heads per kv head (at most {MAX_GROUPS})"
        lib = library()
        if isinstance(lib, str):
            return lib
        if head_dim is not None and head_dim not in head_dims():
            return f"head_dim {head_dim} is not one of {head_dims()}"
        if kv_dtype is not None and jnp.dtype(kv_dtype) not in map(jnp.dtype, PAGE_DTYPES):
            names = ", ".join(jnp.dtype(d).name for d in PAGE_DTYPES)
            return f"it reads {names} pools, not {jnp.dtype(kv_dtype).name}"
        return None

    def fn(self):
        return ragged_paged_attention_cpu


BACKEND = CpuBackend()
