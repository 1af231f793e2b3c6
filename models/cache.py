"""A cache of converted weights: dequantizing and re-laying-out a GGUF takes seconds on every
start, so the resulting Flax param tree is saved once (plus the config and the tokenizer) and
restored on later loads of the same file. Each array is its own .npy file, written and read
one at a time: saving or restoring a model never holds a second copy of it (a checkpointing
library's writer copied the whole tree first).

The cache lives in $JAXSERVE_CACHE_DIR/converted, else ~/.cache/jaxserve/converted;
JAXSERVE_CACHE_DIR="" turns it off (and every other jaxserve cache). An entry is keyed by the
source file's absolute path, size and modification time, so a changed file is converted again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from typing import Any

import numpy as np

from jaxserve.kernels.cache_dir import cache_home
from jaxserve.models.config import ModelConfig

logger = logging.getLogger(__name__)
_FORMAT = 7  # bump when the param layout changes, so stale entries are ignored


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
        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        if raw["rope_scaling"] is not None:
            raw["rope_scaling"] = tuple((k, tuple(v) if isinstance(v, list) else v)
                                        for k, v in raw["rope_scaling"])
        raw["global_layers"] = tuple(raw.get("global_layers", ()))
        cfg = ModelConfig(**raw)
        params = _read_tree(os.path.join(d, "params"))
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
        tmp = f"{d}.tmp{os.getpid()}"  # concurrent writers never share a staging dir
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        _write_tree(os.path.join(tmp, "params"), params)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        open(os.path.join(tmp, "complete"), "w").close()
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
    except Exception as e:  # noqa: BLE001 - caching is an optimisation only
        logger.warning("could not cache converted weights in %s: %s", d, e)


def _write_tree(d: str, tree: dict) -> None:
    """Nested dicts of arrays as d/index.json (each array's key path) and d/<i>.npy."""
    os.makedirs(d)
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        else:
            np.save(os.path.join(d, f"{len(paths)}.npy"), np.asarray(node), allow_pickle=False)
            paths.append(path)

    walk(tree, ())
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump(paths, f)


def _read_tree(d: str) -> dict:
    with open(os.path.join(d, "index.json")) as f:
        paths = json.load(f)
    tree: dict = {}
    for i, path in enumerate(paths):
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = np.load(os.path.join(d, f"{i}.npy"), allow_pickle=False)
    return tree
