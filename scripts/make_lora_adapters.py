"""Random LoRA adapters in PEFT's format for a model, for benchmarks and trials: no torch, no
peft, no download; the shapes come from the model's own config (a Hugging Face directory or a
GGUF file; default: the default model).

    python scripts/make_lora_adapters.py --out DIR [--model PATH] [--count 4] [--rank 16]

writes DIR/a1 .. DIR/aN, each `adapter_config.json` + `adapter_model.safetensors` on every
projection of every layer (q, k, v, o, gate, up, down), A and B drawn at random (B non-zero,
so each adapter changes the model's output), and prints a `--lora-modules` value for them.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def write_adapter(path: str, cfg, rank: int, seed: int) -> None:
    from safetensors.numpy import save_file

    from jaxserve.models.lora import CONFIG_FILE, MODULES, WEIGHTS_FILE, module_sizes

    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for module, (din, dout) in module_sizes(cfg).items():
            key = f"base_model.model.model.layers.{i}.{MODULES[module][1]}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, din)) / din ** 0.5
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((dout, rank)) * 0.01
                                               ).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                   "lora_alpha": rank, "target_modules": list(module_sizes(cfg)),
                   "bias": "none", "use_rslora": False, "use_dora": False}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to write the adapters into")
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    if args.count < 1 or args.rank < 1:
        ap.error("--count and --rank must be at least 1")

    from jaxserve.models.loader import load_model

    cfg = load_model(args.model).config
    names = [f"a{i}" for i in range(1, args.count + 1)]
    for seed, name in enumerate(names):
        write_adapter(os.path.join(args.out, name), cfg, args.rank, seed)
    print("--lora-modules " + " ".join(f"{n}={os.path.join(args.out, n)}" for n in names))


if __name__ == "__main__":
    main()
