"""scripts/gpu_cost.py compiles the engine's decode step for an H200 on this CPU-only machine,
and the default model's 256-sequence step, alone and in the decode loop, stays within
gpu_cost.BOUNDS: one CUDA graph, no host syncs, bytes near the floor. The scanned layer loop
(the CPU's) breaks the bounds, which shows they catch a step that launches kernels one by one
again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.bench.gpu_cost import check_bounds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.environ.get("JAXSERVE_CUDA_PLUGIN_DIR", os.path.join(ROOT, ".cuda-compiler"))


def _cost(tmp_path, *extra: str, programs=("decode-256",)) -> list[dict]:
    if not os.path.isdir(os.path.join(PLUGIN, "jax_plugins")):
        pytest.fail(f"JAX's CUDA plugin is not in {PLUGIN}; the README's test command installs "
                    "it (pip install --no-deps --target .cuda-compiler jax-cuda12-plugin==0.11.2 "
                    "jax-cuda12-pjrt==0.11.2)")
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_cost.py", "--target", "h200",
                           "--models", "smollm2-135m", "--programs", *programs,
                           "--plugin-dir", PLUGIN, "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = json.loads(out.read_text())["programs"]
    assert [p["name"] for p in got] == list(programs)
    assert all(f"| {name} |" in proc.stdout for name in programs)
    return got


def test_default_decode_step_within_bounds(tmp_path):
    p, loop = _cost(tmp_path, programs=("decode-256", "decode-loop-256"))
    assert p["sequences"] == loop["sequences"] == 256 and p["program"][:2] == [256, 256]
    assert loop["decode_steps"] == 8 and loop["program"][-1] == 8
    assert check_bounds(p) == [], p
    assert check_bounds(loop) == [], loop
    # the floor: bf16 weights once (0.27 GB) + 256 x 512 tokens of K and V over 30 layers
    kv = 2 * 30 * 256 * 512 * 3 * 64 * 2
    assert 0.26e9 < p["floor_bytes"] - kv < 0.28e9
    assert p["launches"] == p["launches_in_graphs"] + p["launches_outside_graphs"]
    assert p["hbm_bytes"] > p["floor_bytes"]
    assert p["top_kernels"][0]["opcode"] == "custom-call"  # the attention kernel leads


def test_bounds_catch_the_scanned_layer_loop(tmp_path):
    (p,) = _cost(tmp_path, "--layer-loop", "scan")
    broken = check_bounds(p)
    assert any(b.startswith("launches_outside_graphs") for b in broken), broken
    assert any(b.startswith("host_syncs") for b in broken), broken


def test_unknown_program_or_target_is_refused_by_name():
    for args, field in ((["--programs", "decode-7"], "--programs"), (["--target", "h300"],
                                                                      "--target")):
        proc = subprocess.run([sys.executable, "scripts/gpu_cost.py", *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr[-2000:]
