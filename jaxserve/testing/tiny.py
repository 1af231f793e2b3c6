"""A tiny random Llama as a Hugging Face directory, written from numpy (no torch): the tests'
model without an oracle, and the benchmarks' model whose step costs little."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def write_tiny_llama(d, vocab_size: int = 512, seed: int = 0, **sizes) -> str:
    """Hidden 64, 2 layers, 4 query / 2 KV heads, `vocab_size` tokens, into directory `d`;
    `sizes` overrides config fields (hidden_size=256, ...)."""
    from safetensors.numpy import save_file

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.loader import expected_hf_shapes

    d = pathlib.Path(d)
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
              hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    hf |= sizes
    (d / "config.json").write_text(json.dumps(hf))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_hf_shapes(ModelConfig.from_hf(hf)).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    return str(d)


def write_fp8_pair(src, fp8_dir, twin_dir, form: str = "block") -> tuple[str, str]:
    """The HF model in directory `src` (float32 safetensors) as an FP8 checkpoint in
    `fp8_dir` and its dequantized twin in `twin_dir` (the same weights as float32, no
    quantization_config). form: "block" (quant_method fp8, 128 x 128 tiles) or "channel" /
    "tensor" (compressed-tensors). Layer projections only; the head stays float (ignored)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    src, fp8_dir, twin_dir = (pathlib.Path(p) for p in (src, fp8_dir, twin_dir))
    hf = json.loads((src / "config.json").read_text())
    codes_of, top = ml_dtypes.float8_e4m3fn, np.float32(448)  # e4m3fn's largest value
    quantized, twin = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            quantized[name] = twin[name] = w
            continue
        if form == "block":
            rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
            tiles = np.zeros((rows * 128, cols * 128), np.float32)
            tiles[:w.shape[0], :w.shape[1]] = np.abs(w)
            scale = tiles.reshape(rows, 128, cols, 128).max(axis=(1, 3)) / top
            full = np.kron(scale, np.ones((128, 128), np.float32))[:w.shape[0], :w.shape[1]]
            suffix = "weight_scale_inv"
        else:
            axis = 1 if form == "channel" else None
            scale = np.abs(w).max(axis=axis, keepdims=axis is not None) / top
            scale = np.asarray(scale, np.float32).reshape(-1, 1) if axis else np.float32(
                scale).reshape(1)
            full = np.broadcast_to(scale.reshape(-1, 1) if axis else scale, w.shape)
            suffix = "weight_scale"
        codes = (w / full).astype(codes_of)
        quantized[name], quantized[name.removesuffix("weight") + suffix] = codes, scale
        twin[name] = codes.astype(np.float32) * full
    if form == "block":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head"],
              "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": {
                      "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True},
                  "weights": {"num_bits": 8, "type": "float", "strategy": form,
                              "dynamic": False, "symmetric": True}}}}
    for d, tensors, config in ((fp8_dir, quantized, hf | {"quantization_config": qc}),
                               (twin_dir, twin, hf)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(d / "model.safetensors"))
    return str(fp8_dir), str(twin_dir)


def write_successor_model(d, vocab_size: int, successors: dict[int, int], seed: int = 0,
                          **sizes) -> str:
    """write_tiny_llama's model (`sizes` as there) whose greedy next token after token `a` is
    `successors[a]`, whatever came before: every layer adds nothing to the residual stream
    (o_proj and down_proj zero), so the last hidden state is the token's own embedding, and
    lm_head's row of `successors[a]` is that embedding, scaled far above the other rows. A
    model that writes a known text, for end-to-end tests of what a text holds."""
    from safetensors.numpy import load_file, save_file

    path = pathlib.Path(write_tiny_llama(d, vocab_size, seed, **sizes | {
        "tie_word_embeddings": False}))
    tensors = load_file(str(path / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(w)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    for a, b in successors.items():
        head[b] += 50.0 * embed[a] / np.linalg.norm(embed[a])
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)
