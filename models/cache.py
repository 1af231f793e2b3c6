"""A cache of converted weights: dequantizing and re-laying-out a GGUF takes seconds on every
start, so the resulting Flax param tree is saved once with orbax (plus the config and the
tokenizer) and restored on later loads of the same file.

The cache lives in $JAXSERVE_CACHE_DIR/converted, else ~/.cache/jaxserve/converted;
JAXSERVE_CACHE_DIR="" turns it off (and every other jaxserve cache). An entry is keyed by the
source file's absolute path, size and modification time, so a changed file is converted again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
from typing import Any

from jaxserve.models.config import ModelConfig

logger = logging.getLogger(__name__)
_FORMAT = 3  # bump when the param layout changes, so stale entries are ignored


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


def cache_root() -> str | None:
    home = cache_home()
    return None if home is None else os.path.join(home, "converted")


def entry_dir(source: str) -> str | None:
    root = cache_root()
    if root is None:
        return None
    st = os.stat(source)
    key = f"{os.path.abspath(source)}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT}"
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:24])


def load(source: str) -> tuple[ModelConfig, dict[str, Any], Any] | None:
    """(config, params, tokenizer) from the cache, or None on a miss or a damaged entry."""
    d = entry_dir(source)
    if d is None or not os.path.exists(os.path.join(d, "complete")):
        return None
    try:
        import orbax.checkpoint as ocp

        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        if raw["rope_scaling"] is not None:
            raw["rope_scaling"] = tuple(raw["rope_scaling"])
        cfg = ModelConfig(**raw)
        with ocp.StandardCheckpointer() as ck:
            params = ck.restore(os.path.join(d, "params"))
        tokenizer = None
        if os.path.isdir(os.path.join(d, "tokenizer")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.path.join(d, "tokenizer"))
        return cfg, params, tokenizer
    except Exception as e:  # noqa: BLE001 - a bad entry is rebuilt, never fatal
        logger.warning("ignoring converted-weights cache entry %s: %s", d, e)
        return None


def store(source: str, cfg: ModelConfig, params: dict[str, Any], tokenizer) -> None:
    d = entry_dir(source)
    if d is None:
        return
    try:
        import orbax.checkpoint as ocp

        tmp = f"{d}.tmp{os.getpid()}"  # concurrent writers never share a staging dir
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with ocp.StandardCheckpointer() as ck:
            ck.save(os.path.join(tmp, "params"), params)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        open(os.path.join(tmp, "complete"), "w").close()
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
    except Exception as e:  # noqa: BLE001 - caching is an optimisation only
        logger.warning("could not cache converted weights in %s: %s", d, e)
