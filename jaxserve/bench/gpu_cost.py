"""What a step program costs on a GPU, read from its compiled form on a machine without one.

XLA:GPU compiles for a target description (jax.experimental.topologies) with no device: the
optimized HLO and the launch list (the thunk sequence XLA dumps, with the command buffers,
i.e. CUDA graphs, it built) are the program a GPU would run. From them:

- **launches**: kernels (and copies, library calls) per call, loop bodies times their trip
  counts, split into those inside command buffers and those launched one by one; the command
  buffers run; the host syncs (a while loop outside a graph reads its condition back at every
  trip, a conditional its predicate).
- **HBM bytes**: each kernel's operands and results, once per run. A fusion's parameter that
  it only slices or gathers from is charged what it takes; an in-place update (a scatter or
  dynamic-update-slice root) the update it writes; a custom call (the attention kernel) its
  operands, the KV pool charged the pages the step's context reads. Left out: caches (L2
  hits count as HBM traffic), re-reads inside a kernel (a matmul's tiles), and the bytes of
  work a loop skips (an early-exiting loop counts every trip).
- **collectives** (tensor parallelism): each all-reduce, all-gather, reduce-scatter,
  all-to-all or collective permute per call, loop bodies times their trips, with the bytes of
  its result; in the launch list, whether it sits in a command buffer.
- **floor**: the weights read once plus the KV the step's context reads, once.
- **predicted**: bytes at the target's bandwidth, plus stated costs for each launch outside a
  graph, each graph launched and each host sync, plus the collectives: a ring moves 2(n-1)/n of
  an all-reduce's bytes over each device's link ((n-1)/n of the others'), at LINK_BANDWIDTH,
  plus COLLECTIVE_US each. A model, not a measurement.

Under tensor parallelism every figure is one device's: the partitioned program's shapes.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import pathlib
import re
import sys
from collections import defaultdict

from jaxserve.bench.op_count import BRANCHES, CALLS, FREE, TRIPS, Instr, parse_hlo

# Per-event costs of the prediction (microseconds): issuing one kernel outside a graph, one
# graph launch, one round trip to read a predicate back. Rough Hopper figures, to calibrate.
LAUNCH_US = 3.0
GRAPH_US = 5.0
SYNC_US = 10.0
# A collective's fixed cost (microseconds) and the bytes per second each device's link moves
# one way: NVLink 4 on H100/H200 (450 GB/s each way).
COLLECTIVE_US = 8.0
LINK_BANDWIDTH = 450e9
# opcode -> the share of its result's bytes a ring moves over each link, times n / (n - 1)
COLLECTIVES = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0,
               "collective-permute": 1.0}

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "token": 0}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# op_count's, and the halves of async pairs whose start is charged
_FREE = FREE | {"async-done", "copy-done", "add-dependency", "iota"}
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # root opcode -> its update operand


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def tuple_elements(shape: str) -> list[str]:
    """A tuple shape's element shapes, "(a, /*index=1*/b, (c, d))" -> ["a", "b", "(c, d)"]."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape.strip())
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(shape[start:i].strip())
            start = i + 1
    return [x for x in parts if x]


@dataclasses.dataclass
class KernelCost:
    name: str  # the source op it came from, layer indices as *: one row for every layer's
    opcode: str
    runs: int
    bytes: int  # per call of the program, all runs


_OP_NAME = re.compile(r'op_name="(?:jit\([^)]*\)/)?([^"]*)"')


def source_op(ins: Instr) -> str:
    """The JAX source op an instruction came from (its op_name), layer indices as *."""
    m = _OP_NAME.search(ins.attrs)
    name = m.group(1) if m else ins.name
    return re.sub(r"layers_\d+", "layers_*", name)


class HloBytes:
    """HBM bytes of one compiled program (the module docstring's model). `pool_shape`: the KV
    pool's HLO dims, whose operands of a custom call are charged `kv_read` bytes each."""

    def __init__(self, hlo: str, pool_dims: tuple[int, ...] | None = None, kv_read: int = 0):
        self.comps, self.entry = parse_hlo(hlo)
        self.shapes = {i.name: i.shape for c in self.comps.values() for i in c}
        for name in {o for c in self.comps.values() for i in c for o in i.operands if "#" in o}:
            base, index = name.rsplit("#", 1)  # element `index` of tuple `base`
            elements = tuple_elements(self.shapes.get(base, ""))
            if index.isdigit() and int(index) < len(elements):
                self.shapes[name] = elements[int(index)]
        self.pool = None if pool_dims is None else ",".join(map(str, pool_dims))
        self.kv_read = kv_read
        self.kernels: dict[str, KernelCost] = {}
        self.conditionals = 0
        self.collectives: dict[str, KernelCost] = {}  # by collective opcode: runs, result bytes
        self._walk(self.entry, 1)

    @property
    def total(self) -> int:
        return sum(k.bytes for k in self.kernels.values())

    def top(self, n: int = 8) -> list[KernelCost]:
        """The `n` costliest source ops, each summed over its kernels."""
        grouped: dict[tuple[str, str], KernelCost] = {}
        for k in self.kernels.values():
            g = grouped.setdefault((k.name, k.opcode), KernelCost(k.name, k.opcode, 0, 0))
            g.runs += k.runs
            g.bytes += k.bytes
        return sorted(grouped.values(), key=lambda k: -k.bytes)[:n]

    def _walk(self, comp: str, times: int) -> None:
        for ins in self.comps.get(comp, ()):
            called = dict(CALLS.findall(ins.attrs))
            if ins.opcode == "while":
                trips = TRIPS.search(ins.attrs)
                n = int(trips.group(1)) if trips else 1
                self._walk(called["body"], times * n)
                self._walk(called["condition"], times * (n + 1))
            elif ins.opcode == "conditional":
                self.conditionals += times
                names = [c.strip().lstrip("%") for g in BRANCHES.findall(ins.attrs)
                         for c in g.split(",")] or [called.get("true_computation"),
                                                    called.get("false_computation")]
                costs = []
                for name in names:  # the costliest branch, each tried on a clean slate
                    kept = self.kernels, self.conditionals
                    self.kernels = {}
                    self._walk(name, times)
                    costs.append((self.total, name))
                    self.kernels, self.conditionals = kept
                if costs:
                    self._walk(max(costs)[1], times)
            elif ins.opcode in ("call", "async-start", "copy-start") and "calls" in called \
                    or ins.opcode == "call":
                self._walk(called.get("calls") or called.get("to_apply"), times)
            elif ins.opcode not in _FREE:
                self._count_collective(ins, times)
                self._charge(ins, times)

    def _count_collective(self, ins: Instr, times: int) -> None:
        """Count `ins` if it is a collective, or a fusion around one (XLA:GPU wraps them)."""
        if ins.opcode == "fusion":
            for inner in self.comps.get(dict(CALLS.findall(ins.attrs)).get("calls", ""), ()):
                self._count_collective(inner, times)
            return
        kind = ins.opcode.removesuffix("-start")
        if kind in COLLECTIVES:
            c = self.collectives.setdefault(kind, KernelCost(kind, kind, 0, 0))
            c.runs += times
            c.bytes += times * array_bytes(tuple_elements(ins.shape)[-1]
                                           if ins.opcode.endswith("-start") else ins.shape)

    def collective_ms(self, devices: int) -> float:
        """The collectives' time per call: ring traffic at LINK_BANDWIDTH plus COLLECTIVE_US
        each (0 on one device)."""
        if devices < 2:
            return 0.0
        share = (devices - 1) / devices
        moved = sum(COLLECTIVES[k] * share * c.bytes for k, c in self.collectives.items())
        runs = sum(c.runs for c in self.collectives.values())
        return (moved / LINK_BANDWIDTH + runs * COLLECTIVE_US * 1e-6) * 1e3

    def _charge(self, ins: Instr, times: int) -> None:
        ops = [self.shapes.get(o, "") for o in ins.operands]
        if ins.opcode == "fusion":
            b = self._fusion_bytes(ins, ops)
        elif ins.opcode == "custom-call":
            b = sum(self.kv_read if self._is_pool(s) else array_bytes(s) for s in ops) \
                + array_bytes(ins.shape)
        elif ins.opcode in _IN_PLACE:
            b = 2 * array_bytes(ops[_IN_PLACE[ins.opcode]])
        elif ins.opcode in _SLICING:
            b = 2 * array_bytes(ins.shape)
        else:
            b = sum(map(array_bytes, ops)) + array_bytes(ins.shape)
        k = self.kernels.setdefault(ins.name, KernelCost(source_op(ins), ins.opcode, 0, 0))
        k.runs += times
        k.bytes += b * times

    def _is_pool(self, shape: str) -> bool:
        m = _ARRAY.search(shape)
        return self.pool is not None and m is not None and m.group(2) == self.pool

    def _fusion_bytes(self, ins: Instr, ops: list[str]) -> int:
        body = self.comps.get(dict(CALLS.findall(ins.attrs)).get("calls", ""), [])
        by_name = {i.name: i for i in body}
        params = {int(i.args): i.name for i in body if i.opcode == "parameter"}
        users = defaultdict(list)
        for i in body:
            for pos, o in enumerate(i.operands):
                users[o].append((i, pos))
        root = next((i for i in body if i.root), None)
        roots = [by_name[o] for o in root.operands] if root and root.opcode == "tuple" else [root]
        in_place = {}  # name of the updated buffer inside -> bytes of the update
        out = 0
        for r in roots:
            while r is not None and r.opcode == "bitcast":
                r = by_name.get(r.operands[0])
            if r is not None and r.opcode in _IN_PLACE:
                upd = array_bytes(by_name[r.operands[_IN_PLACE[r.opcode]]].shape)
                in_place[r.operands[0]] = upd
                out += upd
            elif r is not None:
                out += array_bytes(r.shape)
        total = out
        for idx, shape in enumerate(ops):
            p = params.get(idx)
            if p in in_place:
                continue  # updated where it lies: the update is charged above
            uses = users.get(p, [])
            if uses and all(u.opcode in _SLICING and pos == 0 for u, pos in uses):
                total += sum(array_bytes(u.shape) for u, _ in uses)
            else:
                total += array_bytes(shape)
        return total


# ------------------------------------------------------------------------------ launch list

_THUNK = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_COLLECTIVE_THUNK = re.compile(r"(AllReduce|AllGather|ReduceScatter|AllToAll|CollectivePermute"
                               r"|CollectiveKernel|Ragged\w*)(Start)?$")
_STRUCTURE = frozenset({"kWhile", "kConditional", "kCommandBuffer", "kSequential",
                        "kAsyncStart", "kAsyncDone", "kDynamicSliceFusion", "kWaitForStreams",
                        "kRecordEvent", "kWaitEvent"})


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    text: str
    depth: int
    children: list[Thunk] = dataclasses.field(default_factory=list)
    part: str = ""  # "condition", "body" or a branch, inside a kWhile or kConditional


def parse_thunks(text: str) -> list[Thunk]:
    """A dumped thunk sequence -> its top-level thunks, nested by indentation."""
    top: list[Thunk] = []
    stack: list[Thunk] = []
    part = ""
    for line in text.splitlines():
        m = _THUNK.match(line)
        if not m:
            if line.strip().endswith(":"):
                part = line.strip()[:-1]
            continue
        t = Thunk(int(m.group(2)), m.group(3), m.group(4), len(m.group(1)))
        while stack and stack[-1].depth >= t.depth:
            stack.pop()
        if stack:
            t.part = part if stack[-1].kind in ("kWhile", "kConditional") else ""
            stack[-1].children.append(t)
        else:
            top.append(t)
        stack.append(t)
    return top


@dataclasses.dataclass
class Launches:
    in_graphs: int = 0
    outside: int = 0
    graphs: int = 0
    host_syncs: int = 0
    collectives_in_graphs: int = 0  # of the launches, collectives (their start halves)
    collectives_outside: int = 0

    @property
    def total(self) -> int:
        return self.in_graphs + self.outside


def count_launches(thunks: list[Thunk], trips: dict[int, int]) -> Launches:
    """Launches per call; `trips`: a kWhile thunk's id -> its trip count (default 1)."""
    out = Launches()

    def walk(ts: list[Thunk], times: int, graph: bool) -> None:
        for t in ts:
            if t.kind == "kWhile":
                n = trips.get(t.id, 1)
                if not graph:
                    out.host_syncs += times * (n + 1)
                for part, k in (("condition", n + 1), ("body", n)):
                    walk([c for c in t.children if c.part == part], times * k, graph)
            elif t.kind == "kConditional":
                if not graph:
                    out.host_syncs += times
                branches = defaultdict(list)
                for c in t.children:
                    branches[c.part].append(c)
                costs = [(_size(b), part) for part, b in branches.items()]
                if costs:
                    walk(branches[max(costs)[1]], times, graph)
            elif t.kind == "kCommandBuffer":
                out.graphs += times
                walk(t.children, times, True)
            elif t.kind in _STRUCTURE:
                walk(t.children, times, graph)
            elif graph:
                out.in_graphs += times
                out.collectives_in_graphs += times * bool(_COLLECTIVE_THUNK.search(t.kind))
            else:
                out.outside += times
                out.collectives_outside += times * bool(_COLLECTIVE_THUNK.search(t.kind))

    walk(thunks, 1, False)
    return out


def _size(ts: list[Thunk]) -> int:
    return sum(1 + _size(t.children) for t in ts)


def while_trips(metadata: str, hlo: str) -> dict[int, int]:
    """kWhile thunk id -> the known trip count of the HLO while it runs."""
    known = {}
    for ins in (i for c in parse_hlo(hlo)[0].values() for i in c if i.opcode == "while"):
        m = TRIPS.search(ins.attrs)
        if m:
            known[ins.name] = int(m.group(1))
    trips = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        name = re.search(r'profile_annotation:\s*"([^"]+)"', block)
        tid = re.search(r"thunk_id:\s*(\d+)", block)
        if name and tid and '"kWhile"' in block and name.group(1) in known:
            trips[int(tid.group(1))] = known[name.group(1)]
    return trips


def dumped_module(dump_dir: str, before: set[str]) -> dict[str, str]:
    """The files a compile just dumped into `dump_dir` (those not in `before`): {"thunks",
    "metadata", "hlo"} -> text, for the one module with a thunk sequence among them."""
    new = sorted(set(glob.glob(os.path.join(dump_dir, "*"))) - before)
    seqs = [f for f in new if f.endswith("thunk_sequence_after_thunk_passes.txt")] or \
        [f for f in new if f.endswith("thunk_sequence.txt")]
    if not seqs:
        raise RuntimeError(f"the compile dumped no thunk sequence into {dump_dir}")
    prefix = seqs[-1].split(".thunk_sequence")[0]
    hlo = [f for f in new if f.startswith(prefix) and f.endswith("gpu_after_optimizations.txt")]
    read = lambda p: pathlib.Path(p).read_text()  # noqa: E731
    return {"thunks": read(seqs[-1]), "metadata": read(prefix + ".thunk_metadata.txt"),
            "hlo": read(hlo[0]) if hlo else ""}


# ------------------------------------------------------------------------------ the report

# Model shapes, as config.json fields of a Llama: the default model and Llama-3.1-8B.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
                  tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
MODELS = {"smollm2-135m": SMOLLM2, "llama-3.1-8b": LLAMA31_8B}


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One program of the report: `sequences` real rows at context `context`, of which
    `prefill` more tokens belong to one prompt chunk (a mixed step), `decode_steps` per call;
    `lora`: with the LoRA adapters' updates (a runner with enable_lora)."""

    name: str
    sequences: int
    context: int
    prefill: int = 0
    decode_steps: int = 1
    lora: bool = False


def default_programs(context: int, most: int = 256) -> list[ProgramSpec]:
    """Decode at 1, 64 and `most` sequences, the decode loop at `most`, and a mixed step of
    `most` decodes and one prompt chunk of `most` tokens."""
    return [ProgramSpec(f"decode-{s}", s, context) for s in sorted({1, 64, most})] + [
        ProgramSpec(f"decode-loop-{most}", most, context, decode_steps=8),
        ProgramSpec(f"mixed-{most}+{most}", most, context, prefill=most)]


def abstract_model(preset: dict):
    """A LoadedModel of `preset`'s shapes whose params are ShapeDtypeStructs (nothing is
    allocated): the loader's tree, as the model's own init lays it out."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.attention.metadata import AttentionMetadata
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.llama import Transformer
    from jaxserve.models.loader import LoadedModel

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **preset})
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(1), i32(1), i32(1), i32(1, 1), i32(1), i32(2))
    pages = jax.ShapeDtypeStruct((cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim),
                                 jnp.float32)
    params = jax.eval_shape(lambda k, v: Transformer(cfg).init(
        jax.random.key(0), i32(1), k, v, md, None), pages, pages)["params"]
    return LoadedModel(cfg, params, None, f"(shapes of {preset})")


def setup_compiler(plugin_dir: str, dump_dir: str) -> None:
    """Before JAX starts: the CPU as JAX's platform (the CUDA plugin registers only its
    compiler, no device), the plugin's folder on the path, XLA dumping each compile's launch
    list into `dump_dir`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={dump_dir} "
                               "--xla_dump_hlo_as_text").strip()
    if os.path.isdir(plugin_dir):
        sys.path.insert(0, plugin_dir)


def target_devices(target: str, count: int = 1) -> list:
    """`count` compile-only devices of a GPU target description (a path to a .txtpb), as
    one machine's GPUs."""
    from jax.experimental import topologies

    with open(target) as f:
        topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(),
                                            topology=f"1x1x{count}")
    return list(topo.devices)


def target_device(target: str):
    """The compile-only device of a GPU target description (a path to a .txtpb)."""
    return target_devices(target)[0]


def _field(target: str, name: str) -> float:
    m = re.search(rf"{name}:\s*(\d+)", pathlib.Path(target).read_text())
    if m is None:
        raise ValueError(f"{target}: no {name} field")
    return float(m.group(1))


def bandwidth_of(target: str) -> float:
    """HBM bytes per second of a target description."""
    return _field(target, "memory_bandwidth")


def memory_of(target: str) -> int:
    """Device memory bytes of a target description."""
    return int(_field(target, "device_memory_size"))


def preset_of_config(path: str) -> dict:
    """The fields of an HF config.json (`path`: the file or its directory) as a preset."""
    import json

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def deviceless_runner(preset: dict, device, programs: list[ProgramSpec], loaded=None,
                      **engine):
    """The engine's ModelRunner for `preset` (or the abstract LoadedModel `loaded`) on
    compile-only `device` (or a list of them: one per tensor-parallel rank), at the
    accelerator defaults except what `engine` (EngineConfig
    fields) says, with a pool that holds every program's sequences at its context."""
    from jaxserve.config import EngineConfig
    from jaxserve.runtime.runner import ModelRunner

    devices = list(device) if isinstance(device, (list, tuple)) else [device]
    most = max(p.sequences for p in programs)
    context = max(p.context for p in programs)
    block = engine.get("block_size", 16)
    kw = dict(max_num_seqs=most, max_num_batched_tokens=max(512, 2 * most),
              attention_backend="mosaic", num_kv_blocks=(most + 1) * -(-context // block) + 64,
              compilation_cache_dir="", tensor_parallel_size=len(devices)) | engine
    config = EngineConfig(**kw).on_platform("gpu")
    return ModelRunner(config, loaded or abstract_model(preset), devices, deviceless=True)


def program_of(runner, spec: ProgramSpec):
    """The engine's Program for `spec` (greedy rows: plain where the engine has plain ones)."""
    from jaxserve.core.scheduler import pick_bucket
    from jaxserve.runtime.step_inputs import Program, seq_bucket

    tok, seq, blk = runner.buckets
    tokens = pick_bucket(tok, spec.sequences + spec.prefill, "tokens")
    seqs = seq_bucket(seq, tokens, spec.sequences + bool(spec.prefill),
                      runner.config.max_num_seqs)
    blocks = pick_bucket(blk, -(-spec.context // runner.block_size), "blocks")
    return Program(tokens, seqs, blocks, 0, runner.plain_programs, spec.decode_steps,
                   spec.lora)


def weight_bytes(runner, lora: bool = False) -> int:
    """Bytes of the weights a step reads whole, on one device: all but an untied embedding,
    of which a step gathers its tokens' rows alone, and the LoRA slots but where `lora`."""
    from jaxserve.models.llama import LORA
    from jaxserve.runtime.sharding import bytes_per_device

    params = dict(runner.params)
    if not runner.model_config.tie_word_embeddings:
        params.pop("embed")
    if not lora:
        params.pop(LORA, None)
    return bytes_per_device(params)


def kv_read_bytes(runner, sequences: int, context: int) -> int:
    """K or V bytes of one layer that `sequences` rows at `context` read (whole blocks), on
    one device (its kv heads)."""
    mc = runner.model_config
    tokens = -(-context // runner.block_size) * runner.block_size
    heads = mc.num_kv_heads // runner.tensor_parallel_size
    return sequences * tokens * heads * mc.head_dim * runner.kv_dtype.itemsize


def memory_plan(runner, target: str, temporaries: int, utilization: float = 0.9):
    """The engine's memory plan (runtime/memory_plan.py) on `target`'s device: its memory
    at `utilization` (vLLM's default 0.9) less the weights and `temporaries` (the largest
    compiled program's), the rest as KV blocks of max_model_len sequences."""
    from jaxserve.runtime import memory_plan as mp

    own = runner.memory_plan  # the runner's weights and block, per device
    return mp.from_device(memory_of(target), utilization, own.weights_bytes, temporaries,
                          own.block_bytes, own.block_size, own.max_model_len)


def cost_program(runner, spec: ProgramSpec, dump_dir: str, bandwidth: float) -> dict:
    """Compile `spec`'s program and read its cost (the module docstring's model), per
    decode step (a decode loop's call divided by its steps)."""
    import time

    program = program_of(runner, spec)
    before = set(glob.glob(os.path.join(dump_dir, "*")))
    t0 = time.perf_counter()
    compiled = runner.compile_program(program)
    compile_s = time.perf_counter() - t0
    files = dumped_module(dump_dir, before)
    for path in set(glob.glob(os.path.join(dump_dir, "*"))) - before:
        os.remove(path)  # an 8B's dumps run to hundreds of MB
    launches = count_launches(parse_thunks(files["thunks"]),
                              while_trips(files["metadata"], files["hlo"]))
    mc = runner.model_config
    rows = spec.sequences + bool(spec.prefill)
    read = kv_read_bytes(runner, rows, spec.context)
    pool = runner.kv.k
    hlo = HloBytes(files["hlo"], pool.sharding.shard_shape(pool.shape), read)
    n = spec.decode_steps
    floor = weight_bytes(runner, spec.lora) + 2 * mc.num_layers * read
    per = lambda x: x / n  # noqa: E731
    hbm = per(hlo.total)
    outside, graphs, syncs = per(launches.outside), per(launches.graphs), per(launches.host_syncs)
    collective_ms = per(hlo.collective_ms(runner.tensor_parallel_size))
    overhead_ms = (outside * LAUNCH_US + graphs * GRAPH_US + syncs * SYNC_US) / 1e3 \
        + collective_ms
    return {
        "name": spec.name, "sequences": spec.sequences, "context": spec.context,
        "prefill_tokens": spec.prefill, "decode_steps": n, "program": list(program),
        "compile_s": round(compile_s, 2),
        "launches": round(per(launches.total), 1),
        "launches_in_graphs": round(per(launches.in_graphs), 1),
        "launches_outside_graphs": round(outside, 1), "graphs": round(graphs, 1),
        "host_syncs": round(syncs, 1), "conditionals": round(per(hlo.conditionals), 1),
        "hbm_bytes": int(hbm), "floor_bytes": int(floor),
        "bytes_ms": round(hbm / bandwidth * 1e3, 4), "overhead_ms": round(overhead_ms, 4),
        "predicted_ms": round(hbm / bandwidth * 1e3 + overhead_ms, 4),
        "floor_ms": round(floor / bandwidth * 1e3, 4),
        "temporaries_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "collectives": round(per(sum(c.runs for c in hlo.collectives.values())), 1),
        "collective_bytes": int(per(sum(c.bytes for c in hlo.collectives.values()))),
        "collectives_by_kind": {k: round(per(c.runs), 1) for k, c in hlo.collectives.items()},
        "collectives_in_graphs": round(per(launches.collectives_in_graphs), 1),
        "collectives_outside_graphs": round(per(launches.collectives_outside), 1),
        "collective_ms": round(collective_ms, 4),
        "top_kernels": [{"name": k.name, "opcode": k.opcode, "runs": round(per(k.runs), 1),
                         "bytes": int(per(k.bytes))} for k in hlo.top(10)],
    }


# What the default model's decode step at 256 sequences, alone or in the decode loop, may cost
# per step (CI holds it there): a change that adds launches outside a graph, host syncs or
# bytes fails.
BOUNDS = {"launches_outside_graphs": 10, "host_syncs": 0, "conditionals": 0,
          "launches": 580, "floor_ratio": 1.45, "predicted_ms": 1.0}


def check_bounds(program: dict, bounds: dict = BOUNDS) -> list[str]:
    """The bounds `program` (a cost_program row) breaks, each as a sentence; [] when none."""
    got = dict(program, floor_ratio=program["hbm_bytes"] / program["floor_bytes"])
    return [f"{name} {got[name]:g} > {limit:g}" for name, limit in bounds.items()
            if got[name] > limit]


# ------------------------------------------------------------------------------ GGUF blocks

# The contraction axis of each layer projection in the loader's stacked tree (layer axis 0):
# the axis its GGUF blocks run along (models/loader.py hf_to_params).
GGUF_BLOCK_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# Per kept type, the GPU form kernels/gpu_matmul.py's gpu_form makes of its blocks: codes
# ("g8" int8, "g4" nibbles in int8 (signed) or uint8 bytes), the scale's dtype, the minimum's
# (None: every minimum 0, no plane).
GGUF_GPU_FORMS = {"Q8_0": ("g8", "int8", "float16", None),
                  "Q4_0": ("g4", "int8", "float16", None),
                  "Q4_1": ("g4", "uint8", "float16", "float16"),
                  "Q5_0": ("g8", "int8", "float16", None),
                  "Q5_1": ("g8", "int8", "float16", "float16"),
                  "Q4_K": ("g4", "uint8", "float32", "float32"),
                  "Q5_K": ("g8", "int8", "float32", "float32"),
                  "Q6_K": ("g8", "int8", "float32", None)}


def abstract_gguf(params: dict, type_name: str, form: str = "loader") -> dict:
    """`params` (abstract_model's tree) as a GGUF file whose layer projections are all of
    `type_name` (a kernels/quant.py KEPT_TYPES member) gives it: each of them in blocks of 32
    (16 for Q6_K) along its contraction axis, as ShapeDtypeStructs; the rest as it was.
    `form`: "loader", the loader's int8 form {"q", "scale", "min"} (float32 planes); "gpu",
    the form the runner gives those on a GPU (kernels/gpu_matmul.py, planes (L, K, N)), which
    it cannot make of shapes alone."""
    import jax
    import jax.numpy as jnp

    if type_name not in GGUF_GPU_FORMS:
        raise ValueError(f"type_name: {type_name!r} is not one of {sorted(GGUF_GPU_FORMS)}")
    if form not in ("loader", "gpu"):
        raise ValueError(f"form: {form!r} is neither 'loader' nor 'gpu'")
    block = 16 if type_name == "Q6_K" else 32
    codes, code_dtype, scale_dtype, min_dtype = GGUF_GPU_FORMS[type_name]

    def blocks(w, axis: int) -> dict:
        struct = jax.ShapeDtypeStruct
        if form == "loader":
            short = list(w.shape)
            short[axis] //= block
            plane = struct(tuple(short), jnp.float32)
            return {"q": struct(w.shape, jnp.int8), "scale": plane, "min": plane}
        k, n = math.prod(w.shape[1:axis + 1]), math.prod(w.shape[axis + 1:])
        rows = k // 2 if codes == "g4" else k
        out = {codes: struct((w.shape[0], rows, n), code_dtype),
               "scale": struct((w.shape[0], k // block, n), scale_dtype)}
        if min_dtype is not None:
            out["min"] = struct((w.shape[0], k // block, n), min_dtype)
        return out

    layers = {k: blocks(w, GGUF_BLOCK_AXES[k]) if k in GGUF_BLOCK_AXES else w
              for k, w in params["layers"].items()}
    return {**params, "layers": layers}


def cost_gguf(preset: dict, type_name: str, form: str, device, spec: ProgramSpec,
              dump_dir: str, bandwidth: float, **engine) -> dict:
    """cost_program of `spec` for `preset` with its layer projections in `type_name`'s
    blocks, in `form` (abstract_gguf's), or in bfloat16 where type_name is "bf16"."""
    loaded = abstract_model(preset)
    if type_name != "bf16":
        loaded = dataclasses.replace(loaded, params=abstract_gguf(loaded.params, type_name,
                                                                  form))
    runner = deviceless_runner(preset, device, [spec], loaded=loaded, **engine)
    return cost_program(runner, spec, dump_dir, bandwidth)
