"""How the C++ CPU kernels are built (kernels/cpu_library.py)."""

from __future__ import annotations

import functools
import os
import platform
import tomllib

import jax
import pytest

from jaxserve.kernels import cpu_library

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernels")


# The kernels' paths for CPUs with fewer instructions than this one (cpu_library.ISA_FLAGS):
# CI's CPU may have AVX-512, so its own build never runs the others; the kernels' tests run
# them against their references.
FEWER = {name: flags for name, flags in cpu_library.ISA_FLAGS.items() if flags}


@functools.cache
def fewer_targets(name: str) -> dict[str, str]:
    """Build the library with FEWER[name] and register its handlers -> {target: its name}."""
    suffix = f"_{name}"
    cpu_library.load(cpu_library.build(cpu_library.compiler(), FEWER[name]), suffix)
    return {target: target + suffix for target in cpu_library.TARGETS}


x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                         reason="turns x86 instruction sets off")


def test_built_once_and_loaded_after(tmp_path, monkeypatch):
    """The library is keyed by what went into it: a second build finds it and compiles
    nothing."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    cxx = cpu_library.compiler()
    lib = cpu_library.build(cxx)
    assert os.path.dirname(lib) == str(tmp_path / "kernels")
    stamp = os.stat(lib).st_mtime_ns
    assert cpu_library.build(cxx) == lib and os.stat(lib).st_mtime_ns == stamp
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(lib)]  # no temporaries left


def test_every_target_is_registered_and_every_source_is_shipped():
    """Each FFI target's handler is in the library; every source file is package data."""
    lib = cpu_library.library()
    assert not isinstance(lib, str), lib
    for symbol in cpu_library.TARGETS.values():
        assert hasattr(lib, symbol)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        shipped = tomllib.load(f)["tool"]["setuptools"]["package-data"]["jaxserve.kernels"]
    kinds = {os.path.splitext(p)[1] for p in cpu_library.sources()}
    assert kinds == {".cc", ".h"} and all(f"cpu/*{k}" in shipped for k in kinds)
