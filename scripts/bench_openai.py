"""Chat completions at a fixed concurrency against any OpenAI-compatible server (scripts/serve.py,
llama.cpp's llama-server, vLLM, ...), through the official `openai` client: the same prompts as
bench_generate.py, greedy, all sent at once.

    python scripts/bench_openai.py --base-url http://127.0.0.1:8000/v1 [--concurrency 32]

Runs the workload once to warm up, then once timed; prints output tokens/s (from each
response's usage), TTFT and end-to-end latency medians (streamed) and each request's decode rate
after its first token. With --concurrency 1 that rate is the batch-1 decode speed.
`--json-schema builtin` (or a schema file) asks every request for JSON through
`response_format`, to weigh structured output against the same run without it.
`--compare-structured` runs both in one go: first with the schema, then without it, each
request then asked for exactly as many tokens as its JSON answer had (`ignore_eos`), so the two
runs generate the same tokens per request and differ only by the grammar's work.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

from bench_generate import make_prompts  # a sibling script

#: One free-text field: the answer runs to max_tokens as an unconstrained one would, so the two
#: runs differ only by the grammar's work.
BUILTIN_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
                  "required": ["answer"]}


def one_request(client, model: str, prompt: str, max_tokens: int,
                extra: dict) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, completion tokens) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter() - t0
    return (first if first is not None else end), end, tokens


def run(client, model: str, prompts: list[str], max_tokens: int | list[int],
        concurrency: int, extra: dict):
    """`max_tokens`: one for all, or one per prompt."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p, m: one_request(client, model, p, m, extra),
                                prompts, limits))
    return time.perf_counter() - t0, results


def measure(client, model, prompts, max_tokens, concurrency, extra, label: str):
    """A warm-up run, then a timed one; prints its line and returns (tok/s, results)."""
    run(client, model, prompts, max_tokens, concurrency, extra)
    dur, results = run(client, model, prompts, max_tokens, concurrency, extra)
    n = sum(r[2] for r in results)
    print(f"{label}{len(prompts)} requests at concurrency {concurrency}: {n} output tokens in "
          f"{dur:.2f} s = {n / dur:.1f} output tok/s; TTFT p50 "
          f"{statistics.median(r[0] for r in results) * 1e3:.0f} ms; E2E p50 "
          f"{statistics.median(r[1] for r in results):.2f} s; per-request decode p50 "
          f"{statistics.median((r[2] - 1) / (r[1] - r[0]) for r in results if r[2] > 1):.1f} "
          "tok/s (tokens after the first / time after the first)", flush=True)
    return n / dur, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="model id (default: the first /v1/models lists)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-schema", default=None,
                    help="'builtin' or a JSON schema file: every request asks for JSON")
    ap.add_argument("--compare-structured", action="store_true",
                    help="the schema (builtin by default), then the same lengths without it")
    args = ap.parse_args()
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

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    model = args.model or client.models.list().data[0].id
    prompts = make_prompts(args.num_prompts)
    label = "structured: " if args.compare_structured else ""
    rate, results = measure(client, model, prompts, args.max_tokens, args.concurrency, extra,
                            label)
    if args.compare_structured:
        lengths = [max(1, r[2]) for r in results]
        free, _ = measure(client, model, prompts, lengths, args.concurrency,
                          {"extra_body": {"ignore_eos": True}}, "free, same lengths: ")
        change = (rate / free - 1) * 100
        print(f"structured output: {rate / free:.3f}x the output tok/s of the same tokens "
              f"without it ({abs(change):.1f}% {'faster' if change >= 0 else 'slower'})")


if __name__ == "__main__":
    main()
