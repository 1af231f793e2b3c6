"""One mixture-of-experts layer on a CPU: the grouped matmul as ragged_dot on float32 experts
against the block kernel's grouped call on the same experts kept as Q4 nibbles.

    python scripts/bench_moe.py [--hidden 1024] [--ffn 3584] [--experts 8] [--top-k 2]
                                [--rows 1 16 256]

Random Q4_1-like experts (codes 0-15, float16 scales and minima), the routing of random
logits; the median of 20 timed calls of each jitted function after one warm call, per row
count (the tokens of a step), side by side.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import cpu_matmul, quant
from jaxserve.models import moe


def q4_experts(rng, shape):
    """(E, K, N) experts in Q4_1-like blocks of 32 along K."""
    scale = (shape[0], shape[1] // quant.BLOCK, shape[2])
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    return {"q": rng.integers(0, 16, shape).astype(np.int8),
            "scale": half(rng.random(scale, np.float32) * 0.02),
            "min": half(-rng.random(scale, np.float32) * 0.1)}


def median_ms(fn, *args, calls: int = 20) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    args = ap.parse_args()
    why = cpu_matmul.available()
    if why:
        raise SystemExit(f"the CPU block kernel cannot run here: {why}")
    rng = np.random.default_rng(0)
    d, f, e = args.hidden, args.ffn, args.experts
    blocks = [q4_experts(rng, s) for s in ((e, d, f), (e, d, f), (e, f, d))]
    floats = [jnp.asarray(quant.dequantize_np(w)) for w in blocks]
    packed = [jax.tree.map(jnp.asarray, cpu_matmul.pack(w, 1)) for w in blocks]
    nbytes = lambda ws: sum(a.nbytes for a in jax.tree.leaves(ws)) / 2**20  # noqa: E731
    print(f"experts {e} x (D {d}, F {f}), top {args.top_k}: float32 {nbytes(floats):.0f} MiB, "
          f"Q4 nibbles {nbytes(packed):.0f} MiB")
    ragged, kernel = jax.jit(moe.grouped_experts), jax.jit(moe.block_experts)
    print(f"{'rows':>6} {'ragged_dot ms':>14} {'grouped kernel ms':>18} {'ratio':>7}")
    for t in args.rows:
        x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
        weights, ids = moe.route(jnp.asarray(rng.standard_normal((t, e)), jnp.float32),
                                 args.top_k, True)
        a = median_ms(ragged, x, weights, ids, *floats)
        b = median_ms(kernel, x, weights, ids, *packed)
        print(f"{t:6d} {a:14.2f} {b:18.2f} {a / b:6.1f}x")


if __name__ == "__main__":
    main()
