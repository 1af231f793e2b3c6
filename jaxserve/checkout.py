"""A checkout's kernels/ and models/ folders met under their folder names.

From a checkout's root (`python -c`, the REPL, `python -m`, a notebook) the working directory
comes first on sys.path, so `import kernels` would find this checkout's kernels/ folder (which
installs as jaxserve.kernels) before another distribution's module of that name, such as
Hugging Face's `kernels`, which transformers imports. Imported under its folder's name, each
folder hands the name on to the next module of that name on sys.path, or is not found at all.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, folder: str) -> None:
    """Put the next module called `name` on sys.path, past the checkout that holds `folder`,
    in sys.modules in place of this checkout's (ModuleNotFoundError if there is none)."""
    root = os.path.dirname(os.path.abspath(folder))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        del sys.modules[name]
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
