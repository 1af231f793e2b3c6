"""Chat completions at a fixed concurrency against any OpenAI-compatible server (scripts/serve.py,
llama.cpp's llama-server, vLLM, ...), through the official `openai` client: the same prompts as
bench_generate.py, greedy, all sent at once.

    python scripts/bench_openai.py --base-url http://127.0.0.1:8000/v1 [--concurrency 32]
    python scripts/bench_openai.py --base-url URL_A --base-url URL_B --concurrency 32 1

Runs the workload once to warm up, then once timed; prints output tokens/s (from each
response's usage), TTFT, inter-token latency (ITL: the gaps between streamed tokens) and
end-to-end latency percentiles, and each request's decode rate after its first token. With
--concurrency 1 that rate is the batch-1 decode speed. Several base URLs and concurrencies run
in turn (each server, every concurrency) and end with one table, side by side.
`--workload grounded` sends requests that copy, correct or edit a text they give instead (the
prompts of bench_spec.py), where prompt-lookup speculation has most to propose.
`--json-schema builtin` (or a schema file) asks every request for JSON through
`response_format`, to weigh structured output against the same run without it.
`--compare-structured` runs both in one go: first with the schema, then without it, each
request then asked for exactly as many tokens as its JSON answer had (`ignore_eos`), so the two
runs generate the same tokens per request and differ only by the grammar's work.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import statistics
import time

from jaxserve.bench.chat import grounded_prompts, make_prompts
from jaxserve.serving import api_key

#: One free-text field: the answer runs to max_tokens as an unconstrained one would, so the two
#: runs differ only by the grammar's work.
BUILTIN_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
                  "required": ["answer"]}


def one_request(client, model: str, prompt: str, max_tokens: int,
                extra: dict) -> tuple[float, float, int, list[float]]:
    """(TTFT s, end-to-end s, completion tokens, gaps between content chunks s) of one
    streamed chat completion."""
    t0 = time.perf_counter()
    arrivals, tokens = [], 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter() - t0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return (arrivals[0] if arrivals else end), end, tokens, gaps


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))] if xs else 0.0


def run(client, model: str, prompts: list[str], max_tokens: int | list[int],
        concurrency: int, extra: dict):
    """`max_tokens`: one for all, or one per prompt. `model`: one id, or several comma
    separated, which the requests take in turn."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    models = itertools.islice(itertools.cycle(model.split(",")), len(prompts))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p, m, name: one_request(client, name, p, m, extra),
                                prompts, limits, models))
    return time.perf_counter() - t0, results


def measure(client, model, prompts, max_tokens, concurrency, extra, label: str):
    """A warm-up run, then a timed one; prints its line and returns (tok/s, results, the
    table row's figures)."""
    run(client, model, prompts, max_tokens, concurrency, extra)
    dur, results = run(client, model, prompts, max_tokens, concurrency, extra)
    n = sum(r[2] for r in results)
    ttft, e2e = [r[0] for r in results], [r[1] for r in results]
    itl = [g for r in results for g in r[3]]
    row = {"tok/s": n / dur, "TTFT p50 s": percentile(ttft, 50),
           "TTFT p99 s": percentile(ttft, 99), "ITL p50 ms": percentile(itl, 50) * 1e3,
           "ITL p99 ms": percentile(itl, 99) * 1e3,
           "E2E p50 s": percentile(e2e, 50), "E2E p99 s": percentile(e2e, 99)}
    print(f"{label}{len(prompts)} requests at concurrency {concurrency}: {n} output tokens in "
          f"{dur:.2f} s = {n / dur:.1f} output tok/s; TTFT p50 / p99 "
          f"{row['TTFT p50 s'] * 1e3:.0f} / {row['TTFT p99 s'] * 1e3:.0f} ms; ITL p50 / p99 "
          f"{row['ITL p50 ms']:.1f} / {row['ITL p99 ms']:.1f} ms; E2E p50 / p99 "
          f"{row['E2E p50 s']:.2f} / {row['E2E p99 s']:.2f} s; per-request decode p50 "
          f"{statistics.median((r[2] - 1) / (r[1] - r[0]) for r in results if r[2] > 1):.1f} "
          "tok/s (tokens after the first / time after the first)", flush=True)
    return n / dur, results, row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", action="append",
                    help="a server's /v1 address; repeat to compare servers "
                         "(default: http://127.0.0.1:8000/v1)")
    ap.add_argument("--api-key", default=None,
                    help=f"the servers' API key (default: ${api_key.ENV}, else none)")
    api_key.add_file_option(ap)
    ap.add_argument("--model", default=None,
                    help="model id (default: the first /v1/models lists); several, comma "
                         "separated (LoRA adapters, say): the requests take them in turn")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", choices=("chat", "grounded"), default="chat",
                    help="chat: open-ended prompts; grounded: requests that copy, correct or "
                         "edit a text they give (in turn, to --num-prompts)")
    ap.add_argument("--json-schema", default=None,
                    help="'builtin' or a JSON schema file: every request asks for JSON")
    ap.add_argument("--compare-structured", action="store_true",
                    help="the schema (builtin by default), then the same lengths without it")
    args = ap.parse_args()
    try:
        key = api_key.resolve(args.api_key, args.api_key_file) or "none"
    except ValueError as e:
        ap.error(str(e))
    if args.compare_structured and not args.json_schema:
        args.json_schema = "builtin"
    extra = {}
    if args.json_schema:
        if args.json_schema == "builtin":
            schema = BUILTIN_SCHEMA
        else:
            with open(args.json_schema) as f:
                schema = json.load(f)
        extra["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema}}

    from openai import OpenAI

    if args.workload == "grounded":
        prompts = list(itertools.islice(itertools.cycle(grounded_prompts()), args.num_prompts))
    else:
        prompts = make_prompts(args.num_prompts)
    label = "structured: " if args.compare_structured else ""
    table = []
    for url in args.base_url or ["http://127.0.0.1:8000/v1"]:
        client = OpenAI(base_url=url, api_key=key, timeout=600)
        model = args.model or client.models.list().data[0].id
        for concurrency in args.concurrency:
            print(f"{url} ({model}):", flush=True)
            rate, results, row = measure(client, model, prompts, args.max_tokens, concurrency,
                                         extra, label)
            table.append((url, concurrency, row))
            if args.compare_structured:
                lengths = [max(1, r[2]) for r in results]
                free, _, _ = measure(client, model, prompts, lengths, concurrency,
                                     {"extra_body": {"ignore_eos": True}},
                                     "free, same lengths: ")
                change = (rate / free - 1) * 100
                print(f"structured output: {rate / free:.3f}x the output tok/s of the same "
                      f"tokens without it ({abs(change):.1f}% "
                      f"{'faster' if change >= 0 else 'slower'})")
    if len(table) > 1:
        keys = list(table[0][2])
        print("| server | concurrency | " + " | ".join(keys) + " |")
        print("| --- | --- |" + " --- |" * len(keys))
        for url, concurrency, row in table:
            cells = " | ".join(f"{row[k]:.3f}" if k.split()[-1] == "s" else f"{row[k]:.1f}"
                               for k in keys)
            print(f"| {url} | {concurrency} | {cells} |")


if __name__ == "__main__":
    main()
