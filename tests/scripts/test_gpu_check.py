"""scripts/gpu_check.py --dry-run keeps working on a CPU (interpreters, tiny shapes): a line for
every backend x dtype x shape, skipped ones with why, and its last line the one JSON report."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report
    assert report["failures"] == []
    assert set(report["seconds"]) == {"selftest", "correctness", "kernels", "engine"}

    by_dtype = {r["dtype"]: r for r in report["selftest"]}
    assert by_dtype["float32"]["chosen"] in {"pallas", "cpu", "xla"}
    cpu_bf16 = next(t for t in by_dtype["bfloat16"]["trials"] if t["name"] == "cpu")
    assert not cpu_bf16["passed"] and "float32" in cpu_bf16["reason"]

    backends = {"reference", "cpu", "xla", "mosaic", "triton", "pallas"}
    cases = {(r["backend"], r["dtype"]) for r in report["correctness"]}
    assert cases == {(b, d) for b in backends for d in ("float32", "bfloat16", "float16")}
    ran = {(r["backend"], r["dtype"]) for r in report["correctness"] if "skipped" not in r}
    assert ran >= {("reference", "float32"), ("pallas", "bfloat16"), ("mosaic", "bfloat16"),
                   ("mosaic", "float16"), ("cpu", "float32")}
    skipped = {(r["backend"], r["dtype"]): r["skipped"] for r in report["correctness"]
               if "skipped" in r}
    assert "dtype" in skipped["mosaic", "float32"]  # it takes bf16 and fp16 only
    assert "jax-triton" in skipped["triton", "bfloat16"]
    assert all(r["ok"] for r in report["correctness"] if "skipped" not in r)
    timed = {r["backend"] for r in report["kernels"] if "median_s" in r}
    assert timed >= {"xla", "pallas", "mosaic", "cpu"}
    assert len(report["kernels"]) == len(backends) * 2 * 2  # x 2 dtypes x 2 batches

    engine = report["engine"]
    assert [r["sequences"] for r in engine] == [1, 4]
    for r in engine:
        assert r["step_program_s"] > 0 and r["generate"]["decode_step_s"] > 0
        assert r["generate"]["tok_per_s"] > 0 and r["hf"]["tok_per_s"] > 0
        assert r["ops"]["launches"] >= r["ops"]["fusions"] > 0
