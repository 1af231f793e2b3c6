"""Build a Hugging Face fast tokenizer from a GGUF file's tokenizer metadata, without torch.

transformers can read a GGUF tokenizer too, but only with torch installed, and torch is a test
dependency here. Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3,
Qwen2 and most recent models) are rebuilt directly with the `tokenizers` library; the split
rule before byte-level encoding follows `tokenizer.ggml.pre`, as llama.cpp applies it.
"""

from __future__ import annotations

from typing import Any

# How text is split before byte-level BPE, per `tokenizer.ggml.pre` (the rules these
# vocabularies were trained with). "gpt2" is the byte-level default rule.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "qwen2": _QWEN2,
           "deepseek-r1-qwen": _QWEN2}
_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (as byte-level BPE uses)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(meta: dict[str, Any]):
    """A transformers fast tokenizer from GGUF metadata (`tokenizer.*` keys), or raise
    ValueError for vocabularies this builder does not handle."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer type {kind!r} is not byte-level BPE")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # Tokens are stored already spelled in the byte alphabet; respell any that are not.
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # every digit on its own, then the GPT-2 rule
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    special = [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=token("eos"),
                                 unk_token=token("unknown"), pad_token=token("padding"))
    if special:
        hf.add_special_tokens({"additional_special_tokens": special})
    template = meta.get("tokenizer.chat_template")
    if template:
        hf.chat_template = template
    return hf
