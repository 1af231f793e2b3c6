"""Attention kernels over the paged KV pool, and the choice between them.

| backend | where it runs | what it is |
| --- | --- | --- |
| reference | anywhere | plain jnp, gathers K/V per token: the oracle of the others |
| cpu | CPU with a C++ compiler; float32 | C++ kernel through XLA's FFI, built on first use |
| xla | anywhere | plain jnp for XLA:CPU: the reference, plus query tiles in prefill-heavy steps |
| mosaic | Hopper GPU (sm_90a); bf16/fp16 | Pallas kernel, Mosaic GPU lowering: TMA, wgmma |
| triton | GPU with jax-triton | Triton kernel through `jax_triton.triton_call` |
| pallas | GPU; CPU in interpret mode (slow: for tests) | Pallas kernel, Triton lowering |

`auto` on a CPU is cpu where it can run (else xla, with a warning saying why), and xla on other
platforms without a GPU kernel. On a GPU it takes the first of mosaic, triton, pallas that can run
with this JAX, device and model (the order of expected speed; Pallas' Triton lowering is
deprecated since JAX 0.11), warns for each one it passes over and why, and falls back to xla
(with a warning) rather than failing. This module imports jax only when a backend is selected,
so configuration code can name backends without loading jax.
"""

from __future__ import annotations

import enum
import functools
import logging
import warnings

log = logging.getLogger(__name__)


class AttentionBackend(enum.StrEnum):
    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"
    XLA = "xla"
    MOSAIC = "mosaic"
    TRITON = "triton"
    PALLAS = "pallas"


GPU_ORDER = (AttentionBackend.MOSAIC, AttentionBackend.TRITON, AttentionBackend.PALLAS)


def unavailable(backend: AttentionBackend, *, dtype=None, head_dim: int | None = None,
                groups: int | None = None, block_size: int | None = None,
                kv_dtype=None) -> str | None:
    """Why `backend` cannot run here (for a model of these shapes, where given), or None.
    `kv_dtype`: the KV pool's dtype where it is not the model's (kv_cache_dtype)."""
    import jax
    import jax.numpy as jnp

    platform = jax.default_backend()
    if backend in (AttentionBackend.REFERENCE, AttentionBackend.XLA):
        return None  # they compute in q's dtype whatever the pool's
    if backend is AttentionBackend.CPU:
        from kernels import cpu_attention

        why = cpu_attention.available(dtype, head_dim, groups)
        if why is None and kv_dtype is not None and jnp.dtype(kv_dtype) not in map(
                jnp.dtype, cpu_attention.PAGE_DTYPES):
            return f"it reads float32, float16 or bfloat16 pools, not {jnp.dtype(kv_dtype).name}"
        return why
    if kv_dtype is not None and dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return (f"it reads pools of the model's dtype ({jnp.dtype(dtype).name}), not "
                f"kv_cache_dtype {jnp.dtype(kv_dtype).name}")
    if backend is AttentionBackend.TRITON:
        from kernels import triton_attention

        return triton_attention.available()
    if backend is AttentionBackend.PALLAS:
        if platform not in ("gpu", "cpu"):
            return f"Pallas' Triton lowering cannot run on platform {platform!r}"
        try:
            import jax.experimental.pallas.triton  # noqa: F401
        except ImportError as e:  # removed from JAX after its deprecation in 0.11
            return f"this JAX has no Pallas Triton lowering ({e})"
        return None
    # MOSAIC
    if platform != "gpu":
        return f"it needs a Hopper GPU (sm_90a); the JAX platform here is {platform!r}"
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if not capability.startswith("9."):
        return f"it needs a Hopper GPU (sm_90a); this device's compute capability is {capability!r}"
    try:
        from kernels import mosaic_attention
    except ImportError as e:
        return f"this JAX has no Pallas Mosaic GPU backend ({e})"
    if None in (dtype, head_dim, groups, block_size):
        return None
    return mosaic_attention.supports(dtype, head_dim, groups, block_size)


def select_attention(name: str | AttentionBackend, **shapes):
    """Return (backend, attention fn) for `name`; fail now, not mid-request. `shapes`: the
    model's dtype, head_dim, groups (query heads per kv head) and block_size, which some
    kernels constrain (see `unavailable`)."""
    import jax

    try:
        backend = AttentionBackend(name)
    except ValueError:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(b.value for b in AttentionBackend)}; got {name!r}") from None
    platform = jax.default_backend()
    if backend is AttentionBackend.AUTO:
        backend = _auto(platform, shapes)
    else:
        why = unavailable(backend, **shapes)
        if why:
            raise ValueError(f"attention_backend {backend.value!r} cannot run here: {why}")
    if backend is AttentionBackend.REFERENCE:
        from kernels.reference import ragged_paged_attention_reference

        return backend, ragged_paged_attention_reference
    if backend is AttentionBackend.CPU:
        from kernels.cpu_attention import ragged_paged_attention_cpu

        return backend, ragged_paged_attention_cpu
    if backend is AttentionBackend.XLA:
        from kernels.xla_attention import ragged_paged_attention_xla

        return backend, ragged_paged_attention_xla
    if backend is AttentionBackend.MOSAIC:
        from kernels.mosaic_attention import ragged_paged_attention_mosaic

        return backend, ragged_paged_attention_mosaic
    if backend is AttentionBackend.PALLAS:
        from kernels.pallas_attention import ragged_paged_attention

        # On a CPU the kernel body runs in Pallas' interpreter: correct, slow, for testing.
        return backend, functools.partial(ragged_paged_attention, interpret=platform == "cpu")
    from kernels import triton_attention

    return backend, triton_attention.ragged_paged_attention_triton


def _auto(platform: str, shapes: dict) -> AttentionBackend:
    if platform == "cpu":
        choice = AttentionBackend.CPU
        why = unavailable(choice, **shapes)
        if why:
            choice = AttentionBackend.XLA
            warnings.warn(f"attention_backend auto: passing over 'cpu': {why}; using 'xla' "
                          "(plain jnp, slower)", stacklevel=3)
    elif platform != "gpu":
        choice = AttentionBackend.XLA
    else:
        for backend in GPU_ORDER:
            why = unavailable(backend, **shapes)
            if why is None:
                choice = backend
                break
            warnings.warn(f"attention_backend auto: passing over {backend.value!r}: {why}",
                          stacklevel=3)
        else:
            choice = AttentionBackend.XLA
            warnings.warn("attention_backend auto: no GPU kernel can run here; using 'xla' "
                          "(plain jnp), which is much slower on a GPU", stacklevel=3)
    log.info("attention_backend auto: %s on %s", choice.value, platform)
    return choice
