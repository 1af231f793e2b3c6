"""How far a decode step is from the machine: the steady decode step time next to two floors,
both measured in the same process:
- memory: the time to stream the model's weights once. A decode step reads every weight at
  least once, so that read bounds it where compute outruns memory (small batches);
- arithmetic: the time the step's multiply-adds (its rows through the projections and the
  head) take at the fastest rate a float32 matmul reaches here. It bounds a step whose rows
  are many enough that the multiplies outlast the read (on a CPU, from a few rows on).
The ratios say how much of a step is something else (attention, sampling, small-matmul
inefficiency, overheads).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

from jaxserve.models.llama import HEAD_BLOCKS


def weight_stream_seconds(params, repeats: int = 9) -> float:
    """Fastest of `repeats` jitted passes that read every weight once: the best the memory
    system does, as a floor should be. XLA:CPU's reductions read some dtypes and layouts at
    well under the memory's speed (int8 codes fast as a float32 sum, slow as uint32 words;
    uint32 nibble planes the other way round), so each pass is timed three ways: every array
    summed in float32, every array summed as uint32 words, and each array by its width (narrow
    codes in float32, words as words); the fastest counts, so the floor changes with the
    machine, not with the weights' layout."""
    import jax
    import jax.numpy as jnp

    def words(a):  # uint32 words, or float32 values for an array not of whole words
        if a.dtype.itemsize == 4:
            return jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(-1)
        if a.dtype.itemsize in (1, 2) and a.nbytes % 4 == 0:  # 4 / itemsize to a word
            return jax.lax.bitcast_convert_type(a.reshape(-1, 4 // a.dtype.itemsize),
                                                jnp.uint32)
        return a.astype(jnp.float32).reshape(-1)  # the odd array out (none in the models here)

    def sum_words(a):
        w = words(a)
        return jnp.sum(w, dtype=w.dtype).astype(jnp.float32)

    def sum_floats(a):
        return jnp.sum(a, dtype=jnp.float32)

    reads = (sum_floats, sum_words,
             lambda a: (sum_words if a.dtype.itemsize == 4 else sum_floats)(a))
    return min(fastest(jax.jit(lambda p, read=read: sum(read(a) for a in jax.tree.leaves(p))),
                       (params,), repeats)
               for read in reads)


def fastest(fn, args: tuple, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*args) to their results, after one
    call that compiles it."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(repeats: int = 9, size: int = 1024) -> float:
    """Multiply-adds per second of XLA's float32 matmul on a (size, size) square, the fastest
    of `repeats`: the rate the machine's multiply units give this process. (The CPU kernel's
    integer products run at about the same rate per instruction slot: AVX2's vpmaddwd and two
    float FMAs do as many multiply-adds a cycle.)"""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    return size ** 3 / fastest(jax.jit(lambda a, b: a @ b), (a, a), repeats)


def params_bytes(params) -> int:
    import jax

    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def streamed_params(params: dict, tied: bool) -> dict:
    """The params a decode step reads whole: all but the embedding table, of which a lookup
    reads only its rows, unless that table is also the (tied) head the step multiplies by.
    Where the head's Q8 blocks are there (models/llama.py's HEAD_BLOCKS) they are the head."""
    drop = {"embed", "lm_head"} if HEAD_BLOCKS in params else set() if tied else {"embed"}
    return {k: v for k, v in params.items() if k not in drop}


def steady_decode_step(step_trace) -> tuple[float, tuple[int, int, int], int] | None:
    """(median seconds between the completions of consecutive decode-only steps, their most
    common bucket, how many) -- the step rate a user sees, with asynchronous scheduling too."""
    gaps: dict[tuple, list[float]] = {}
    for prev, rec in zip(step_trace, step_trace[1:], strict=False):
        if rec.num_prefill_tokens == 0 and prev.num_prefill_tokens == 0:
            gaps.setdefault(rec.bucket, []).append(rec.finished_at - prev.finished_at)
    if not gaps:
        return None
    bucket, _ = Counter({b: len(g) for b, g in gaps.items()}).most_common(1)[0]
    return statistics.median(gaps[bucket]), bucket, len(gaps[bucket])


def decode_vs_floor(engine) -> dict | None:
    """The steady decode step of `engine`'s trace against its weight-streaming floor and its
    arithmetic floor: the bucket's token rows (padding included) through the layers'
    projections and its logits rows through the head, at matmul_rate(). Attention's products
    (a few % at these contexts) are left out."""
    steady = steady_decode_step(engine.step_trace or [])
    if steady is None:
        return None
    step_s, bucket, n = steady
    cfg = engine.runner.model_config
    params = streamed_params(engine.runner.params, cfg.tie_word_embeddings)
    floor_s = weight_stream_seconds(params)
    nbytes = params_bytes(params)
    tokens, logits_rows = bucket[:2]
    macs = tokens * cfg.projection_weights + logits_rows * cfg.hidden_size * cfg.vocab_size
    rate = matmul_rate()
    return {"decode_step_s": step_s, "decode_bucket": list(bucket), "decode_steps": n,
            "weight_stream_s": floor_s, "weight_bytes": nbytes,
            "weight_stream_gb_per_s": nbytes / floor_s / 1e9, "step_over_floor": step_s / floor_s,
            "step_multiply_adds": macs, "matmul_rate": rate, "arithmetic_s": macs / rate,
            "step_over_arithmetic": step_s * rate / macs,
            "step_over_both": step_s / max(floor_s, macs / rate)}


def format_floor(f: dict | None) -> str:
    if f is None:
        return "steady decode: no two consecutive decode-only steps in this run"
    return (f"steady decode step {f['decode_step_s'] * 1e3:.1f} ms (median of {f['decode_steps']}"
            f" steps, bucket {tuple(f['decode_bucket'])}) vs weight-streaming floor "
            f"{f['weight_stream_s'] * 1e3:.1f} ms ({f['weight_bytes'] / 1e6:.0f} MB at "
            f"{f['weight_stream_gb_per_s']:.1f} GB/s): {f['step_over_floor']:.2f}x; vs "
            f"arithmetic floor {f['arithmetic_s'] * 1e3:.1f} ms "
            f"({f['step_multiply_adds'] / 1e9:.2f} G multiply-adds at "
            f"{f['matmul_rate'] / 1e9:.0f} G/s, float32 matmul): "
            f"{f['step_over_arithmetic']:.2f}x; over the larger floor: "
            f"{f['step_over_both']:.2f}x")
