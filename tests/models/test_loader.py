"""Weight loading: clear errors, and GGUF/safetensors layouts that agree with the config."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.config import ModelConfig
from models.loader import expected_hf_shapes, load_model


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("/nonexistent/model-dir")


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(str(d))


def test_wrong_tensor_shape_is_named(tmp_path, tiny_llama_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((7, 64), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 64\)"):
        load_model(str(d))


def test_sharded_safetensors_with_index(tmp_path, tiny_llama_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard))
        weight_map |= {k: shard for k in keys}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    m = load_model(str(d))
    np.testing.assert_array_equal(m.params["layers"]["w_up"][1],
                                  tensors["model.layers.1.mlp.up_proj.weight"].T)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(str(d))


def test_default_gguf_config(smollm):
    cfg = smollm.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (30, 9, 3, 576)
    assert cfg.tie_word_embeddings and "lm_head" not in smollm.params
    assert 2 in cfg.eos_token_ids
    assert smollm.params["layers"]["wq"].shape == (30, 576, 9, 64)


def test_rope_parameters_from_transformers5_config():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == (8.0, 1.0, 4.0, 8192)
    assert "model.layers.0.self_attn.q_proj.weight" in expected_hf_shapes(cfg)
