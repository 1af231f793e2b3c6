"""Ragged paged attention as a C++ kernel for CPUs, called through XLA's FFI: the default
attention backend off a GPU.

The kernel (`cpu/paged_attention.cc`) reads every key and value row in place in the pool,
once per query tile (a decode row, or up to `block_q` rows of one prompt chunk), and only up
to the tile's own positions. The jnp backends instead gather each row's padded context into a
new array and read it two more times (transpose, dots). On SmolLM2-135M's decode steps the
kernel's attention took ~2.5x less time than the `xla` backend's (see the README).

It is compiled on first use with the machine's C++ compiler ($CXX, else c++, g++ or clang++)
for this CPU (-march=native), against the FFI headers that ship with jaxlib, and kept in
$JAXSERVE_CACHE_DIR/kernels (else ~/.cache/jaxserve/kernels) under a key of everything that
went into it, so later starts only load it. Where no compiler works, `available()` says why and
`auto` takes the `xla` backend instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from kernels.metadata import AttentionMetadata, check_attention_inputs
from models.cache import cache_home, host_cpu

SOURCE = os.path.join(os.path.dirname(__file__), "cpu", "paged_attention.cc")
TARGET = "jaxserve_ragged_paged_attention"
MAX_GROUPS = 16  # query heads per kv head
FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fno-math-errno", "-w")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cxx: str) -> str:
    """Compile the kernel (or find it already compiled) -> the shared library's path."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in (
        source, version, " ".join(FLAGS), jax.ffi.include_dir(), jax.__version__,
        host_cpu()))).hexdigest()[:20]
    home = cache_home()
    root = os.path.join(home, "kernels") if home else tempfile.gettempdir()
    lib = os.path.join(root, f"paged_attention_{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(root, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {os.path.basename(SOURCE)} failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr[-2000:]}")
    os.replace(tmp, lib)
    return lib


@functools.cache
def _library():
    """Build, load and register the kernel once per process -> the library, or why not."""
    import ctypes

    if jax.default_backend() != "cpu":
        return f"it runs on CPUs; the JAX platform here is {jax.default_backend()!r}"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    try:
        lib = ctypes.cdll.LoadLibrary(_build(cxx))
    except (OSError, RuntimeError) as e:
        return str(e)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RaggedPagedAttention),
                                platform="cpu")
    return lib


@functools.cache
def head_dims() -> tuple[int, ...]:
    """The head dims the built kernel has code for (the list lives in the C++ source)."""
    import ctypes

    lib = _library()
    if isinstance(lib, str):
        return ()
    out = (ctypes.c_int64 * 64)()
    lib.RaggedPagedAttentionHeadDims.restype = ctypes.c_int64
    count = lib.RaggedPagedAttentionHeadDims(out, 64)
    return tuple(out[:count])


def available(dtype=None, head_dim: int | None = None, groups: int | None = None) -> str | None:
    """Why the kernel cannot run here for a model of these shapes (where given), or None."""
    if dtype is not None and jnp.dtype(dtype) != jnp.float32:
        return f"it reads float32 pages; the model's dtype is {jnp.dtype(dtype).name}"
    if groups is not None and groups > MAX_GROUPS:
        return f"{groups} query heads per kv head (at most {MAX_GROUPS})"
    lib = _library()
    if isinstance(lib, str):
        return lib
    if head_dim is not None and head_dim not in head_dims():
        return f"head_dim {head_dim} is not one of {head_dims()}"
    return None


def ragged_paged_attention_cpu(
    q: jax.Array,  # (T, N, H) float32
    k_pool: jax.Array,  # (L, P, B, K, H) float32
    v_pool: jax.Array,  # (L, P, B, K, H) float32
    layer: jax.Array | int,  # () int32
    md: AttentionMetadata,
    *,
    scale: float | None = None,
    block_q: int = 16,
) -> jax.Array:  # (T, N, H) float32; padding rows are zeros
    """Same contract as `ragged_paged_attention_reference`; query tiles of `block_q` rows."""
    check_attention_inputs(q, k_pool, v_pool, md)
    why = available(q.dtype, q.shape[-1], q.shape[1] // k_pool.shape[3])
    if why:
        raise ValueError(f"the cpu attention kernel cannot run: {why}")
    if not 1 <= block_q <= 64:
        raise ValueError(f"block_q must be in [1, 64], got {block_q}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), md.block_tables,
                md.positions, md.query_start_loc, scale=np.float32(scale),
                block_q=np.int64(block_q))
