"""`auto`'s choice of attention backend, made on the device by a self-test.

Each candidate of the platform (`CANDIDATES`; on a GPU mosaic, triton, pallas and xla) that its
backend's `unavailable()` allows is compiled and run on one mixed ragged batch (decodes and
prefill chunks over shuffled pages, with padding rows and sequences) at the model's head shapes
and dtypes, compared with the reference computed in float32 (`TOLERANCE` by dtype), and timed
on a decode-only and a mixed batch (`timing_batches`). `auto` takes the fastest that passes, by
the sum of the two times; one that is unavailable, fails to lower or compile, raises, or differs
from the reference is passed over with a warning that says why. xla is the last resort when
none passes. A fixed order cannot do this: which backend is fastest depends on the device, the
JAX version and the dtype.

The result is kept as JSON in $JAXSERVE_CACHE_DIR/autotune (else ~/.cache/jaxserve/autotune;
JAXSERVE_CACHE_DIR="" turns it off) under a key of the device kind, the platform and JAX
versions, the kernels' source, the head shapes, the dtypes and the candidates, so a warm start
reads its choice instead of testing again; deleting the file tests again.

A platform without an entry in `CANDIDATES` keeps choose.py's fixed rule. A candidate is a
backend's name or a `Candidate` with a function of its own (tests set `CANDIDATES["cpu"]` to run
all of this on a CPU, with candidates broken on purpose).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib

from jaxserve.kernels.attention.base import AttentionBackend
from jaxserve.kernels.attention.ragged import ragged_metadata
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from jaxserve.kernels.attention.registry import backend as get_backend
from jaxserve.kernels.cache_dir import cache_home, source_digest

log = logging.getLogger(__name__)

_FORMAT = 1  # bump when a cached result's fields or meaning change
KERNELS_DIR = os.path.dirname(os.path.dirname(__file__))  # every kernel's source, C++ included

CANDIDATES: dict[str, tuple] = {
    "gpu": (AttentionBackend.MOSAIC, AttentionBackend.TRITON, AttentionBackend.PALLAS,
            AttentionBackend.XLA),
}

# (atol, rtol) against the float32 reference. float32 allows TF32 dots, which GPUs use for
# float32 matmuls by default; a kernel that reads the wrong rows is off by O(1).
TOLERANCE = {"float32": (5e-3, 5e-3), "bfloat16": (2e-2, 2e-2), "float16": (5e-3, 5e-3)}

# (query rows this step, context length after it) per sequence: decodes, chunks that start and
# end mid-page, a decode after a chunk (GQA rows not starting on a tile), a full-page chunk.
CHECK_BATCH = ((1, 1), (1, 17), (7, 40), (1, 40), (17, 33), (33, 64), (2, 81), (1, 5))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate with its own function (the attention contract of reference.py)."""

    name: str
    fn: Callable


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate's self-test: passed, or why not; its error and times where it ran."""

    name: str
    passed: bool
    reason: str = ""
    max_error: float | None = None
    decode_s: float | None = None
    mixed_s: float | None = None

    @property
    def seconds(self) -> float:
        return (self.decode_s or 0.0) + (self.mixed_s or 0.0)

    def describe(self) -> str:
        if not self.passed:
            return f"{self.name}: FAIL ({self.reason})"
        return (f"{self.name}: pass (max error {self.max_error:.1e}; decode "
                f"{self.decode_s * 1e6:.1f} us, mixed {self.mixed_s * 1e6:.1f} us)")


@dataclasses.dataclass(frozen=True)
class SelfTest:
    """The outcome: the chosen backend, those that passed (fastest first), every trial."""

    chosen: str
    ranking: tuple[str, ...]
    trials: tuple[Trial, ...]
    cached: bool = False  # read from the cache file, not run now

    def describe(self) -> list[str]:
        head = f"self-test{' (cached)' if self.cached else ''}: chose {self.chosen}"
        return [head] + [f"  {t.describe()}" for t in self.trials]

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "ranking": list(self.ranking),
                "trials": [dataclasses.asdict(t) for t in self.trials]}

    @classmethod
    def from_json(cls, d: dict) -> SelfTest:
        return cls(d["chosen"], tuple(d["ranking"]), tuple(Trial(**t) for t in d["trials"]),
                   cached=True)


def timing_batches(platform: str) -> dict[str, list[tuple[int, int]]]:
    """The decode-only and mixed batches each candidate is timed on (tiny off a GPU, where
    tests and interpreters run them)."""
    if platform == "cpu":
        return {"decode": [(1, 64)] * 4, "mixed": [(1, 48)] * 3 + [(32, 32)]}
    return {"decode": [(1, 1024)] * 64, "mixed": [(1, 1024)] * 32 + [(256, 256)]}


def _resolve(candidate) -> tuple[str, AttentionBackend | None, Callable | None]:
    """(name, backend or None for a Candidate, function or None where it cannot run here)."""
    if isinstance(candidate, Candidate):
        return candidate.name, None, candidate.fn
    backend = AttentionBackend(candidate)
    return backend.value, backend, None


def cache_path(key: dict) -> str | None:
    home = cache_home()
    if home is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(home, "autotune", f"{digest}.json")


def _load(path: str | None, key: dict) -> SelfTest | None:
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["key"] != key:
            return None
        return SelfTest.from_json(saved["result"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # a bad entry is tested again
        log.warning("attention self-test: ignoring cache entry %s (%s)", path, e)
        return None


def _store(path: str | None, key: dict, result: SelfTest) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "result": result.to_json()}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # caching is an optimisation only
        log.warning("attention self-test: could not cache the result in %s: %s", path, e)


def make_batch(seqs, kv_heads: int, groups: int, head_dim: int, dtype, kv_dtype=None,
               block_size: int = 16, seed: int = 0, pad: bool = True):
    """(q, k_pool, v_pool, layer, md, real token count) for `seqs` (query rows, context length),
    drawn on the device over a one-layer pool of shuffled pages."""
    md, num_tokens, pages = ragged_metadata(list(seqs), block_size, seed,
                                            pad_tokens=16 if pad else 0,
                                            pad_seqs=2 if pad else 0, spare_pages=3)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (md.positions.shape[0], kv_heads * groups, head_dim), jnp.float32)
    shape = (1, pages, block_size, kv_heads, head_dim)
    pool_dtype = jnp.dtype(kv_dtype if kv_dtype is not None else dtype)
    k = jax.random.normal(kk, shape, jnp.float32).astype(pool_dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(pool_dtype)
    return q.astype(dtype), k, v, jnp.int32(0), md, num_tokens


def max_error(fn, q, k, v, layer, md, num_tokens: int, dtype) -> tuple[float, bool]:
    """(max abs error of `fn`'s rows against the float32 reference's, within TOLERANCE[dtype]);
    `fn` runs as it is (a compiled call, or jit it first)."""
    with jax.default_matmul_precision("float32"):
        want = jax.jit(ragged_paged_attention_reference)(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), layer, md)
    got = fn(q, k, v, layer, md).astype(jnp.float32)[:num_tokens]
    want = want[:num_tokens]
    atol, rtol = TOLERANCE[jnp.dtype(dtype).name]
    err = jnp.abs(got - want)
    ok = bool(jnp.all(err <= atol + rtol * jnp.abs(want)))  # False on a NaN too
    return float(jnp.nan_to_num(jnp.max(err), nan=jnp.inf)), ok


def time_attention(fn, q, k, v, layer, md, repeats: int, inner: int) -> float:
    """Seconds per call: the median of `repeats` runs of one program that calls `fn` `inner`
    times in a chain (each call's output is the next one's queries), so the host's dispatch
    is not what is timed."""
    def chain(q, k, v, layer, md):
        return jax.lax.fori_loop(0, inner, lambda _, x: fn(x, k, v, layer, md), q)

    run = jax.jit(chain).lower(q, k, v, layer, md).compile()
    jax.block_until_ready(run(q, k, v, layer, md))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, k, v, layer, md))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _trial(name: str, fn, shapes: dict, kv_heads: int, platform: str) -> Trial:
    dtype, kv_dtype = jnp.dtype(shapes["dtype"]), shapes.get("kv_dtype")
    head = dict(kv_heads=kv_heads, groups=shapes["groups"], head_dim=shapes["head_dim"],
                dtype=dtype, kv_dtype=kv_dtype, block_size=shapes["block_size"])
    q, k, v, layer, md, t = make_batch(CHECK_BATCH, **head)
    try:
        lowered = jax.jit(fn).lower(q, k, v, layer, md)
    except Exception as e:  # noqa: BLE001 - a finding, not an error
        return Trial(name, False, f"lowering failed: {describe_error(e)}")
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001
        return Trial(name, False, f"compiling failed: {describe_error(e)}")
    try:
        err, ok = max_error(compiled, q, k, v, layer, md, t, dtype)
    except Exception as e:  # noqa: BLE001
        return Trial(name, False, f"running failed: {describe_error(e)}")
    if not ok:
        return Trial(name, False, f"differs from the reference: max abs error {err:.3g} "
                                  f"(tolerance {TOLERANCE[dtype.name]})", err)
    repeats, inner = (3, 2) if platform == "cpu" else (5, 20)
    times = {}
    for label, seqs in timing_batches(platform).items():
        try:
            times[label] = time_attention(fn, *make_batch(seqs, **head, pad=False)[:5],
                                          repeats, inner)
        except Exception as e:  # noqa: BLE001
            return Trial(name, False, f"{label} batch failed: {describe_error(e)}", err)
    return Trial(name, True, "", err, times["decode"], times["mixed"])


def describe_error(e: BaseException, limit: int = 300) -> str:
    """The exception's type and its message on one line, cut at `limit` characters."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def run(candidates: Sequence, *, dtype, head_dim: int, groups: int, block_size: int,
        kv_heads: int = 2, kv_dtype=None, reuse: bool = True) -> SelfTest:
    """Self-test `candidates` (backend names or `Candidate`s) at a model's shapes and choose.

    `kv_dtype`: the pool's dtype where kv_cache_dtype makes it other than `dtype`. Candidates
    that do not pass are warned about, with why. The result is cached (see the module doc);
    `reuse=False` tests again whatever the cache holds, and caches the new result."""
    if not candidates:
        raise ValueError("candidates: give at least one backend to test")
    platform = jax.default_backend()
    dev = jax.devices()[0]
    resolved = [_resolve(c) for c in candidates]
    names = [name for name, _, _ in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"candidates: names must be unique, got {names}")
    shapes = dict(dtype=jnp.dtype(dtype).name, head_dim=head_dim, groups=groups,
                  block_size=block_size,
                  kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name)
    key = {"format": _FORMAT, "device_kind": dev.device_kind, "platform": platform,
           "platform_version": dev.client.platform_version, "jax": jax.__version__,
           "jaxlib": jaxlib.__version__, "kv_heads": kv_heads,
           "kernels": source_digest(KERNELS_DIR, ["."]),  # a changed kernel
           "candidates": names, **shapes}
    path = cache_path(key)
    cached = _load(path, key) if reuse else None
    if cached is not None:
        log.info("attention_backend auto: %s (self-test cached in %s)", cached.chosen, path)
        return cached
    trials = []
    for name, backend, fn in resolved:
        why = None if backend is None else get_backend(backend).unavailable(**shapes)
        if why:
            trials.append(Trial(name, False, f"unavailable: {why}"))
            continue
        trials.append(_trial(name, fn or get_backend(backend).fn(), shapes, kv_heads, platform))
    result = _choose(trials, names)
    for t in trials:
        if not t.passed:
            warnings.warn(f"attention_backend auto: passing over {t.name!r}: {t.reason}",
                          stacklevel=2)
    for line in result.describe():
        log.info("attention_backend auto: %s", line.strip())
    _store(path, key, result)
    return result


def _choose(trials: list[Trial], names: list[str]) -> SelfTest:
    passed = sorted((t for t in trials if t.passed), key=lambda t: t.seconds)
    ranking = tuple(t.name for t in passed)
    if jax.process_count() > 1 and ranking:  # every process must run the same programs
        from jax.experimental import multihost_utils

        first = int(multihost_utils.broadcast_one_to_all(jnp.int32(names.index(ranking[0]))))
        ranking = (names[first],) + tuple(n for n in ranking if n != names[first])
    if not ranking:
        warnings.warn("attention_backend auto: no candidate passed its self-test; using 'xla' "
                      "(plain jnp)", stacklevel=3)
    return SelfTest(ranking[0] if ranking else AttentionBackend.XLA.value, ranking,
                    tuple(trials))
