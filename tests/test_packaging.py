"""What the install claims: one import root, jaxserve, with kernels/ and models/ inside it and
the CPU kernels' sources shipped; no top-level `kernels` or `models` of this project."""

from __future__ import annotations

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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FROM_THE_ROOT = """if True:
    import importlib, importlib.metadata, os
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1))
    for name in ("kernels", "models"):
        try:
            print(os.path.dirname(importlib.import_module(name).__file__))
        except ModuleNotFoundError:
            print(None)
    try:
        importlib.metadata.distribution("kernels")
        print(True)
    except importlib.metadata.PackageNotFoundError:
        print(False)
"""


def test_from_the_checkouts_root_its_folders_shadow_no_other_distribution():
    """`python -c` in the checkout's root puts it first on sys.path: transformers still builds
    a model (it imports Hugging Face's `kernels` where installed), and `kernels` and `models`
    by those names are another distribution's modules or none, never this checkout's folders
    (jaxserve/checkout.py)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", FROM_THE_ROOT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    kernels, models, installed = proc.stdout.split("\n")[:3]
    assert kernels != os.path.join(ROOT, "kernels") and models == "None"
    assert (kernels != "None") == (installed == "True")
