"""Mixture of experts (Mixtral, Qwen3-MoE): a router picks k of E SwiGLU experts per token, in
place of the dense MLP.

Routing: softmax over the E router logits (float32), the k largest kept, renormalised to sum to
1 where the config says so (`norm_topk_prob`: always for Mixtral, whose softmax over the k
chosen logits is the same thing; Qwen3-MoE's own flag).

The experts run grouped: a step's T*k (token, expert) pairs are sorted by expert, their rows
gathered, and each of gate, up and down is one `jax.lax.ragged_dot` over the expert groups
(a grouped matmul; no loop over experts). Nothing is dropped: the T*k rows are a static count,
however they spread over the experts. The rows are put back in (token, slot) order and each
token's k outputs summed with their routing weights, in a fixed order.

The grouped matmul is a parameter: `jax.lax.ragged_dot` on float weights, or, on a CPU with
the block kernel, `block_experts`' kernels/cpu_matmul.grouped_block_matmul, which reads a GGUF's
experts in their blocks (never expanded: Mixtral's experts are most of its bytes).

`grouped_experts` computes the experts numbered [first, first + E_local) of its weights and
leaves zeros for the pairs routed elsewhere: under expert parallelism (runtime/sharding.py)
each device runs it on its own experts, and the partial outputs are summed over the mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.fp8 import Fp8
from jaxserve.kernels.quant import PLANES, Blocks, dequantize, one_block
from jaxserve.models.config import ModelConfig

# (x (T, D), weights (T, k), experts (T, k), w_gate (E, D, F), w_up (E, D, F), w_down (E, F, D))
# -> (T, D): the routed experts' weighted sum per token (grouped_experts, or sharded over a mesh)
ExpertsFn = Callable[..., jax.Array]
# (rows (R, K) sorted by expert, [weights (E, K, N)], sizes (E,) int32) -> [(R, N) per weight]
GroupedMatmul = Callable[[jax.Array, list, jax.Array], list[jax.Array]]


def ragged_matmul(rows: jax.Array, ws: list, sizes: jax.Array) -> list[jax.Array]:
    """The grouped matmul on float weights (quantized ones expanded in the step)."""
    return [jax.lax.ragged_dot(rows, dequantize(w, rows.dtype), sizes) for w in ws]


def block_matmul_experts(rows: jax.Array, ws: list, sizes: jax.Array,
                         base: jax.Array | int = 0) -> list[jax.Array]:
    """The grouped matmul on weights in GGUF blocks, by the CPU kernel (experts from stack
    entry `base` on): the weights it reads in one call, else one at a time, and ragged_matmul
    for those it does not read (which must then be one layer's, base 0)."""
    from jaxserve.kernels.cpu_matmul import grouped_block_matmul_or_none

    ys = grouped_block_matmul_or_none(rows, ws, sizes, base)
    if ys is not None:
        return ys
    if len(ws) > 1:
        return [y for w in ws for y in block_matmul_experts(rows, [w], sizes, base)]
    return ragged_matmul(rows, ws, sizes)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits (T, E) -> routing weights (T, k) float32 and expert ids (T, k) int32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate, w_up,
                    w_down, first: jax.Array | int = 0,
                    matmul: GroupedMatmul = ragged_matmul,
                    num_local: int | None = None) -> jax.Array:
    """x (T, D); weights, experts (T, k); w_gate, w_up (El, D, F); w_down (El, F, D) (float,
    or quantized dicts that `matmul` reads): the experts [first, first + El) -> (T, D), each
    token's routed outputs weighted and summed (zero from pairs routed to experts outside the
    range). `num_local`: El where the weights are not (El, ...) (stacks `matmul` reads)."""
    t, k = experts.shape
    num_local = num_local or jax.tree.leaves(w_gate)[0].shape[0]
    local = experts.reshape(-1) - first  # (T*k,)
    is_local = (local >= 0) & (local < num_local)
    key = jnp.where(is_local, local, num_local)  # pairs routed elsewhere sort last
    order = jnp.argsort(key, stable=True)  # (T*k,) pair indices grouped by expert
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # (El,)
    rows = x[order // k]  # (T*k, D)
    gate, up = matmul(rows, [w_gate, w_up], sizes)
    (y,) = matmul(jax.nn.silu(gate) * up, [w_down], sizes)  # (T*k, D)
    y = jnp.where(is_local[order][:, None], y, 0)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    y = y[back].reshape(t, k, -1)  # (T, k, D): (token, slot) order again
    return jnp.sum(y * weights[..., None].astype(y.dtype), axis=1)


def block_experts(x, weights, experts, w_gate, w_up, w_down, first=0,
                  stack_base: jax.Array | int = 0, num_local: int | None = None) -> jax.Array:
    """grouped_experts on experts kept in GGUF blocks, through the CPU kernel. `stack_base`:
    the weights are stacks of several layers' experts (merged on their leading axes), this
    layer's `num_local` starting at that entry."""
    return grouped_experts(x, weights, experts, w_gate, w_up, w_down, first,
                           functools.partial(block_matmul_experts, base=stack_base), num_local)


def grouped_experts_reference(x, weights, experts, w_gate, w_up, w_down, first=0):
    """grouped_experts in plain jnp: every local expert on every token, the routed ones kept."""
    num_local = w_gate.shape[0]
    h = jax.nn.silu(jnp.einsum("TD,EDF->TEF", x, w_gate)) * jnp.einsum("TD,EDF->TEF", x, w_up)
    every = jnp.einsum("TEF,EFD->TED", h, w_down)  # (T, El, D)
    local = experts - first  # (T, k)
    chosen = jnp.take_along_axis(every, jnp.clip(local, 0, num_local - 1)[..., None], axis=1)
    keep = ((local >= 0) & (local < num_local))[..., None]
    return jnp.sum(jnp.where(keep, chosen, 0) * weights[..., None], axis=1)  # (T, D)


class MoE(nn.Module):
    """Router and experts of one layer: y (T, D) -> (T, D)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    experts_fn: ExpertsFn = grouped_experts

    @nn.compact
    def __call__(self, y, stacks: dict | None = None, layer: jax.Array | int = 0):  # (T, D)
        """`stacks`: experts held apart as every layer's (L, E, ...) stacks (the CPU kernel
        reads layer `layer`'s in place; llama.split_layer_blocks), else this layer's params."""
        cfg, dt = self.cfg, self.dtype
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        router = self.param("router", init, (d, e), dt)
        # loaded experts may be quantized dicts (kernels/quant.py): the experts_fn reads them
        w_gate, w_up, w_down = (
            stacks[name] if stacks is not None and name in stacks
            else self.get_variable("params", name) if self.has_variable("params", name)
            else self.param(name, init, shape, dt)
            for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)),
                                ("w_down", (e, f, d))))
        logits = jnp.einsum("TD,DE->TE", y, router, preferred_element_type=jnp.float32)
        weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if stacks:  # the held-apart stacks: layer `layer`'s experts are entries L * E on
            return block_experts(y, weights, experts, w_gate, w_up, w_down,
                                 stack_base=layer * e, num_local=e).astype(y.dtype)
        return self.experts_fn(y, weights, experts, w_gate, w_up, w_down).astype(y.dtype)


# ------------------------------------------------------------------------------------ loading

# Mixtral's names for one expert's projections -> the names the loader reads (Qwen's)
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_expert_names(cfg: ModelConfig, tensors: dict) -> dict:
    """A checkpoint's expert tensors under one naming: `mlp.gate.weight` (E, D) and
    `mlp.experts.{j}.{gate,up,down}_proj.weight`. Reads Mixtral's `block_sparse_moe.*` names,
    the fused (E, 2F, D) `gate_up_proj` / (E, D, F) `down_proj` layout and the stacked (E, F, D)
    `gate_proj` / `up_proj` a GGUF holds (loader.py names them so)."""
    if not cfg.is_moe:
        return tensors
    f = cfg.moe_intermediate_size
    out = {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, _, tail = name.rpartition(".experts.")
        if tail in ("gate_up_proj", "gate_proj", "up_proj", "down_proj"):  # every expert
            for j in range(t.shape[0]):
                if tail != "gate_up_proj":
                    out[f"{head}.experts.{j}.{tail}.weight"] = t[j]
                else:
                    out[f"{head}.experts.{j}.gate_proj.weight"] = t[j, :f]
                    out[f"{head}.experts.{j}.up_proj.weight"] = t[j, f:]
            continue
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in _MIXTRAL and ".experts." in name:
            parts[-2] = _MIXTRAL[parts[-2]]
            name = ".".join(parts)
        out[name] = t
    return out


def expert_hf_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The HF shapes of one layer's router and experts, `prefix` the layer's."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes = {prefix + "mlp.gate.weight": (e, d)}
    for j in range(e):
        p = f"{prefix}mlp.experts.{j}."
        shapes |= {p + "gate_proj.weight": (f, d), p + "up_proj.weight": (f, d),
                   p + "down_proj.weight": (d, f)}
    return shapes


def expert_params(cfg: ModelConfig, tensors: dict) -> dict:
    """Every layer's MoE params stacked on axis 0: router (L, D, E) float32; w_gate and w_up
    (L, E, D, F), w_down (L, E, F, D): quantized dicts (kernels/quant.py, blocks along D and F)
    where every expert's tensor is `Blocks`, else float32 (FP8 experts expanded)."""
    def stack(fn):
        return np.stack([fn(f"model.layers.{i}.mlp.") for i in range(cfg.num_layers)])

    def projection(proj):
        ts = [[tensors[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"]
               for j in range(cfg.num_experts)] for i in range(cfg.num_layers)]
        if all(isinstance(t, Blocks) for row in ts for t in row):
            flat, e = one_block([t for row in ts for t in row]), cfg.num_experts
            ts = [flat[i * e:(i + 1) * e] for i in range(cfg.num_layers)]
            return {k: np.stack([np.stack([getattr(t, k).T for t in row]) for row in ts])
                    for k in PLANES}
        expand = lambda t: t.dequantize() if isinstance(t, Blocks | Fp8) else t  # noqa: E731
        return np.stack([np.stack([np.asarray(expand(t)).T for t in row]) for row in ts])

    return {"router": stack(lambda p: np.asarray(tensors[p + "gate.weight"]).T),
            "w_gate": projection("gate_proj"), "w_up": projection("up_proj"),
            "w_down": projection("down_proj")}
