"""What the engine's decode step program launches: its compiled operations outside fusions.

    python scripts/step_ops.py [--model PATH] [--sequences 16] [--plain] [--layer-loop unroll]

Builds the engine (the default model unless --model), compiles the decode program of
--sequences rows and prints its launch count per call by opcode (jaxserve/bench/op_count.py);
--plain counts the plain program (StepInputs.plain) instead of the branching one.
"""

from __future__ import annotations

import argparse
import json

from jaxserve import LLM
from jaxserve.bench.decode_step import decode_inputs
from jaxserve.bench.op_count import count_ops, describe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--plain", action="store_true", help="the plain program's count")
    ap.add_argument("--layer-loop", default=None, choices=("scan", "unroll"))
    args = ap.parse_args()
    extra = {"layer_loop": args.layer_loop} if args.layer_loop else {}
    llm = LLM(args.model, max_num_seqs=args.sequences, token_buckets=(args.sequences,),
              block_buckets=(8,), max_model_len=128, plain_programs=args.plain, **extra)
    runner = llm.engine.runner
    inp = decode_inputs(runner, args.sequences, 64)
    if args.plain:
        import dataclasses

        inp = dataclasses.replace(inp, plain=True)
    runner.execute(inp)
    counts = count_ops(runner._executables[inp.program].as_text())
    print(f"decode step, {args.sequences} sequences, {jax_platform()}, "
          f"{'plain' if args.plain else 'branching'} program: {describe(counts, 12)}")
    print(json.dumps(counts))


def jax_platform() -> str:
    import jax

    return jax.default_backend()


if __name__ == "__main__":
    main()
