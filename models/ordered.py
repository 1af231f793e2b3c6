"""Float sums in an order fixed by the summed axis alone (batch invariance).

XLA's own reductions pick their order of additions from the whole shape: on XLA:CPU a row of
an RMSNorm or a log-softmax sums differently when the step holds 1, 3 or 64 rows, so a
sequence's logits, and near-tied greedy tokens, changed with what shared its step. These sums
add the halves of the axis, elementwise, until one value is left: the same additions in the
same order for a row whatever the other axes hold, with no reduce for the compiler to
reorganize (XLA does not reassociate float adds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """x summed over `axis` as a tree of halves: element i pairs with i + n // 2, and an odd
    axis carries its last element to the next level."""
    x = jnp.moveaxis(x, axis, -1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        h = n // 2
        pairs = x[..., :h] + x[..., h:2 * h]
        x = pairs if n % 2 == 0 else jnp.concatenate([pairs, x[..., 2 * h:]], axis=-1)
    x = x.reshape(x.shape[:-1]) if x.shape[-1] == 1 else jnp.zeros(x.shape[:-1], x.dtype)
    return jnp.expand_dims(x, axis) if keepdims else x


def _shift(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """(the shift, x's maximum over `axis` kept as an axis of 1, or 0 where that is not
    finite; the log of the sum of exp(x - shift)): a maximum is exact in any order."""
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return m, jnp.log(ordered_sum(jnp.exp(x - m), axis, keepdims=True))


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over `axis`; a row of -inf gives -inf."""
    m, log_sum = _shift(x, axis)
    out = log_sum + m
    return out if keepdims else jnp.squeeze(out, axis)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """x - logsumexp(x), computed as (x - max) - log(sum), as jax.nn.log_softmax does."""
    m, log_sum = _shift(x, axis)
    return (x - m) - log_sum
