"""The C++ kernels for CPUs (`kernels/cpu/*.cc`), built into one library and registered as XLA
FFI targets.

The library is compiled on first use with the machine's C++ compiler ($CXX, else c++, g++ or
clang++) for this CPU (-march=native), against the FFI headers that ship with jaxlib, and kept
in $JAXSERVE_CACHE_DIR/kernels (else ~/.cache/jaxserve/kernels) under a key of everything that
went into it, so later starts only load it (processes that start together build it once: the
others wait for that build). Where no compiler works, `library()` returns why,
and the callers choose their jnp paths instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

import jax

from jaxserve.kernels.cache_dir import cache_home, host_cpu

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "cpu")
# FFI target name -> the handler symbol the library exports for it.
TARGETS = {
    "jaxserve_ragged_paged_attention": "RaggedPagedAttention",
    "jaxserve_block_matmul": "BlockMatmul",
    "jaxserve_block_matmul_q4": "BlockMatmulQ4",
    "jaxserve_block_matmul_q4f": "BlockMatmulQ4F",
    "jaxserve_block_matmul_q8": "BlockMatmulQ8",
    "jaxserve_block_matmul_q8h": "BlockMatmulQ8H",
    "jaxserve_block_matmul_q4k": "BlockMatmulQ4K",
    "jaxserve_block_matmul_q6": "BlockMatmulQ6",
    "jaxserve_block_matmul_q6h": "BlockMatmulQ6H",
    "jaxserve_grouped_block_matmul": "GroupedBlockMatmul",
    "jaxserve_grouped_block_matmul_q4": "GroupedBlockMatmulQ4",
    "jaxserve_grouped_block_matmul_q4f": "GroupedBlockMatmulQ4F",
    "jaxserve_grouped_block_matmul_q8": "GroupedBlockMatmulQ8",
    "jaxserve_grouped_block_matmul_q8h": "GroupedBlockMatmulQ8H",
    "jaxserve_grouped_block_matmul_q4k": "GroupedBlockMatmulQ4K",
    "jaxserve_grouped_block_matmul_q6": "GroupedBlockMatmulQ6",
    "jaxserve_grouped_block_matmul_q6h": "GroupedBlockMatmulQ6H",
}
# -ffp-contract=off: a product and a sum fuse into an FMA only where the source says so, never
# by the compiler's choice per call site, which could round a row differently in two code paths.
FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=off", "-w")
# The instruction sets a build may use, named by $JAXSERVE_CPU_ISA: all this CPU has, or fewer
# (turned off on top of -march=native), so that one machine runs the paths of CPUs with less:
# AVX2 without AVX-512, and no AVX2 (the portable loops). Where the CPU lacks a set already, the
# build is its own path again.
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2", "-mno-avx512f")}
ISA_ENV = "JAXSERVE_CPU_ISA"


def isa_flags() -> tuple[str, ...]:
    """The flags of the build that $JAXSERVE_CPU_ISA names (native when unset)."""
    name = os.environ.get(ISA_ENV) or "native"
    if name not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}; got {name!r}")
    return ISA_FLAGS[name]


def sources() -> list[str]:
    """The translation units (.cc) and the headers they share, in a fixed order."""
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "*.cc")) +
                  glob.glob(os.path.join(SOURCE_DIR, "*.h")))


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cxx: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Compile the kernels (or find them already compiled) -> the shared library's path.
    `extra_flags` follow FLAGS (ISA_FLAGS' sets, for the paths of CPUs with fewer
    instructions)."""
    flags = (*FLAGS, *extra_flags)
    files = sources()
    texts = []
    for path in files:
        with open(path, "rb") as f:
            texts.append(os.path.basename(path).encode() + b"\0" + f.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in (
        *texts, version, " ".join(flags), jax.ffi.include_dir(), jax.__version__,
        host_cpu()))).hexdigest()[:20]
    home = cache_home()
    root = os.path.join(home, "kernels") if home else tempfile.gettempdir()
    lib = os.path.join(root, f"jaxserve_cpu_{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(root, exist_ok=True)
    # One build at a time per library: a process that finds another building it waits, then
    # finds it built. The lock file goes once the library is in place (a process arriving
    # later finds the library; one that opened the lock before waits on it all the same).
    with open(lib + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.exists(lib):
                _compile(cxx, flags, files, root, lib)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lib + ".lock")
    return lib


def _compile(cxx: str, flags: tuple[str, ...], files: list[str], root: str, lib: str) -> None:
    # Built under a temporary name and renamed: a process never loads half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    units = [p for p in files if p.endswith(".cc")]
    cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), *units, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr[-2000:]}")
    os.replace(tmp, lib)


@functools.cache
def library():
    """Build, load and register the kernels once per process -> the library, or why not."""
    if jax.default_backend() != "cpu":
        return f"it runs on CPUs; the JAX platform here is {jax.default_backend()!r}"
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    try:
        return load(build(cxx, isa_flags()))
    except (OSError, RuntimeError) as e:
        return str(e)


def load(path: str, suffix: str = ""):
    """Load the library at `path` and register its handlers, each as FFI target name +
    `suffix` (tests register builds for other CPUs beside this one's) -> the library."""
    import ctypes

    lib = ctypes.cdll.LoadLibrary(path)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target + suffix, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib
