"""The backend behind each name: one module per backend, loaded when its backend is first asked for.

The GPU backends import Pallas' Mosaic GPU or Triton lowering, or Triton itself, which is slow
and needless on a machine that never runs them: so each module is imported here, on demand.
"""

from __future__ import annotations

from jaxserve.kernels.attention.base import AttentionBackend, Backend


def backend(name: AttentionBackend | str) -> Backend:
    """The backend called `name`; auto is no backend (choose.py resolves it)."""
    name = AttentionBackend(name)
    if name is AttentionBackend.REFERENCE:
        from jaxserve.kernels.attention import reference as module
    elif name is AttentionBackend.CPU:
        from jaxserve.kernels.attention import cpu as module
    elif name is AttentionBackend.XLA:
        from jaxserve.kernels.attention import xla as module
    elif name is AttentionBackend.MOSAIC:
        from jaxserve.kernels.attention import mosaic as module
    elif name is AttentionBackend.TRITON:
        from jaxserve.kernels.attention import triton as module
    elif name is AttentionBackend.PALLAS:
        from jaxserve.kernels.attention import pallas as module
    else:
        raise ValueError("attention_backend auto names no one backend: choose_attention() "
                         "resolves it")
    return module.BACKEND
