"""Where jaxserve keeps what it builds (converted weights, the CPU kernels' library, compiled
step programs, the attention self-test's choice), and the parts of their keys that say an entry
is stale: the host CPU and a digest of the source that built it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform


def cache_home() -> str | None:
    """The root of jaxserve's caches: $JAXSERVE_CACHE_DIR, else ~/.cache/jaxserve; None when
    JAXSERVE_CACHE_DIR is empty (caching off)."""
    root = os.environ.get("JAXSERVE_CACHE_DIR")
    if root == "":
        return None
    return root or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")


@functools.cache
def host_cpu() -> str:
    """The CPU model and its instruction flags (Linux), else what `platform` knows: part of
    the key of every cached artifact built for this CPU's instructions (step executables, the
    C++ kernels)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        seen = dict(ln.split(":", 1) for ln in lines)  # the first core's lines are enough
        return "|".join(f"{k.strip()}:{' '.join(sorted(v.split()))}" for k, v in sorted(
            seen.items()))
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def source_digest(root: str, sources) -> str:
    """sha256 over the .py, .cc and .h files of `sources` (files or folders, relative to
    `root`), each with its path: cache keys that change when that code does."""
    paths = []
    for src in sources:
        top = os.path.join(root, src)
        if os.path.isfile(top):
            paths.append(top)
        for d, _, files in os.walk(top):
            paths += [os.path.join(d, f) for f in files if f.endswith((".py", ".cc", ".h"))]
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()
