"""Offline throughput, side by side in one run: `LLM.generate` at its default settings vs HF
transformers' continuous batching (`generate_batch`) and HF `generate` in static batches.

    python scripts/bench_generate.py [--num-prompts 32] [--max-tokens 64] [--hf-batch 8]

The workload is chat-style: each prompt goes through the model's chat template, decoding is
greedy and stops at EOS or --max-tokens. Every system runs the workload once to warm up (so no
compilation is timed), then once timed. Prints output tokens/s per system and the ratios, the
engine's warmup/compile figures, and its steady decode step against the in-run
weight-streaming floor (jaxserve/bench/roofline.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxserve.bench.chat import chat_ids, make_prompts


def timed_twice(run) -> tuple[float, int]:
    """Run once to warm up, then once timed: (seconds, output tokens) of the timed run."""
    run()
    t0 = time.perf_counter()
    n = run()
    return time.perf_counter() - t0, n


def hf_continuous(model, ids: list[list[int]], max_tokens: int, eos: int) -> int:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos)
    out = model.generate_batch(inputs=ids, generation_config=gc, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values())


def hf_static(model, ids: list[list[int]], max_tokens: int, eos: int, batch: int) -> int:
    """HF generate in left-padded batches; a row's output ends at its first EOS (included)."""
    import torch

    n_out = 0
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            rows = ids[i:i + batch]
            width = max(map(len, rows))
            x = torch.full((len(rows), width), eos, dtype=torch.long)
            mask = torch.zeros_like(x)
            for j, r in enumerate(rows):
                x[j, width - len(r):] = torch.tensor(r)
                mask[j, width - len(r):] = 1
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
            for row in out[:, width:].tolist():
                n_out += row.index(eos) + 1 if eos in row else len(row)
    return n_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8, help="HF generate static batch size")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.roofline import decode_vs_floor, format_floor

    t0 = time.perf_counter()
    llm = LLM(enable_step_trace=True)  # the defaults, as a user gets them
    load_s = time.perf_counter() - t0
    engine = llm.engine
    ids = chat_ids(llm.tokenizer, make_prompts(args.num_prompts))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def run_jaxserve() -> int:
        engine.step_trace.clear()
        outs = llm.generate(ids, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    compiles_before = engine.runner.num_compiles
    jx_s, jx_n = timed_twice(run_jaxserve)
    res = {
        "device": str(jax.devices()[0]), "dtype": engine.runner.dtype.name,
        "prompt_tokens": sum(map(len, ids)), "load_s": load_s,
        "programs_compiled": engine.runner.num_compiles - compiles_before,
        "compile_s": engine.runner.compile_seconds,
        "jaxserve_output_tokens": jx_n, "jaxserve_s": jx_s, "jaxserve_tok_per_s": jx_n / jx_s,
        "steps": len(engine.step_trace),
    }
    floor = decode_vs_floor(engine)
    res["decode_floor"] = floor
    if not args.no_hf:
        try:
            from jaxserve.testing.oracle import load_hf_model

            model = load_hf_model(engine.loaded.path)
            eos = llm.tokenizer.eos_token_id
            for name, run in (
                    ("hf_generate_batch", lambda: hf_continuous(model, ids, args.max_tokens, eos)),
                    (f"hf_static_b{args.hf_batch}",
                     lambda: hf_static(model, ids, args.max_tokens, eos, args.hf_batch))):
                s, n = timed_twice(run)
                res |= {f"{name}_output_tokens": n, f"{name}_s": s, f"{name}_tok_per_s": n / s,
                        f"jaxserve_over_{name}": res["jaxserve_tok_per_s"] / (n / s)}
        except ImportError as e:
            print(f"HF baselines skipped: {e}", file=sys.stderr)
    for k, v in res.items():
        if k != "decode_floor":
            print(f"{k:>40}: {v:.4g}" if isinstance(v, float) else f"{k:>40}: {v}")
    print(format_floor(floor))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
