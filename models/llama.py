"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 3, SmolLM2) in Flax linen,
over a paged KV cache.

Gemma 3 is the same layer with its switches on (ModelConfig): (1 + w) norms, norms on the
attention and MLP outputs, a scaled embedding, GELU gating, soft-capped logits, and
local layers that see a sliding window and rotate with a RoPE base of their own. Under the
scanned loop the layer index is traced, so a layer's window and RoPE table are picked from
per-layer arrays; unrolled, they are static.

The forward takes one step's tokens (prefill chunks and decodes mixed, flattened to T rows) and
the KV pages, and returns the updated pages plus the logits of the rows that produce them.

Two layer loops, same maths (`scan_layers`):
- scanned: the layers' params are stacked on axis 0 and `nn.scan` runs one layer body L times.
  The program is small and compiles fast. Each iteration slices its layer's params out of the
  stacks, which XLA:CPU does as a copy; the projections kept for the CPU block matmul are
  therefore held apart (`split_layer_blocks`), passed to every iteration whole, and read by the
  kernel at the layer's index in place.
- unrolled: L separate layers (`layers_0` ... params), each reading its own weight arrays in
  place: faster decode steps on a CPU, for a bigger program, slower to compile.
`layout_params` turns the loader's stacked tree into either layout.

Either way the KV pool rides through the layers whole; each layer scatters into it at (layer,
block, offset) and attention reads it at its layer index, so XLA updates the donated pool in place
(slicing a layer out and writing it back would copy the pool every step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_layout import KVLayout
from jaxserve.kernels import gpu_matmul
from jaxserve.kernels.attention.base import NO_WINDOW
from jaxserve.kernels.attention.kv_write import write_kv
from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.kernels.attention.reference import ragged_paged_attention_reference
from jaxserve.kernels.fp8 import is_fp8
from jaxserve.kernels.quant import dequantize, is_quantized, is_split, requantize_q8
from jaxserve.models.config import (
    ModelConfig,
    rope_attention_factor,
    rope_inv_freq,
    rope_long_from,
)
from jaxserve.models.moe import ExpertsFn, MoE, grouped_experts
from jaxserve.models.ordered import ordered_sum

# (q (T, N, H), k_pool (L, P, B, K, H), v_pool (L, P, B, K, H), layer (), md) -> (T, N, H)
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, AttentionMetadata], jax.Array]
# (x (T, K), quantized weights, contracted axes, the weights' shapes (K..., N...), layer) ->
# [(T, N...) per weight] in one call, or None where these weights are not ones it reads in one
# call (the step then takes them one at a time, and expands a weight it does not read and runs
# the dot). With a layer index (else None), each weight is a stack of layers' on axis 0.
# (x, weights, contract, shapes, layer[, rows]) -> ys or None: kernels/cpu_matmul.py
BlockMatmulFn = Callable[..., list[jax.Array] | None]
LAYER_BLOCKS = "layer_blocks"  # a scanned model's block-matmul weights: split_layer_blocks()
# LoRA adapter slots, every layer's: {param: {"a": (L, Din, S, R), "b": (L, S, R, Dout)}}
# (models/lora.py); a row's update is added to the base projection's output
LORA = "lora"


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    offset: float = 0.0  # Gemma scales by (offset + weight), in float32 before the cast

    @nn.compact
    def __call__(self, x):  # (T, D)
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        mean_square = ordered_sum(x32 * x32, keepdims=True) / x.shape[-1]  # batch-invariant
        x32 = x32 * jax.lax.rsqrt(mean_square + self.eps)
        if self.offset:
            return (x32 * (self.offset + w.astype(jnp.float32))).astype(self.dtype)
        return w * x32.astype(self.dtype)




def layer_windows(cfg: ModelConfig) -> np.ndarray | None:
    """(L,) int32: each layer's sliding window (NO_WINDOW for the global ones), or None for a
    model without windows."""
    if cfg.sliding_window is None:
        return None
    return np.array([cfg.layer_window(i) or NO_WINDOW for i in range(cfg.num_layers)],
                    np.int32)


def attention_options(cfg: ModelConfig, layer: jax.Array | int) -> dict:
    """The keyword arguments of layer `layer`'s attention call that the model sets."""
    kw = {}
    if cfg.attn_scale is not None:
        kw["scale"] = cfg.attn_scale
    windows = layer_windows(cfg)
    if windows is None:
        return kw
    if isinstance(layer, int) or len(set(windows.tolist())) == 1:
        # static where it can be: a kernel then skips the pages before the window's
        kw["window"] = int(windows[layer if isinstance(layer, int) else 0])
    else:
        kw["window"] = jnp.asarray(windows)[layer]
    return kw


def layer_pages(layout: KVLayout | None, layer: jax.Array | int,
                md: AttentionMetadata) -> tuple[jax.Array | int, AttentionMetadata]:
    """Layer `layer`'s row of the pool and the metadata with its group's block tables and
    slots (core/kv_layout.py): the pool's own row and md where there is one group."""
    if layout is None or layout.num_groups == 1:
        return layer, md
    if isinstance(layer, int):
        group, row = layout.layer_group[layer], layout.layer_row[layer]
    else:
        group = jnp.asarray(layout.layer_group, jnp.int32)[layer]
        row = jnp.asarray(layout.layer_row, jnp.int32)[layer]
    return row, dataclasses.replace(md, block_tables=md.block_tables[group],
                                    slot_mapping=md.slot_mapping[group])


def slot_mask(lora_slots: jax.Array, num_slots: int, rank: int, dtype) -> jax.Array:
    """(T,) each row's slot (0: none; s in 1..S at index s - 1 of the stacks) -> (T, S * R):
    1 on the row's slot's R rank columns, else 0 (all 0 for slot 0)."""
    cols = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank + 1
    return (lora_slots[:, None] == cols[None, :]).astype(dtype)


def lora_update(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's low-rank update, its own slot's: x (T, Din), a (Din, S, R), b (S, R, Dout),
    mask (T, S * R) from slot_mask -> (T, Dout)."""
    din, s, r = a.shape
    xa = (x @ a.reshape(din, s * r)) * mask  # (T, S * R): other slots' columns zeroed
    return xa @ b.reshape(s * r, -1)


def apply_rope(x, cos, sin):  # x (T, heads, H); cos/sin (T, H/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm block; `nn.scan` stacks L of them with params along axis 0."""

    cfg: ModelConfig
    dtype: jnp.dtype
    attn_fn: AttentionFn
    block_matmul: BlockMatmulFn | None = None
    experts_fn: ExpertsFn = grouped_experts  # a mixture of experts' (models/moe.py)
    kv_layout: KVLayout | None = None  # layer groups of the pool (None: one of every layer)
    # (k_scale, v_scale) of an fp8 pool: stored K is K / k_scale (kv_write.py, reference.py)
    kv_scales: tuple[float, float] = (1.0, 1.0)

    @nn.compact
    def __call__(self, carry, cos, sin, md: AttentionMetadata, stacks: dict | None = None,
                 lora: tuple[dict, jax.Array] | None = None):
        """`stacks`: {name: every layer's weight, stacked} for projections read in place at
        this layer's index (LAYER_BLOCKS) instead of from this layer's params. `cos`, `sin`:
        (T, H/2), or a pair (global, local) of them where local layers rotate apart. `lora`:
        the adapter slots (LORA) and each row's slot mask (models/lora.py slot_mask)."""
        x, k_pages, v_pages, layer = carry  # x (T, D); pages (L, P, B, K, H); layer ()
        cfg, dt = self.cfg, self.dtype

        def norm(name: str) -> RMSNorm:
            return RMSNorm(cfg.rms_norm_eps, dt, cfg.norm_offset, name=name)

        if isinstance(cos, tuple):  # pick this layer's table
            is_local = (cfg.layer_window(layer) is not None if isinstance(layer, int) else
                        jnp.asarray(layer_windows(cfg) != NO_WINDOW)[layer])
            cos, sin = (jnp.where(is_local, cos[1], cos[0]), jnp.where(is_local, sin[1], sin[0]))
        d, n, kh, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size)

        # padding rows follow the real tokens: the block matmul leaves them zero, uncomputed
        rows = md.query_start_loc[-1]

        def project(x, group, contract=1):
            ys = self.project(x, group, contract, stacks, layer, rows)
            if lora is None:
                return ys
            slots, mask = lora  # after the base matmul, whichever computed it
            return [y if name not in slots else y + lora_update(
                x, slots[name]["a"][layer], slots[name]["b"][layer], mask
            ).reshape(y.shape).astype(y.dtype) for (name, _), y in zip(group, ys, strict=True)]

        y = norm("input_norm")(x)
        q, k, v = project(y, (("wq", (d, n, h)), ("wk", (d, kh, h)), ("wv", (d, kh, h))))
        if cfg.attention_bias:
            q = q + self.param("bq", nn.initializers.zeros, (n, h), dt)
            k = k + self.param("bk", nn.initializers.zeros, (kh, h), dt)
            v = v + self.param("bv", nn.initializers.zeros, (kh, h), dt)
        if cfg.qk_norm:  # over each head's H
            q = norm("q_norm")(q)
            k = norm("k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        row, md_layer = layer_pages(self.kv_layout, layer, md)
        # passed only where not 1.0, so a pool without scales runs the same program as before
        scales = ({} if self.kv_scales == (1.0, 1.0)
                  else dict(zip(("k_scale", "v_scale"), self.kv_scales, strict=True)))
        k_pages, v_pages = write_kv(k_pages, v_pages, row, k, v, md_layer.slot_mapping, **scales)
        attn = self.attn_fn(q, k_pages, v_pages, row, md_layer,
                            **attention_options(cfg, layer), **scales)  # (T, N, H)
        (o,) = project(attn.reshape(attn.shape[0], n * h), (("wo", (n, h, d)),), 2)
        if cfg.sandwich_norms:  # HF's post_attention_layernorm is on the attention's output
            x = x + norm("post_attention_norm")(o)
            y = norm("pre_feedforward_norm")(x)
        else:
            x = x + o
            y = norm("post_attention_norm")(x)
        if cfg.is_moe:
            moe = MoE(cfg, dt, self.experts_fn, name="moe")
            return (x + moe(y, None if stacks is None else stacks.get("moe"), layer), k_pages,
                    v_pages, layer + 1), None
        gate, up = project(y, (("w_gate", (d, f)), ("w_up", (d, f))))
        act = nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        (down,) = project(act * up, (("w_down", (f, d)),))
        if cfg.sandwich_norms:
            down = norm("post_feedforward_norm")(down)
        return (x + down, k_pages, v_pages, layer + 1), None

    def project(self, x: jax.Array, group: tuple[tuple[str, tuple[int, ...]], ...],
                contract: int = 1, stacks: dict | None = None,
                layer: jax.Array | None = None,
                rows: jax.Array | None = None) -> list[jax.Array]:
        """x (T, prod(shape[:contract])) @ each weight (name, shape) of `group` ->
        [(T, *shape[contract:])]: all in one `block_matmul` call where the weights are kept in
        blocks it reads (it then scales x once for the group), else (and for a group of one) one
        at a time (project_one).
        `stacks`: weights held apart as every layer's stack, read at layer `layer`.
        `rows`: how many of x's rows are real; a block matmul computes only those (the rest
        of its output is zeros), a plain dot all of them."""
        fused = FUSED.get(tuple(name for name, _ in group))
        if fused is not None and self.has_variable("params", fused):
            return self.project_fused(x, fused, [shape for _, shape in group], contract)
        held = [stacks is not None and name in stacks for name, _ in group]
        if self.block_matmul is not None and len(group) > 1 and len(set(held)) == 1:
            ws = [stacks[name] if apart else
                  self.get_variable("params", name) if self.has_variable("params", name) else None
                  for (name, _), apart in zip(group, held, strict=True)]
            if all(w is not None for w in ws):
                ys = self.block_matmul(x, ws, contract, [shape for _, shape in group],
                                       layer if held[0] else None, rows)
                if ys is not None:
                    return ys
        return [self.project_one(x, name, shape, contract,
                                 None if stacks is None else stacks.get(name), layer, rows)
                for name, shape in group]

    def project_one(self, x: jax.Array, name: str, shape: tuple[int, ...], contract: int = 1,
                    stack: dict | None = None, layer: jax.Array | None = None,
                    rows: jax.Array | None = None) -> jax.Array:
        """x (T, prod(shape[:contract])) @ weight `name` of `shape` -> (T, *shape[contract:]):
        through `block_matmul` when the weight is kept in blocks and it reads them, else as
        one dot on the expanded weight (one contraction: with two contracting dims XLA:CPU
        copies the weight every step). `stack`: the weight is layer `layer` of it."""
        if stack is not None:  # held apart for the kernel (split_layer_blocks), which reads it
            ys = None if self.block_matmul is None else self.block_matmul(
                x, [stack], contract, [shape], layer, rows)
            if ys is None:
                raise ValueError(f"{LAYER_BLOCKS} holds {name!r}, which no block matmul reads")
            return ys[0]
        if self.block_matmul is not None and self.has_variable("params", name):
            ys = self.block_matmul(x, [self.get_variable("params", name)], contract, [shape],
                                   None, rows)
            if ys is not None:
                return ys[0]
        k = math.prod(shape[:contract])
        if self.has_variable("params", name):
            w = self.get_variable("params", name)
            if gpu_matmul.is_gpu_form(w):  # read by the matmul itself (kernels/gpu_matmul.py)
                if w["scale"].shape[-2] * gpu_matmul.block_of(w) != k:
                    raise ValueError(f"{name}: GPU-form blocks do not run along its {k} "
                                     f"contracted values")
                return gpu_matmul.matmul(x, w).reshape(x.shape[0], *shape[contract:])
        w = self.weight(name, shape)
        return (x @ w.reshape(k, -1)).reshape(x.shape[0], *shape[contract:])

    def project_fused(self, x: jax.Array, name: str, shapes: list[tuple[int, ...]],
                      contract: int) -> list[jax.Array]:
        """project() of a group whose weights fuse_projections() concatenated into `name`
        along their first output axis: one dot, its output split back."""
        sizes = [shape[contract] for shape in shapes]
        whole = (*shapes[0][:contract], sum(sizes), *shapes[0][contract + 1:])
        y = self.project_one(x, name, whole, contract)  # (T, sum(sizes), ...)
        # Written once, then split: left fusible, XLA recomputes the matmul's epilogue (a
        # split-K sum of float32 partials) inside every consumer of every part.
        y = jax.lax.optimization_barrier(y)
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=1)

    def weight(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        """A projection in the compute dtype. Stored GGUF blocks (kernels/quant.py) and FP8
        codes (kernels/fp8.py) are dequantized here, inside the step, so only their codes
        stream from memory (and, under nn.scan, are sliced out of the layer stacks, which XLA
        does by a copy)."""
        if self.has_variable("params", name):
            return dequantize(self.get_variable("params", name), self.dtype, shape)
        return self.param(name, nn.initializers.normal(0.02), shape, self.dtype)


def layout_params(params: dict, num_layers: int, scan_layers: bool) -> dict:
    """The loader's tree (layers stacked under "layers") in the layout `Transformer` expects."""
    if scan_layers:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    return out


# projections that read the same input, each group computable as one matmul: fuse_projections()
FUSED = {("wq", "wk", "wv"): "wqkv", ("w_gate", "w_up"): "w_gate_up"}


def fuse_projections(params: dict, scan_layers: bool) -> dict:
    """Each layer's q/k/v and gate/up weights concatenated along their first output axis
    (wq (D, N, H), wk and wv (D, K, H) -> wqkv (D, N + 2K, H); w_gate, w_up (D, F) ->
    w_gate_up (D, 2F)): one matmul each instead of three and two. FP8 groups fuse plane by
    plane where their scales line up; groups with another quantized weight stay apart.
    Takes and returns the layout of layout_params(..., scan_layers)."""
    def concat(ws: list, axis: int):
        xp = jnp if any(isinstance(w, jax.Array) for w in ws) else np  # traced: jnp
        return xp.concatenate([xp.asarray(w) for w in ws], axis=axis)

    def fuse(layer: dict, stacked: int) -> dict:
        out = dict(layer)
        axis = 1 + stacked
        for names, name in FUSED.items():
            ws = [layer.get(n) for n in names]
            if any(w is None for w in ws):
                continue
            if all(is_fp8(w) for w in ws):
                shapes = {tuple(np.delete(w["scale"].shape, axis)) for w in ws}
                if len(shapes) != 1 or any(w["scale"].shape[axis] != w["fp8"].shape[axis]
                                           for w in ws):  # scales not one per output
                    continue
                out[name] = {k: concat([w[k] for w in ws], axis) for k in ws[0]}
            elif any(is_quantized(w) for w in ws):
                continue
            else:
                out[name] = concat(ws, axis)
            for n in names:
                del out[n]
        return out

    return {k: (fuse(v, 1) if k == "layers" and scan_layers else
                fuse(v, 0) if k.startswith("layers_") and not scan_layers else v)
            for k, v in params.items()}


def split_layer_blocks(params: dict, held_apart: Callable[[dict], bool]) -> dict:
    """A scanned model's params with the stacked quantized layer weights that `held_apart`
    picks (those the block matmul reads at a layer index, and a mixture's experts, under
    "moe") moved from "layers" to LAYER_BLOCKS: every scan iteration then sees those stacks
    whole instead of a copy of its layer's slice."""
    layers = params["layers"]
    moved = {k: w for k, w in layers.items()
             if is_split(w) or is_quantized(w) and held_apart(w)}
    kept = {k: w for k, w in layers.items() if k not in moved}
    experts = {k: w for k, w in layers.get("moe", {}).items() if is_quantized(w)
               and held_apart(w)}  # a mixture's experts: (L, E, ...) stacks, read at L * E
    if experts:
        moved["moe"] = experts
        kept["moe"] = {k: w for k, w in layers["moe"].items() if k not in experts}
    if not moved:
        return params
    return {**params, "layers": kept, LAYER_BLOCKS: moved}


HEAD_BLOCKS = "head_blocks"  # the output projection as exact blocks (D, V): head_blocks()


def head_weight(cfg: ModelConfig, params: dict) -> jax.Array:
    """The output projection among a Transformer's params: the embedding when tied."""
    return params["embed"] if cfg.tie_word_embeddings else params["lm_head"]


def head_blocks(cfg: ModelConfig, params: dict) -> dict | None:
    """The output projection as (D, V) blocks for a BlockMatmulFn: the GGUF's own, which the
    loader gives as HEAD_BLOCKS (Q6_K's, Q8_0's, ...), else where its float weights are
    exactly Q8 blocks (see quant.requantize_q8), else None. Kept under HEAD_BLOCKS beside the
    float weights, which the embedding lookup still reads: a decode step then streams ~1.1-1.5
    bytes per head weight instead of 4."""
    if HEAD_BLOCKS in params:
        return params[HEAD_BLOCKS]
    head = np.asarray(head_weight(cfg, params))
    return requantize_q8(head.T if cfg.tie_word_embeddings else head, 0)


def lm_logits(cfg: ModelConfig, x: jax.Array, params: dict,
              block_matmul: BlockMatmulFn | None = None,
              rows: jax.Array | None = None) -> jax.Array:
    """Final hidden states (N, D) -> logits (N, V) float32: through `block_matmul` on the
    params' HEAD_BLOCKS where both are there, else a dot with head_weight(). `rows`: how many
    of x's rows are real (the rest padding); block_matmul computes only those, as zeros."""
    if block_matmul is not None and HEAD_BLOCKS in params:
        logits = block_matmul(x, [params[HEAD_BLOCKS]], 1,
                              [(cfg.hidden_size, cfg.vocab_size)], None, rows)
        if logits is not None:
            return soft_cap_logits(cfg, logits[0])
    spec = "ND,VD->NV" if cfg.tie_word_embeddings else "ND,DV->NV"
    logits = jnp.einsum(spec, x, head_weight(cfg, params), preferred_element_type=jnp.float32)
    return soft_cap_logits(cfg, logits)


def soft_cap_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """The model's final logit soft-capping (Gemma), where it has one."""
    if cfg.final_softcap is None:
        return logits
    return jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap


class Transformer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attn_fn: AttentionFn = ragged_paged_attention_reference
    scan_layers: bool = True
    block_matmul: BlockMatmulFn | None = None  # see DecoderLayer.project
    experts_fn: ExpertsFn = grouped_experts  # see models/moe.py
    kv_layout: KVLayout | None = None  # see DecoderLayer
    # the embedding's rows of input_ids (table (V, D), ids (T,) -> (T, D)); None: a gather
    # (tensor parallelism passes one that reads each device's share of the vocabulary)
    embed_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    kv_scales: tuple[float, float] = (1.0, 1.0)  # see DecoderLayer

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,  # (T,) int32
        k_pages: jax.Array,  # (L, P, B, K, H); with layer groups (R, P, B, K, H)
        v_pages: jax.Array,  # (L, P, B, K, H); with layer groups (R, P, B, K, H)
        md: AttentionMetadata,  # with layer groups: tables (G, S, MB), slots (G, T)
        logits_indices: jax.Array | None,  # (S,) int32: each seq's logits row (None: no logits)
        lora_slots: jax.Array | None = None,  # (T,) int32: each row's LoRA slot (0: none)
    ) -> tuple[jax.Array, ...]:  # updated pages, logits (S, V) float32, final hidden (T, D)
        cfg, dt = self.cfg, self.dtype
        embed = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size),
                           dt)
        x = embed[input_ids] if self.embed_fn is None else self.embed_fn(embed, input_ids)
        if cfg.embed_scale != 1.0:  # Gemma: rounded to the weights' dtype, as HF does
            x = x * jnp.asarray(cfg.embed_scale, dt)

        def rope_table(local: bool):  # (T, H/2) each
            pos = md.positions.astype(jnp.float32)[:, None]
            freqs = pos * jnp.asarray(rope_inv_freq(cfg, local))[None, :]
            long_from = rope_long_from(cfg, local)
            if long_from is not None:  # LongRoPE: positions from long_from on rotate long
                long = pos * jnp.asarray(rope_inv_freq(cfg, local, long=True))[None, :]
                freqs = jnp.where(md.positions[:, None] >= long_from, long, freqs)
            factor = rope_attention_factor(cfg, local)
            cos, sin = jnp.cos(freqs), jnp.sin(freqs)
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            return cos.astype(dt), sin.astype(dt)

        lora = self.variables.get("params", {}).get(LORA)
        if lora is not None and lora_slots is not None:  # each row's slot, as a mask
            _, _, num_slots, rank = next(iter(lora.values()))["a"].shape
            lora = (lora, slot_mask(lora_slots, num_slots, rank, dt))
        else:
            lora = None

        cos, sin = rope_table(False)
        if cfg.local_rope_theta is not None:  # local layers rotate with their own base
            (cos_l, sin_l) = rope_table(True)
            cos, sin = (cos, cos_l), (sin, sin_l)

        if self.scan_layers:
            # stacks that every iteration reads whole, at its layer index (the module doc)
            stacks = self.variables.get("params", {}).get(LAYER_BLOCKS)
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,) * 5,
                length=cfg.num_layers,
            )(cfg, dt, self.attn_fn, self.block_matmul, self.experts_fn, self.kv_layout,
              self.kv_scales, name="layers")
            (x, k_pages, v_pages, _), _ = layers((x, k_pages, v_pages, jnp.int32(0)), cos, sin,
                                                 md, stacks, lora)
        else:  # the layer index is a Python int: static slices of the pool, no dynamic ones
            carry = (x, k_pages, v_pages, 0)
            for i in range(cfg.num_layers):
                carry, _ = DecoderLayer(cfg, dt, self.attn_fn, self.block_matmul,
                                         self.experts_fn, self.kv_layout, self.kv_scales,
                                         name=f"layers_{i}")(carry, cos, sin, md, None, lora)
            x, k_pages, v_pages, _ = carry

        # Every row is normalized (a (T, D) elementwise op): prompt logprobs read them all.
        x = RMSNorm(cfg.rms_norm_eps, dt, cfg.norm_offset, name="final_norm")(x)  # (T, D)
        if not cfg.tie_word_embeddings and not self.has_variable("params", HEAD_BLOCKS):
            self.param("lm_head", nn.initializers.normal(0.02), (cfg.hidden_size,
                                                                  cfg.vocab_size), dt)
        # a step's real sequences come first, padding (no context) after
        logits = None if logits_indices is None else lm_logits(
            cfg, x[logits_indices], self.variables["params"], self.block_matmul,
            jnp.sum(md.context_lens > 0, dtype=jnp.int32))
        return k_pages, v_pages, logits, x
