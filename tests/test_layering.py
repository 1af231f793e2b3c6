"""The package layering, checked on the real module graph: every import of every module (inside
functions too) parsed with `ast`; no cycle between modules, no import of a higher layer."""

from __future__ import annotations

import ast
import importlib.util
import os
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first: a module imports only from its own layer and the layers before it.
LAYERS = (
    ("jaxserve",),  # the package's __init__: the version; its public names load lazily, by name
    ("jaxserve.core",),  # the host core: sequences, blocks, scheduler (no jax)
    ("jaxserve.kernels",),  # attention backends, CPU kernels, quantized weight forms
    ("jaxserve.models",),  # the Flax model, its config, weight loading
    ("jaxserve.config",),  # EngineConfig and the options derived from it
    ("jaxserve.runtime",),  # the device side: KV pool, step inputs, sampling, the runner
    ("jaxserve.engine",),  # LLMEngine, postprocess, LLM, metrics
    ("jaxserve.testing",),  # the scheduler simulator and the HF oracle
    ("jaxserve.serving",),  # one serving core; the socket front and the HTTP front on it
    ("jaxserve.bench",),  # workloads, drivers, HF baselines, reports
    ("jaxserve.__main__", "jaxserve.launch"),  # entry points
)


def package_dirs() -> dict[str, str]:
    """Each top-level package of the install -> its folder (kernels/ and models/ beside
    jaxserve/ in a checkout)."""
    return {name: importlib.util.find_spec(name).submodule_search_locations[0]
            for name in ("jaxserve", "jaxserve.kernels", "jaxserve.models")}


def module_files() -> dict[str, str]:
    """Every module of jaxserve -> its file."""
    roots = package_dirs()
    found = {}
    for name, folder in roots.items():
        for d, subdirs, files in os.walk(folder):
            subdirs[:] = [s for s in subdirs if os.path.exists(os.path.join(d, s, "__init__.py"))]
            rel = os.path.relpath(d, folder)
            package = name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"
            if package in roots and package != name:  # a mapped package: walked as its own root
                subdirs[:] = []
                continue
            for f in files:
                if f.endswith(".py"):
                    stem = f[:-3]
                    found[package if stem == "__init__" else f"{package}.{stem}"] = (
                        os.path.join(d, f))
    return found


def imports_of(name: str, path: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that `name` imports anywhere in its file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package (a module's is its parent's)
                parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def module_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def layer_of(module: str, layers=LAYERS) -> int:
    """The index of the layer with the longest prefix of `module`."""
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise ValueError(f"{module} is in no layer")
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-import
    (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """Every import of a module in a higher layer than the importer's."""
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if layer_of(b, layers) > layer_of(a, layers))


def test_no_cycles_and_no_upward_imports():
    graph = module_graph()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150  # the walk found the code
    assert cycles(graph) == []
    assert upward(graph) == []


def test_every_module_is_in_a_layer_and_every_layer_has_modules():
    graph = module_graph()
    used = {layer_of(m) for m in graph}
    assert used == set(range(len(LAYERS)))


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a made-up graph: a cycle, an upward import, an import inside a function."""
    graph = {"jaxserve.core.a": {"jaxserve.core.b"}, "jaxserve.core.b": {"jaxserve.core.a"},
             "jaxserve.runtime.x": {"jaxserve.engine.y"}, "jaxserve.engine.y": set()}
    assert cycles(graph) == [["jaxserve.core.a", "jaxserve.core.b"]]
    assert upward(graph) == [("jaxserve.runtime.x", "jaxserve.engine.y")]
    probe = tmp_path / "a.py"
    probe.write_text("def f():\n    from jaxserve.core import b\n")
    assert imports_of("jaxserve.core.a", str(probe), {"jaxserve.core.b"}) == {"jaxserve.core.b"}
    with pytest.raises(ValueError, match="in no layer"):
        layer_of("kernels.reference")


def test_the_package_docstring_states_this_order():
    """jaxserve/__init__.py lists the layers for a reader: the same ones, in the same order."""
    import jaxserve

    lines = [ln.strip().split("  ")[0] for ln in jaxserve.__doc__.splitlines()
             if ln.startswith("    ")]
    stated = [tuple("jaxserve" if n == "jaxserve" else f"jaxserve.{n.strip('/')}"
                    for n in line.split(", ")) for line in lines]
    assert stated == list(LAYERS)


def test_pyproject_lists_every_package_folder():
    """A package folder missing from pyproject.toml's list would be missing from the wheel."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {m for m, path in module_files().items() if path.endswith("__init__.py")}
    assert listed == packages
