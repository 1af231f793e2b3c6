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
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=vocab_size, hidden_size=64,
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
