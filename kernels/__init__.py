"""Attention kernels over the paged KV pool, and the choice between them."""

from __future__ import annotations

import jax

from kernels.reference import ragged_paged_attention_reference

BACKENDS = ("reference", "pallas", "triton")


def select_attention(name: str):
    """Return (backend name, attention fn) for `name`, failing now rather than mid-request."""
    platform = jax.default_backend()
    if name == "auto":
        name = "reference"
    if name == "reference":
        return name, ragged_paged_attention_reference
    raise ValueError(
        f"attention_backend {name!r} cannot run on platform {platform!r} in this build; "
        f"available here: ['reference']")
