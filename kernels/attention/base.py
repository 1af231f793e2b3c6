"""The attention backend contract: what a backend takes, what it refuses, and how auto asks it.

A backend's function (`AttentionFn`) takes one step's query rows and the paged K/V pool of every
layer, and returns the rows' attention; reference.py is its oracle and states the semantics. A
backend refuses, with a reason, where it cannot run: the platform, a package missing, or a model
whose dtype, head_dim, query heads per kv head, block size or KV pool dtype it has no code for
(`Backend.unavailable`). A backend named in the config that refuses fails at engine start; auto
asks each candidate the same question and self-tests those that accept (choose.py).

This module imports no jax, so configuration can name backends without loading it.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import jax

    from jaxserve.kernels.attention.metadata import AttentionMetadata


# The window of a layer that has none, where a kernel takes a number: wider than any context.
NO_WINDOW = 1 << 30


class AttentionBackend(enum.StrEnum):
    """The names a config may give; auto names no backend of its own (choose.py)."""

    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"
    XLA = "xla"
    MOSAIC = "mosaic"
    TRITON = "triton"
    PALLAS = "pallas"


class AttentionFn(Protocol):
    def __call__(
        self,
        q: jax.Array,  # (T, N, H)
        k_pool: jax.Array,  # (L, P, B, K, H)
        v_pool: jax.Array,  # (L, P, B, K, H)
        layer: jax.Array | int,  # () int32: the layer of the pools to read
        md: AttentionMetadata,
        *,
        scale: float | None = None,  # default H ** -0.5
        window: jax.Array | int | None = None,  # () int32: keys a row sees, its own included
        k_scale: float = 1.0,  # the pools hold K / k_scale (an fp8 pool's, kv_write.py)
        v_scale: float = 1.0,  # ... and V / v_scale
    ) -> jax.Array:  # (T, N, H) in q's dtype; padding rows unspecified
        ...


class Backend(abc.ABC):
    """One attention backend: its name, why it cannot run here, its function."""

    name: ClassVar[AttentionBackend]
    # Whether its cost follows each row's context alone, not the block table's width: then
    # one table width (max_model_len's) serves every step, and a blocks bucket is one program.
    table_width_free: ClassVar[bool] = False

    def unavailable(self, *, dtype=None, head_dim: int | None = None, groups: int | None = None,
                    block_size: int | None = None, kv_dtype=None, device=None) -> str | None:
        """Why the backend cannot run here for a model of these shapes, or None. A shape left
        None is not asked about. `dtype`: the model's; `groups`: query heads per kv head;
        `kv_dtype`: the KV pool's, where kv_cache_dtype makes it other than `dtype`;
        `device`: the device the step is compiled for (default: JAX's first), which may be a
        compile-only one of a GPU target description. This default is plain jnp's answer: it
        runs anywhere, in q's dtype whatever the pool's."""
        return None

    @abc.abstractmethod
    def fn(self) -> AttentionFn:
        """The attention function (whether it can run is `unavailable`'s answer, not this)."""


def platform_of(device=None) -> str:
    """The JAX platform `device` belongs to ("gpu" for CUDA), default JAX's own."""
    import jax  # here, not at the top: config imports this module without jax

    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in ("cuda", "rocm") else device.platform


# The 8-bit float pools of kv_cache_dtype fp8 / fp8_e5m2, by name.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def is_fp8(dtype) -> bool:
    """Whether `dtype` is one of the 8-bit float pool dtypes."""
    import jax.numpy as jnp  # here, not at the top: config imports this module without jax

    return dtype is not None and jnp.dtype(dtype).name in FP8_DTYPES


def pool_of_model_dtype(dtype, kv_dtype, fp8: bool = False) -> str | None:
    """Why a kernel that reads pools of the model's own dtype (and, with `fp8`, 8-bit float
    pools, widened as they load) refuses `kv_dtype`, or None."""
    import jax.numpy as jnp  # here, not at the top: config imports this module without jax

    if fp8 and is_fp8(kv_dtype):
        return None
    if kv_dtype is not None and dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        also = " or an fp8 one" if fp8 else ""
        return (f"it reads pools of the model's dtype ({jnp.dtype(dtype).name}){also}, not "
                f"kv_cache_dtype {jnp.dtype(kv_dtype).name}")
    return None
