"""Launch counts of a compiled program's HLO: loops counted per trip, bookkeeping not at all."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.bench.op_count import count_ops, describe


def _program(trips: int) -> str:
    def f(x, w):
        def layer(_, h):
            return jnp.tanh(h @ w) + jnp.sort(h, axis=-1)  # a dot, a sort, elementwise work
        return jax.lax.fori_loop(0, trips, layer, x).sum()

    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    return jax.jit(f).lower(x, w).compile().as_text()


def test_a_loop_body_counts_once_per_trip():
    few, many = count_ops(_program(3)), count_ops(_program(7))
    per_trip = (many["launches"] - few["launches"]) / 4
    assert per_trip >= 2  # at least the dot (or its fusion) and the sort run every trip
    assert few["launches"] - 3 * per_trip == many["launches"] - 7 * per_trip  # the rest once
    assert few["distinct"] == many["distinct"]  # the same program text, unrolled differently
    assert many["by_opcode"]["sort"] == 7
    assert "parameter" not in many["by_opcode"] and "get-tuple-element" not in many["by_opcode"]
    assert describe(many).startswith(f"{many['launches']} launches per call")


def test_a_conditional_counts_itself_and_its_largest_branch():
    def f(x, p):
        big = lambda v: jnp.sort(jnp.tanh(v) @ v.T, axis=-1) + jnp.sort(v @ v.T, axis=0)
        return jax.lax.cond(p, big, lambda v: v @ v.T, x)

    x = jnp.ones((8, 8))
    counts = count_ops(jax.jit(f).lower(x, True).compile().as_text())
    assert counts["by_opcode"]["conditional"] == 1
    assert counts["by_opcode"]["sort"] == 2  # the big branch's, counted once
