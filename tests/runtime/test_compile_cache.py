"""The persistent compilation cache is on by default: a second process loads its programs."""

from __future__ import annotations

import os
import subprocess
import sys

# A fresh process with no JAX cache configured: warm up a tiny engine and report how many
# programs came from the persistent cache (JAX records an event per cache hit).
SCRIPT = """
import sys
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
from jaxserve import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], max_num_seqs=4, max_num_batched_tokens=32,
                                max_model_len=64, num_kv_blocks=16, token_buckets=(16, 32),
                                seq_buckets=(4,), block_buckets=(4,)))
engine.warmup()
print("dir", engine.runner.compilation_cache_dir)
print("compiled", engine.runner.num_compiles, "hits", len(hits))
"""


def run(tiny_llama_dir, cache_env: str) -> dict[str, str]:
    env = dict(os.environ, JAXSERVE_CACHE_DIR=cache_env)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama_dir], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    return dict(zip(words[::2], words[1::2], strict=True))


def test_second_start_loads_programs_from_the_cache(tiny_llama_dir, tmp_path):
    first = run(tiny_llama_dir, str(tmp_path))
    assert first == {"dir": str(tmp_path / "xla"), "compiled": "2", "hits": "0"}
    assert any((tmp_path / "xla").iterdir())
    second = run(tiny_llama_dir, str(tmp_path))
    # the two step programs, and the small jitted helpers around them, all come from disk
    assert second["compiled"] == "2" and int(second["hits"]) >= 2


def test_an_empty_cache_dir_turns_it_off(tiny_llama_dir):
    assert run(tiny_llama_dir, "")["dir"] == "None"
