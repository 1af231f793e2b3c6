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
from jaxserve.runtime.step_inputs import Program

STEPS, LORA = Program._fields.index("decode_steps"), Program._fields.index("lora")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.environ.get("JAXSERVE_CUDA_PLUGIN_DIR", os.path.join(ROOT, ".cuda-compiler"))


# a model given by its config.json alone
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=256,
            intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


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
    assert loop["decode_steps"] == 8 and loop["program"][STEPS] == 8
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


def test_lora_program_beside_the_base_one(tmp_path):
    """--enable-lora: each program with the adapters' updates beside the one without, both
    one graph; the updated one reads the slots too (its floor and its bytes grow)."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_cost.py", "--target", "h100",
                           "--config", str(tmp_path / "tiny"), "--programs", "decode-64",
                           "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                           "--plugin-dir", PLUGIN, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    base, lora = json.loads(out.read_text())["programs"]
    assert (base["name"], lora["name"]) == ("decode-64", "decode-64+lora")
    assert not base["program"][LORA] and lora["program"][LORA]
    # Din + Dout of q, k, v, o (4 heads of 64, 2 kv heads) and gate, up, down (256 -> 512)
    sizes = 2 * (256 + 256) + 2 * (256 + 128) + 3 * (256 + 512)
    slots = 2 * sizes * 4 * 16 * 2  # 2 layers, 4 slots of rank 16, bf16
    assert lora["floor_bytes"] - base["floor_bytes"] == slots
    assert lora["hbm_bytes"] > base["hbm_bytes"] + slots / 2
    for p in (base, lora):
        assert p["graphs"] == 1 and p["launches_outside_graphs"] == 0


def test_tensor_parallel_step_and_memory_plan_from_a_config(tmp_path):
    """A model given by its config.json alone, split over two H100s: every collective inside
    the step's one graph, two all-reduces a layer (attention's and the MLP's outputs) plus the
    embedding's and the logits' gather; the weights halved per device; the memory plan."""
    layers = TINY["num_hidden_layers"]
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        proc = subprocess.run([sys.executable, "scripts/gpu_cost.py", "--target", "h100",
                               "--config", str(tmp_path / "tiny"), "--tensor-parallel-size",
                               str(tp), "--programs", "decode-64", "--plugin-dir", PLUGIN,
                               "--json", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "memory plan per device" in proc.stdout
        runs[tp] = json.loads(out.read_text())
    one, two = runs[1], runs[2]
    (p1,), (p2,) = one["programs"], two["programs"]
    assert two["tensor_parallel_size"] == 2 and p1["model"] == p2["model"] == "tiny"
    assert p1["collectives"] == 0
    assert p2["collectives"] == 2 * layers + 2, p2["collectives_by_kind"]
    assert p2["collectives_by_kind"]["all-reduce"] == 2 * layers + 1
    assert p2["collectives_in_graphs"] == p2["collectives"]
    assert p2["launches_outside_graphs"] == 0 and p2["graphs"] == 1 and p2["host_syncs"] == 0
    assert p2["collective_ms"] > 0 and p2["predicted_ms"] > p2["bytes_ms"]
    plan1, plan2 = one["plan"], two["plan"]
    w1, w2 = plan1["weights_bytes_per_device"], plan2["weights_bytes_per_device"]
    assert w1 / 2 <= w2 < 0.55 * w1  # all but the norms split in two
    assert plan2["block_bytes_per_device"] * 2 == plan1["block_bytes_per_device"]
    for plan, p in ((plan1, p1), (plan2, p2)):
        assert plan["temporaries_bytes_per_device"] == p["temporaries_bytes"] > 0
        used = (plan["weights_bytes_per_device"] + plan["temporaries_bytes_per_device"]
                + plan["kv_bytes_per_device"])
        assert 0.9 * plan["device_bytes"] - plan["block_bytes_per_device"] < used \
            <= 0.9 * plan["device_bytes"]
        assert plan["max_seqs_at_max_model_len"] == plan["num_blocks"] // (2048 // 16)


def test_bad_report_options_are_refused_by_name(tmp_path):
    for args, field in ((["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
                        (["--config", str(tmp_path)], "--config"),
                        (["--xla-option", "oops"], "--xla-option")):
        proc = subprocess.run([sys.executable, "scripts/gpu_cost.py", *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr[-2000:]
