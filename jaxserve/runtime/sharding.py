"""Tensor parallelism: the device mesh, the Megatron layout of the params and the KV pool, and
attention run per device on its own heads.

One mesh axis, `model`, of `tensor_parallel_size` devices. Column-parallel: q/k/v split by heads,
gate/up by intermediate columns; row-parallel: o by heads and down by intermediate rows, whose
partial sums XLA all-reduces; embedding and LM head split by vocabulary (the lookup's partial
rows are all-reduced; the (S, V) logits are computed split and gathered once for the sampler).
The KV pool is split on its kv-head axis, and the attention kernel (any backend) runs inside
`shard_map` on each device's heads, so a kernel never sees another device's pages.

Heads must split evenly. When the kv-head count K does not divide by TP (tp):
- tp a multiple of K: each kv head is replicated tp / K times (as vLLM does), so every device
  holds the one kv head its query heads read;
- otherwise: the query groups are padded with all-zero groups up to a multiple of tp. A zero
  group's queries, keys and values are 0 and its rows of the output projection are 0, so it adds
  exactly nothing. (9 query / 3 kv heads at tp = 2: 4 groups of 3, 12 query heads.)
Either costs memory (replicated or padded K/V and weights); the startup log says which applies.
The engine's jitted step stays one program per bucket: XLA's SPMD partitioner inserts the
collectives from these shardings.

Expert parallelism (a mixture-of-experts model, models/moe.py): with expert_parallel_size
ep > 1 the mesh is (`expert`, `model`) = (ep, tp). Each layer's experts are split over
`expert` (E / ep per device) and, within an expert, gate/up by columns and down by rows over
`model`; the router, and everything else, is laid out as under TP alone (replicated over
`expert`). A step's tokens are already on every device (attention's output is replicated), so
they are not exchanged: each device routes all of them, runs the grouped matmul on the pairs
routed to its own experts (shard_experts) and one all-reduce over the whole mesh sums the
partial outputs, the same all-reduce a dense row-parallel MLP ends with.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.kernels import fp8
from jaxserve.kernels.quant import is_quantized, map_planes
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LORA
from jaxserve.models.moe import grouped_experts

AXIS = "model"
EXPERT_AXIS = "expert"
Q_SPEC = P(None, AXIS, None)  # q / attention output (T, N, H): split by head
KV_SPEC = P(None, None, None, AXIS, None)  # the pool (L, P, B, K, H): split by kv head


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the model's heads are laid out over `tp` devices."""

    num_heads: int  # query heads after padding
    num_kv_heads: int  # kv heads after replication or padding
    kv_replicas: int  # copies of each kv head (1: none)
    pad_groups: int  # all-zero query groups appended (0: none)

    @staticmethod
    def plan(cfg: ModelConfig, tp: int) -> HeadLayout:
        n, k = cfg.num_heads, cfg.num_kv_heads
        if k % tp == 0 and n % tp == 0:
            return HeadLayout(n, k, 1, 0)
        if tp % k == 0 and n % tp == 0:
            return HeadLayout(n, tp, tp // k, 0)
        groups = -(-k // tp) * tp
        return HeadLayout(groups * (n // k), groups, 1, groups - k)

    @property
    def model_kv_heads(self) -> int:
        """The model's own kv-head count, before replication or padding."""
        return (self.num_kv_heads - self.pad_groups) // self.kv_replicas

    def model_heads(self, pages: jax.Array) -> jax.Array:
        """Pages (..., K, H) laid out by this plan -> the model's own kv heads (..., K0, H)."""
        return pages[..., ::self.kv_replicas, :][..., :self.model_kv_heads, :]

    def laid_out(self, pages: jax.Array) -> jax.Array:
        """The inverse of `model_heads`: each head replicated, or zero heads appended."""
        pages = jnp.repeat(pages, self.kv_replicas, axis=-2)
        widths = [(0, 0)] * (pages.ndim - 2) + [(0, self.pad_groups), (0, 0)]
        return jnp.pad(pages, widths)

    def describe(self, cfg: ModelConfig, tp: int) -> str:
        if self.kv_replicas > 1:
            return (f"{cfg.num_kv_heads} kv heads replicated {self.kv_replicas}x to "
                    f"{self.num_kv_heads} for tensor_parallel_size={tp}")
        if self.pad_groups:
            return (f"{cfg.num_heads} query / {cfg.num_kv_heads} kv heads padded with "
                    f"{self.pad_groups} zero group(s) to {self.num_heads} / {self.num_kv_heads} "
                    f"for tensor_parallel_size={tp}")
        return f"heads split evenly ({cfg.num_heads // tp} query, {cfg.num_kv_heads // tp} kv " \
               f"per device)"


def device_group(devices: list[jax.Device] | None, tp: int, ep: int = 1) -> list[jax.Device]:
    """The tp * ep devices one model instance runs on: `devices`, or the first of all."""
    every, n = jax.devices(), tp * ep
    what = f"tensor_parallel_size={tp}" + (f" x expert_parallel_size={ep}" if ep > 1 else "")
    if devices is None:
        if n > len(every):
            raise ValueError(f"{what} needs {n} devices; this process sees "
                             f"{len(every)} ({every[0].platform})")
        return every[:n]
    if len(devices) != n:
        raise ValueError(f"{what} needs {n} devices, given {len(devices)}")
    return list(devices)


def make_mesh(devices: list[jax.Device], ep: int = 1) -> Mesh:
    """A (`model`,) mesh, or (`expert`, `model`) under expert parallelism (ep > 1)."""
    if ep == 1:
        return Mesh(np.asarray(devices), (AXIS,))
    return Mesh(np.asarray(devices).reshape(ep, -1), (EXPERT_AXIS, AXIS))


def check_experts(cfg: ModelConfig, tp: int, ep: int) -> None:
    """Raise where a model's experts cannot be split over ep x tp devices."""
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; "
                         f"{cfg.architecture} has no experts")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide the model's "
                         f"{cfg.num_experts} experts")
    if cfg.is_moe and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide each expert's "
                         f"intermediate size ({cfg.moe_intermediate_size})")


def expert_specs(ep: int) -> dict:
    """Specs of one layer's MoE params (models/moe.py), no layer axis."""
    e = EXPERT_AXIS if ep > 1 else None
    return {"router": P(), "w_gate": P(e, None, AXIS), "w_up": P(e, None, AXIS),
            "w_down": P(e, AXIS, None)}


def shard_experts(mesh: Mesh):
    """moe.grouped_experts run per device on its experts (and, within them, its columns of F):
    tokens and routing replicated, the partial outputs summed over the whole mesh."""
    ep = dict(mesh.shape).get(EXPERT_AXIS, 1)
    specs = expert_specs(ep)

    def local(x, weights, experts, w_gate, w_up, w_down):
        first = jax.lax.axis_index(EXPERT_AXIS) * w_gate.shape[0] if ep > 1 else 0
        y = grouped_experts(x, weights, experts, w_gate, w_up, w_down, first)
        return jax.lax.psum(y, tuple(mesh.axis_names))

    def per_device(x, weights, experts, w_gate, w_up, w_down):
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(P(), P(), P(), specs["w_gate"], specs["w_up"],
                                       specs["w_down"]),
                             out_specs=P(), check_vma=False)(x, weights, experts, w_gate, w_up,
                                                             w_down)

    return per_device


def _xp(a):
    """numpy for host arrays, jax.numpy for traced ones (relayout_shapes)."""
    return jnp if isinstance(a, jax.Array) else np


def relayout(cfg: ModelConfig, params: dict, layout: HeadLayout,
             tp: int = 1) -> tuple[ModelConfig, dict]:
    """The loader's (stacked) params and config with the heads of `layout`, FP8 scale blocks
    along a split axis small enough to divide among `tp` devices."""
    layers = {name: fp8.split_blocks(w, _head_axis(name), tp) if fp8.is_fp8(w) else w
              for name, w in params["layers"].items()}
    params = {**params, "layers": layers}
    if layout.kv_replicas == 1 and not layout.pad_groups:
        return cfg, params
    layers = dict(params["layers"])
    pad_q = layout.pad_groups * (cfg.num_heads // cfg.num_kv_heads)
    for name in _Q_PARAMS + _KV_PARAMS:
        if name not in layers:
            continue
        axis = _head_axis(name)  # never a quantized weight's block axis: one plan for all planes
        if name in _KV_PARAMS and layout.kv_replicas > 1:
            layers[name] = map_planes(lambda a, ax=axis: _xp(a).repeat(
                _xp(a).asarray(a), layout.kv_replicas, axis=ax), layers[name])
        elif layout.pad_groups:
            def pad(a, axis=axis, width=pad_q if name in _Q_PARAMS else layout.pad_groups):
                widths = [(0, 0)] * np.ndim(a)
                widths[axis] = (0, width)
                # zero codes, scales and minima: zero rows
                return _xp(a).pad(_xp(a).asarray(a), widths)

            layers[name] = map_planes(pad, layers[name])
    cfg = dataclasses.replace(cfg, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)
    return cfg, {**params, "layers": layers}


def relayout_shapes(cfg: ModelConfig, params: dict, layout: HeadLayout,
                    tp: int = 1) -> tuple[ModelConfig, dict]:
    """relayout() of params given as shapes alone (ShapeDtypeStructs: a deviceless runner's)."""
    laid_out = {}

    def run(p):
        laid_out["cfg"], p = relayout(cfg, p, layout, tp)
        return p

    params = jax.eval_shape(run, params)
    return laid_out["cfg"], params


# Specs of one layer's params (no layer axis), by name.
_LAYER_SPECS = {
    "wq": P(None, AXIS, None), "wk": P(None, AXIS, None), "wv": P(None, AXIS, None),
    "bq": P(AXIS, None), "bk": P(AXIS, None), "bv": P(AXIS, None),
    "wo": P(AXIS, None, None),
    "w_gate": P(None, AXIS), "w_up": P(None, AXIS), "w_down": P(AXIS, None),
}
# LoRA slots {"a": (L, Din, S, R), "b": (L, S, R, Dout)}: by whether the base weight splits
# its inputs (wo, w_down: A's rows split, partial sums reduced as the base's are) or outputs
_LORA_SPECS = {True: {"a": P(None, AXIS, None, None), "b": P()},
               False: {"a": P(), "b": P(None, None, None, AXIS)}}
_Q_PARAMS = ("wq", "bq", "wo")  # indexed by query head
_KV_PARAMS = ("wk", "wv", "bk", "bv")  # indexed by kv head


def _head_axis(name: str) -> int:
    """The head axis of a stacked layer param: where its spec splits, after the layer axis."""
    return 1 + tuple(_LAYER_SPECS[name]).index(AXIS)


def _plane_spec(spec: P, shape: tuple[int, ...]) -> P:
    """A quantized weight's spec for one of its planes: an axis of length 1 (an FP8 scale
    along its weight's inputs, per channel) is not split but broadcast."""
    return P(*(None if a == AXIS and n == 1 else a for a, n in zip(spec, shape, strict=False)))


def param_specs(params: dict, vocab_size: int, tp: int, ep: int = 1) -> dict:
    """A PartitionSpec per param leaf, for the stacked ("layers") or unrolled ("layers_i")
    layout. The vocabulary is split only when it divides by tp (else replicated)."""
    vocab = AXIS if vocab_size % tp == 0 else None

    def layer(tree, stacked):
        out = {}
        for name, leaf in tree.items():
            if name == "moe":  # a mixture of experts' router and experts
                out[name] = {k: P(None, *s) if stacked else s
                             for k, s in expert_specs(ep).items()}
                continue
            if is_quantized(leaf):  # every plane split like the weight (block axes divide)
                spec = P(None, *_LAYER_SPECS[name]) if stacked else _LAYER_SPECS[name]
                out[name] = {k: _plane_spec(spec, np.shape(a)) for k, a in leaf.items()}
                continue
            if isinstance(leaf, dict):  # norms
                out[name] = jax.tree.map(lambda _: P(), leaf)
                continue
            spec = _LAYER_SPECS[name]
            out[name] = P(None, *spec) if stacked else spec
        return out

    specs = {}
    for name, leaf in params.items():
        if name == LORA:  # A and B split as their base weight is (models/lora.py layout)
            specs[name] = {p: _LORA_SPECS[tuple(_LAYER_SPECS[p]).index(AXIS) == 0]
                           for p in leaf}
        elif name == "layers":
            specs[name] = layer(leaf, True)
        elif name.startswith("layers_"):
            specs[name] = layer(leaf, False)
        elif name == "embed":
            specs[name] = P(vocab, None)
        elif name == "lm_head":
            specs[name] = P(None, vocab)
        else:
            specs[name] = jax.tree.map(lambda _: P(), leaf)
    return specs


def shard_attention(attn_fn, mesh: Mesh):
    """`attn_fn` run per device on its heads: q split by head, the pool by kv head, the
    metadata replicated; each device's output is its own heads."""

    def per_device(q, k_pool, v_pool, layer, md, **kw):
        # a traced window (scanned layers of mixed windows) goes in replicated; the rest of
        # the options are static
        window = kw.pop("window", None)
        fn = functools.partial(attn_fn, **kw)
        if isinstance(layer, int):  # unrolled layers pass a static index: keep it static
            return jax.shard_map(lambda q, k, v, md: fn(q, k, v, layer, md, window=window),
                                 mesh=mesh, in_specs=(Q_SPEC, KV_SPEC, KV_SPEC, P()),
                                 out_specs=Q_SPEC, check_vma=False)(q, k_pool, v_pool, md)
        if window is None or isinstance(window, int):
            return jax.shard_map(lambda q, k, v, layer, md: fn(q, k, v, layer, md, window=window),
                                 mesh=mesh, in_specs=(Q_SPEC, KV_SPEC, KV_SPEC, P(), P()),
                                 out_specs=Q_SPEC, check_vma=False)(q, k_pool, v_pool, layer, md)
        return jax.shard_map(lambda q, k, v, layer, md, w: fn(q, k, v, layer, md, window=w),
                             mesh=mesh, in_specs=(Q_SPEC, KV_SPEC, KV_SPEC, P(), P(), P()),
                             out_specs=Q_SPEC, check_vma=False)(q, k_pool, v_pool, layer, md,
                                                                window)

    return per_device


def shard_embedding(mesh: Mesh):
    """The embedding lookup on a table split by vocabulary: each device takes the rows of
    the ids in its share (zeros for the rest) and one all-reduce sums them. Left to itself,
    XLA's partitioner may gather the whole table to every device at every step instead."""

    def local(table, ids):
        rows = table.shape[0]
        at = ids - jax.lax.axis_index(AXIS) * rows
        mine = (at >= 0) & (at < rows)
        x = jnp.where(mine[:, None], table[jnp.clip(at, 0, rows - 1)], 0)
        return jax.lax.psum(x, AXIS)

    def lookup(table, ids):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P(),
                             check_vma=False)(table, ids)

    return lookup


def gather_once(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """(S, V) logits computed split by vocabulary, then gathered whole onto every device."""
    split = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, AXIS)))
    return jax.lax.with_sharding_constraint(split, NamedSharding(mesh, P()))


def named(mesh: Mesh, specs):
    """PartitionSpecs (a tree) -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def bytes_per_device(tree) -> int:
    """Bytes of one device's share of `tree`'s arrays (or ShapeDtypeStructs with shardings),
    each split evenly over its sharding's devices."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(tree))


def bytes_on_device(tree, device) -> int:
    """Bytes of `tree`'s arrays that live on `device`."""
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards
               if s.device == device)
