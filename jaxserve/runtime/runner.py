"""ModelRunner: owns the params and the KV pool on the device and runs compiled steps.

`step(params, pools, last_tokens, inputs) -> (pools, result, tokens)` is jitted with the KV
pools donated (the target's, and a draft model's under speculative decoding), so XLA updates the
pages in place. One executable exists per (tokens, sequences, blocks-per-sequence) bucket and,
under speculative decoding, per K in {0, num_speculative_tokens} (the proposal slots per row);
the buckets of steps where every sequence decodes have one more, that runs several decode steps
per call (runtime/decode_loop.py). `warmup()` compiles them all ahead of time, and
`num_compiles` counts every compile so a test can prove nothing compiles after warmup
(`strict_compile` turns that into an error). The runner prepares each step's inputs from the
scheduler's output itself (`prepare_step`, runtime/step_inputs.StepPreparer).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from jaxserve.config import FP8_KV_DTYPES, EngineConfig, Quantization, Role
from jaxserve.core.kv_layout import KVLayout
from jaxserve.core.scheduler import PreemptionMode
from jaxserve.kernels import cpu_matmul, fp8, gpu_matmul, quant
from jaxserve.kernels.attention import registry
from jaxserve.kernels.attention.base import AttentionBackend, is_fp8, platform_of
from jaxserve.kernels.attention.choose import choose_attention
from jaxserve.kernels.attention.selftest import describe_error
from jaxserve.kernels.cpu_matmul import block_matmul_or_none
from jaxserve.models import families, layer_stack, lora
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import (
    HEAD_BLOCKS,
    LAYER_BLOCKS,
    LORA,
    fuse_projections,
    head_blocks,
    layout_params,
    lm_logits,
    split_layer_blocks,
)
from jaxserve.models.loader import LoadedModel
from jaxserve.models.moe import block_experts, grouped_experts
from jaxserve.runtime import (
    compile_cache,
    decode_loop,
    distributed,
    executable_cache,
    logits_processing,
    memory_maps,
    memory_plan,
    sharding,
)
from jaxserve.runtime.kv_cache import HostSwapPool, KVCache, bytes_per_block
from jaxserve.runtime.sampling import (
    PromptLogprobs,
    SamplerOutput,
    prompt_logprobs,
    sample,
    sample_plain,
)
from jaxserve.runtime.speculative import draft_proposals, fill_proposals, verify
from jaxserve.runtime.step_inputs import (
    Program,
    StepInputs,
    StepPreparer,
    dummy_step_inputs,
    seq_bucket,
)

logger = logging.getLogger(__name__)


def plan_kv_layout(config: EngineConfig, cfg: ModelConfig, has_draft: bool) -> KVLayout:
    """The pool's layer groups (core/kv_layout.py): freeing out-of-window blocks where the
    model has sliding windows and `free_window_blocks` is on or unset, unless something here
    needs every block of a sequence kept (then unset means off, and on is refused)."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    if config.free_window_blocks is False or not any(w is not None for w in windows):
        return KVLayout.whole(cfg.num_layers)
    keep = [why for why, needs in (
        ("a draft model reads every block through group 0's table", has_draft),
        ("preemption_mode=swap copies whole tables", config.preemption_mode
         is PreemptionMode.SWAP),
        (f"role={config.role} hands whole tables over", config.role is not Role.BOTH))
        if needs]
    if keep:
        if config.free_window_blocks:
            raise ValueError(f"free_window_blocks: not available here: {'; '.join(keep)}")
        logger.info("sliding-window blocks kept whole (%s)", "; ".join(keep))
        return KVLayout.whole(cfg.num_layers)
    return KVLayout.plan(windows, True)


def pack_in_place(tree: dict, batch_dims: int = 0) -> None:
    """A param tree's quantized weights in the CPU kernel's panels (cpu_matmul.pack_weight),
    in place, one at a time: a scanned model's "layers" are stacked on a leading axis, and a
    mixture's experts ("moe") have one stacked axis more (E), which the grouped kernel reads."""
    for k, v in tree.items():
        if quant.is_quantized(v):
            tree[k] = cpu_matmul.pack_weight(v, batch_dims)
        elif isinstance(v, dict):
            pack_in_place(v, batch_dims + (k in ("layers", "moe")))


def replace_leaves(tree: dict, fn, targets=None) -> dict:
    """fn(leaf) (or fn(leaf, target), `targets` a tree of the same dicts or one value for all)
    on every leaf of the nested dicts `tree` (an array or a quantized dict), in place, one
    leaf at a time: a host array nothing else holds frees once its replacement is made, so
    converting and placing a model's weights needs room for one weight more, not a second
    copy of the model. Returns `tree`."""
    for k, v in tree.items():
        t = targets[k] if isinstance(targets, dict) else targets
        if isinstance(v, dict) and not quant.is_quantized(v):
            replace_leaves(v, fn, t)
        else:
            tree[k] = fn(v) if targets is None else fn(v, t)
    return tree


def is_int(a) -> bool:
    """An array of integers (a split stack's slots, quant.is_split): never cast to floats."""
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.integer)


def put_waiting(a, sharding):
    """jax.device_put, waiting for the copy: the host array is let go of then, not whenever
    an asynchronous transfer finishes (a model's worth could pile up)."""
    return jax.block_until_ready(jax.device_put(a, sharding))


def layer_keys(scan: bool) -> tuple[str, ...]:
    """The keys of a one-layer step tree that hold the layer: stacked (leading axis 1) when
    scanned, else the layer itself."""
    return ("layers", LAYER_BLOCKS) if scan else ("layers_0",)


def all_layers(params: dict, num_layers: int, scan: bool) -> dict:
    """A step tree of one layer (and the rest) as shapes of the tree of `num_layers` alike."""
    out = {k: v for k, v in params.items() if k not in layer_keys(scan)}
    if scan:
        for k in layer_keys(scan):
            if k in params:
                out[k] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                    (num_layers, *a.shape[1:]), a.dtype), params[k])
    else:
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                              params["layers_0"])
        out |= {f"layers_{i}": shapes for i in range(num_layers)}
    return out


@functools.cache
def _write_layer(where):
    """slot i of a stacked param on its devices, written in place (the stack donated)."""
    return jax.jit(lambda stack, part, i: jax.lax.dynamic_update_index_in_dim(stack, part, i, 0),
                   donate_argnums=0, out_shardings=where)


def own_structure(tree: dict) -> dict:
    """`tree`'s nested dicts copied (the leaves shared): replace_leaves may then edit it
    without touching the caller's tree."""
    return {k: own_structure(v) if isinstance(v, dict) and not quant.is_quantized(v) else v
            for k, v in tree.items()}


def hand_over(loaded: LoadedModel, take: bool) -> dict:
    """`loaded`'s params for the runner to edit in place: taken (loaded keeps None, so each
    host array frees once replaced) or with their dicts copied (the caller's tree untouched)."""
    params = loaded.params
    if not take:
        return own_structure(params)
    loaded.params = None
    return params


class RecompileError(RuntimeError):
    """A step needed a program that warmup() did not compile (strict_compile=True)."""


class _ProgramError(Exception):
    """A step program failed to lower or compile at warmup (which one, and the error)."""

    def __init__(self, program: Program, error: Exception):
        super().__init__(program, error)
        self.program, self.error = program, error


# XLA:GPU's command buffers (CUDA graphs): its default kinds (JAX 0.11), while loops, so the
# decode loop runs as graph nodes on the device, not a host round trip per trip, and
# collectives. Tensor parallelism's all-reduces go through NCCL, which a graph can hold, not
# XLA's own all-reduce kernel, which splits the step's graph at every one.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,"
                        "CUSTOM_CALL,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE,COLLECTIVES",
                        "xla_gpu_experimental_use_collective_kernels": "",
                        # FP8 codes times their block scales fused into the dot that reads
                        # them (kernels/fp8.py), not written out as a weight first
                        "xla_gpu_experimental_enable_subchannel_dequantisation_fusion": True}


def compiler_options(platform: str) -> dict | None:
    """The XLA options the step programs are compiled with on `platform` (None: XLA's own)."""
    return dict(GPU_COMPILER_OPTIONS) if platform == "gpu" else None


def resolve_dtype(name: str, platform: str | None = None):
    """A dtype option's dtype; auto: float32 on a CPU, bfloat16 elsewhere (`platform`: the
    step's device's, default JAX's); fp8, fp8_e4m3, fp8_e5m2: kv_cache_dtype's 8-bit floats."""
    if name == "auto":
        name = "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"
    return jnp.dtype(FP8_KV_DTYPES.get(name, name))


def abstract(tree, sharding):
    """`tree`'s arrays as ShapeDtypeStructs placed on `sharding` (one for all, or a tree of
    them like `tree`'s): what a deviceless runner holds instead of device buffers."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, sharding)


def auto_kv_dtype(dtype, backend: AttentionBackend):
    """kv_cache_dtype "auto": float16 under a float32 model on the CPU kernel, the model's dtype
    elsewhere. The kernel widens float16 exactly as it loads and computes in float32, so only
    the stored K/V round (to 11 bits): the pool streams half the bytes a step, which a long
    context's decode is bound by, and holds twice the tokens. Greedy tokens still equal HF's
    float32 ones on the oracle tests (bfloat16's 8 bits flipped 2 of 21 prompts in 64 tokens)."""
    if backend is AttentionBackend.CPU and jnp.dtype(dtype) == jnp.float32:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(dtype)


@dataclasses.dataclass(slots=True)
class StepOutput:
    """One step's sampled tokens on the host: up to K per sequence row (K > 1: accepted
    proposals, or several decode steps)."""

    token_ids: np.ndarray  # (S, K) int32
    num_tokens: np.ndarray  # (S,) int32: real tokens of each row (0: nothing sampled)
    logprobs: np.ndarray | None = None  # (S, K) float32, when asked
    top_ids: np.ndarray | None = None  # (S, K, max_logprobs) int32
    top_logprobs: np.ndarray | None = None  # (S, K, max_logprobs) float32
    prompt: PromptLogprobs | None = None  # as numpy, when a row asked for prompt logprobs
    pooled: Pooled | None = None  # as numpy, when a row is an embedding request

    def rows(self, num_seqs: int) -> list[list[int]]:
        """The tokens of the first `num_seqs` rows, as lists."""
        ids, counts = self.token_ids[:num_seqs].tolist(), self.num_tokens[:num_seqs].tolist()
        k = self.token_ids.shape[1]
        return [row if n == k else row[:n] for row, n in zip(ids, counts, strict=True)]

    def prompt_entry(self, row: int, k: int) -> dict:
        """The logprob of the prompt token after query `row`: {"logprob", "rank", "top":
        {token id: logprob} of the k best}."""
        p = self.prompt
        return {"logprob": float(p.logprobs[row]), "rank": int(p.ranks[row]),
                "top": _top(p.top_ids[row, :k], p.top_logprobs[row, :k])}

    def logprob_entry(self, row: int, j: int, k: int) -> dict:
        """{"logprob": of token j of `row`, "top": {token id: logprob} of the k best}."""
        return {"logprob": float(self.logprobs[row, j]),
                "top": _top(self.top_ids[row, j, :k], self.top_logprobs[row, j, :k])}


def _top(ids: np.ndarray, logprobs: np.ndarray) -> dict[int, float]:
    """Top ids and their logprobs -> {token id: logprob}, best first."""
    return {int(t): float(lp) for t, lp in zip(ids, logprobs, strict=True)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """A dispatched step's outputs, still on the device."""

    sampled: SamplerOutput
    prompt: PromptLogprobs
    pooled: Pooled


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pooled:
    """Each row's final hidden states this step, for embedding requests (read back only when
    a row is one)."""

    sums: jax.Array  # (S, D) float32: the sum over the row's query tokens
    last: jax.Array  # (S, D) float32: its last query token's

    @staticmethod
    def of(hidden: jax.Array, md) -> Pooled:
        """hidden (T, D): the final norm's output; md: the step's AttentionMetadata."""
        qsl = md.query_start_loc  # (S + 1,) int32, padding rows start at the real token count
        x = hidden.astype(jnp.float32)
        real = (jnp.arange(x.shape[0]) < qsl[-1])[:, None]  # (T, 1)
        sums = jax.ops.segment_sum(jnp.where(real, x, 0.0), md.token_seq,
                                   num_segments=qsl.shape[0] - 1)
        return Pooled(sums, x[jnp.maximum(qsl[1:] - 1, 0)])

    @staticmethod
    def empty(num_rows: int, dim: int) -> Pooled:
        return Pooled(jnp.zeros((num_rows, dim), jnp.float32),
                      jnp.zeros((num_rows, dim), jnp.float32))


class ModelRunner(StepPreparer):
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 devices: list[jax.Device] | None = None, draft: LoadedModel | None = None,
                 deviceless: bool = False, take_params: bool = False):
        """`devices`: the tensor_parallel_size devices this runner's model and pool live on
        (default: the first ones; a data-parallel replica gets its own group). `draft`: the
        draft model of speculative_method="draft_model" (runtime/speculative.py).
        `take_params`: the runner takes `loaded`'s params (and `draft`'s), leaving None there,
        so their host arrays free one by one as they are converted and put on the device.
        `deviceless`: `devices` are compile-only (a GPU target description's, jax.experimental
        .topologies) and `loaded`'s params may be ShapeDtypeStructs: the runner holds no
        buffers, builds its programs with `compile_program` and runs none."""
        self.config = config
        self.deviceless = deviceless
        if deviceless and (not devices or config.expert_parallel_size > 1
                           or draft is not None):
            raise ValueError("deviceless: compile-only devices, no expert parallelism, no "
                             "draft model")
        target = devices[0] if deviceless else None
        self.compilation_cache_dir = (None if deviceless
                                      else compile_cache.enable(config.compilation_cache_dir))
        platform = None if target is None else platform_of(target)
        self.dtype = resolve_dtype(config.dtype, platform)
        asked = (None if config.kv_cache_dtype == "auto"
                 else resolve_dtype(config.kv_cache_dtype, platform))
        lc = loaded.config
        # auto: a self-test on the device picks the backend (kernels/attention/selftest.py), and
        # names the one a step program that fails to compile for the kernel's sake falls back to.
        self.attention = choose_attention(
            config.attention_backend, kv_heads=lc.num_kv_heads, dtype=self.dtype,
            head_dim=lc.head_dim, groups=lc.num_heads // lc.num_kv_heads,
            block_size=config.block_size, device=target,
            kv_dtype=None if asked is None or asked == self.dtype else asked)
        self.kv_dtype = (asked if asked is not None
                         else auto_kv_dtype(self.dtype, self.attention.backend))
        # vLLM's: the scales apply to fp8 pools only
        self.kv_scales = ((float(config.k_scale), float(config.v_scale))
                          if is_fp8(self.kv_dtype) else (1.0, 1.0))
        scan = config.scan_layers
        tp = self.tensor_parallel_size = config.tensor_parallel_size
        ep = config.expert_parallel_size
        sharding.check_experts(loaded.config, tp, ep)
        self.devices = sharding.device_group(devices, tp, ep)
        self.compiler_options = compiler_options(platform_of(self.devices[0]))
        mc, params = loaded.config, hand_over(loaded, take_params)
        self.head_layout = sharding.HeadLayout.plan(mc, tp)  # (the identity at tp = 1)
        # runtime/sharding.py: heads (and experts) over the mesh
        self.mesh = sharding.make_mesh(self.devices, ep) if tp * ep > 1 else None
        keep_blocks = config.quantization is Quantization.AUTO
        # Projections kept in GGUF blocks run through the CPU kernel where it builds (it says
        # why not on other platforms; one device: XLA cannot split a custom call over a mesh);
        # else they are expanded in the step.
        self.block_matmul = (block_matmul_or_none if keep_blocks and self.mesh is None
                             and self.dtype == jnp.float32 and cpu_matmul.available() is None
                             else None)

        on_cpu = self.devices[0].platform == "cpu"
        self.plain_programs = (config.plain_programs if config.plain_programs is not None
                               else not on_cpu)
        fuse = (self.block_matmul is None and self.mesh is None
                and not on_cpu)
        expand_fp8 = not keep_blocks or fp8.expands_at_load(on_cpu)
        self._fp8_expanded = [0, 0]  # bytes held as FP8, values expanded

        def serving(a):
            """A float leaf in the serving dtype; quantized and integer leaves as they are."""
            return (a if quant.is_quantized(a) or is_int(a) else
                    jnp.asarray(a, self.dtype) if isinstance(a, jax.Array) else
                    np.asarray(a, self.dtype))

        def placed(a, where):
            """A leaf cast and put on its devices in one go: the loader's (mapped) array frees
            before the next is cast, so no second copy of the model builds up on the host;
            a mapped file's pages are given back once copied."""
            out = put_waiting(serving(a), where)
            if loaded.release is not None:
                loaded.release([a])
            return out

        def as_step_params(cfg, p, cast=True):
            """The loader's tree in the step's layout: floats in the serving dtype (`cast`;
            else as loaded, for `placed`), quantized weights (kernels/quant.py) as they are,
            or expanded with quantization=none; with the CPU block matmul, codes in the
            panels it reads (nibbles: half the bytes to stream) and the head as Q8 blocks, in
            pairs, where it is exactly that. Edits p's dicts in place, a weight at a time
            (replace_leaves)."""
            if self.block_matmul is None:  # only the CPU kernel reads a head's blocks
                p.pop(HEAD_BLOCKS, None)
            if expand_fp8:
                self._expand_fp8(p)
            p = layout_params(p, cfg.num_layers, scan)
            if not keep_blocks:
                p = replace_leaves(p, quant.dequantize_tree)
            if fuse:  # off the CPU: q/k/v and gate/up as one matmul each
                p = fuse_projections(p, scan)
            if keep_blocks and self.block_matmul is None and self.mesh is None:
                p = gpu_matmul.to_gpu_forms(p)  # blocks the matmul reads in place
            if self.block_matmul is not None:
                pack_in_place(p)
                if scan:  # read in place at each layer's index, not sliced out per layer
                    p = split_layer_blocks(p, quant.is_packed)
                blocks = head_blocks(cfg, p) if "embed" in p or HEAD_BLOCKS in p else None
                if blocks is not None:
                    p = {**p, HEAD_BLOCKS: cpu_matmul.pack_weight(blocks)}
                    if quant.is_packed(p[HEAD_BLOCKS]):  # the kernel reads it: no float head
                        p.pop("lm_head", None)
            return replace_leaves(p, serving) if cast else p

        def step_form(cfg, p):
            """The loader's tree (and config) as the step reads them, on the host: heads laid
            out for the mesh, then as_step_params (deviceless: traced on shapes alone)."""
            if cfg.is_moe and tp * ep > 1:  # experts split over the mesh as float weights
                p = {**p, "layers": {**p["layers"], "moe": quant.dequantize_tree(
                    p["layers"]["moe"])}}
            if tp * ep > 1:
                cfg, p = (sharding.relayout_shapes(cfg, p, self.head_layout, tp) if deviceless
                          else sharding.relayout(cfg, p, self.head_layout, tp))
            return cfg, (jax.eval_shape(functools.partial(as_step_params, cfg), p)
                         if deviceless else as_step_params(cfg, p, cast=False))

        # A mapped checkpoint's layers (models/layer_stack.py) are converted and placed a
        # layer at a time (_place_layers): here layer 0 with the rest gives every shape.
        stacks = params.pop("layers") if layer_stack.holds_stacks(params) else None
        if stacks is None:
            mc, params = step_form(mc, params)
        else:
            one = dataclasses.replace(mc, num_layers=1)
            mc, params = step_form(one, {**params, "layers": layer_stack.layer_of(stacks, 0)})
            mc = dataclasses.replace(mc, num_layers=loaded.config.num_layers)
        self.model_config = mc  # heads as laid out (padded or replicated under TP)
        self.draft_config = self._check_draft(config, loaded, draft)
        self.kv_layout = plan_kv_layout(config, mc, draft is not None)
        self.block_size = config.block_size
        self.map_budget = memory_maps.MapBudget()  # memory maps its programs take
        per_block = bytes_per_block(mc, config.block_size, self.kv_dtype, self.kv_layout.rows)
        if self.draft_config is not None:  # its pool has the same blocks: they share the budget
            per_block += bytes_per_block(self.draft_config, config.block_size, self.kv_dtype)
        self._use_attention(self.attention.backend, self.attention.fn)
        self.lora_enabled = config.enable_lora
        if self.lora_enabled:
            self._check_lora(config, mc, loaded.config)
            # max_loras slots, each written in place (load_lora); slot 0, none, takes none
            params[LORA] = lora.empty_slots(mc, lora.supported_modules(mc),
                                            config.max_loras, config.max_lora_rank,
                                            self.dtype)
            self._write_lora = jax.jit(lora.write_slot, donate_argnums=(0,))
        if self.mesh is None:  # committed to its device: the jitted step runs where they live
            rep = kv_sharding = param_sharding = jax.sharding.SingleDeviceSharding(
                self.devices[0])
            self._jit_kw = {}
        else:
            param_sharding = sharding.named(self.mesh, sharding.param_specs(
                params if stacks is None else all_layers(params, mc.num_layers, scan),
                mc.vocab_size, tp, ep))
            kv_sharding = sharding.named(self.mesh, sharding.KV_SPEC)
            rep = sharding.named(self.mesh, sharding.P())
            self._jit_kw = {"in_shardings": ((param_sharding,), (kv_sharding,), rep, rep),
                            "out_shardings": ((kv_sharding,), rep, rep)}
        # deviceless: shapes alone, on the compile-only devices
        self.params = (abstract(params, param_sharding) if deviceless else
                       replace_leaves(params, placed, param_sharding) if stacks is None else
                       self._place_layers(params, stacks, param_sharding, scan, placed, serving,
                                          lambda p: step_form(one, p)[1]))
        if self.draft_config is not None:
            self.draft_params = replace_leaves(as_step_params(
                self.draft_config, layer_stack.built(hand_over(draft, take_params)),
                cast=False), placed, rep)
        self._warn_expanded()
        # Rows' logit processing: the history holds every distinct token of a context.
        self.logits_shape = logits_processing.LogitsShape(loaded.config.vocab_size,
                                                          config.max_model_len)
        self._replicated = rep  # where the step's small inputs live
        self._unused: dict[int, logits_processing.LogitsInputs] = {}
        self._last_tokens = (
            jax.ShapeDtypeStruct((max(self.buckets[1]),), jnp.int32, sharding=rep) if deviceless
            else jnp.zeros(max(self.buckets[1]), jnp.int32, device=rep))
        # The plan counts blocks of every layer, per device (each holds 1/tp of a block: its
        # kv heads); the pool holds them as pages of kv_layout.rows layers.
        pages = mc.num_layers // self.kv_layout.rows
        self.memory_plan = self._plan_memory(per_block * pages // tp, kv_sharding)
        logger.info("%s", self.memory_plan.describe())
        self.num_blocks = self.memory_plan.num_blocks * pages
        pools = self._pools(self.num_blocks, kv_sharding, abstract_only=deviceless)
        self.kv = pools[0]
        if self.draft_config is not None:
            self.draft_kv = pools[1]
        if self.mesh is not None:
            logger.info("tensor parallel: mesh %s over %s; %s; per device: params %.1f MiB, "
                        "KV pool %.1f MiB (%d blocks of %d tokens)", dict(self.mesh.shape),
                        [str(d) for d in self.mesh.devices.flat],
                        self.head_layout.describe(loaded.config, tp),
                        sharding.bytes_per_device(self.params) / 2**20,
                        sharding.bytes_per_device(self.kv) / 2**20, self.num_blocks,
                        self.block_size)
            if mc.is_moe:
                experts = [{k: w for k, w in layer["moe"].items() if k != "router"}
                           for name, layer in self.params.items() if name.startswith("layers")]
                logger.info("experts: %d per device of %d (expert_parallel_size=%d); expert "
                            "weights per device %.1f MiB", mc.num_experts // ep, mc.num_experts,
                            ep, sharding.bytes_per_device(experts) / 2**20)
        # Across processes (runtime/distributed.py) the leader broadcasts each step first.
        self.multiprocess = jax.process_count() > 1
        self.broadcast = (distributed.StepBroadcast(self._dummy_inputs)
                          if self.multiprocess else None)
        if self.multiprocess and config.preemption_mode is PreemptionMode.SWAP:
            raise ValueError("preemption_mode=swap is not available across processes (the "
                             "host pool would be split between them); use recompute")
        # The host pool serves swap preemption and the prefix cache's host tier (which a
        # pool freeing window blocks has not: Scheduler.host_tier).
        tier = config.enable_prefix_caching and not self.kv_layout.frees
        swap = config.preemption_mode is PreemptionMode.SWAP
        uses_host = (swap or tier) and not self.multiprocess and not deviceless
        self.num_host_blocks = config.swap_space_bytes // per_block if uses_host else 0
        self.host_pool = (HostSwapPool(self.pools, self.num_host_blocks, self.num_blocks)
                          if self.num_host_blocks else None)
        self._make_step()
        self.num_compiles = 0  # programs lowered and compiled (XLA's own cache may serve those)
        self.compile_seconds = 0.0  # spent in lower + compile (or loading from the cache)
        self.is_warm = False

    @property
    def attention_backend(self) -> AttentionBackend | str:
        """The backend the step programs run (after a fallback, the one fallen back to)."""
        return self._attention_backend

    def _use_attention(self, backend: AttentionBackend | str, attn_fn) -> None:
        """Build the model (and the draft model) around `attn_fn`, per device under TP."""
        self._attention_backend, self._attention_fn = backend, attn_fn
        self.buckets = self.config.buckets(isinstance(backend, AttentionBackend) and
                                           registry.backend(backend).table_width_free)
        experts_fn = block_experts if self.block_matmul is not None else grouped_experts
        embed_fn = None
        if self.mesh is not None:
            attn_fn = sharding.shard_attention(attn_fn, self.mesh)
            experts_fn = sharding.shard_experts(self.mesh)
            if self.model_config.vocab_size % self.tensor_parallel_size == 0:  # split by vocab
                embed_fn = sharding.shard_embedding(self.mesh)
        scan = self.config.scan_layers
        model_class = families.family(self.model_config.architecture).model_class()
        self.model = model_class(self.model_config, self.dtype, attn_fn, scan_layers=scan,
                                 block_matmul=self.block_matmul, experts_fn=experts_fn,
                                 kv_layout=self.kv_layout, embed_fn=embed_fn,
                                 kv_scales=self.kv_scales)
        if self.draft_config is not None:
            draft_class = families.family(self.draft_config.architecture).model_class()
            self.draft_model = draft_class(self.draft_config, self.dtype, attn_fn,
                                           scan_layers=scan, block_matmul=self.block_matmul,
                                           kv_scales=self.kv_scales)

    def _jit_step(self):
        """The step around the current model, jitted (nothing compiled yet)."""
        max_logprobs = self.config.max_logprobs

        def step(*args):
            return self._step(*args, max_logprobs=max_logprobs)

        # Named after the step's source: JAX's cache keys on the name, so a program whose HLO
        # an upgrade left as it was is compiled afresh once, and then stored whole here (an
        # executable loaded from JAX's cache cannot be; runtime/executable_cache.py).
        step.__name__ = step.__qualname__ = f"step_{executable_cache.source_digest()[:16]}"
        return jax.jit(step, donate_argnums=(1,), **self._jit_kw)

    def _pools(self, num_blocks: int, kv_sharding, abstract_only: bool) -> tuple[KVCache, ...]:
        """Zeroed pools of `num_blocks` pages (the target's, and the draft model's), or their
        shapes alone."""
        def create(cfg, rows):
            make = functools.partial(KVCache.create, cfg, num_blocks, self.block_size,
                                     self.kv_dtype, None if abstract_only else kv_sharding, rows)
            return abstract(jax.eval_shape(make), kv_sharding) if abstract_only else make()

        pools = (create(self.model_config, self.kv_layout.rows),)
        if self.draft_config is not None:
            pools += (create(self.draft_config, None),)
        return pools

    def _plan_memory(self, block_bytes: int, kv_sharding) -> memory_plan.MemoryPlan:
        """The pool's size (runtime/memory_plan.py): from the device's memory where
        kv_cache_memory_fraction asks and the device reports it, the step's temporaries read
        from compiling its largest programs; else num_kv_blocks, else kv_cache_memory_bytes."""
        config = self.config
        weights = sharding.bytes_per_device(self.step_params)
        plan = functools.partial(memory_plan.from_blocks, weights_bytes=weights,
                                 block_bytes=block_bytes, block_size=self.block_size,
                                 max_model_len=config.max_model_len)
        if config.num_kv_blocks:
            return plan(config.num_kv_blocks)
        fraction = config.kv_cache_memory_fraction
        stats = (None if fraction is None or self.deviceless
                 else self.devices[0].memory_stats())
        if not stats or "bytes_limit" not in stats:
            if fraction is not None:
                logger.warning("device reports no memory statistics; using "
                               "kv_cache_memory_bytes=%d", config.kv_cache_memory_bytes)
            return plan(max(1, config.kv_cache_memory_bytes // block_bytes))
        # What else the device already holds (the self-test's leftovers) counts as weights.
        in_use = max(weights, stats.get("bytes_in_use", 0))
        return memory_plan.from_device(
            stats["bytes_limit"], fraction, in_use, self.step_temporaries(kv_sharding),
            block_bytes, self.block_size, config.max_model_len)

    def largest_programs(self) -> list[Program]:
        """The programs whose temporaries bound the rest: the most tokens (a mixed step's
        activations and logits) and, with the decode loop, its most sequences."""
        programs = self.all_programs()
        picks = [max(programs, key=lambda p: (p.tokens, p.seqs, p.blocks))]
        loops = [p for p in programs if p.decode_steps > 1]
        if loops:
            picks.append(max(loops, key=lambda p: (p.seqs, p.blocks)))
        return picks

    def step_temporaries(self, kv_sharding) -> int:
        """Scratch bytes per device of the largest step programs, compiled on a pool of a few
        blocks (the pool is an argument the step updates in place, so its size is not
        scratch): the step's own memory, which the KV pool must leave room for."""
        groups = self.model_config.num_layers // self.kv_layout.rows
        num_blocks = (self.config.max_blocks_per_seq + 1) * groups
        pools = self._pools(num_blocks, kv_sharding, abstract_only=True)
        jitted = self._jit_step()
        most = 0
        for program in self.largest_programs():
            inputs = abstract(self._dummy_inputs(program, num_blocks), self._replicated)
            exe = jitted.lower(self.step_params, pools, self._last_tokens,
                               inputs).compile(self.compiler_options)
            most = max(most, exe.memory_analysis().temp_size_in_bytes)
        return most

    def _make_step(self) -> None:
        """Jit the step around the current model, with no program built yet."""
        self._jitted = self._jit_step()
        self._executables: dict[Program, jax.stages.Compiled] = {}
        self.executable_cache = executable_cache.ExecutableCache.create(
            self.compilation_cache_dir, "\n".join([
                repr(self.config), repr(self.model_config), repr(self.draft_config),
                # auto's choice, which depends on the machine (a C++ compiler for 'cpu')
                f"attention_backend={self.attention_backend}",
                f"block_matmul={self.block_matmul is not None}",
                f"compiler_options={self.compiler_options}",
                executable_cache.abstract(self.step_params), executable_cache.abstract(self.pools),
                executable_cache.abstract(self._last_tokens)]),
            list(self.mesh.devices.flat) if self.mesh is not None else self.devices[:1])

    def _place_layers(self, first: dict, stacks: dict, where, scan: bool, placed, serving,
                      step_form) -> dict:
        """The step's params on their devices from `first` (the rest and layer 0 in the step's
        layout, on the host) and the loader's LayerStacks, a layer at a time: `step_form`
        converts each further layer, and its mapped pages are given back once it is placed.
        Scanned, each stack is allocated on the devices and written slot by slot. `where`:
        the params' shardings (a tree, or one for all); `placed(leaf, sharding)` places one;
        `serving`: a leaf in its dtype."""
        num_layers = len(jax.tree.leaves(stacks)[0])
        keys = layer_keys(scan)
        at = lambda k: where[k] if isinstance(where, dict) else where
        on = lambda fn, k, *trees: (jax.tree.map(fn, *trees, at(k)) if isinstance(where, dict)
                                    else jax.tree.map(lambda *a: fn(*a, where), *trees))
        out = {k: first.pop(k) for k in list(first) if k not in keys}  # taken: freed as placed
        replace_leaves(out, placed, {k: at(k) for k in out})
        for i in range(num_layers):
            layer = ({k: first.pop(k) for k in keys if k in first} if i == 0 else
                     step_form({"layers": layer_stack.layer_of(stacks, i)}))
            for k in keys:
                if k not in layer:
                    continue
                part = replace_leaves(layer[k], serving)  # on the host, a layer's worth
                if not scan:
                    out[f"layers_{i}"] = on(put_waiting, f"layers_{i}", part)
                    continue
                if i == 0:
                    out[k] = on(lambda a, s: jnp.zeros((num_layers, *a.shape[1:]), a.dtype,
                                                       device=s), k, part)
                out[k] = on(lambda stack, a, s, i=i: _write_layer(s)(stack, put_waiting(a, s), i),
                            k, out[k], part)
            del layer, part  # this layer's host copy, before the next is made
            layer_stack.release_layer(stacks, i)
        return out

    def _expand_fp8(self, params: dict) -> None:
        """A checkpoint's FP8 weights (kernels/fp8.py) expanded to the serving dtype, in
        place: on a CPU (XLA:CPU has no FP8 matmul) or with quantization=none. Counted for
        _warn_expanded."""
        held, count = fp8.expand_tree(params)
        self._fp8_expanded = [a + b for a, b in zip(self._fp8_expanded, (held, count),
                                                    strict=True)]

    def _warn_expanded(self) -> None:
        """One warning for the FP8 weights expanded at load, with what it costs."""
        held, count = self._fp8_expanded
        if count:
            logger.warning(
                "FP8 weights expanded to %s at load (%s): %.1f MB -> %.1f MB",
                jnp.dtype(self.dtype).name, "quantization=none"
                if self.config.quantization is Quantization.NONE
                else "on a CPU, where FP8 weights gain nothing", held / 1e6,
                count * jnp.dtype(self.dtype).itemsize / 1e6)

    @staticmethod
    def _check_draft(config: EngineConfig, loaded: LoadedModel,
                     draft: LoadedModel | None):
        """The draft model's config, after checking it can propose for this target."""
        if config.speculative_method != "draft_model":
            return None
        if draft is None:
            raise ValueError("speculative_method='draft_model' needs the draft model "
                             "(speculative_model)")
        if config.tensor_parallel_size > 1 or config.expert_parallel_size > 1:
            raise ValueError("speculative_method='draft_model' runs with "
                             "tensor_parallel_size=1 and expert_parallel_size=1 only; use "
                             "'ngram' under tensor or expert parallelism")
        if draft.config.vocab_size != loaded.config.vocab_size:
            raise ValueError(
                f"speculative_model: its vocabulary has {draft.config.vocab_size} tokens and "
                f"the target's {loaded.config.vocab_size}; a draft model must share the "
                f"target's tokenizer")
        return draft.config

    @staticmethod
    def _check_lora(config: EngineConfig, mc: ModelConfig, model: ModelConfig) -> None:
        """Raise ValueError where enable_lora meets what its slots do not serve yet (`mc`: the
        config with heads laid out for tensor parallelism, `model`: the model's own)."""
        why = ("expert_parallel_size 1" if config.expert_parallel_size > 1 else
               "tensor parallelism whose size divides the kv heads"
               if (mc.num_heads, mc.num_kv_heads) != (model.num_heads, model.num_kv_heads) else
               "one process" if jax.process_count() > 1 else None)
        if why is not None:
            raise ValueError(f"enable_lora: adapters are served with {why} only")

    def load_lora(self, slot: int, adapter: lora.LoRAAdapter) -> None:
        """Write `adapter`'s weights into device slot `slot` (1..max_loras), in place. A step
        already launched reads the slots before this write, which follows it on the device."""
        if not 1 <= slot <= self.config.max_loras:
            raise ValueError(f"slot {slot} is not one of 1..{self.config.max_loras}")
        self._put_lora(slot, lora.slot_values(adapter, self.params[LORA], self.dtype))

    def _put_lora(self, slot: int, values: dict) -> None:
        values = jax.device_put(values, self._replicated)
        slots = self._write_lora(self.params[LORA], jnp.int32(slot), values)
        self.params = {**self.params, LORA: slots}

    @property
    def pools(self) -> tuple[KVCache, ...]:
        """The device KV pools: the target's, then the draft model's if there is one."""
        return (self.kv,) if self.draft_config is None else (self.kv, self.draft_kv)

    @pools.setter
    def pools(self, pools: tuple[KVCache, ...]) -> None:
        self.kv = pools[0]
        if self.draft_config is not None:
            self.draft_kv = pools[1]

    @property
    def step_params(self) -> tuple:
        return ((self.params,) if self.draft_config is None
                else (self.params, self.draft_params))

    def _step(self, params: tuple, pools: tuple[KVCache, ...], last_tokens: jax.Array,
              inp: StepInputs, max_logprobs: int):
        """-> (pools, sampled, this step's tokens padded to last_tokens' shape).

        `params`, `pools`: the target's, then the draft model's if speculation has one.
        last_tokens (max seq bucket,) int32: the previous step's sampled tokens, still on the
        device; rows with prev_rows >= 0 take their input token from there, which lets the
        host build this step before the previous one's tokens are read back."""
        spec_k = inp.spec.draft_tokens.shape[1]  # speculative decoding's K (0: off)
        (params, *draft_params), kv = params, pools[0]
        ids = jnp.where(inp.prev_rows >= 0, last_tokens[jnp.maximum(inp.prev_rows, 0)],
                        inp.input_ids)
        if inp.decode is not None:  # several decode steps (runtime/decode_loop.py)
            kv, out = decode_loop.run(
                functools.partial(self._decode_step, params, inp.logits_indices, max_logprobs,
                                  inp.plain, inp.lora_slots),
                kv, ids, inp.attn, inp.sampling, inp.processing, inp.logits_indices, inp.decode,
                max_logprobs, self.logits_shape.vocab_size,
                early_exit=not self.plain_programs)  # (a condition to read back, as a branch)
            return self._result((kv, *pools[1:]), out,
                                PromptLogprobs.empty(ids.shape[0], max_logprobs), last_tokens,
                                Pooled.empty(inp.attn.query_start_loc.shape[0] - 1,
                                             self.model_config.hidden_size))
        if len(pools) > 1:  # a draft model proposes the speculating rows' tokens
            with jax.named_scope("draft"):
                run_draft = functools.partial(self._run_draft, draft_params[0])
                draft_kv = pools[1]
                if spec_k:
                    draft_kv, drafts = draft_proposals(run_draft, draft_kv, ids, inp.attn,
                                                       inp.spec)
                    ids = fill_proposals(ids, drafts, inp.spec)
                    inp = dataclasses.replace(
                        inp, spec=dataclasses.replace(inp.spec, draft_tokens=drafts))
                # its cache follows the target's: every row's K/V, from the same tokens
                draft_kv, _ = run_draft(draft_kv, ids, inp.attn, False)
            pools = (None, draft_kv)
        with jax.named_scope("forward"):
            # (with speculation the head runs below, over the rows each step needs)
            k, v, logits, hidden = self.model.apply({"params": params}, ids, kv.k, kv.v,
                                                    inp.attn,
                                                    None if spec_k else inp.logits_indices,
                                                    inp.lora_slots)
            pools = (KVCache(k, v), *pools[1:])
        def head_logits(x):
            # Under TP: computed split by vocabulary, then gathered once (left split, the
            # sampler's sorts and reductions gather them several times; asked for replicated
            # logits alone, XLA gathers the (V, D) embedding instead).
            logits = lm_logits(self.model_config, x, params, self.block_matmul)
            return logits if self.mesh is None else sharding.gather_once(logits, self.mesh)

        if not spec_k and self.mesh is not None:
            logits = sharding.gather_once(logits, self.mesh)
        if inp.plain:  # no branches: every row greedy or from its temperature alone
            with jax.named_scope("sample"):
                out = sample_plain(logits, inp.sampling, max_logprobs)
            return self._result(pools, out, PromptLogprobs.empty(hidden.shape[0], max_logprobs),
                                last_tokens, Pooled.of(hidden, inp.attn))
        with jax.named_scope("sample"):
            if not spec_k:
                out = self._sample_rows(logits, inp.sampling, inp.processing, max_logprobs)
            else:
                out = self._sample_or_verify(hidden, head_logits, inp,
                                             max_logprobs)
        with jax.named_scope("prompt_logprobs"):
            prompt = prompt_logprobs(head_logits, hidden, inp.prompt_targets, max_logprobs)
        return self._result(pools, out, prompt, last_tokens, Pooled.of(hidden, inp.attn))

    @staticmethod
    def _result(pools: tuple[KVCache, ...], out: SamplerOutput, prompt: PromptLogprobs,
                last_tokens: jax.Array, pooled: Pooled):
        """The step's outputs, with each row's last token (a later step's input under
        asynchronous scheduling) padded to last_tokens' shape."""
        last = jnp.take_along_axis(out.tokens, jnp.maximum(out.num_tokens - 1, 0)[:, None],
                                   axis=1)[:, 0]
        next_tokens = jnp.zeros_like(last_tokens).at[:last.shape[0]].set(last)
        return pools, StepResult(out, prompt, pooled), next_tokens

    @staticmethod
    def _sample_rows(logits: jax.Array, si, li, max_logprobs: int) -> SamplerOutput:
        """(S, V) -> the plain sampler's output, after the rows' logit processing."""
        return sample(logits_processing.apply(logits, li), si, max_logprobs, li.min_p,
                      raw_logits=logits)

    def _decode_step(self, params, logits_indices: jax.Array, max_logprobs: int, plain: bool,
                     lora_slots: jax.Array | None, kv: KVCache, ids: jax.Array, md, si,
                     li) -> tuple[KVCache, SamplerOutput]:
        """One decode step of the loop (runtime/decode_loop.py's StepFn): the forward, then
        the sampler, as a single step runs them (`plain`: StepInputs.plain; `lora_slots`:
        StepInputs')."""
        with jax.named_scope("forward"):
            k, v, logits, _ = self.model.apply({"params": params}, ids, kv.k, kv.v, md,
                                               logits_indices, lora_slots)
        if self.mesh is not None:
            logits = sharding.gather_once(logits, self.mesh)
        with jax.named_scope("sample"):
            return KVCache(k, v), (sample_plain(logits, si, max_logprobs) if plain else
                                   self._sample_rows(logits, si, li, max_logprobs))

    def _run_draft(self, params, kv: KVCache, ids: jax.Array, md, want_logits: bool):
        """The draft model over rows `ids` (runtime/speculative.py's DraftFn)."""
        k, v, _, hidden = self.draft_model.apply({"params": params}, ids, kv.k, kv.v, md, None)
        logits = (lm_logits(self.draft_config, hidden, params, self.block_matmul)
                  if want_logits else None)
        return KVCache(k, v), logits

    @staticmethod
    def _sample_or_verify(hidden, head_logits, inp: StepInputs,
                          max_logprobs: int) -> SamplerOutput:
        """Verify a step's proposals (runtime/speculative.py): its program has K > 0, which
        the host gives only a step that has some. (A step without runs the plain program:
        choosing between the two inside one program, under a lax.cond, slows every step of a
        small batch on a CPU.)"""
        spec = inp.spec
        s, k1 = spec.verify_rows.shape
        if hidden.shape[0] <= s * k1:  # fewer query rows than row slots: the head on them all
            x, idx = head_logits(hidden), spec.verify_rows
        else:
            x, idx = head_logits(hidden[spec.verify_rows.reshape(-1)]), \
                jnp.arange(s * k1, dtype=jnp.int32).reshape(s, k1)
        # position 0 processes its logits as a plain step does
        first = logits_processing.apply(x[idx[:, 0]], inp.processing)
        return verify(x, idx, first, spec, inp.sampling, max_logprobs, inp.processing.min_p)

    # -------------------------------------------------------------------------------- compile

    def all_buckets(self) -> list[tuple[int, int, int]]:
        """(tokens, seqs, blocks) of every program: per token and blocks bucket, the seq bucket
        of a step within the decode slots and, where it differs, of one with held prefills."""
        tok, seq, blk = self.buckets
        slots = self.config.max_num_seqs
        return list(dict.fromkeys((t, seq_bucket(seq, t, n, slots), b)
                                  for t, b in itertools.product(tok, blk)
                                  for n in (slots, slots + 1)))

    def all_programs(self) -> list[Program]:
        """Every bucket without proposals, under speculation with K too, and with
        plain_programs the plain variant of each; the buckets a step of decodes alone pads to
        (tokens <= max_num_seqs) also with the decode loop's steps (plain with plain_programs:
        the scheduler then gives the loop only steps that qualify); with enable_lora, each of
        those with and without the adapters' updates."""
        ks = sorted({0, self.config.spec_tokens})
        programs = [Program(*b, k) for b in self.all_buckets() for k in ks]
        if self.plain_programs:
            programs += [Program(*b, 0, True) for b in self.all_buckets()]
        n = self.config.decode_loop_steps
        if n > 1:
            programs += [Program(*b, 0, self.plain_programs, n) for b in self.all_buckets()
                         if b[0] <= self.config.max_num_seqs]
        if self.lora_enabled:  # each also with the adapters' updates
            programs += [p._replace(lora=True) for p in programs]
        return programs

    def _unused_processing(self, s: int) -> logits_processing.LogitsInputs:
        """The neutral logit-processing inputs of sequence bucket `s`, kept on the device."""
        if s not in self._unused:
            self._unused[s] = jax.device_put(self.logits_shape.unused(s), self._replicated)
        return self._unused[s]

    def _dummy_inputs(self, program: Program, num_blocks: int | None = None) -> StepInputs:
        """`program`'s padding inputs, its ids within a pool of `num_blocks` pages (default:
        this runner's)."""
        return dummy_step_inputs(program.tokens, program.seqs, program.blocks, self.block_size,
                                 num_blocks or self.num_blocks, self.logits_shape,
                                 program.spec_k, program.plain, program.decode_steps,
                                 self.kv_layout.num_groups, program.lora)

    def _lower(self, program: Program) -> jax.stages.Lowered:
        inputs = self._dummy_inputs(program)
        if not self.deviceless:
            return self._jitted.lower(self.step_params, self.pools, self._last_tokens, inputs)
        inputs = abstract(inputs, self._replicated)
        # Triton-lowered Pallas kernels read their target from an abstract device
        target = self.devices[0]
        device = AbstractDevice(device_kind=target.device_kind,
                                num_cores=getattr(target, "core_count", None), platform="gpu")
        with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
            return self._jitted.lower(self.step_params, self.pools, self._last_tokens, inputs)

    def compile_program(self, program: Program) -> jax.stages.Compiled:
        """Lower and compile `program` afresh (no cache): a deviceless runner's way to see
        the programs the engine would run on its target."""
        return self._lower(program).compile(self.compiler_options)

    def _compile(self, program: Program) -> jax.stages.Compiled:
        if self.is_warm and self.config.strict_compile:
            raise RecompileError(f"program {program} (tokens, sequences, blocks, proposal "
                                 f"slots, decode steps) was not compiled at warmup")
        t0 = time.perf_counter()
        exe = self._cached(program)
        if exe is None:
            try:
                exe = self._build(program, self._lower(program))
            except memory_maps.MapLimitError:
                raise
            except Exception as e:  # noqa: BLE001 - the kernel's fault falls back once
                if not self._fall_back(program, e):
                    raise
                exe = self._cached(program) or self._build(program, self._lower(program))
        self.compile_seconds += time.perf_counter() - t0
        self._executables[program] = exe
        return exe

    def _cached(self, program: Program) -> jax.stages.Compiled | None:
        if self.executable_cache is None:
            return None
        return self.map_budget.run(self.executable_cache.load, program)

    def _build(self, program: Program,
               lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        self.num_compiles += 1
        if self.executable_cache is None:
            return self.map_budget.run(lowered.compile, self.compiler_options)
        return self.map_budget.run(self.executable_cache.compile, program, lowered,
                                   self.compiler_options)

    @property
    def num_loaded_executables(self) -> int:
        """Programs that came whole from the executable cache (no tracing, no lowering)."""
        return 0 if self.executable_cache is None else self.executable_cache.num_loaded

    def warmup(self) -> float:
        """Compile every program; returns seconds spent.

        Programs in the executable cache load whole. The rest are traced and lowered one by one
        (that holds the GIL); XLA's compiles, or loads from its compilation cache, run on a
        thread per core, since each mostly uses one."""
        t0 = time.perf_counter()
        try:
            self._build_missing()
        except _ProgramError as e:  # the kernel's fault falls back once, then builds all again
            if not self._fall_back(e.program, e.error):
                raise e.error from None
            self._build_missing()
        self.compile_seconds += time.perf_counter() - t0
        if self.host_pool is not None:
            self.pools = self.host_pool.warmup(self.pools)
        if self.lora_enabled:  # the slot writer compiles now: slot 1 written as it is
            self._put_lora(1, {p: {"a": w["a"][:, :, 0], "b": w["b"][:, 0]}
                               for p, w in self.params[LORA].items()})
        self.is_warm = True
        dt = time.perf_counter() - t0
        logger.info("warmup: %d programs in %.1fs (%d loaded whole from the executable cache)",
                    len(self._executables), dt, self.num_loaded_executables)
        return dt

    def _build_missing(self) -> None:
        """Load or build every program not built yet; a failure is raised as _ProgramError."""
        def build(program, lowered):
            try:
                return self._build(program, lowered)
            except memory_maps.MapLimitError:
                raise
            except Exception as e:  # noqa: BLE001 - raised again, naming the program
                raise _ProgramError(program, e) from e

        def ends_alone(pool, fn, *lists) -> list:
            """fn over the lists' items: the first and last (all_programs' plainest and its
            most complex variant) alone, then, once the memory maps they took say the rest
            fit (runtime/memory_maps.py), the rest on the pool."""
            n = len(lists[0])
            if n < 3:
                return [fn(*items) for items in zip(*lists, strict=True)]
            ends = [fn(*(x[i] for x in lists)) for i in (0, -1)]
            self.map_budget.check_remaining(n - 2)
            return [ends[0], *pool.map(fn, *(x[1:-1] for x in lists)), ends[1]]

        todo = []
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            missing = [p for p in self.all_programs() if p not in self._executables]
            for program, exe in zip(missing, ends_alone(pool, self._cached, missing),
                                    strict=True):
                if exe is None:
                    todo.append(program)
                else:
                    self._executables[program] = exe
            lowered = []
            for program in todo:
                try:
                    lowered.append(self._lower(program))
                except Exception as e:  # noqa: BLE001
                    raise _ProgramError(program, e) from e
            for program, exe in zip(todo, ends_alone(pool, build, todo, lowered), strict=True):
                self._executables[program] = exe

    def _fall_back(self, program: Program, error: Exception) -> bool:
        """`program` failed to build. If its attention kernel alone fails to build at its
        shapes and auto named a fallback not taken yet, switch to that backend (the programs
        built so far are dropped) and return True; else False."""
        fallback, failed = self.attention.fallback, self.attention_backend
        if fallback is None or failed == fallback:
            return False
        why = self._kernel_fails(program)
        if why is None:
            return False
        message = (f"attention_backend auto: the step program {program} failed to build with "
                   f"{failed!s} ({type(error).__name__}), whose kernel alone fails at its "
                   f"shapes ({why}); falling back to {fallback.value!r}")
        logger.warning("%s", message)
        warnings.warn(message, stacklevel=2)
        self._use_attention(fallback, registry.backend(fallback).fn())
        self._make_step()
        return True

    def _kernel_fails(self, program: Program) -> str | None:
        """Why the attention function alone fails to lower or compile at `program`'s shapes
        (all heads, one device), or None."""
        mc, md = self.model_config, self._dummy_inputs(program).attn
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
        q = jax.ShapeDtypeStruct((md.positions.shape[0], mc.num_heads, mc.head_dim), self.dtype)
        try:
            jax.jit(self._attention_fn).lower(q, spec(self.kv.k), spec(self.kv.v),
                                              jax.ShapeDtypeStruct((), jnp.int32),
                                              jax.tree.map(spec, md)).compile()
        except Exception as e:  # noqa: BLE001 - the answer, not an error
            return describe_error(e, 200)
        return None

    # ----------------------------------------------------------------------------------- swap

    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.host_pool.swap_out(self.pools, device_ids, host_ids)

    def swap_in(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.pools = self.host_pool.swap_in(self.pools, device_ids, host_ids)

    def flush_host_copies(self) -> None:
        if self.host_pool is not None:
            self.host_pool.flush()

    # -------------------------------------------------------------------------------- execute

    def dispatch(self, inp: StepInputs) -> StepResult:
        """Launch one step; returns its device output without waiting for it."""
        if self.broadcast is None:
            return self._launch(inp)
        try:  # the leader of several processes: they all run it, from the same inputs
            self.broadcast.send_step(inp)
            return self._launch(inp)
        except Exception as e:  # noqa: BLE001 - the processes cannot run on out of step
            distributed.fatal("a step", e)

    def _launch(self, inp: StepInputs) -> StepResult:
        exe = self._executables.get(inp.program) or self._compile(inp.program)
        if not inp.processing.active:  # the unused arrays stay on the device: none to copy
            inp = dataclasses.replace(inp, processing=self._unused_processing(inp.bucket[1]))
        self.pools, out, self._last_tokens = exe(self.step_params, self.pools,
                                                 self._last_tokens, inp)
        return out

    def fetch(self, step: StepResult, want_logprobs: bool,
              want_prompt_logprobs: bool = False, want_pooled: bool = False) -> StepOutput:
        """Wait for a dispatched step and bring its tokens (and logprobs if asked) to the host.
        The outputs are replicated: this process's first copy is the whole of each."""
        try:
            host = lambda x: np.asarray(x.addressable_data(0))
            out = step.sampled
            result = StepOutput(host(out.tokens), host(out.num_tokens))
            if want_logprobs:
                result.logprobs = host(out.logprobs)
                result.top_ids = host(out.top_ids)
                result.top_logprobs = host(out.top_logprobs)
            if want_prompt_logprobs:
                result.prompt = jax.tree.map(host, step.prompt)
            if want_pooled:
                result.pooled = jax.tree.map(host, step.pooled)
            return result
        except Exception as e:  # noqa: BLE001
            if self.multiprocess:
                distributed.fatal("reading a step's tokens", e)
            raise

    def execute(self, inp: StepInputs) -> StepOutput:
        """dispatch + fetch: one synchronous step."""
        return self.fetch(self.dispatch(inp), bool(inp.sampling.want_logprobs),
                          bool((inp.prompt_targets >= 0).any()))

    # --------------------------------------------------------------------- several processes

    def keepalive(self) -> None:
        """The leader, idle: a no-op now and then keeps the followers' wait short-lived and
        tells each side at once when the other is gone."""
        if self.broadcast is not None:
            try:
                self.broadcast.keepalive()
            except Exception as e:  # noqa: BLE001
                distributed.fatal("the idle heartbeat", e)

    def stop_followers(self) -> None:
        if self.broadcast is not None:
            self.broadcast.send(distributed.STOP)

    def follow(self) -> None:
        """A follower's life: run the leader's steps, in its order, until it stops."""
        while True:
            try:
                op, inp = self.broadcast.receive()
                if op == distributed.STOP:
                    return
                if op == distributed.STEP:
                    self._launch(inp)
                    self._last_tokens.block_until_ready()  # errors surface here, not later
            except Exception as e:  # noqa: BLE001
                distributed.fatal("following process 0's steps", e)
