"""Random-weight models of the sizes people run, as the GGUF files they download, made with
llama.cpp's own tools (nothing is downloaded; files are cached, never committed).

    python scripts/make_gguf_models.py --llama-cpp DIR [--models smollm2-1.7b llama-3.1-8b]
        [--types Q4_K_M Q6_K Q8_0] [--out DIR]

DIR is a llama.cpp source tree (the one in the `llama-cpp-python` sdist will do) with
`llama-quantize` built under DIR/build/bin. Per model: an HF directory (config.json, random
float16 weights in safetensors, the default model's tokenizer), converted to F16 by
DIR/convert_hf_to_gguf.py, then quantized to each type. Prints each file's path and size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

SHAPES = {  # HF config fields; both use the default model's vocabulary (49152 tokens)
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32,
                         tie_word_embeddings=True, rope_theta=130000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, rope_theta=500000.0),
}
SHARD_BYTES = 2 << 30
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "gguf-models")


def write_hf(path: str, shape: dict, seed: int = 0) -> None:
    """An HF Llama directory of `shape` with random float16 weights (std 0.02, norms 1) and
    the default model's tokenizer."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.loader import default_model_path, expected_hf_shapes

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  vocab_size=len(tok), max_position_embeddings=8192, rms_norm_eps=1e-5,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  hidden_act="silu", torch_dtype="float16") | shape
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    rng = np.random.default_rng(seed)
    # written a shard at a time: an 8B's float16 weights (16 GB) are never in memory at once
    shard: dict[str, np.ndarray] = {}
    shards = 0
    for name, dims in expected_hf_shapes(ModelConfig.from_hf(config)).items():
        if name.endswith("norm.weight"):
            shard[name] = np.ones(dims, np.float16)
        else:  # drawn as float32 a row block at a time: float16 halves the file
            a = np.empty(dims, np.float16)
            for lo in range(0, dims[0], 1024):
                a[lo:lo + 1024] = rng.standard_normal((min(1024, dims[0] - lo), *dims[1:]),
                                                      np.float32) * 0.02
            shard[name] = a
        if sum(a.nbytes for a in shard.values()) >= SHARD_BYTES:
            shards += 1
            save_file(shard, os.path.join(path, f"model-{shards:05d}.safetensors"))
            shard = {}
    if shard:
        save_file(shard, os.path.join(path, f"model-{shards + 1:05d}.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def make(model: str, types: list[str], llama_cpp: str, out: str) -> list[str]:
    """The model's GGUF files of `types` (made where missing) -> their paths."""
    folder = os.path.join(out, model)
    hf, f16 = os.path.join(folder, "hf"), os.path.join(folder, f"{model}-F16.gguf")
    quantize = os.path.join(llama_cpp, "build", "bin", "llama-quantize")
    paths = [os.path.join(folder, f"{model}-{t}.gguf") for t in types]
    if all(os.path.exists(p) for p in paths):
        return paths
    if not os.path.exists(f16):
        if not os.path.exists(os.path.join(hf, "config.json")):
            write_hf(hf, SHAPES[model])
        env = dict(os.environ, PYTHONPATH=os.path.join(llama_cpp, "gguf-py"))
        subprocess.run([sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), hf,
                        "--outtype", "f16", "--outfile", f16], check=True, env=env)
    for kind, path in zip(types, paths, strict=True):
        if not os.path.exists(path):
            subprocess.run([quantize, f16, path, kind], check=True)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree, tools built")
    ap.add_argument("--models", nargs="+", default=["smollm2-1.7b"], choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q6_K", "Q8_0"])
    ap.add_argument("--out", default=CACHE)
    args = ap.parse_args()
    for model in args.models:
        for path in make(model, args.types, args.llama_cpp, args.out):
            print(f"{path}  {os.path.getsize(path) / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
