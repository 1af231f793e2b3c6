"""The reference implementation: HF transformers on torch (a test and benchmark dependency only;
the engine never imports torch). It loads the same weights the engine serves, GGUF included, and
writes tiny random models of the supported architectures with `save_pretrained`."""

from __future__ import annotations

import os

from jaxserve.models.loader import default_model_path


def load_hf_model(model_path: str | None):
    """The HF model for `model_path` (default: the bundled GGUF), float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_tiny_hf_model(arch: str, path: str, seed: int = 0, **overrides):
    """Write a tiny random-weight model with `save_pretrained` and return the torch model."""
    import torch
    import transformers as tf

    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    common |= overrides
    if arch == "llama":
        cfg = tf.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    elif arch == "mistral":
        # a window shorter than most prompts: every layer slides
        cfg, cls = tf.MistralConfig(sliding_window=24, **common), tf.MistralForCausalLM
    elif arch == "phi3":  # q/k/v and gate/up fused in the checkpoint
        cfg = tf.Phi3Config(pad_token_id=0, sliding_window=None, **common)
        cls = tf.Phi3ForCausalLM
    elif arch == "gemma3":  # a window shorter than the prompts, soft-capping, local/global
        common |= dict(num_hidden_layers=3, head_dim=32, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                       query_pre_attn_scalar=24, rope_parameters={
                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 100000.0},
                           "sliding_attention": {"rope_type": "default",
                                                 "rope_theta": 10000.0}}) | overrides
        # attn_logit_softcapping set: transformers' Gemma 3 never applies it, nor may we
        cfg = tf.Gemma3TextConfig(pad_token_id=0, **common)
        cls = tf.Gemma3ForCausalLM
    elif arch == "qwen3":  # q/k norms, and a head_dim apart from hidden / heads
        cfg = tf.Qwen3Config(head_dim=32, tie_word_embeddings=True, **common)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mixtral":  # 8 experts, top-2, renormalised; the index-sharded safetensors
        cfg = tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                               **common | {"intermediate_size": 64})
        cls = tf.MixtralForCausalLM
    elif arch == "qwen3_moe":  # 8 experts, top-2, not renormalised; Qwen3's q/k norms
        cfg = tf.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=False, head_dim=32, **common)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # norms not all ones, so a weight that loads in the wrong place shows
    if arch in ("qwen3", "qwen3_moe", "gemma3"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
    # the MoE checkpoints in several files named by an index, as big ones come
    model.save_pretrained(path, max_shard_size="300KB" if "moe" in arch or arch == "mixtral"
                          else "5GB")
    return model


def make_peft_adapter(model, path: str, seed: int = 0, b_std: float = 0.1, **lora_config):
    """Write a PEFT LoRA adapter for HF `model` into `path` (`lora_config`: LoraConfig's
    fields): made with get_peft_model, its B set to random values (PEFT starts B at zero,
    an adapter that changes nothing), saved with save_pretrained; `model` is left as it was."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(**lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # A as well: PEFT's own draw is torch's global one
                p.copy_(torch.randn(p.shape, generator=gen) * (b_std if "lora_B" in name
                                                                else p.shape[-1] ** -0.5))
    peft_model.save_pretrained(path)
    peft_model.unload()  # the base model's own modules back in place
    return path


# Three adapters of different ranks and targets (LoraConfig's fields): the LoRA oracle tests'
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_CONFIGS = (
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=8, lora_alpha=16, use_rslora=True,
         target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
    dict(r=16, lora_alpha=16, target_modules=["o_proj", "down_proj"],
         rank_pattern={"down_proj": 8}, alpha_pattern={"o_proj": 8}),
)


def peft_greedy(model, adapters: dict[str, str], runs: list[tuple[list[int], str | None]],
                n: int) -> list[tuple[list[int], list[float]]]:
    """HF + PEFT's greedy run of each (prompt ids, adapter name or None: the base model) in
    `runs`, with `adapters` {name: directory} loaded by PeftModel.from_pretrained: (n token
    ids, the log-probability of each). `model` is left as it was."""
    import torch
    from peft import PeftModel

    names = list(adapters)
    pm = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    try:
        for name in names[1:]:
            pm.load_adapter(adapters[name], adapter_name=name)
        out = []
        for ids, name in runs:
            with torch.no_grad():
                if name is None:
                    with pm.disable_adapter():
                        out.append(_greedy(pm, ids, n))
                else:
                    pm.set_adapter(name)
                    out.append(_greedy(pm, ids, n))
        return out
    finally:
        pm.unload()


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    import torch

    got = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    logits = model(input_ids=torch.tensor([got])).logits[0, len(ids) - 1:-1].float()
    new = got[len(ids):]
    lps = torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(new)]
    return new, lps.tolist()
