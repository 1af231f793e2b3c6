"""Speculative decoding on an input-grounded workload: chat requests that copy, correct, edit,
quote or summarize a text given in the prompt (or, `--workload chat`, open-ended ones), in
process at a fixed concurrency, with speculation off, adaptive (the policy of
jaxserve/core/speculative.py) and at a fixed k, all n-gram; `draft` runs the adaptive policy on
a draft model's proposals (`--draft-model`, by default the target itself: every proposal is
then accepted, and the draft costs what the target does, so it shows the acceptance side, not
a speed-up).

    python scripts/bench_spec.py [--concurrency 1 4 64] [--max-tokens 128]
    python scripts/bench_spec.py --configs off draft --draft-model PATH
    python scripts/bench_spec.py --workload chat   # open-ended chat prompts: little to copy

Greedy, so every configuration generates the same tokens; each engine warms up (compiles)
first and runs the concurrencies in order. Prints output tok/s, TPOT p50, the acceptance rate
and the tokens a verifying row gained per step, and each configuration's speed against the
first one ('off' by default), and what the policy chose: the share of steps that verified
proposals and their mean k.
"""

from __future__ import annotations

import argparse
import gc

from jaxserve import EngineConfig, LLMEngine
from jaxserve.bench import drivers, report
from jaxserve.bench.chat import chat_ids, grounded_prompts, make_prompts
from jaxserve.bench.workload import BenchRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 64])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workload", choices=("grounded", "chat"), default="grounded",
                    help="grounded: the prompts above; chat: bench_generate.py's 32 open-ended "
                         "chat prompts, which give n-grams little to copy")
    ap.add_argument("--configs", nargs="+", default=["off", "adaptive", "fixed"],
                    help="which of off, adaptive, fixed, draft to run")
    ap.add_argument("--draft-model", default=None,
                    help="draft: the draft model's path (default: the target's)")
    args = ap.parse_args()
    from jaxserve.models.loader import load_model

    loaded = load_model()
    tok = loaded.tokenizer
    ids = chat_ids(tok, grounded_prompts() if args.workload == "grounded" else make_prompts(32))
    configs = {"off": {},
               "adaptive": dict(speculative_method="ngram", num_speculative_tokens=args.k),
               "fixed": dict(speculative_method="ngram", num_speculative_tokens=args.k,
                             speculative_adaptive=False),
               "draft": dict(speculative_method="draft_model", num_speculative_tokens=args.k,
                             speculative_model=args.draft_model or loaded.path)}
    configs = {name: configs[name] for name in args.configs}
    rows = {}
    for name, kw in configs.items():
        engine = LLMEngine(EngineConfig(log_stats_interval_s=0, **kw), loaded=loaded)
        engine.warmup()
        for c in args.concurrency:
            n = max(c * args.requests_per_client, len(ids)) if c > 1 else len(ids)
            workload = [BenchRequest(i, 0.0, list(ids[i % len(ids)]), args.max_tokens)
                        for i in range(n)]
            before = engine.metrics_snapshot()
            res, dur, samples = drivers.run_engine(engine, workload, progress=False,
                                                   concurrency=c, ignore_eos=False)
            s = report.summarize(res, dur, workload, samples)
            after = engine.metrics_snapshot()
            rows_v = after["spec_verify_rows"] - before["spec_verify_rows"]
            acc = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            prop = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
            # the policy's choices: how many steps verified proposals, at what mean k
            steps = after["num_steps"] - before["num_steps"]
            preempted = after["num_preemptions"] - before["num_preemptions"]
            spec_steps = after["spec_steps"] - before["spec_steps"]
            failed = [r.error for r in res if r.error]
            if failed:
                raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
            rows[(name, c)] = s | {"acceptance": acc / prop if prop else 0.0,
                                   "per_row": (acc + rows_v) / rows_v if rows_v else 0.0,
                                   "proposed": prop, "mean_k": prop / rows_v if rows_v else 0.0,
                                   "spec_share": spec_steps / steps if steps else 0.0}
            r = rows[(name, c)]
            print(f"{name:>10} c={c:<3} {r['output_tok_per_s']:7.1f} tok/s  TPOT p50 "
                  f"{r['tpot_p50_s'] * 1e3:6.1f} ms  proposed {prop:6d}  acceptance "
                  f"{r['acceptance']:.2f}  tokens per verifying row {r['per_row']:.2f}  "
                  f"steps speculating {r['spec_share']:4.0%} at mean k {r['mean_k']:.2f}  "
                  f"preemptions {preempted}", flush=True)
            if engine.speculator is not None and engine.speculator.policy.adaptive:
                policy = engine.speculator.policy  # what its choices rested on
                table = lambda t: " ".join(f"{b}:{x * 1e3:.0f}" for b, x in sorted(t.items()))  # noqa: E731
                print(f"{'':>16}policy: acceptance {policy.acceptance:.2f}; step ms by token "
                      f"bucket, decode-only {table(policy.step_time)}; verifying "
                      f"{table(policy.verify_time)}; with prefill "
                      f"{table(policy.mixed_time)}; steps explored {policy.num_explored}",
                      flush=True)
        del engine
        gc.collect()  # its programs' memory (and memory maps) go before the next compiles
    print("\nconcurrency  " + "  ".join(f"{n:>22}" for n in configs))
    for c in args.concurrency:
        base = rows[(next(iter(configs)), c)]["output_tok_per_s"]
        cells = [f"{rows[(n, c)]['output_tok_per_s']:7.1f} tok/s "
                 f"({rows[(n, c)]['output_tok_per_s'] / base:4.2f}x)" for n in configs]
        print(f"{c:>11}  " + "  ".join(f"{x:>22}" for x in cells))


if __name__ == "__main__":
    main()
