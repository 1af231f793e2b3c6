"""Offline throughput: LLM.generate vs HF transformers generate, on the same prompts, in one run.

    python scripts/bench_generate.py [--num-prompts 32] [--max-tokens 64] [--hf-batch 8]

Reports warmup time and compiled programs, jaxserve output tokens/s, HF output tokens/s (torch,
static batches with left padding; skipped when torch is missing), and the median step time at
the smallest and the largest bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPICS = ["the ocean", "a robot", "ancient Rome", "prime numbers", "a lighthouse", "coffee",
          "the moon", "a violin", "winter", "volcanoes", "a library", "chess", "bees", "rain",
          "a train journey", "gardening"]


def make_prompts(n: int) -> list[str]:
    kinds = ["Write a short story about {}.", "Explain {} to a child.",
             "List some facts about {}:", "Describe {} in detail."]
    return [kinds[i % len(kinds)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def time_bucket(runner, bucket, repeats: int = 7) -> float:
    from jaxserve.runtime.step_inputs import dummy_step_inputs

    inp = dummy_step_inputs(*bucket, runner.block_size, runner.num_blocks)
    runner.execute(inp)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(inp)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_generate(prompts, max_tokens: int, batch: int) -> tuple[float, int]:
    import torch

    from jaxserve.testing.oracle import load_hf_model
    from models.loader import default_model_path, load_tokenizer

    path = default_model_path()
    model = load_hf_model(path)
    tok = load_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    n_out, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
            n_out += (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]
    return time.perf_counter() - t0, n_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    import jax

    from jaxserve import LLM, SamplingParams

    prompts = make_prompts(args.num_prompts)
    t0 = time.perf_counter()
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_step_trace=True, strict_compile=True)
    load_s = time.perf_counter() - t0
    warm_s = llm.engine.warmup()
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    buckets = runner.all_buckets()
    small, large = min(buckets), max(buckets)
    res = {
        "device": str(jax.devices()[0]), "dtype": str(runner.dtype.__name__),
        "load_s": load_s, "warmup_s": warm_s, "compiled_programs": runner.num_compiles,
        "jaxserve_s": gen_s, "jaxserve_output_tokens": n_out,
        "jaxserve_tok_per_s": n_out / gen_s, "steps": len(llm.engine.step_trace),
        "step_median_s_smallest_bucket": time_bucket(runner, small), "smallest_bucket": small,
        "step_median_s_largest_bucket": time_bucket(runner, large), "largest_bucket": large,
        "compiles_after_warmup": runner.num_compiles - len(buckets),
    }
    if not args.no_hf:
        try:
            hf_s, hf_n = hf_generate(prompts, args.max_tokens, args.hf_batch)
            res |= {"hf_s": hf_s, "hf_output_tokens": hf_n, "hf_tok_per_s": hf_n / hf_s,
                    "speedup_vs_hf": (n_out / gen_s) / (hf_n / hf_s)}
        except ImportError as e:
            print(f"HF baseline skipped: {e}", file=sys.stderr)
    for k, v in res.items():
        print(f"{k:>32}: {v:.4g}" if isinstance(v, float) else f"{k:>32}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
