"""How the C++ CPU kernels are built (kernels/cpu_library.py)."""

from __future__ import annotations

import concurrent.futures
import ctypes
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


@pytest.fixture
def small_sources(tmp_path, monkeypatch):
    """build() over one small source file (the kernels' own take a while to compile, and
    library() builds those for the tests that run them), into a cache of its own."""
    src = tmp_path / "src" / "one.cc"
    src.parent.mkdir()
    src.write_text('extern "C" int one() { return 1; }\n')
    monkeypatch.setattr(cpu_library, "sources", lambda: [str(src)])
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def test_built_once_and_loaded_after(small_sources):
    """The library is keyed by what went into it: a second build finds it and compiles
    nothing."""
    cxx = cpu_library.compiler()
    lib = cpu_library.build(cxx)
    assert os.path.dirname(lib) == str(small_sources)
    stamp = os.stat(lib).st_mtime_ns
    assert cpu_library.build(cxx) == lib and os.stat(lib).st_mtime_ns == stamp
    assert os.listdir(small_sources) == [os.path.basename(lib)]  # no temporaries left
    assert ctypes.CDLL(lib).one() == 1


def test_builds_started_together_compile_once(small_sources, tmp_path):
    """Builds of one library that start together (the workers of a test run, the processes
    of a server) compile it once: the others wait for it and find it built."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"  # the compiler, counting the compiles (not --version) and slowed
    cxx.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo x >> {calls}; sleep 1;; esac\n'
                   f'exec {cpu_library.compiler()} "$@"\n')
    cxx.chmod(0o755)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        libs = list(pool.map(lambda _: cpu_library.build(str(cxx)), range(4)))
    assert len(set(libs)) == 1 and ctypes.CDLL(libs[0]).one() == 1
    assert calls.read_text() == "x\n"
    assert os.listdir(small_sources) == [os.path.basename(libs[0])]


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
