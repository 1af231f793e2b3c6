"""Attention kernels over the paged KV pool, and the choice between them.

| backend | where it runs | what it is |
| --- | --- | --- |
| reference | anywhere | plain jnp, gathers K/V per token: the oracle of the others |
| cpu | CPU with a C++ compiler; float32 | C++ kernel through XLA's FFI, built on first use |
| xla | anywhere | plain jnp for XLA:CPU: the reference, plus query tiles in prefill-heavy steps |
| mosaic | Hopper GPU (sm_90a); bf16/fp16 | Pallas kernel, Mosaic GPU lowering: TMA, wgmma |
| triton | GPU with jax-triton | Triton kernel through `jax_triton.triton_call` |
| pallas | GPU; CPU in interpret mode (slow: for tests) | Pallas kernel, Triton lowering |

`auto` on a GPU is decided on the device (kernels/selftest.py): each of mosaic, triton, pallas
and xla that can run with this JAX, device and model is compiled, checked against the reference
on a mixed ragged batch at the model's shapes and dtype, and timed on a decode and a mixed batch;
the fastest that passes is used, each one passed over is warned about with its reason, xla is
the last resort, and the result is cached per device kind, JAX version, shapes and dtype. On a
CPU auto is cpu where it can run (else xla, with a warning saying why); on other platforms xla.
Under auto, a step program that fails to compile for the kernel's sake falls back once, with a
warning, to `Choice.fallback` (the next that passed, else xla; runtime/runner.py). A backend
named explicitly that cannot run fails at engine start. This module imports jax only when a
backend is chosen, so configuration code can name backends without loading jax.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.kernels.selftest import SelfTest

log = logging.getLogger(__name__)


class AttentionBackend(enum.StrEnum):
    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"
    XLA = "xla"
    MOSAIC = "mosaic"
    TRITON = "triton"
    PALLAS = "pallas"


def unavailable(backend: AttentionBackend, *, dtype=None, head_dim: int | None = None,
                groups: int | None = None, block_size: int | None = None,
                kv_dtype=None) -> str | None:
    """Why `backend` cannot run here (for a model of these shapes, where given), or None.
    `kv_dtype`: the KV pool's dtype where it is not the model's (kv_cache_dtype)."""
    import jax
    import jax.numpy as jnp

    platform = jax.default_backend()
    if backend in (AttentionBackend.REFERENCE, AttentionBackend.XLA):
        return None  # they compute in q's dtype whatever the pool's
    if backend is AttentionBackend.CPU:
        from jaxserve.kernels import cpu_attention

        why = cpu_attention.available(dtype, head_dim, groups)
        if why is None and kv_dtype is not None and jnp.dtype(kv_dtype) not in map(
                jnp.dtype, cpu_attention.PAGE_DTYPES):
            return f"it reads float32, float16 or bfloat16 pools, not {jnp.dtype(kv_dtype).name}"
        return why
    if kv_dtype is not None and dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return (f"it reads pools of the model's dtype ({jnp.dtype(dtype).name}), not "
                f"kv_cache_dtype {jnp.dtype(kv_dtype).name}")
    if backend is AttentionBackend.TRITON:
        from jaxserve.kernels import triton_attention

        return triton_attention.available()
    if backend is AttentionBackend.PALLAS:
        if platform not in ("gpu", "cpu"):
            return f"Pallas' Triton lowering cannot run on platform {platform!r}"
        try:
            import jax.experimental.pallas.triton  # noqa: F401
        except ImportError as e:  # removed from JAX after its deprecation in 0.11
            return f"this JAX has no Pallas Triton lowering ({e})"
        return None
    # MOSAIC
    if platform != "gpu":
        return f"it needs a Hopper GPU (sm_90a); the JAX platform here is {platform!r}"
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if not capability.startswith("9."):
        return f"it needs a Hopper GPU (sm_90a); this device's compute capability is {capability!r}"
    try:
        from jaxserve.kernels import mosaic_attention
    except ImportError as e:
        return f"this JAX has no Pallas Mosaic GPU backend ({e})"
    if None in (dtype, head_dim, groups, block_size):
        return None
    return mosaic_attention.supports(dtype, head_dim, groups, block_size)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the engine runs: a backend (a test candidate's name where it is not a backend),
    its attention function, and under `auto` the one backend a step program that fails to
    compile for the kernel's sake falls back to; the self-test where one ran."""

    backend: AttentionBackend | str
    fn: Callable
    fallback: AttentionBackend | None = None
    selftest: SelfTest | None = None


def attention_fn(backend: AttentionBackend | str) -> Callable:
    """The attention function of `backend` (checked by `unavailable`, not here)."""
    import jax

    backend = AttentionBackend(backend)
    if backend is AttentionBackend.REFERENCE:
        from jaxserve.kernels.reference import ragged_paged_attention_reference

        return ragged_paged_attention_reference
    if backend is AttentionBackend.CPU:
        from jaxserve.kernels.cpu_attention import ragged_paged_attention_cpu

        return ragged_paged_attention_cpu
    if backend is AttentionBackend.XLA:
        from jaxserve.kernels.xla_attention import ragged_paged_attention_xla

        return ragged_paged_attention_xla
    if backend is AttentionBackend.MOSAIC:
        from jaxserve.kernels.mosaic_attention import ragged_paged_attention_mosaic

        return ragged_paged_attention_mosaic
    if backend is AttentionBackend.PALLAS:
        from jaxserve.kernels.pallas_attention import ragged_paged_attention

        # On a CPU the kernel body runs in Pallas' interpreter: correct, slow, for testing.
        return functools.partial(ragged_paged_attention,
                                 interpret=jax.default_backend() == "cpu")
    if backend is AttentionBackend.TRITON:
        from jaxserve.kernels import triton_attention

        return triton_attention.ragged_paged_attention_triton
    raise ValueError("attention_backend auto names no one function: choose_attention() "
                     "resolves it")


def choose_attention(name: str | AttentionBackend, *, kv_heads: int = 2, **shapes) -> Choice:
    """Resolve `name` (auto included) for a model of these shapes; fail now, not mid-request.
    `shapes`: the model's dtype, head_dim, groups (query heads per kv head), block_size and
    kv_dtype (see `unavailable`); `kv_heads` sizes the self-test's batches."""
    try:
        backend = AttentionBackend(name)
    except ValueError:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(b.value for b in AttentionBackend)}; got {name!r}") from None
    if backend is not AttentionBackend.AUTO:
        why = unavailable(backend, **shapes)
        if why:
            raise ValueError(f"attention_backend {backend.value!r} cannot run here: {why}")
        return Choice(backend, attention_fn(backend))
    import jax

    from jaxserve.kernels import selftest

    platform = jax.default_backend()
    candidates = selftest.CANDIDATES.get(platform)
    if candidates is None:
        backend = _fixed_rule(platform, shapes)
        fallback = None if backend is AttentionBackend.XLA else AttentionBackend.XLA
        return Choice(backend, attention_fn(backend), fallback)
    missing = [f for f in ("dtype", "head_dim", "groups", "block_size") if shapes.get(f) is None]
    if missing:
        raise ValueError(f"attention_backend auto: the self-test needs the model's "
                         f"{', '.join(missing)}")
    result = selftest.run(candidates, kv_heads=kv_heads, **shapes)
    fns = {c.name: c.fn for c in candidates if isinstance(c, selftest.Candidate)}
    chosen = result.chosen
    # The next backend that passed, else xla; a test candidate is never a fallback.
    fallback = next((AttentionBackend(n) for n in result.ranking[1:] if n not in fns),
                    None if chosen == AttentionBackend.XLA else AttentionBackend.XLA)
    if chosen in fns:
        return Choice(chosen, fns[chosen], fallback, result)
    chosen = AttentionBackend(chosen)
    return Choice(chosen, attention_fn(chosen), fallback, result)


def select_attention(name: str | AttentionBackend, **shapes):
    """(backend, attention fn) for `name`: `choose_attention` without the rest."""
    choice = choose_attention(name, **shapes)
    return choice.backend, choice.fn


def _fixed_rule(platform: str, shapes: dict) -> AttentionBackend:
    """auto where no self-test runs: on a CPU the C++ kernel where it can run, else xla."""
    if platform != "cpu":
        choice = AttentionBackend.XLA
    else:
        choice = AttentionBackend.CPU
        why = unavailable(choice, **shapes)
        if why:
            choice = AttentionBackend.XLA
            warnings.warn(f"attention_backend auto: passing over 'cpu': {why}; using 'xla' "
                          "(plain jnp, slower)", stacklevel=4)
    log.info("attention_backend auto: %s on %s", choice.value, platform)
    return choice
