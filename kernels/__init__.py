"""Attention kernels over the paged KV pool, and the choice between them.

| backend | where it runs | what it is |
| --- | --- | --- |
| reference | anywhere | plain jnp, gathers K/V per token: the oracle of the others |
| xla | anywhere | plain jnp for XLA:CPU: the reference, plus query tiles in prefill-heavy steps |
| pallas | GPU; CPU in interpret mode (slow: for tests) | Pallas kernel, Triton lowering |
| triton | GPU with jax-triton | Triton kernel through `jax_triton.triton_call` |

`auto` picks pallas on a GPU and xla elsewhere. This module imports jax only when a backend
is selected, so configuration code can name backends without loading jax.
"""

from __future__ import annotations

import enum
import functools


class AttentionBackend(enum.StrEnum):
    AUTO = "auto"
    REFERENCE = "reference"
    XLA = "xla"
    PALLAS = "pallas"
    TRITON = "triton"


def select_attention(name: str | AttentionBackend):
    """Return (backend, attention fn) for `name`; fail now, not mid-request."""
    import jax

    try:
        backend = AttentionBackend(name)
    except ValueError:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(b.value for b in AttentionBackend)}; got {name!r}") from None
    platform = jax.default_backend()
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.XLA
    if backend is AttentionBackend.REFERENCE:
        from kernels.reference import ragged_paged_attention_reference

        return backend, ragged_paged_attention_reference
    if backend is AttentionBackend.XLA:
        from kernels.xla_attention import ragged_paged_attention_xla

        return backend, ragged_paged_attention_xla
    if backend is AttentionBackend.PALLAS:
        from kernels.pallas_attention import ragged_paged_attention

        if platform not in ("gpu", "cpu"):
            raise ValueError(f"attention_backend 'pallas' cannot run on platform {platform!r}; "
                             f"use 'reference'")
        # On a CPU the kernel body runs in Pallas' interpreter: correct, slow, for testing.
        return backend, functools.partial(ragged_paged_attention, interpret=platform == "cpu")
    from kernels import triton_attention

    reason = triton_attention.available()
    if reason:
        raise ValueError(f"attention_backend 'triton' cannot run here: {reason}")
    return backend, triton_attention.ragged_paged_attention_triton
