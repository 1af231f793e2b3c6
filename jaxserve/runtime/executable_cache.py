"""Compiled step programs kept on disk whole, so that a warm start neither traces nor lowers.

JAX's persistent compilation cache (compile_cache.py) saves XLA's work, but it finds an entry by
the program's HLO, so every start still traced and lowered the Flax model once per bucket, which
took most of a warm start. This cache stores each compiled executable
(`jax.experimental.serialize_executable`) under a key of everything that decides the program,
without building it:

- the source that builds the step: `jaxserve/runtime`, `jaxserve/config.py`, `models`,
  `kernels` (any edit there, C++ included, makes new keys);
- jax and jaxlib versions, the backend and its version, the execution devices and the host CPU's
  model and instruction flags (code built for one CPU's instructions must not run on another);
- XLA_FLAGS and the jax options that change lowering (x64, matmul precision, PRNG);
- what the runner compiles against: the engine config, the model configs, the abstract params,
  pools and inputs (tree structure, shapes, dtypes, shardings);
- the program: token, sequence and block buckets, proposal slots.

An entry that fails to load is removed and its program built again. Only programs that XLA
really compiled are stored: an executable that XLA:CPU loaded from JAX's cache serializes without
its kernels (it then fails at run time with "Function ... not found"), so a program that came
from JAX's cache is left to it. The runner names its step after the source digest, so after an
upgrade JAX's cache misses too and the program is compiled, and stored here, once. (A changed
setting that leaves the HLO as it was still finds JAX's entry: such a start traces the model as
it did before this cache.) Entries live beside JAX's cache (`<compilation cache dir>/executables`)
and are off with it. Only single-process runs use them: across processes every peer builds its
programs together.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import pickle
import threading

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve.kernels.cache_dir import host_cpu
from jaxserve.kernels.cache_dir import source_digest as files_digest

logger = logging.getLogger(__name__)

# JAX's cache hits, counted per thread (a compile records its hit in the thread that runs it).
_thread = threading.local()


def _count_hit(name: str, **_) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _thread.xla_cache_hits = getattr(_thread, "xla_cache_hits", 0) + 1


jax.monitoring.register_event_listener(_count_hit)

# The code that builds a step program: the runtime, the models, the kernels, the buckets.
_SOURCES = ("jaxserve.runtime", "jaxserve.config", "jaxserve.models", "jaxserve.kernels")
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable")


@functools.cache
def source_digest() -> str:
    """sha256 over the source that builds the step (Python, and the C++ kernels it calls)."""
    root = os.path.dirname(os.path.dirname(importlib.util.find_spec("jaxserve").origin))
    # A package's folder, a module's file: where they are installed, which for kernels and
    # models is beside jaxserve/ in a source tree and inside it in a wheel.
    paths = [importlib.util.find_spec(m).origin for m in _SOURCES]
    paths = [os.path.dirname(p) if p.endswith("__init__.py") else p for p in paths]
    return files_digest(root, [os.path.relpath(p, root) for p in paths])


def abstract(tree) -> str:
    """A pytree's structure with each leaf's shape, dtype and sharding: what a program is
    compiled against, not the values."""
    def leaf(a):
        return (tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None)))
    return f"{jax.tree.structure(tree)}|{jax.tree.leaves(jax.tree.map(leaf, tree))}"


class ExecutableCache:
    def __init__(self, directory: str, context: str, devices: list):
        """`context`: everything the runner compiles against (see the module doc); `devices`:
        the execution devices, in the order the programs were built for."""
        self.directory = directory
        self.devices = devices
        backend = devices[0].client
        self._key = "\n".join([
            source_digest(), jax.__version__, jaxlib.__version__,
            backend.platform, backend.platform_version, repr([str(d) for d in devices]),
            repr([d.device_kind for d in devices]), host_cpu(), os.environ.get("XLA_FLAGS", ""),
            repr([getattr(jax.config, o, None) for o in _JAX_OPTIONS]), context])
        self.num_loaded = 0

    @classmethod
    def create(cls, compilation_cache_dir: str | None, context: str,
               devices: list) -> ExecutableCache | None:
        if not compilation_cache_dir or jax.process_count() > 1:
            return None
        directory = os.path.join(compilation_cache_dir, "executables")
        os.makedirs(directory, exist_ok=True)
        return cls(directory, context, devices)

    def _path(self, program: tuple) -> str:
        digest = hashlib.sha256(f"{self._key}\n{program}".encode()).hexdigest()[:40]
        return os.path.join(self.directory, f"{digest}.exe")

    def load(self, program: tuple) -> jax.stages.Compiled | None:
        path = self._path(program)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            exe = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=self.devices[0].client,
                execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - a bad entry is built again, never fatal
            logger.warning("executable cache: could not load %s (%s); removed it", path, e)
            with contextlib.suppress(OSError):
                os.remove(path)
            return None
        self.num_loaded += 1
        return exe

    def compile(self, program: tuple, lowered: jax.stages.Lowered,
                options: dict | None = None) -> jax.stages.Compiled:
        """XLA's compile (or load from JAX's cache) of `lowered` with compiler `options`;
        stored here if compiled."""
        before = getattr(_thread, "xla_cache_hits", 0)
        exe = lowered.compile(options)
        if getattr(_thread, "xla_cache_hits", 0) == before:
            self.store(program, exe)
        return exe

    def store(self, program: tuple, exe: jax.stages.Compiled) -> None:
        path = self._path(program)
        try:
            data = pickle.dumps(serialize_executable.serialize(exe))
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - caching is an optimisation only
            logger.warning("executable cache: could not store program %s: %s", program, e)
