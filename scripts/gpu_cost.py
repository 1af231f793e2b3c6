"""The engine's GPU step programs, compiled and costed on a machine without a GPU.

    python scripts/gpu_cost.py --target h200            # default model and Llama-3.1-8B
    python scripts/gpu_cost.py --target h100 --models smollm2-135m --json cost.json
    python scripts/gpu_cost.py --target h100 --config DIR --tensor-parallel-size 8 --json PATH

Compiles, for the target's description (`h200`, `h100`, or a path to a GpuTargetConfigProto
.txtpb), the step programs the engine would run there (its own ModelRunner, random weights of
each model's shapes, bfloat16, the accelerator defaults): decode at 1, 64 and 256 sequences, the
decode loop, a mixed step. Per program it prints compile time, launches per decode step (in
command buffers and outside), host syncs, conditionals, HBM bytes, the floor, the predicted
time, the collectives (under tensor parallelism) and the top kernels by bytes:
jaxserve/bench/gpu_cost.py says how each is counted. Per model it prints the memory plan the
engine would make on one such device (runtime/memory_plan.py): weights, the largest program's
temporaries, the KV pool and how many sequences of max_model_len it holds.
`--config DIR` costs the model of an HF config.json (no checkpoint: random weights of its
shapes); `--tensor-parallel-size N` splits it over N devices of the target (every figure is then
one device's).

Needs JAX's CUDA plugin beside JAX, kept out of the environment so that JAX there stays on the
CPU: `pip install --no-deps --target .cuda-compiler jax-cuda12-plugin==0.11.2
jax-cuda12-pjrt==0.11.2` (`--plugin-dir` or $JAXSERVE_CUDA_PLUGIN_DIR name another folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"h200": "h200.txtpb", "h100": "h100_sxm.txtpb"}
PLUGIN_HELP = ("pip install --no-deps --target .cuda-compiler jax-cuda12-plugin==0.11.2 "
               "jax-cuda12-pjrt==0.11.2")


def target_path(name: str) -> str:
    """A target's description: a path, or a name looked up in the repository's shared/gpu
    folder or the one beside the checkout."""
    if os.path.exists(name):
        return name
    file = TARGETS.get(name)
    if file is None:
        raise SystemExit(f"--target: {name!r} is neither a file nor one of {sorted(TARGETS)}")
    for folder in (os.path.join(ROOT, "shared", "gpu"),
                   os.path.join(os.path.dirname(ROOT), "shared", "gpu")):
        if os.path.exists(os.path.join(folder, file)):
            return os.path.join(folder, file)
    raise SystemExit(f"--target {name}: no {file} in shared/gpu beside or inside the checkout")


def parse_args(argv=None) -> argparse.Namespace:
    from jaxserve.bench.gpu_cost import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h200", help="h200, h100 or a .txtpb path")
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                    help="default: both, or none with --config")
    ap.add_argument("--config", default=None,
                    help="also cost this model: a directory holding an HF config.json")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="the memory plan's share of the device's memory")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the memory plan's sequence length (default: the engine's)")
    ap.add_argument("--kv-cache-dtype", default=None, help="default: the engine's")
    ap.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA option over the engine's (runtime/runner.py "
                         "GPU_COMPILER_OPTIONS), e.g. to cost a step compiled another way")
    ap.add_argument("--programs", nargs="+", default=None,
                    help="only these programs (names as printed, e.g. decode-256)")
    ap.add_argument("--context", type=int, default=512, help="tokens each sequence has seen")
    ap.add_argument("--sequences", type=int, default=256, help="the largest batch")
    ap.add_argument("--attention-backend", default="mosaic")
    ap.add_argument("--enable-lora", action="store_true",
                    help="LoRA slots too: each program also with the adapters' updates "
                         "(its name + '+lora'), beside the one without")
    ap.add_argument("--max-loras", type=int, default=None, help="with --enable-lora")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="with --enable-lora")
    ap.add_argument("--layer-loop", default=None, choices=("scan", "unroll"),
                    help="default: the engine's on an accelerator")
    ap.add_argument("--plugin-dir", default=os.environ.get(
        "JAXSERVE_CUDA_PLUGIN_DIR", os.path.join(ROOT, ".cuda-compiler")))
    ap.add_argument("--json", default=None,
                    help="write {'programs': [...], 'plans': {model: plan}, 'plan': ...} here")
    args = ap.parse_args(argv)
    if args.models is None:
        args.models = [] if args.config else list(MODELS)
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    bad = [o for o in args.xla_option if "=" not in o]
    if bad:
        ap.error(f"--xla-option: expected NAME=VALUE, got {bad[0]!r}")
    if args.config and not os.path.exists(os.path.join(args.config, "config.json")):
        ap.error(f"--config: no config.json in {args.config!r}")
    return args


def row(p: dict) -> str:
    gb = lambda b: f"{b / 1e9:.3f}"  # noqa: E731
    return (f"| {p['name']} | {p['compile_s']:.1f} | {p['launches']:.0f} "
            f"({p['launches_in_graphs']:.0f} / {p['launches_outside_graphs']:.0f}) | "
            f"{p['graphs']:.2g} | {p['host_syncs']:.2g} | {p['conditionals']:.0f} | "
            f"{gb(p['hbm_bytes'])} | {gb(p['floor_bytes'])} | "
            f"{p['hbm_bytes'] / p['floor_bytes']:.2f} | "
            f"{p['predicted_ms']:.3f} | {p['floor_ms']:.3f} | {p['collectives']:.0f} "
            f"({p['collectives_in_graphs']:.0f}) | {gb(p['collective_bytes'])} | "
            f"{p['collective_ms']:.3f} |")


HEADER = ("| program | compile s | launches per step (in graphs / outside) | graphs | host syncs "
          "| conditionals | HBM GB | floor GB | x floor | predicted ms | floor ms | collectives "
          "(in graphs) | collective GB | collective ms |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxserve.bench.gpu_cost import default_programs

    names = [s.name for s in default_programs(args.context, args.sequences)]
    unknown = sorted(set(args.programs or ()) - set(names))
    if unknown:
        raise SystemExit(f"--programs: no program {', '.join(unknown)}; the programs are "
                         f"{', '.join(names)}")
    target = target_path(args.target)
    dump_dir = tempfile.mkdtemp(prefix="gpu-cost-")
    from jaxserve.bench import gpu_cost as gc

    gc.setup_compiler(args.plugin_dir, dump_dir)

    tp = args.tensor_parallel_size
    try:
        devices = gc.target_devices(target, tp)
    except Exception as e:  # noqa: BLE001 - say what to install
        raise SystemExit(f"cannot compile for the GPU here ({type(e).__name__}: {e}); "
                         f"install JAX's CUDA plugin: {PLUGIN_HELP}") from None
    bandwidth = gc.bandwidth_of(target)
    print(f"target: {tp} x {devices[0].device_kind} ({os.path.basename(target)}), "
          f"{bandwidth / 1e12:.2f} TB/s, {gc.memory_of(target) / 2**30:.1f} GiB; predicted = "
          f"bytes / bandwidth + {gc.LAUNCH_US} us a launch outside a graph + {gc.GRAPH_US} us "
          f"a graph + {gc.SYNC_US} us a host sync + collectives at "
          f"{gc.LINK_BANDWIDTH / 1e9:.0f} GB/s a link + {gc.COLLECTIVE_US} us each", flush=True)
    engine = {"attention_backend": args.attention_backend}
    for name in ("layer_loop", "max_model_len", "kv_cache_dtype", "enable_lora", "max_loras",
                 "max_lora_rank"):
        if getattr(args, name):
            engine[name] = getattr(args, name)
    models = {m: gc.MODELS[m] for m in args.models}
    if args.config:
        models[os.path.basename(os.path.abspath(args.config))] = gc.preset_of_config(args.config)
    programs, plans = [], {}
    for model, preset in models.items():
        specs = [s for s in gc.default_programs(args.context, args.sequences)
                 if args.programs is None or s.name in args.programs]
        if args.enable_lora:
            specs = [v for s in specs for v in (s, dataclasses.replace(
                s, name=s.name + "+lora", lora=True))]
        if not specs:
            continue
        runner = gc.deviceless_runner(preset, devices, specs, **engine)
        runner.compiler_options = (runner.compiler_options or {}) | dict(
            o.split("=", 1) for o in args.xla_option)
        print(f"\n{model}: {runner.model_config.num_layers} layers, weights "
              f"{gc.weight_bytes(runner) / 1e9:.2f} GB {runner.dtype.name} a device, KV "
              f"{runner.kv_dtype.name}, attention {runner.attention_backend}, layer loop "
              f"{runner.config.layer_loop}, context {args.context}, tensor parallel {tp}"
              f"\n{HEADER}", flush=True)
        for spec in specs:
            p = gc.cost_program(runner, spec, dump_dir, bandwidth) | {"model": model}
            programs.append(p)
            print(row(p), flush=True)
        temporaries = max(p["temporaries_bytes"] for p in programs if p["model"] == model)
        plan = gc.memory_plan(runner, target, temporaries, args.gpu_memory_utilization)
        plans[model] = plan.as_dict() | {"temporaries_of": [
            p["name"] for p in programs if p["model"] == model]}
        print(f"  {plan.describe()} (temporaries: the largest of the programs above)")
        for p in programs:
            if p["model"] == model:
                print(f"  {p['name']}, top kernels by bytes (source op, kind, runs, GB):")
                for k in p["top_kernels"]:
                    print(f"    {k['name'][-90:]}  {k['opcode']}  {k['runs']:g}  "
                          f"{k['bytes'] / 1e9:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": os.path.basename(target), "tensor_parallel_size": tp,
                       "programs": programs, "plans": plans,
                       "plan": next(iter(plans.values()), None)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
