"""The launch-list and HBM-bytes readers of jaxserve/bench/gpu_cost.py, on texts in the forms
XLA:GPU dumps (the whole path, compiled for an H200, is tests/scripts/test_gpu_cost.py), and
a compiled decode step on GGUF blocks against bfloat16's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.bench.gpu_cost import (
    COLLECTIVE_US,
    LINK_BANDWIDTH,
    HloBytes,
    array_bytes,
    check_bounds,
    count_launches,
    parse_thunks,
    tuple_elements,
    while_trips,
)

THUNKS = """\
001: kCustomKernel  [source | next=002 (1)] loop_broadcast_fusion grid: [2, 1, 1]
002: kWhile         [prev=001 (1) | next=000 (1)]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    004: kAsyncStart    [source | next=000 (6) ] stream=computation_stream[3], async_id=7
        006: kDynamicSliceFusion [source | sink] params=1, results=1
            005: kCopy [source | sink] kCopy
    000: kCommandBuffer [source | next=000 (2) ]
        007: kCustomKernel [source | next=008 (1)] loop_select_fusion grid: [2, 1, 1]
        008: kCustomCall   [prev=007 (1) | sink] kCustomCall
    009: kAsyncDone     [source | sink ] async_id=7
    010: kCustomKernel  [prev=000 (2) | sink ] gemm_fusion_dot grid: [7680, 1, 1]
000: kCommandBuffer [prev=002 (1) | sink ]
    011: kCustomKernel [source | sink] loop_add_fusion grid: [18, 1, 1]
"""
METADATA = """thunk_metadata {
  thunk_info {
    profile_annotation: "while.2"
    thunk_id: 2
  }
  thunk_kind: "kWhile"
}
"""


def test_launches_count_loop_trips_graphs_and_syncs():
    hlo = ('  %while.2 = (s32[]) while(%t), condition=%c, body=%b, '
           'backend_config={"known_trip_count":{"n":"30"}}\n')
    trips = while_trips(METADATA, "ENTRY %main {\n" + hlo + "}\n")
    assert trips == {2: 30}
    got = count_launches(parse_thunks(THUNKS), trips)
    # outside: the broadcast, the 31 condition checks, 30 x (copy + gemm); in graphs: 30 x 2
    # in the body's buffer and the last one's add
    assert got.outside == 1 + 31 + 30 * 2
    assert got.in_graphs == 30 * 2 + 1
    assert got.graphs == 31 and got.host_syncs == 31
    assert got.total == got.in_graphs + got.outside
    assert count_launches(parse_thunks(THUNKS), {}).outside == 1 + 2 + 2  # one trip, unknown


HLO = """\
%fused_update (p0: bf16[30,100,16,64], p1: bf16[8,64], p2: s32[]) -> bf16[30,100,16,64] {
  %p0 = bf16[30,100,16,64]{3,2,1,0} parameter(0)
  %p1 = bf16[8,64]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %b = bf16[1,1,8,64]{3,2,1,0} bitcast(%p1)
  ROOT %dus = bf16[30,100,16,64]{3,2,1,0} dynamic-update-slice(%p0, %b, %p2, %p2, %p2, %p2)
}

%fused_slice (p0.1: bf16[30,576,64], p1.1: s32[]) -> bf16[1,576,64] {
  %p0.1 = bf16[30,576,64]{2,1,0} parameter(0)
  %p1.1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,576,64]{2,1,0} dynamic-slice(%p0.1, %p1.1, %z, %z), dynamic_slice_sizes={1,576,64}
}

ENTRY %main (pool: bf16[30,100,16,64], w: bf16[30,576,64], u: bf16[8,64], i: s32[]) -> bf16[30,100,16,64] {
  %pool = bf16[30,100,16,64]{3,2,1,0} parameter(0)
  %w = bf16[30,576,64]{2,1,0} parameter(1)
  %u = bf16[8,64]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %slice = bf16[1,576,64]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/forward/layers_3/dynamic_slice"}
  %update = bf16[30,100,16,64]{3,2,1,0} fusion(%pool, %u, %i), kind=kLoop, calls=%fused_update
  %attn = bf16[8,64]{1,0} custom-call(%u, %pool, %pool), custom_call_target="mosaic_gpu"
  ROOT %t = (bf16[30,100,16,64]{3,2,1,0}, bf16[1,576,64]{2,1,0}) tuple(%update, %slice)
}
"""  # noqa: E501  (HLO lines as XLA writes them)


def test_hbm_bytes_charge_slices_updates_and_the_pool_read():
    assert array_bytes("(bf16[8,64]{1,0}, f32[2]{0}, s32[])") == 8 * 64 * 2 + 8 + 4
    hb = HloBytes(HLO, (30, 100, 16, 64), kv_read=1000)
    by = {k.opcode + ":" + k.name: k.bytes for k in hb.kernels.values()}
    layer = 576 * 64 * 2
    assert by["fusion:forward/layers_*/dynamic_slice"] == 2 * layer + 4  # read, written, index
    update = next(b for k, b in by.items() if k.startswith("fusion:") and "slice" not in k)
    assert update == 2 * 8 * 64 * 2 + 4  # the rows read and written (and the index), no pool
    assert by["custom-call:attn"] == 8 * 64 * 2 + 2 * 1000 + 8 * 64 * 2  # q, the pool read, out
    assert hb.total == sum(by.values())
    assert [k.name for k in hb.top(3)][:2] == ["forward/layers_*/dynamic_slice", "attn"]


def test_check_bounds_names_what_breaks():
    ok = {"launches_outside_graphs": 0, "host_syncs": 0, "conditionals": 0, "launches": 500,
          "hbm_bytes": 4.0e9, "floor_bytes": 3.3e9, "predicted_ms": 1.0}
    assert check_bounds(ok) == []
    assert check_bounds(ok | {"host_syncs": 31}) == ["host_syncs 31 > 0"]
    assert check_bounds(ok | {"hbm_bytes": 6e9})[0].startswith("floor_ratio 1.8")


def test_tuple_element_operands_are_charged_their_element():
    """A loop body names a carried tuple's element as `%tuple#k` (no get-tuple-element): the
    operand is charged that element's bytes, not lost."""
    assert tuple_elements("(s32[], bf16[2,3]{1,0}, /*index=2*/(f32[1], u8[2]))") == [
        "s32[]", "bf16[2,3]{1,0}", "(f32[1], u8[2])"]
    hlo = ("ENTRY %body (arg: (s32[], bf16[64,128], bf16[8,64])) -> bf16[8,128] {\n"
           "  %arg = (s32[], bf16[64,128]{1,0}, bf16[8,64]{1,0}) parameter(0)\n"
           "  ROOT %dot = bf16[8,128]{1,0} dot(%arg#2, %arg#1), lhs_contracting_dims={1}, "
           "rhs_contracting_dims={0}\n}\n")
    assert HloBytes(hlo).total == (64 * 128 + 8 * 64 + 8 * 128) * 2


def test_a_conditional_is_charged_its_costliest_branch_once():
    hlo = """\
%cheap (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%a)
}

%dear (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%b)
  ROOT %m = f32[4]{0} multiply(%e, %b)
}

ENTRY %main (p: pred[], x: f32[4]) -> f32[4] {
  %p = pred[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(%p, %x, %x), true_computation=%dear, false_computation=%cheap
}
"""
    hb = HloBytes(hlo)
    assert hb.conditionals == 1
    assert hb.total == (16 + 16) + (2 * 16 + 16)  # exponential, then multiply; not the negate
    assert sorted(k.opcode for k in hb.kernels.values()) == ["exponential", "multiply"]


COLLECTIVE_HLO = """\
%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%fused_all-reduce (p: bf16[64,1024]) -> bf16[64,1024] {
  %p = bf16[64,1024]{1,0} parameter(0)
  ROOT %ar = bf16[64,1024]{1,0} all-reduce(%p), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
}

%async_computation (q: bf16[64,1024]) -> bf16[64,1024] {
  %q = bf16[64,1024]{1,0} parameter(0)
  ROOT %f = bf16[64,1024]{1,0} fusion(%q), kind=kCustom, calls=%fused_all-reduce
}

%body (t: (s32[], bf16[64,1024])) -> (s32[], bf16[64,1024]) {
  %t = (s32[], bf16[64,1024]{1,0}) parameter(0)
  %x = bf16[64,1024]{1,0} get-tuple-element(%t), index=1
  %st = ((bf16[64,1024]{1,0}), bf16[64,1024]{1,0}) async-start(%x), calls=%async_computation
  %dn = bf16[64,1024]{1,0} async-done(%st)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], bf16[64,1024]{1,0}) tuple(%i, %dn)
}

%cond (c: (s32[], bf16[64,1024])) -> pred[] {
  %c = (s32[], bf16[64,1024]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x0: bf16[64,1024], y: bf16[64,4096]) -> bf16[64,32768] {
  %x0 = bf16[64,1024]{1,0} parameter(0)
  %y = bf16[64,4096]{1,0} parameter(1)
  %init = (s32[], bf16[64,1024]{1,0}) tuple(%x0, %x0)
  %w = (s32[], bf16[64,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"80"}}
  %ag = ((bf16[64,4096]{1,0}), bf16[64,32768]{1,0}) all-gather-start(%y), dimensions={1}
  ROOT %agd = bf16[64,32768]{1,0} all-gather-done(%ag)
}
"""  # noqa: E501  (HLO lines as XLA writes them)


def test_collectives_are_counted_inside_fusions_and_loops_with_their_bytes():
    hb = HloBytes(COLLECTIVE_HLO)
    reduce, gather = hb.collectives["all-reduce"], hb.collectives["all-gather"]
    assert (reduce.runs, reduce.bytes) == (80, 80 * 64 * 1024 * 2)
    assert (gather.runs, gather.bytes) == (1, 64 * 32768 * 2)  # the start's result, once
    # a ring over 8: 2 x 7/8 of each all-reduce's bytes, 7/8 of the gathered ones, a link each
    moved = 2 * 7 / 8 * reduce.bytes + 7 / 8 * gather.bytes
    assert abs(hb.collective_ms(8) - (moved / LINK_BANDWIDTH + 81 * COLLECTIVE_US * 1e-6) * 1e3) \
        < 1e-9
    assert hb.collective_ms(1) == 0.0


COLLECTIVE_THUNKS = """\
001: kAsyncStart    [source | next=000 (3)] stream=computation_stream[0], async_id=4
    002: kCollectiveKernel [source | sink] kCollectiveKernel
003: kAsyncDone     [source | sink] async_id=4
000: kCommandBuffer [source | sink]
    004: kCustomKernel [source | next=005 (1)] loop_add_fusion grid: [18, 1, 1]
    005: kAllReduceStart [source | sink] kAllReduceStart
    006: kAllReduceDone [source | sink] kAllReduceDone
"""


def test_collective_launches_are_split_by_graph():
    got = count_launches(parse_thunks(COLLECTIVE_THUNKS), {})
    assert (got.collectives_outside, got.collectives_in_graphs) == (1, 1)
    assert got.graphs == 1 and got.in_graphs == 3 and got.outside == 1


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.environ.get("JAXSERVE_CUDA_PLUGIN_DIR", os.path.join(ROOT, ".cuda-compiler"))
GGUF_COSTS = """
import json, os, sys, tempfile
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
import gpu_cost
from jaxserve.bench import gpu_cost as gc
dump = tempfile.mkdtemp()
gc.setup_compiler(sys.argv[2], dump)
target = gpu_cost.target_path("h100")
device, bandwidth = gc.target_device(target), gc.bandwidth_of(target)
preset = dict(gc.SMOLLM2, num_hidden_layers=2)
spec = gc.ProgramSpec("decode-16", 16, 256)
print(json.dumps({f"{t} {f}": gc.cost_gguf(preset, t, f, device, spec, dump, bandwidth)
                  for t, f in (("bf16", ""), ("Q8_0", "loader"), ("Q8_0", "gpu"))}))
"""


def test_gguf_blocks_on_a_gpu_stream_fewer_bytes_than_bfloat16(tmp_path):
    """The decode step of a two-layer model of the default model's shapes, compiled for an
    H100: Q8_0 projections in the GPU form (kernels/gpu_matmul.py) are read by the block
    matmul kernel, and the step streams fewer bytes than in bfloat16; in the loader's int8
    form XLA expands them to bfloat16 in memory first, and the step streams more."""
    if not os.path.isdir(os.path.join(PLUGIN, "jax_plugins")):
        pytest.fail(f"JAX's CUDA plugin is not in {PLUGIN}; the README's test command installs "
                    "it (pip install --no-deps --target .cuda-compiler jax-cuda12-plugin==0.11.2 "
                    "jax-cuda12-pjrt==0.11.2)")
    proc = subprocess.run([sys.executable, "-c", GGUF_COSTS, ROOT, PLUGIN], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bf16, loader, gpu = got["bf16 "], got["Q8_0 loader"], got["Q8_0 gpu"]
    assert gpu["hbm_bytes"] < bf16["hbm_bytes"] < loader["hbm_bytes"]
    assert gpu["floor_bytes"] < bf16["floor_bytes"]
    assert gpu["hbm_bytes"] / gpu["floor_bytes"] < loader["hbm_bytes"] / loader["floor_bytes"]
    kernels = [k["name"] for k in gpu["top_kernels"] if k["opcode"] == "custom-call"]
    assert any("gguf_block_matmul" in k for k in kernels), gpu["top_kernels"]
    assert gpu["host_syncs"] == 0 and gpu["conditionals"] == 0
