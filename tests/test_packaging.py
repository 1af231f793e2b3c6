"""What the install claims: one import root, jaxserve, with kernels/ and models/ inside it and
the CPU kernels' sources shipped; no top-level `kernels` or `models` of this project."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

import jaxserve.kernels
import jaxserve.models

CLAIMS = """if True:
    import importlib.util, os
    import jaxserve.kernels, jaxserve.models
    from jaxserve.kernels import cpu_library
    print(bool(cpu_library.sources()))
    for name in ("kernels", "models"):
        spec = importlib.util.find_spec(name)
        print(None if spec is None else os.path.dirname(spec.origin or ""))
"""


def ours(folder: str | None) -> bool:
    return folder in (os.path.dirname(jaxserve.kernels.__file__),
                      os.path.dirname(jaxserve.models.__file__))


def test_outside_the_checkout_only_jaxserve_is_ours(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CLAIMS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shipped, kernels, models = proc.stdout.split("\n")[:3]
    assert shipped == "True"
    assert not ours(kernels) and not ours(models), (kernels, models)
    assert models == "None"  # Hugging Face's `kernels` may be there: transformers needs it


def test_in_the_tests_kernels_is_not_this_checkouts_folder():
    """tests/conftest.py keeps the checkout's root after site-packages, so an installed
    `kernels` (Hugging Face's, which newer transformers import) wins over the folder."""
    spec = importlib.util.find_spec("kernels")
    if spec is not None and ours(os.path.dirname(spec.origin or "")):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution("kernels")  # found last only for want of another
