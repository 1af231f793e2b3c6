"""Sums in a fixed order (models/ordered.py): a row's result does not depend on the other rows,
and it is the sum, the logsumexp and the log-softmax to float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import ordered


@pytest.mark.parametrize("n", [1, 2, 7, 576, 1000, 49152])
def test_a_rows_sum_is_the_same_whatever_the_other_rows(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((48, n)).astype(np.float32) * 3
    f = jax.jit(lambda x: ordered.ordered_sum(x, keepdims=True))
    full = np.asarray(f(x))
    for rows in (1, 2, 3, 5, 13, 16, 31):
        np.testing.assert_array_equal(np.asarray(f(x[:rows])), full[:rows])
        np.testing.assert_array_equal(np.asarray(f(x[rows:][::-1]))[::-1], full[rows:])
    np.testing.assert_allclose(full[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4)


def test_any_axis_and_empty():
    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4)
    for axis in range(3):
        np.testing.assert_array_equal(ordered.ordered_sum(x, axis), x.sum(axis))
        assert ordered.ordered_sum(x, axis, keepdims=True).shape == x.sum(axis, keepdims=True).shape
    assert ordered.ordered_sum(jnp.zeros((3, 0))).tolist() == [0.0, 0.0, 0.0]


def test_logsumexp_and_log_softmax_match_jax_nn():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((9, 3000)).astype(np.float32) * 8)
    x = x.at[2, :].set(-jnp.inf).at[3, 5:].set(-jnp.inf)  # a masked row, a mostly masked one
    np.testing.assert_allclose(ordered.logsumexp(x), jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    want = jax.nn.log_softmax(x, axis=-1)
    got = ordered.log_softmax(x)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], atol=2e-5)
    f = jax.jit(ordered.log_softmax)
    np.testing.assert_array_equal(np.asarray(f(x[:3])), np.asarray(f(x))[:3])
