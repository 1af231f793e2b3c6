"""Attention kernels over the paged KV pool, and the choice between them.

| backend | where it runs | what it is |
| --- | --- | --- |
| reference | anywhere | plain jnp, gathers K/V per token (the CPU path and the oracle) |
| pallas | GPU; CPU in interpret mode (slow: for tests) | Pallas kernel, Triton lowering |
| triton | GPU with jax-triton | Triton kernel through `jax_triton.triton_call` |

`auto` picks pallas on a GPU and reference elsewhere.
"""

from __future__ import annotations

import functools

import jax

from kernels.reference import ragged_paged_attention_reference

BACKENDS = ("reference", "pallas", "triton")


def select_attention(name: str):
    """Return (backend name, attention fn) for `name`; fail now, not mid-request."""
    platform = jax.default_backend()
    if name == "auto":
        name = "pallas" if platform == "gpu" else "reference"
    if name == "reference":
        return name, ragged_paged_attention_reference
    if name == "pallas":
        from kernels.pallas_attention import ragged_paged_attention

        if platform not in ("gpu", "cpu"):
            raise ValueError(f"attention_backend 'pallas' cannot run on platform {platform!r}; "
                             f"use 'reference'")
        # On a CPU the kernel body runs in Pallas' interpreter: correct, slow, for testing.
        return name, functools.partial(ragged_paged_attention, interpret=platform == "cpu")
    if name == "triton":
        from kernels import triton_attention

        reason = triton_attention.available()
        if reason:
            raise ValueError(f"attention_backend 'triton' cannot run here: {reason}")
        return name, triton_attention.ragged_paged_attention_triton
    raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
