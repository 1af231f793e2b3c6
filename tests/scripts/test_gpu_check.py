"""scripts/gpu_check.py --dry-run keeps working on a CPU (interpreters, tiny shapes), and its
last line is the one JSON report."""

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
    cases = {(r["backend"], r["dtype"]) for r in report["correctness"]}
    assert cases >= {("reference", "float32"), ("pallas", "bfloat16"), ("mosaic", "bfloat16"),
                     ("mosaic", "float16")}
    assert ("mosaic", "float32") not in cases  # it takes bf16 and fp16 only
    assert all(r["ok"] for r in report["correctness"])
    assert "triton" in report["backends_missing"]
    assert {r["backend"] for r in report["kernels"]} >= {"reference", "pallas", "mosaic"}
    assert [r["batch"] for r in report["engine"]] == [1, 4]
    assert all(r["step_median_s"] > 0 for r in report["engine"])
    assert report["end_to_end"]["output_tok_per_s"] > 0
