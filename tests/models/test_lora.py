"""Reading PEFT LoRA adapters (models/lora.py): layout and scaling, and every adapter the step
cannot compute refused with a ValueError naming the field (no torch, no device)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import lora_update, slot_mask
from jaxserve.models.lora import load_adapter

HF = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
          intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2)
CFG = ModelConfig.from_hf(HF)
MOE = ModelConfig.from_hf(HF | dict(architectures=["MixtralForCausalLM"], num_local_experts=4,
                                    num_experts_per_tok=2))
SIZES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
         "gate_proj": (32, 48), "up_proj": (32, 48), "down_proj": (48, 32)}


def write_adapter(d, conf: dict | None = None, tensors: dict | None = None,
                  drop: tuple[str, ...] = ()) -> str:
    """A PEFT adapter as save_pretrained writes it: r 4, alpha 8 on q and v (`conf` overrides
    fields), random A and B per layer (`tensors` adds or replaces, `drop` removes keys)."""
    conf = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                bias="none", use_dora=False, use_rslora=False, modules_to_save=None,
                rank_pattern={}, alpha_pattern={}) | (conf or {})
    rng = np.random.default_rng(0)
    out = {}
    for layer in range(CFG.num_layers):
        for name in (n for n in conf["target_modules"] if n in SIZES):
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            r = conf["rank_pattern"].get(name, conf["r"])
            din, dout = SIZES[name]
            out[f"{key}.lora_A.weight"] = rng.standard_normal((r, din)).astype(np.float32)
            out[f"{key}.lora_B.weight"] = rng.standard_normal((dout, r)).astype(np.float32)
    out = {k: v for k, v in (out | (tensors or {})).items() if k not in drop}
    (d / "adapter_config.json").write_text(json.dumps(conf))
    save_file(out, str(d / "adapter_model.safetensors"))
    return str(d)


def test_adapter_layout_and_scaling(tmp_path):
    """a = A^T, b = B^T * scaling per layer; alpha / r, alpha / sqrt(r) with rsLoRA, the
    patterns' rank and alpha per module; modules not targeted are absent."""
    path = write_adapter(tmp_path, dict(target_modules=["q_proj", "down_proj"],
                                        rank_pattern={"down_proj": 2},
                                        alpha_pattern={"down_proj": 6}))
    from safetensors.numpy import load_file
    raw = load_file(f"{path}/adapter_model.safetensors")
    ad = load_adapter(path, CFG, 16)
    assert set(ad.a) == {"wq", "w_down"} and ad.rank == 4
    key = "base_model.model.model.layers.1.mlp.down_proj"
    np.testing.assert_allclose(ad.a["w_down"][1, :, :2], raw[f"{key}.lora_A.weight"].T)
    np.testing.assert_allclose(ad.b["w_down"][1, :2], raw[f"{key}.lora_B.weight"].T * 3.0)
    assert not ad.a["w_down"][..., 2:].any()  # padded to the adapter's largest rank
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    np.testing.assert_allclose(ad.b["wq"][0], raw[f"{key}.lora_B.weight"].T * 2.0)
    rs = load_adapter(write_adapter(tmp_path, dict(use_rslora=True)), CFG, 16)
    np.testing.assert_allclose(rs.b["wq"][0], raw[f"{key}.lora_B.weight"].T * 8 / math.sqrt(4),
                               rtol=1e-6)


def test_update_reads_each_rows_own_slot():
    """lora_update over a mixed batch equals each row's own x A B (slot s at index s - 1;
    slot 0: none, zeros)."""
    rng = np.random.default_rng(1)
    s, r, din, dout = 2, 4, 8, 5
    a = rng.standard_normal((din, s, r)).astype(np.float32)
    b = rng.standard_normal((s, r, dout)).astype(np.float32)
    x = rng.standard_normal((6, din)).astype(np.float32)
    slots = np.array([0, 2, 1, 2, 0, 1], np.int32)
    got = np.asarray(lora_update(x, a, b, slot_mask(slots, s, r, np.float32)))
    want = np.stack([x[i] @ a[:, k - 1] @ b[k - 1] if k else np.zeros(dout, np.float32)
                     for i, k in enumerate(slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("conf, tensors, drop, field", [
    (dict(use_dora=True), None, (), "use_dora"),
    (dict(modules_to_save=["lm_head"]), None, (), "modules_to_save"),
    (dict(bias="all"), None, (), "bias"),
    (dict(bias="lora_only"), None, (), "bias"),
    (dict(peft_type="IA3"), None, (), "peft_type"),
    (dict(target_modules=["embed_tokens"]), None, (), "target_modules"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), None, (), "target_parameters"),
    (dict(r=32), None, (), "r: rank 32 exceeds max_lora_rank"),
    (dict(rank_pattern={"v_proj": 32}), None, (), "rank_pattern"),
    (dict(fan_in_fan_out=True), None, (), "fan_in_fan_out"),
    (None, {A0: np.zeros((4, 31), np.float32)}, (), "shape"),
    (None, {"base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight":
            np.zeros((4, 32), np.float32)}, (), "MoE experts"),
    (None, {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
            np.zeros(32, np.float32)}, (), "use_dora"),
    (None, {"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight":
            np.zeros((4, 32), np.float32)}, (), "layers"),
    (None, None, (A0.replace("lora_A", "lora_B"),), "lora_B"),
])
def test_unsupported_adapters_are_refused_naming_the_field(tmp_path, conf, tensors, drop,
                                                           field):
    path = write_adapter(tmp_path, conf, tensors, drop)
    with pytest.raises(ValueError, match=field):
        load_adapter(path, CFG, 16)


def test_adapters_on_moe_experts_and_missing_files_are_refused(tmp_path):
    path = write_adapter(tmp_path, dict(target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(ValueError, match="target_modules.*MoE experts"):
        load_adapter(path, MOE, 16)
    assert load_adapter(write_adapter(tmp_path), MOE, 16).a.keys() == {"wq", "wv"}
    with pytest.raises(ValueError, match="lora_path"):
        load_adapter(str(tmp_path / "nowhere"), CFG, 16)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_adapter(str(tmp_path), CFG, 16)
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_adapter(str(tmp_path), CFG, 16)
