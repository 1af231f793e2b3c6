"""One short, self-contained check for a machine with a GPU (under 5 minutes, no network).

    python scripts/gpu_check.py            # on a GPU
    python scripts/gpu_check.py --dry-run  # on a CPU: interpreters, tiny shapes

1. Correctness: every attention backend that can run here (a missing one is reported with its
   reason) against the jnp reference, on a mixed batch (prefill chunks and decodes, shuffled
   block tables), in each dtype it takes (float32, bfloat16, float16).
2. Kernel timing: median of repeated runs per backend at decode and mixed shapes, with achieved
   bandwidth (bytes of K/V, Q and output the attention must move, over time) and its fraction of
   the device's peak HBM bandwidth.
3. Engine: the compiled decode step time on the default model in bf16 at batch 1, 32 and 256,
   with the backend `auto` chose.
4. End to end: `scripts/bench.py` at its defaults in bf16, output tok/s.

The last line printed is one JSON object with all of it (also written to --json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.testing.ragged import ragged_metadata  # noqa: E402
from kernels import AttentionBackend, select_attention, unavailable  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from kernels.mosaic_attention import ragged_paged_attention_mosaic, supports  # noqa: E402
from kernels.reference import ragged_paged_attention_reference  # noqa: E402

PEAK_HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 3.0e11}


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_HBM_BYTES_S.items() if k in kind), None)


def make_batch(seqs, kv_heads, groups, head_dim, dtype, block_size=16, seed=0, layers=2):
    """seqs: (query rows, context length) per sequence. Returns (q, k, v, layer, md, tokens).
    Tensors are drawn on the device: the large shapes do not fit a host round trip quickly."""
    md, num_tokens, pages = ragged_metadata(seqs, block_size, seed)
    n = kv_heads * groups
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (md.positions.shape[0], n, head_dim), jnp.float32).astype(dtype)
    shape = (layers, pages, block_size, kv_heads, head_dim)
    k = jax.random.normal(k2, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(k3, shape, jnp.float32).astype(dtype)
    return q, k, v, jnp.int32(layers - 1), md, num_tokens


def attention_bytes(seqs, kv_heads, groups, head_dim, itemsize) -> int:
    kv = sum(c for _, c in seqs) * kv_heads * head_dim * 2 * itemsize
    qo = sum(q for q, _ in seqs) * kv_heads * groups * head_dim * 2 * itemsize
    return kv + qo


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backends_here(dry_run: bool) -> tuple[dict, dict]:
    """(name -> attention fn, name -> why it cannot run here)."""
    out, missing = {}, {}
    for name in (b.value for b in AttentionBackend if b is not AttentionBackend.AUTO):
        try:
            out[name] = select_attention(name)[1]
        except ValueError as e:
            if dry_run and name == AttentionBackend.MOSAIC:  # Pallas' GPU interpreter
                out[name] = functools.partial(ragged_paged_attention_mosaic, interpret=True)
                continue
            missing[name] = str(e)
            print(f"  backend {name}: skipped ({e})")
    return out, missing


def takes(name: str, dtype, head_dim: int, groups: int, block_size: int = 16) -> bool:
    """Whether a backend handles these shapes (mosaic's limits are checked without a GPU: the
    dry run interprets it)."""
    if name == AttentionBackend.MOSAIC:
        return supports(dtype, head_dim, groups, block_size) is None
    return unavailable(AttentionBackend(name), dtype=dtype, head_dim=head_dim, groups=groups,
                       block_size=block_size) is None


def check_correctness(backends, dry_run: bool) -> list[dict]:
    print("== correctness vs reference (max abs error)")
    seqs = [(1, 1), (1, 17), (7, 40), (17, 33), (33, 64), (65, 65), (2, 81)]
    rows = []
    for dtype, tol in (("float32", 2e-5), ("bfloat16", 2e-2), ("float16", 4e-3)):
        q, k, v, layer, md, t = make_batch(seqs, 2, 3, 64, jnp.dtype(dtype))
        want = ragged_paged_attention_reference(q, k, v, layer, md).astype(jnp.float32)
        for name, fn in backends.items():
            if not takes(name, dtype, 64, 3):
                continue
            try:
                got = fn(q, k, v, layer, md).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got[:t] - want[:t])))
            except Exception as e:  # a kernel that fails to compile or run is a finding
                rows.append({"backend": name, "dtype": dtype, "error": repr(e)[:500],
                             "ok": False})
                print(f"  {name:>9} {dtype:>8}: error {type(e).__name__}: {e}")
                continue
            ok = err <= tol
            rows.append({"backend": name, "dtype": dtype, "max_abs_err": err, "ok": ok})
            print(f"  {name:>9} {dtype:>8}: {err:.3e} {'ok' if ok else 'FAIL'} (tol {tol})")
    return rows


def time_kernels(backends, dry_run: bool) -> list[dict]:
    print("== kernel timing (median), achieved bandwidth")
    peak = peak_bandwidth()
    if dry_run:
        shapes = {"decode b4 ctx64": [(1, 64)] * 4, "mixed": [(1, 48)] * 3 + [(32, 32)]}
        kv_heads, groups, head_dim, repeats = 1, 2, 64, 2
        backends = {k: v for k, v in backends.items() if k != "reference"} | {
            "reference": backends["reference"]}
    else:
        shapes = {"decode b32 ctx2048": [(1, 2048)] * 32,
                  "decode b256 ctx1024": [(1, 1024)] * 256,
                  "mixed 64 decodes + 512 prefill": [(1, 1024)] * 64 + [(512, 512)]}
        kv_heads, groups, head_dim, repeats = 8, 4, 128, 20
    rows = []
    dtype = jnp.bfloat16
    for label, seqs in shapes.items():
        q, k, v, layer, md, _ = make_batch(seqs, kv_heads, groups, head_dim, dtype)
        nbytes = attention_bytes(seqs, kv_heads, groups, head_dim, 2)
        for name, fn in backends.items():
            if not takes(name, dtype, head_dim, groups):
                continue
            f = jax.jit(fn)
            args = (q, k, v, layer, md)
            try:
                dt = timed(lambda f=f, args=args: f(*args), repeats)
            except Exception as e:  # report and go on: one backend failing is a finding
                print(f"  {label:>32} {name:>9}: error {type(e).__name__}: {e}")
                continue
            bw = nbytes / dt
            frac = bw / peak if peak else float("nan")
            rows.append({"shape": label, "backend": name, "median_s": dt, "bytes_per_s": bw,
                         "peak_fraction": frac})
            print(f"  {label:>32} {name:>9}: {dt * 1e6:9.1f} us  {bw / 1e9:8.1f} GB/s  "
                  f"{frac:6.1%} of peak")
    return rows


def time_engine(dry_run: bool) -> list[dict]:
    print("== engine decode step (default model)")
    from jaxserve.config import EngineConfig
    from jaxserve.runtime.runner import ModelRunner
    from jaxserve.runtime.sampling import SamplingInputs
    from jaxserve.runtime.step_inputs import StepInputs, empty_spec_inputs
    from models.loader import load_model

    loaded = load_model()
    batches = (1, 4) if dry_run else (1, 32, 256)
    ctx = 64 if dry_run else 512
    dtype = "float32" if dry_run else "bfloat16"
    rows = []
    for b in batches:
        cfg = EngineConfig(dtype=dtype, max_num_seqs=b, max_num_batched_tokens=max(16, b),
                           max_model_len=ctx + 16, num_kv_blocks=b * (ctx // 16 + 1),
                           token_buckets=(max(16, b),), seq_buckets=(b,))
        runner = ModelRunner(cfg, loaded)
        t = max(16, b)
        mb = ctx // 16 + 1
        tables = np.arange(b * mb, dtype=np.int32).reshape(b, mb)
        pos = np.zeros(t, np.int32)
        pos[:b] = ctx
        tseq = np.zeros(t, np.int32)
        tseq[:b] = np.arange(b)
        slots = np.full(t, runner.num_blocks * 16, np.int32)
        slots[:b] = tables[:, ctx // 16] * 16 + ctx % 16
        qsl = np.full(b + 1, b, np.int32)
        qsl[:b] = np.arange(b)
        inp = StepInputs(
            input_ids=np.ones(t, np.int32), prev_rows=np.full(t, -1, np.int32),
            attn=AttentionMetadata(pos, tseq, slots, tables, np.full(b, ctx + 1, np.int32), qsl),
            logits_indices=np.arange(b, dtype=np.int32),
            prompt_targets=np.full(t, -1, np.int32),
            sampling=SamplingInputs(np.zeros(b, np.float32), np.ones(b, np.float32),
                                    np.zeros(b, np.int32), np.zeros(b, np.uint32),
                                    np.zeros(b, np.int32), np.ones(b, bool), np.bool_(False)),
            processing=runner.logits_shape.unused(b),
            spec=empty_spec_inputs(b, runner.config.spec_tokens,
                                   runner.logits_shape.mask_words))
        dt = timed(lambda inp=inp, runner=runner: runner.execute(inp).token_ids,
                   3 if dry_run else 20)
        rows.append({"batch": b, "context": ctx, "dtype": dtype, "backend":
                     runner.attention_backend, "step_median_s": dt, "tok_per_s": b / dt})
        print(f"  batch {b:>4} ctx {ctx} {dtype} [{runner.attention_backend}]: "
              f"{dt * 1e3:8.2f} ms/step  {b / dt:9.1f} tok/s")
    return rows


def end_to_end(dry_run: bool) -> dict:
    """scripts/bench.py at its defaults (bf16 on a GPU), in this process."""
    print("== end to end: scripts/bench.py")
    from jaxserve.bench.cli import main as bench_main

    with tempfile.TemporaryDirectory() as out:
        argv = ["--dtype", "float32" if dry_run else "bfloat16", "--out-dir", out,
                "--no-progress"] + (["--num-requests", "4", "--output-len", "fixed:8",
                                     "--no-warmup"] if dry_run else [])
        t0 = time.perf_counter()
        bench_main(argv)
        with open(os.path.join(out, "bench.json")) as f:
            summary = json.load(f)["summaries"]["jaxserve"]
    row = {"args": argv[:2] + argv[5:], "output_tok_per_s": summary["output_tok_per_s"],
           "tpot_p50_s": summary["tpot_p50_s"], "wall_s": time.perf_counter() - t0}
    print(f"  output {row['output_tok_per_s']:.1f} tok/s, TPOT p50 "
          f"{row['tpot_p50_s'] * 1e3:.2f} ms ({row['wall_s']:.0f} s with warmup)")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: kernels in Pallas' interpreters, tiny shapes (keeps the script "
                         "working)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    if not args.dry_run and jax.default_backend() != "gpu":
        print("no GPU here: use --dry-run")
        return 2
    backends, missing = backends_here(args.dry_run)
    report = {"device": dev.device_kind, "jax": jax.__version__,
              "compute_capability": getattr(dev, "compute_capability", None),
              "backends_missing": missing,
              "correctness": check_correctness(backends, args.dry_run),
              "kernels": time_kernels(backends, args.dry_run),
              "engine": time_engine(args.dry_run)}
    try:
        report["end_to_end"] = end_to_end(args.dry_run)
    except Exception as e:  # the figures above stand on their own
        report["end_to_end"] = {"error": repr(e)[:500]}
        print(f"  end to end failed: {e!r}")
    report["total_s"] = time.perf_counter() - t0
    print(f"done in {report['total_s']:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0 if all(r["ok"] for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
