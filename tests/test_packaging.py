"""What the install claims: one import root, jaxserve, with kernels/ and models/ inside it and
the CPU kernels' sources shipped; no top-level `kernels` or `models` of this project."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

import jaxserve.kernels
import jaxserve.models
from tests.helpers import TINY_SERVE, wait_for_line

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


def test_a_wheel_installed_in_a_fresh_venv_serves(tmp_path, tiny_llama_dir):
    """The wheel built from the checkout, in a venv of its own (its dependencies lent by this
    environment's site-packages, after its own): `python -m jaxserve serve MODEL`, run away
    from the checkout, serves a request and stops on SIGTERM."""
    from jaxserve.serving.client import Client

    src, wheels = tmp_path / "src", tmp_path / "wheels"  # a copy: the build writes beside it
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "bench-out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   timeout=600)
    [wheel] = wheels.glob("jaxserve-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = venv.glob("lib/python*/site-packages")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    (site / "lent.pth").write_text("\n".join(p for p in sys.path
                                             if p.endswith("site-packages")) + "\n")
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "jaxserve", "serve", tiny_llama_dir, "--port",
         "0", "--http-port", "0", *TINY_SERVE],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        port, _ = wait_for_line(proc, r"listening on socket 127\.0\.0\.1:(\d+)")
        with Client(port=int(port[1])) as c:
            assert c.generate(prompt_token_ids=[5, 6, 7], max_tokens=3,
                              ignore_eos=True)["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import jaxserve.kernels as k; "
                            "print(k.__file__)"], cwd=tmp_path, capture_output=True, text=True)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
