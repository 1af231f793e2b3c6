"""Scripts are entry points over the package: none imports another script or edits sys.path
(what two of them share lives in jaxserve.bench)."""

from __future__ import annotations

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def offences(source: str, siblings: set[str]) -> list[str]:
    """Imports of `siblings` and uses of sys.path in one script's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name in siblings]
        elif isinstance(node, ast.ImportFrom) and node.module in siblings:
            found.append(f"from {node.module} import ...")
        elif (isinstance(node, ast.Attribute) and node.attr == "path"
              and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            found.append(f"sys.path at line {node.lineno}")
    return found


def test_no_script_imports_a_sibling_or_edits_sys_path():
    files = sorted(SCRIPTS.glob("*.py"))
    siblings = {f.stem for f in files}
    assert {"bench_generate", "bench_spec", "step_ops", "gpu_cost"} <= siblings
    bad = {f.name: o for f in files if (o := offences(f.read_text(), siblings))}
    assert bad == {}


def test_the_check_finds_both():
    src = "import sys\nsys.path.insert(0, 'x')\nfrom bench_generate import make_prompts\n"
    assert sorted(offences(src, {"bench_generate"})) == ["from bench_generate import ...",
                                                         "sys.path at line 2"]
