"""JAX's persistent compilation cache, on by default: a second start of the CLI or the server
loads its step programs from disk instead of compiling every bucket again.

The cache lives in `EngineConfig.compilation_cache_dir`, else $JAXSERVE_CACHE_DIR/xla, else
~/.cache/jaxserve/xla; an empty string (or JAXSERVE_CACHE_DIR="") turns it off. A process that
configured JAX's cache itself keeps its own setting.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxserve.kernels.cache_dir import cache_home

logger = logging.getLogger(__name__)


def default_dir() -> str | None:
    home = cache_home()
    return None if home is None else os.path.join(home, "xla")


def enable(path: str | None) -> str | None:
    """Point JAX's persistent cache at `path` (None: `default_dir()`; "": off) unless it is
    already configured; returns the directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = default_dir() if path is None else path
    if not path:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # A step program compiles in about a second on a CPU, under JAX's default threshold for
    # caching; every one of them is worth keeping.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("XLA compilation cache: %s", path)
    return path
