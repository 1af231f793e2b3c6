"""The backend behind each name: one module per backend, loaded when its backend is first asked for.

The GPU backends import Pallas' Mosaic GPU or Triton lowering, or Triton itself, which is slow
and needless on a machine that never runs them: so each module is imported here, on demand.
"""

from __future__ import annotations

import importlib

from jaxserve.kernels.attention.base import AttentionBackend, Backend


def backend(name: AttentionBackend | str) -> Backend:
    """The backend called `name` (its module in this package has its name); auto is no backend
    (choose.py resolves it)."""
    name = AttentionBackend(name)
    if name is AttentionBackend.AUTO:
        raise ValueError("attention_backend auto names no one backend: choose_attention() "
                         "resolves it")
    return importlib.import_module(f"{__package__}.{name.value}").BACKEND
