"""Weight loading: clear errors, and GGUF/safetensors layouts that agree with the config."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import expected_hf_shapes, load_model


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
    wq = smollm.params["layers"]["wq"]  # kept in its Q4_1 blocks (kernels/quant.py)
    assert wq["q"].shape == (30, 576, 9, 64) and wq["q"].dtype == np.int8
    assert wq["scale"].shape == wq["min"].shape == (30, 576 // 32, 9, 64)


def test_rope_parameters_from_transformers5_config():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 500000.0
    assert dict(cfg.rope_scaling) == {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    assert "model.layers.0.self_attn.q_proj.weight" in expected_hf_shapes(cfg)


def test_qwen3_config_has_qk_norms_and_its_own_head_dim():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qk_norm and cfg.head_dim == 16 and not cfg.attention_bias
    shapes = expected_hf_shapes(cfg)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 8)
    assert cfg.sliding_window is None  # named, but not turned on
    assert ModelConfig.from_hf(hf | {"sliding_window": 4}).sliding_window is None
    assert ModelConfig.from_hf(hf | {"use_sliding_window": True,
                                     "sliding_window": 4}).sliding_window == 4
    # as HF's Qwen2/3: layers below max_window_layers see their whole context
    two = ModelConfig.from_hf(hf | {"use_sliding_window": True, "sliding_window": 4,
                                    "num_hidden_layers": 3, "max_window_layers": 2})
    assert two.global_layers == (0, 1) and two.local_layers == (2,)
    with pytest.raises(ValueError, match="^partial_rotary_factor"):
        ModelConfig.from_hf(hf | {"partial_rotary_factor": 0.5})


def test_gemma3_config_in_both_of_transformers_forms():
    """layer_types and rope_parameters per layer type (transformers 5), or the Hub's older
    sliding_window_pattern, rope_theta, rope_local_base_freq and rope_scaling: the same
    ModelConfig."""
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 10, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4,
            "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0}
    old = ModelConfig.from_hf(base | {
        "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    new = ModelConfig.from_hf(base | {"layer_types": types, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert old == new
    assert new.global_layers == (2, 5) and new.local_layers == (0, 1, 3, 4)
    assert new.layer_window(0) == 4 and new.layer_window(2) is None
    assert new.rope_theta == 1e6 and new.local_rope_theta == 1e4
    assert dict(new.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert new.tie_word_embeddings and new.qk_norm and new.sandwich_norms
    assert new.attn_scale == 16 ** -0.5 and new.final_softcap == 30.0
    assert new.embed_scale == 4.0 and new.norm_offset == 1.0 and new.hidden_act == "gelu_tanh"
    shapes = expected_hf_shapes(new)
    assert shapes["model.layers.5.pre_feedforward_layernorm.weight"] == (16,)
    assert "lm_head.weight" not in shapes
    assert ModelConfig.from_hf(base | {"model_type": "gemma3_text",
                                       "architectures": None}) == ModelConfig.from_hf(base)
    with pytest.raises(ValueError, match="^layer_types"):
        ModelConfig.from_hf(base | {"layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="^hidden_activation"):
        ModelConfig.from_hf(base | {"hidden_activation": "relu"})


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """Float rows (R, C), C a multiple of 256, as Q4_K or Q5_K bytes (R, C / 256 * size), the
    way llama.cpp's simplest K-quantizer goes: per sub-block of 32 a scale and a minimum, each
    a 6-bit multiple of its super-block's float16 d and dmin, and codes rounded to the grid."""
    top = 15 if kind == "Q4_K" else 31
    half = lambda a: a.astype(np.float16)  # noqa: E731
    b = np.asarray(w, np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    d, dmin = half((hi - lo).max(-1) / top / 63), half((-lo).max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint((hi - lo) / top / df)), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.rint(-lo / dminf)), 0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.clip(np.nan_to_num(np.rint((b + (dminf * m)[..., None]) / step)), 0, top)
    q = q.astype(np.uint8)  # (n, 8, 32)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    parts = [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales]
    if kind == "Q5_K":  # bit s of byte i: the fifth bit of value i of sub-block s
        parts.append(sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Float rows (R, C), C a multiple of 256, as Q6_K bytes (R, C / 256 * 210): per sub-block
    of 16 an int8 scale times the super-block's float16 d, codes -32 to 31 stored + 32."""
    b = np.asarray(w, np.float32).reshape(-1, 16, 16)
    step = np.abs(b).max(-1) / 32  # (n, 16)
    d = (np.abs(step).max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(step / df)), -128, 127).astype(np.int8)
        q = np.nan_to_num(np.rint(b / (df * sc)[..., None]))
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low = (u[..., :64] & 15) | ((u[..., 64:] & 15) << 4)  # (n, 2, 64)
    high = sum(((u[..., 32 * j:32 * j + 32] >> 4) & 3) << (2 * j) for j in range(4))
    return np.concatenate([low.reshape(-1, 128), high.astype(np.uint8).reshape(-1, 64),
                           sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)],
                          axis=1).reshape(w.shape[0], -1)


def _write_tiny_gguf(path, tensors: dict[str, np.ndarray], cfg: ModelConfig,
                     qtypes: dict[str, str] | None = None, arch: str = "llama") -> None:
    """A GGUF as llama.cpp's converter writes it: `arch`, for llama q/k rows permuted for its
    RoPE. `qtypes`: a GGML type (e.g. "Q4_1") per HF name suffix, for tensors stored quantized."""
    import gguf
    from gguf.quants import quantize

    def permute(w, heads):
        return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight":
                 "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight":
                 "ffn_gate_inp.weight", "mlp.experts.gate_proj": "ffn_gate_exps.weight",
                 "mlp.experts.up_proj": "ffn_up_exps.weight",
                 "mlp.experts.down_proj": "ffn_down_exps.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.is_moe:  # experts stacked, as "mlp.experts.{gate,up,down}_proj"
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
    for name, arr in tensors.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{per_layer[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = permute(arr, cfg.num_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = permute(arr, cfg.num_kv_heads)
        else:
            out = names[name]
        arr = np.ascontiguousarray(arr, np.float32)
        qtype = next((t for suffix, t in (qtypes or {}).items() if name.endswith(suffix)), None)
        if qtype is None:
            w.add_tensor(out, arr)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            raw = (quantize_q6_k(arr) if qtype == "Q6_K" else quantize_k(arr, qtype)
                   if qtype.endswith("_K") else quantize(arr, kind))
            w.add_tensor(out, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_roundtrip_restores_hf_layout_and_caches(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    from_st = load_model(tiny_llama_dir)
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path, tensors, from_st.config)
    first = load_model(str(gguf_path))  # converts (and un-permutes q/k), then caches
    assert any((tmp_path / "cache" / "converted").iterdir())
    second = load_model(str(gguf_path))  # from the cache
    for got in (first, second):
        assert got.config.num_heads == 4 and got.config.num_kv_heads == 2
        assert not got.config.tie_word_embeddings
        for key in ("wq", "wk", "wv", "wo", "w_up"):
            np.testing.assert_array_equal(got.params["layers"][key],
                                          from_st.params["layers"][key])
        np.testing.assert_array_equal(got.params["lm_head"], from_st.params["lm_head"])


def test_gguf_tokenizer_matches_transformers_gguf_tokenizer(smollm):
    """Our torch-free rebuild of the GGUF vocabulary tokenizes like transformers' own reader."""
    pytest.importorskip("torch")
    from jaxserve.models.loader import default_model_path, load_tokenizer

    path = default_model_path()
    theirs = load_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = smollm.tokenizer
    texts = ["Hello world!", "What is 12 times 7? 2024", "naïve café — 你好，世界! 🙂👍",
             "<|im_start|>user\nHi<|im_end|>\n", "  spaces   and\ttabs\n\nnewlines",
             "def f(x):\n    return x**2"]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == theirs.eos_token_id == 2


def test_bfloat16_safetensors_load(tmp_path):
    torch = pytest.importorskip("torch")
    from jaxserve.testing.oracle import make_tiny_hf_model

    model = make_tiny_hf_model("mistral", str(tmp_path / "f32"))
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    got = load_model(str(tmp_path / "bf16"))
    want = model.model.layers[1].mlp.up_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(got.params["layers"]["w_up"][1].astype(np.float32), want)
    # kept in the file's dtype (no float32 copy of the model); norms, tiny, as float32
    assert got.params["layers"]["w_up"].dtype == jnp.bfloat16
    assert got.params["embed"].dtype == jnp.bfloat16 and not got.params["embed"].flags.writeable
    assert got.params["final_norm"]["weight"].dtype == np.float32


def test_mapped_tensors_give_back_pages_and_read_them_again(tmp_path, tiny_llama_dir):
    """A checkpoint's tensors are views of its mapped files; dropping a view's pages after it
    was copied out leaves it readable (the pages come back from the file)."""
    from jaxserve.models.loader import MappedTensors

    mapped = MappedTensors()
    for file in sorted(pathlib.Path(tiny_llama_dir).glob("*.safetensors")):
        mapped.add(str(file))
    name = "model.layers.0.mlp.up_proj.weight"
    view = mapped.tensors[name]
    assert not view.flags.owndata and not view.flags.writeable  # the file's bytes, mapped
    copy = np.array(view)
    mapped.drop([view])
    np.testing.assert_array_equal(view, copy)
    mapped.drop([view])  # a second drop of the same view does nothing


def test_quantized_gguf_keeps_blocks_that_dequantize_to_the_float_load(tmp_path, tiny_llama_dir,
                                                                       monkeypatch):
    """Q8_0 / Q4_0 / Q4_1 projections stay in their blocks; expanded, they are exactly the
    weights of the same file read as float32 (gguf's own dequantizer), in every layout, q/k
    un-permuted. wo's blocks would straddle heads of 16 dims, so it is float32."""
    import gguf
    from gguf.quants import dequantize, quantize

    from jaxserve.kernels.quant import dequantize_tree, is_quantized

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_model(tiny_llama_dir).config
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    qtypes = {"q_proj.weight": "Q8_0", "k_proj.weight": "Q4_0", "v_proj.weight": "Q4_1",
              "o_proj.weight": "Q4_1", "gate_proj.weight": "Q4_1", "up_proj.weight": "Q8_0",
              "down_proj.weight": "Q4_0"}
    _write_tiny_gguf(tmp_path / "q.gguf", tensors, cfg, qtypes)
    # The same values as float32: what the quantized file holds, through gguf's dequantizer.
    held = dict(tensors)
    for name, arr in tensors.items():
        kind = next((t for sfx, t in qtypes.items() if name.endswith(sfx)), None)
        if kind is not None:
            t = gguf.GGMLQuantizationType[kind]
            held[name] = dequantize(quantize(np.ascontiguousarray(arr, np.float32), t), t)
    _write_tiny_gguf(tmp_path / "f.gguf", held, cfg)
    for _ in range(2):  # converted, then from the cache
        got = load_model(str(tmp_path / "q.gguf")).params
        want = load_model(str(tmp_path / "f.gguf")).params
        layers = got["layers"]
        assert all(is_quantized(layers[k]) for k in ("wq", "wk", "wv", "w_gate", "w_up",
                                                     "w_down"))
        assert layers["w_gate"]["q"].dtype == np.int8 and not is_quantized(layers["wo"])
        assert layers["w_down"]["scale"].shape == (2, 128 // 32, 64)  # blocks along F
        flat = dequantize_tree(got)
        assert sorted(flat["layers"]) == sorted(want["layers"])
        for key, w in want["layers"].items():
            w, f = (w["weight"], flat["layers"][key]["weight"]) if key.endswith("norm") else (
                w, flat["layers"][key])
            np.testing.assert_array_equal(f, w, err_msg=key)


def write_moe_gguf(path, model_dir: str, cfg: ModelConfig, qtypes: dict[str, str],
                   gguf_arch: str) -> dict[str, np.ndarray]:
    """The safetensors MoE in `model_dir` as a GGUF with its experts stacked, as llama.cpp
    writes them (`qtypes` as _write_tiny_gguf's) -> the HF-named tensors written."""
    import glob

    from jaxserve.models.moe import canonical_expert_names

    tensors = {}
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        tensors |= load_file(f)
    tensors = canonical_expert_names(cfg, tensors)
    for i in range(cfg.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = f"model.layers.{i}.mlp.experts."
            tensors[p + proj] = np.stack([tensors.pop(f"{p}{j}.{proj}.weight")
                                          for j in range(cfg.num_experts)])
    _write_tiny_gguf(path, tensors, cfg, qtypes, gguf_arch)
    return tensors


@pytest.mark.parametrize("arch, gguf_arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_moe_gguf_loads_its_experts(arch, gguf_arch, tmp_path, tiny_models, monkeypatch):
    """A GGUF with expert tensors (llama arch for Mixtral, as llama.cpp writes it; qwen3moe):
    the router and the stacked experts land where the safetensors load puts them; a Q8_0
    expert stack keeps its blocks, which expand exactly as gguf dequantizes them."""
    import gguf
    from gguf.quants import dequantize, quantize

    from jaxserve.kernels import quant

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = tiny_models[arch]
    from_st = load_model(path)
    cfg = from_st.config
    tensors = write_moe_gguf(tmp_path / "moe.gguf", path, cfg, {"experts.up_proj": "Q8_0"},
                             gguf_arch)
    got = load_model(str(tmp_path / "moe.gguf"))
    c = got.config
    # llama.cpp renormalises qwen3moe's top k whatever HF's config said (this one: not)
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.head_dim, c.qk_norm, c.norm_topk_prob) == (
        cfg.architecture, 8, 2, cfg.moe_intermediate_size, cfg.head_dim, cfg.qk_norm, True)
    moe, want = got.params["layers"]["moe"], from_st.params["layers"]["moe"]
    for key in ("router", "w_gate", "w_down"):
        np.testing.assert_array_equal(moe[key], want[key])
    for key in ("wq", "wk", "wo"):
        np.testing.assert_array_equal(got.params["layers"][key], from_st.params["layers"][key])
    if cfg.qk_norm:
        np.testing.assert_array_equal(got.params["layers"]["q_norm"]["weight"],
                                      from_st.params["layers"]["q_norm"]["weight"])
    q8 = gguf.GGMLQuantizationType.Q8_0
    up = np.stack([dequantize(quantize(np.ascontiguousarray(
        tensors[f"model.layers.{i}.mlp.experts.up_proj"]), q8), q8) for i in range(2)])
    assert quant.is_quantized(moe["w_up"]) and moe["w_up"]["q"].dtype == np.int8
    assert moe["w_up"]["q"].shape == want["w_up"].shape  # (L, E, D, F), blocks along D
    np.testing.assert_array_equal(quant.dequantize_np(moe["w_up"]), up.transpose(0, 1, 3, 2))
    np.testing.assert_allclose(quant.dequantize_np(moe["w_up"]), want["w_up"], atol=0.02)


def test_gguf_load_holds_the_weights_about_once(tmp_path, monkeypatch):
    """Loading reads one tensor at a time and stacks layers as it takes them: the host memory it
    allocates peaks well under twice what the loaded model holds (decoded tensors and their
    stacks side by side would be two copies)."""
    import tracemalloc

    import jax

    from jaxserve.testing.tiny import write_tiny_llama

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", "")  # no converted-weights cache: a real convert
    (tmp_path / "hf").mkdir()
    d = write_tiny_llama(tmp_path / "hf", 512, seed=3, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=8)
    cfg = load_model(d).config
    tensors = load_file(os.path.join(d, "model.safetensors"))
    _write_tiny_gguf(tmp_path / "k.gguf", tensors, cfg, {"proj.weight": "Q4_K"})
    del tensors
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        loaded = load_model(str(tmp_path / "k.gguf"))
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    held = sum(a.nbytes for a in jax.tree.leaves(loaded.params))
    assert loaded.params["layers"]["w_up"]["q"].shape == (8, 256, 1024)  # kept in blocks
    assert peak <= 1.6 * held, (peak, held)
