"""The engine's choice of attention backend: the one the config names, or auto's.

A backend named explicitly that cannot run (its `unavailable` says why) fails here, at engine
start. auto on a GPU is decided on the device by a self-test of the candidates (selftest.py):
the fastest that passes is used, each one passed over is warned about with its reason, xla is
the last resort. Elsewhere auto is a fixed rule: on a CPU the C++ kernel where it can run (else
xla, with a warning saying why); on other platforms xla. Under auto, a step program that fails
to compile for the kernel's sake falls back once, with a warning, to `Choice.fallback` (the next
that passed, else xla; runtime/runner.py).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable

import jax

from jaxserve.kernels.attention import selftest
from jaxserve.kernels.attention.base import AttentionBackend
from jaxserve.kernels.attention.registry import backend as get_backend

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the engine runs: a backend (a test candidate's name where it is not a backend),
    its attention function, and under `auto` the one backend a step program that fails to
    compile for the kernel's sake falls back to; the self-test where one ran."""

    backend: AttentionBackend | str
    fn: Callable
    fallback: AttentionBackend | None = None
    selftest: selftest.SelfTest | None = None


def choose_attention(name: str | AttentionBackend, *, kv_heads: int = 2, device=None,
                     **shapes) -> Choice:
    """Resolve `name` (auto included) for a model of these shapes; fail now, not mid-request.
    `shapes`: the model's dtype, head_dim, groups (query heads per kv head), block_size and
    kv_dtype (see `Backend.unavailable`); `kv_heads` sizes the self-test's batches. `device`:
    a compile-only device (a GPU target description's) the step is built for without running;
    a backend must then be named, since auto's self-test runs on the device."""
    try:
        name = AttentionBackend(name)
    except ValueError:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(b.value for b in AttentionBackend)}; got {name!r}") from None
    if name is not AttentionBackend.AUTO:
        backend = get_backend(name)
        why = backend.unavailable(device=device, **shapes)
        if why:
            raise ValueError(f"attention_backend {name.value!r} cannot run here: {why}")
        return Choice(name, backend.fn())
    if device is not None:
        raise ValueError("attention_backend auto self-tests the backends on the device; a "
                         "program compiled without one needs a backend named (mosaic, xla, ...)")
    platform = jax.default_backend()
    candidates = selftest.CANDIDATES.get(platform)
    if candidates is None:
        name = _fixed_rule(platform, shapes)
        fallback = None if name is AttentionBackend.XLA else AttentionBackend.XLA
        return Choice(name, get_backend(name).fn(), fallback)
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
    return Choice(chosen, get_backend(chosen).fn(), fallback, result)


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
        why = get_backend(choice).unavailable(**shapes)
        if why:
            choice = AttentionBackend.XLA
            warnings.warn(f"attention_backend auto: passing over 'cpu': {why}; using 'xla' "
                          "(plain jnp, slower)", stacklevel=4)
    log.info("attention_backend auto: %s on %s", choice.value, platform)
    return choice
