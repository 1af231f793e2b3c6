"""RoPE scaling variants against HF transformers' own frequency functions (ROPE_INIT_FUNCTIONS)
on tiny configs: linear, YaRN, llama3 and LongRoPE (short and long factors); dynamic NTK is
refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models.config import (
    ModelConfig,
    rope_attention_factor,
    rope_inv_freq,
    rope_long_from,
)

HEAD_DIM = 16
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
            max_position_embeddings=512)
HALF = HEAD_DIM // 2
CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 128}),
    "yarn-mscale": ("llama", {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                              "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.5,
                              "original_max_position_embeddings": 64}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "longrope": ("phi3", {"rope_type": "longrope",
                          "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                          "long_factor": [2.0 + 0.5 * i for i in range(HALF)]}),
}


def hf_config(family: str, rope: dict):
    import transformers as tf

    if family == "phi3":  # Phi-3 keeps the pretraining length at the top level
        return tf.Phi3Config(rope_scaling=dict(rope), original_max_position_embeddings=128,
                             pad_token_id=0, **BASE)
    return tf.LlamaConfig(rope_scaling=dict(rope), **BASE)


@pytest.mark.parametrize("case", CASES)
def test_inverse_frequencies_and_attention_factor_match_hf(case):
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family, rope = CASES[case]
    hf = hf_config(family, rope)
    cfg = ModelConfig.from_hf(hf.to_dict())
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    want, factor = init(hf, "cpu")
    np.testing.assert_allclose(rope_inv_freq(cfg), want.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-6)
    if rope["rope_type"] == "longrope":  # HF's long set: a sequence past the pretraining length
        long, _ = init(hf, "cpu", seq_len=129)
        np.testing.assert_allclose(rope_inv_freq(cfg, long=True), long.numpy(), rtol=1e-6)
        assert rope_long_from(cfg) == 128 and factor > 1
        assert not np.allclose(long.numpy(), want.numpy())
    else:
        assert rope_long_from(cfg) is None


def test_unserved_rope_types_name_the_field():
    hf = {"architectures": ["LlamaForCausalLM"], **BASE}
    with pytest.raises(ValueError, match=r"^rope_scaling.rope_type 'dynamic'"):
        ModelConfig.from_hf(hf | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"^rope_scaling.rope_type 'mrope'"):
        ModelConfig.from_hf(hf | {"rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(ValueError, match=r"^rope_scaling.short_factor"):
        ModelConfig.from_hf(hf | {"rope_scaling": {"type": "su", "short_factor": [1.0],
                                                   "long_factor": [1.0] * HALF}})
