"""One short, self-contained check for a machine with a GPU (no network needed).

    python scripts/gpu_check.py                 # a random bf16 model of SmolLM2-135M's shapes
    python scripts/gpu_check.py --model PATH    # the engine section on a real model
    python scripts/gpu_check.py --dry-run       # on a CPU: interpreters, tiny shapes

1. Self-test: `auto`'s choice (kernels/attention/selftest.py) at the engine model's head shapes in
   bfloat16 and float32: each candidate's pass or fail (with why) and its times.
2. Correctness: every backend x dtype x head shape against the float32 reference on a mixed
   ragged batch (prefill chunks and decodes over shuffled pages); a skipped one says why.
3. Kernel timing: every backend x dtype x batch (decode and mixed), median time per call in one
   program, achieved bandwidth and its fraction of the device's peak.
4. Engine: at 1, 32 and 256 sequences, the decode step program's time alone, the decode step
   time inside `LLM.generate` end to end (the host's share is the difference), and HF
   transformers' `generate` on the same device and prompts as a peer.

Each section runs on its own: one that fails is reported with its traceback and the next runs.
Every line is flushed as it is printed, and the JSON report (--json) is written after every
section; the last line printed is that report.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

# JAX takes 75% of the GPU at start by default; torch's peer needs room of its own.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.bench.decode_step import decode_inputs  # noqa: E402
from jaxserve.bench.gpu_cost import SMOLLM2  # noqa: E402
from jaxserve.config import LayerLoop  # noqa: E402
from jaxserve.kernels.attention import registry, selftest  # noqa: E402
from jaxserve.kernels.attention.base import AttentionBackend  # noqa: E402

say = functools.partial(print, flush=True)
PEAK_HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 3.0e11}
SECTIONS = ("selftest", "correctness", "kernels", "engine")
BACKENDS = [b for b in AttentionBackend if b is not AttentionBackend.AUTO]
DTYPES = ("float32", "bfloat16", "float16")
# SMOLLM2: the default model's shapes (30 layers, 9 query / 3 kv heads of 64); TINY: --dry-run's
TINY = SMOLLM2 | dict(vocab_size=1024, hidden_size=192, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1)


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_HBM_BYTES_S.items() if k in kind), None)


def backend_fns(dry_run: bool) -> tuple[dict, dict]:
    """(name -> attention fn, name -> why it cannot run here at all)."""
    fns, missing = {}, {}
    for b in BACKENDS:
        why = registry.backend(b).unavailable()
        if why and dry_run and b is AttentionBackend.MOSAIC:  # Pallas' GPU interpreter
            from jaxserve.kernels.attention.mosaic import ragged_paged_attention_mosaic

            fns[b.value] = functools.partial(ragged_paged_attention_mosaic, interpret=True)
        elif why:
            missing[b.value] = why
        else:
            fns[b.value] = registry.backend(b).fn()
    return fns, missing


def skip_reason(name: str, missing: dict, dtype: str, kv_heads: int, groups: int,
                head_dim: int) -> str | None:
    """Why `name` cannot take these shapes here, or None (mosaic's limits are checked
    without a GPU: the dry run interprets it)."""
    if name in missing:
        return missing[name]
    if name == AttentionBackend.MOSAIC:
        from jaxserve.kernels.attention.mosaic import supports

        return supports(dtype, head_dim, groups, 16)
    return registry.backend(name).unavailable(dtype=dtype, head_dim=head_dim, groups=groups,
                                              block_size=16)


# --------------------------------------------------------------------------------- sections


def check_selftest(dry_run: bool, heads: dict) -> list[dict]:
    candidates = (("pallas", "cpu", "xla") if dry_run
                  else selftest.CANDIDATES.get(jax.default_backend(), ("xla",)))
    rows = []
    for dtype in ("bfloat16", "float32"):
        # tested afresh; the result is cached, so the engine section's start reads it
        result = selftest.run(candidates, dtype=dtype, head_dim=heads["head_dim"],
                              groups=heads["groups"], kv_heads=heads["kv_heads"],
                              block_size=16, reuse=False)
        say(f"  {dtype}: chose {result.chosen}")
        for t in result.trials:
            say(f"    {t.describe()}")
        rows.append({"dtype": dtype, **result.to_json()})
    return rows


def check_correctness(fns: dict, missing: dict, dry_run: bool) -> list[dict]:
    shapes = {"K1 G3 H64": (1, 3, 64)} if dry_run else {
        "K3 G3 H64": (3, 3, 64), "K8 G4 H128": (8, 4, 128), "K8 G1 H128": (8, 1, 128)}
    rows = []
    for label, (kv_heads, groups, head_dim) in shapes.items():
        for dtype in DTYPES:
            q, k, v, layer, md, t = selftest.make_batch(selftest.CHECK_BATCH, kv_heads, groups,
                                                        head_dim, jnp.dtype(dtype))
            for name in [b.value for b in BACKENDS]:
                row = {"backend": name, "dtype": dtype, "shape": label}
                why = skip_reason(name, missing, dtype, kv_heads, groups, head_dim)
                if why:
                    rows.append(row | {"skipped": why})
                    say(f"  {name:>9} {dtype:>8} {label:>11}: skipped ({why})")
                    continue
                try:
                    err, ok = selftest.max_error(jax.jit(fns[name]), q, k, v, layer, md, t,
                                                 dtype)
                except Exception as e:  # noqa: BLE001 - a kernel that fails is a finding
                    rows.append(row | {"error": short(e), "ok": False})
                    say(f"  {name:>9} {dtype:>8} {label:>11}: error {short(e)}")
                    continue
                rows.append(row | {"max_abs_err": err, "ok": ok})
                say(f"  {name:>9} {dtype:>8} {label:>11}: {err:.3e} {'ok' if ok else 'FAIL'} "
                    f"(tol {selftest.TOLERANCE[dtype]})")
    return rows


def attention_bytes(seqs, kv_heads: int, groups: int, head_dim: int, itemsize: int) -> int:
    kv = sum(c for _, c in seqs) * kv_heads * head_dim * 2 * itemsize
    qo = sum(q for q, _ in seqs) * kv_heads * groups * head_dim * 2 * itemsize
    return kv + qo


def time_kernels(fns: dict, missing: dict, dry_run: bool) -> list[dict]:
    peak = peak_bandwidth()
    if dry_run:
        batches = {"decode b4 ctx64": [(1, 64)] * 4, "mixed": [(1, 48)] * 3 + [(32, 32)]}
        (kv_heads, groups, head_dim), repeats, inner = (1, 2, 64), 1, 1
    else:
        batches = {"decode b32 ctx2048": [(1, 2048)] * 32,
                   "decode b256 ctx1024": [(1, 1024)] * 256,
                   "mixed 64 decodes + 512 prefill": [(1, 1024)] * 64 + [(512, 512)]}
        (kv_heads, groups, head_dim), repeats, inner = (8, 4, 128), 5, 10
    rows = []
    for dtype in ("bfloat16", "float32"):
        itemsize = jnp.dtype(dtype).itemsize
        for label, seqs in batches.items():
            q, k, v, layer, md, _ = selftest.make_batch(seqs, kv_heads, groups, head_dim,
                                                        jnp.dtype(dtype), pad=False)
            nbytes = attention_bytes(seqs, kv_heads, groups, head_dim, itemsize)
            for name in [b.value for b in BACKENDS]:
                row = {"backend": name, "dtype": dtype, "shape": label}
                why = ("the oracle, not a serving kernel" if name == AttentionBackend.REFERENCE
                       else skip_reason(name, missing, dtype, kv_heads, groups, head_dim))
                if why:
                    rows.append(row | {"skipped": why})
                    say(f"  {label:>31} {dtype:>8} {name:>9}: skipped ({why})")
                    continue
                try:
                    dt = selftest.time_attention(fns[name], q, k, v, layer, md, repeats, inner)
                except Exception as e:  # noqa: BLE001 - one backend failing is a finding
                    rows.append(row | {"error": short(e)})
                    say(f"  {label:>31} {dtype:>8} {name:>9}: error {short(e)}")
                    continue
                bw = nbytes / dt
                frac = bw / peak if peak else None
                rows.append(row | {"median_s": dt, "bytes_per_s": bw, "peak_fraction": frac})
                say(f"  {label:>31} {dtype:>8} {name:>9}: {dt * 1e6:9.1f} us  "
                    f"{bw / 1e9:8.1f} GB/s  "
                    + (f"{frac:6.1%} of peak" if peak else "(peak unknown)"))
    return rows


# ----------------------------------------------------------------------------------- engine


def make_model(directory: str, dry_run: bool, tokenizer: str | None = None) -> str:
    """A random-weight Llama of SmolLM2-135M's shapes (tiny ones in a dry run), in bfloat16,
    made on this machine's accelerator, with a tokenizer (`tokenizer`: a directory holding
    one, e.g. the default model's saved where it is installed); returns its directory."""
    import torch
    import transformers as tf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**(TINY if dry_run else SMOLLM2)))
    model.to(torch.bfloat16).save_pretrained(directory)
    tok = None
    if tokenizer is not None:
        try:
            tok = tf.AutoTokenizer.from_pretrained(tokenizer)
            if len(tok) > model.config.vocab_size:
                raise ValueError(f"{len(tok)} tokens, more than the model's "
                                 f"{model.config.vocab_size}")
        except (OSError, ValueError) as e:
            say(f"  (--tokenizer {tokenizer}: {short(e)}; the default instead)")
            tok = None
    tok = tok or make_tokenizer(model.config.vocab_size, dry_run)
    tok.save_pretrained(directory)
    return directory


def make_tokenizer(vocab_size: int, dry_run: bool):
    """The default model's own tokenizer where its package is installed, else a word-level one
    over the whole vocabulary (prompts are token ids either way; it detokenizes the outputs)."""
    if not dry_run:
        try:
            from gguf import GGUFReader

            from jaxserve.models.gguf_tokenizer import build_tokenizer
            from jaxserve.models.loader import default_model_path

            reader = GGUFReader(default_model_path())
            return build_tokenizer({k: f.contents() for k, f in reader.fields.items()
                                    if k.startswith("tokenizer.")})
        except (ImportError, FileNotFoundError, ValueError) as e:
            say(f"  (no default model's tokenizer: {short(e)}; a word-level one instead)")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # no space clean-up: the engine then decodes through the Rust tokenizer, as it does the
    # default model's (engine/detokenizer.py)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=False)


def time_step_program(runner, b: int, ctx: int, steps: int) -> float:
    """Seconds per decode step of the compiled program alone: `steps` launched back to back
    (the device runs them in a queue), median of 3 rounds."""
    inp = decode_inputs(runner, b, ctx)
    runner.execute(inp)  # built at warmup; this loads it
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = runner.dispatch(inp)
        runner.fetch(out, False)
        rounds.append((time.perf_counter() - t0) / steps)
    return statistics.median(rounds)


def time_generate(llm, prompts, new_tokens: int) -> dict:
    """LLM.generate end to end: wall time, and the median time between consecutive
    decode-only steps' tokens reaching the host (the step time a user sees)."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    engine.step_trace.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs), "short outputs"
    decodes = [r for r in engine.step_trace if r.num_prefill_tokens == 0]
    # per decode step: a call of several decode steps yields that many tokens per row
    per_step = [(b.finished_at - a.finished_at) / b.decode_steps
                for a, b in zip(decodes, decodes[1:], strict=False)]
    return {"wall_s": wall, "tok_per_s": len(prompts) * new_tokens / wall,
            "decode_step_s": float(np.median(per_step)) if per_step else float("nan"),
            "decode_calls": len(decodes),
            "decode_steps_per_call": max((r.decode_steps for r in decodes), default=1)}


def hf_peer(model_dir: str, model_path: str | None, prompts, new_tokens: int, dtype) -> dict:
    """HF transformers' greedy `generate` on the same device and prompts."""
    import torch

    from jaxserve.testing.oracle import load_hf_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_model(model_path or model_dir).to(device=device, dtype=dtype)
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kw)  # warm
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync()
        wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return {"wall_s": wall, "tok_per_s": len(prompts) * new_tokens / wall,
            "step_s": wall / new_tokens}


def profile_step(runner, b: int, ctx: int, log_dir: str, steps: int = 5) -> dict:
    """The decode step program under the XLA profiler: device time per kernel, per call."""
    from jaxserve.bench import kernel_times

    inp = decode_inputs(runner, b, ctx)
    runner.execute(inp)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(steps):
            out = runner.dispatch(inp)
        runner.fetch(out, False)
    path = kernel_times.perfetto_file(log_dir)
    if path is None:
        return {"error": f"no perfetto trace under {log_dir}"}
    table = kernel_times.kernel_table(path, steps)
    for line in kernel_times.describe(table):
        say(f"    {line}")
    return table | {"trace": path}


def check_engine(dry_run: bool, model_path: str | None, batches: tuple[int, ...],
                 profile_dir: str | None, peer: bool = True, tokenizer: str | None = None,
                 **options) -> list[dict]:
    """`options`: EngineConfig fields to set (layer_loop, attention_backend)."""
    import torch

    from jaxserve import LLM
    from jaxserve.bench.op_count import count_ops, describe

    batches, prompt_len, new_tokens = (((1, 4), 8, 4) if dry_run else (batches, 64, 64))
    dtype = "float32" if dry_run else "bfloat16"
    most = max(batches)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = model_path or make_model(tmp, dry_run, tokenizer)
        shapes = "tiny" if dry_run else "SmolLM2-135M's"
        say(f"  model: {model_path or f'random weights of {shapes} shapes'} "
            f"({time.perf_counter() - t0:.1f}s to make)")
        max_len = prompt_len + new_tokens
        blocks = -(-max_len // 16)
        tokens = (1, 4, 16) if dry_run else (1, 32, 256, 1024)
        llm = LLM(model_dir, dtype=dtype, max_num_seqs=most, max_num_batched_tokens=tokens[-1],
                  max_model_len=max_len, token_buckets=tokens, block_buckets=(blocks,),
                  num_kv_blocks=most * blocks + 8, enable_step_trace=True, **options)
        runner = llm.engine.runner
        say(f"  attention: {runner.attention_backend}")
        if runner.attention.selftest is not None:
            for line in runner.attention.selftest.describe():
                say(f"    {line}")
        say(f"  warmup: {llm.engine.warmup():.1f}s, {runner.num_compiles} programs")
        vocab = llm.engine.model_config.vocab_size
        rng = np.random.default_rng(0)
        rows = []
        for b in batches:
            prompts = rng.integers(3, vocab, (b, prompt_len)).tolist()
            row = {"sequences": b, "dtype": dtype, "backend": str(runner.attention_backend),
                   "prompt_len": prompt_len, "new_tokens": new_tokens}
            try:
                row["step_program_s"] = time_step_program(runner, b, max_len - 8,
                                                          5 if dry_run else 20)
                inp = decode_inputs(runner, b, max_len - 8)
                row["ops"] = count_ops(runner._executables[inp.program].as_text())
                say(f"  {b} seqs, decode step program: {describe(row['ops'])}")
                if profile_dir and b == most:
                    row["profile"] = profile_step(runner, b, max_len - 8, profile_dir)
                time_generate(llm, prompts, new_tokens)  # warm: every program it takes
                row["generate"] = time_generate(llm, prompts, new_tokens)
                row["host_share_s"] = row["generate"]["decode_step_s"] - row["step_program_s"]
                if peer:
                    row["hf"] = hf_peer(model_dir, model_path, prompts, new_tokens,
                                        getattr(torch, dtype))
            except Exception as e:  # noqa: BLE001 - the other batch sizes still run
                row["error"] = short(e)
                traceback.print_exc(file=sys.stdout)
            rows.append(row)
            say("  " + engine_line(row))
    return rows


def engine_line(row: dict) -> str:
    head = f"{row['sequences']:>4} seqs {row['dtype']} [{row['backend']}]:"
    if "error" in row:
        return f"{head} error {row['error']}"
    g, hf = row["generate"], row.get("hf")
    line = (f"{head} step program {row['step_program_s'] * 1e3:7.2f} ms; in LLM.generate "
            f"{g['decode_step_s'] * 1e3:7.2f} ms per decode step, up to "
            f"{g['decode_steps_per_call']} per call (host share "
            f"{row['host_share_s'] * 1e3:+.2f} ms), {g['tok_per_s']:9.1f} tok/s")
    return line if hf is None else (
        f"{line}; HF generate {hf['step_s'] * 1e3:7.2f} ms/step, {hf['tok_per_s']:9.1f} tok/s "
        f"({g['tok_per_s'] / hf['tok_per_s']:.2f}x)")


# ------------------------------------------------------------------------------------- main


def short(e: BaseException) -> str:
    return selftest.describe_error(e, 400)


def write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def run_section(report: dict, name: str, fn, path: str) -> None:
    say(f"== {name}")
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - report it; the next section runs
        report[name] = {"error": short(e)}
        say(f"  section {name} failed: {short(e)}")
        traceback.print_exc(file=sys.stdout)
    finally:
        report["seconds"][name] = time.perf_counter() - t0
        say(f"  ({report['seconds'][name]:.1f}s)")
        write(report, path)


def failed(report: dict) -> list[str]:
    """What went wrong: failed sections, and rows with an error or a wrong result."""
    out = []
    for name in SECTIONS:
        part = report.get(name)
        if isinstance(part, dict):
            out.append(f"{name}: {part['error']}")
            continue
        out += [f"{name}: {r}" for r in part or () if "error" in r or r.get("ok") is False]
    return out


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # a crash inside XLA still prints where it was
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: kernels in Pallas' interpreters, tiny shapes (keeps the script "
                         "working)")
    ap.add_argument("--model", default=None,
                    help="the engine section on this model (a directory or .gguf) instead of "
                         "random weights of SmolLM2-135M's shapes")
    ap.add_argument("--json", default="gpu_check.json", help="report file, rewritten after "
                                                              "every section")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS,
                    help="run only these sections")
    ap.add_argument("--sequences", nargs="+", type=int, default=(1, 32, 256),
                    help="the engine section's batch sizes")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace the engine's decode step at the largest batch with the XLA "
                         "profiler into DIR, and print device time per kernel")
    ap.add_argument("--no-hf", action="store_true", help="the engine section without HF's peer")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the random model's tokenizer (default: the default model's where it "
                         "is installed, else a word-level one)")
    ap.add_argument("--layer-loop", choices=[m.value for m in LayerLoop], default=None,
                    help="the engine's layer loop (default: the engine's default)")
    ap.add_argument("--attention-backend", default=None,
                    help="the engine's attention backend (default: auto)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="the engine's decode steps per call (default: the engine's)")
    args = ap.parse_args()
    options = {k: v for k, v in (("layer_loop", args.layer_loop),
                                 ("attention_backend", args.attention_backend),
                                 ("decode_steps", args.decode_steps)) if v}
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    say(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"python {sys.version.split()[0]}")
    if not args.dry_run and jax.default_backend() != "gpu":
        say("no GPU here: use --dry-run")
        return 2
    fns, missing = backend_fns(args.dry_run)
    for name, why in missing.items():
        say(f"  backend {name}: unavailable ({why})")
    heads = (dict(kv_heads=1, groups=3, head_dim=64) if args.dry_run
             else dict(kv_heads=3, groups=3, head_dim=64))  # the engine model's
    report = {"device": dev.device_kind, "jax": jax.__version__,
              "compute_capability": getattr(dev, "compute_capability", None),
              "backends_missing": missing, "seconds": {}}
    sections = {
        "selftest": lambda: check_selftest(args.dry_run, heads),
        "correctness": lambda: check_correctness(fns, missing, args.dry_run),
        "kernels": lambda: time_kernels(fns, missing, args.dry_run),
        "engine": lambda: check_engine(args.dry_run, args.model, tuple(args.sequences),
                                       args.profile, not args.no_hf, args.tokenizer,
                                       **options),
    }
    for name in args.sections:
        run_section(report, name, sections[name], args.json)
    report["failures"] = failed(report)
    report["total_s"] = time.perf_counter() - t0
    write(report, args.json)
    say(f"done in {report['total_s']:.1f}s; {len(report['failures'])} failures")
    for line in report["failures"]:
        say(f"  {line[:300]}")
    say(json.dumps(report, default=str))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
