"""Command line (`jaxserve` or `python -m jaxserve`): `serve [MODEL] [options]` (the socket and
OpenAI HTTP server; `serve --help` lists its options), `bench [options]` (scripts/bench.py's
benchmarks), `generate "prompt" [--max-tokens N]
[--temperature T]`, `launch --num-processes N -- serve|SCRIPT ARGS` (one engine over N
processes) and `launch --prefill N --decode M -- serve|SCRIPT ARGS` (disaggregated)."""

from __future__ import annotations

import argparse
import sys
import time

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.launch import launch as run
from jaxserve.launch import launch_disaggregated


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its options are the server's own (serving/cli.py)
        return serve(argv[1:])
    if argv[:1] == ["bench"]:  # and the benchmark's own (bench/cli.py)
        from jaxserve.bench import cli

        return cli.main(argv[1:], prog="jaxserve bench")
    ap = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve a model over the socket protocol and the OpenAI HTTP "
                                 "API (jaxserve serve --help lists the options)")
    sub.add_parser("bench", help="benchmark the engine against its baselines (jaxserve bench "
                                 "--help lists the options)")
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="HF model directory or .gguf file (default: bundled SmolLM2-135M)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--dtype", default="auto")
    launch = sub.add_parser("launch", help="run a script (e.g. scripts/serve.py) as N processes "
                                           "of one engine on this machine")
    launch.add_argument("--num-processes", type=int, default=None)
    launch.add_argument("--prefill", type=int, default=None,
                        help="disaggregated serving: this many prefill engine processes "
                             "(with --decode), and one front on the script's ports")
    launch.add_argument("--decode", type=int, default=None,
                        help="disaggregated serving: this many decode engine processes")
    launch.add_argument("--devices-per-engine", type=int, default=None,
                        help="disaggregated serving: devices of its own for each engine (its "
                             "--tensor-parallel-size): a run of CUDA_VISIBLE_DEVICES each, or "
                             "that many forced CPU devices")
    launch.add_argument("--cpu-devices-per-process", type=int, default=None,
                        help="on a CPU: devices to force in each process")
    launch.add_argument("--coordinator-port", type=int, default=None,
                        help="port of process 0's coordination service (default: a free one)")
    launch.add_argument("script", nargs=argparse.REMAINDER,
                        help="-- then `serve` or a script, and its arguments")
    args = ap.parse_args(argv)
    if args.command == "launch":
        script = args.script[1:] if args.script[:1] == ["--"] else args.script
        if script[:1] == ["serve"]:  # this command's own server, in each process
            script = ["-m", "jaxserve", *script]
        if (args.prefill is None) != (args.decode is None) or (
                (args.prefill is None) == (args.num_processes is None)):
            ap.error("launch: give --num-processes, or --prefill and --decode")
        if args.prefill is not None:
            return launch_disaggregated(args.prefill, args.decode, script,
                                        args.devices_per_engine)
        return run(args.num_processes, script, args.cpu_devices_per_process,
                   args.coordinator_port)

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048,
                                    max_num_seqs=4, max_num_batched_tokens=256))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    try:
        engine.add_request("cli", prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    t1 = time.perf_counter()
    n, reason = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].new_text)
            sys.stdout.flush()
            n = len(out.outputs[0].token_ids)
            if out.finished:
                reason = out.outputs[0].finish_reason
    dt = time.perf_counter() - t1
    runner = engine.runner
    print(f"\n[{n} tokens in {dt:.2f}s, finish_reason={reason}; compiled {runner.num_compiles} "
          f"programs in {runner.compile_seconds:.1f}s]", file=sys.stderr)
    return 0


def serve(argv: list[str]) -> int:
    """`serve [MODEL] [options]`: MODEL, first and not an option, is --model."""
    from jaxserve.serving import cli

    if argv[:1] and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    return cli.main(argv, prog="jaxserve serve")


if __name__ == "__main__":
    sys.exit(main())
