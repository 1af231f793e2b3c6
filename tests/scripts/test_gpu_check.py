"""scripts/gpu_check.py --dry-run keeps working on a CPU (interpret mode, tiny shapes)."""

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
    assert {r["backend"] for r in report["correctness"]} >= {"reference", "pallas"}
    assert all(r["ok"] for r in report["correctness"])
    assert {r["backend"] for r in report["kernels"]} >= {"reference", "pallas"}
    assert [r["batch"] for r in report["engine"]] == [1, 4]
    assert all(r["step_median_s"] > 0 for r in report["engine"])
