"""The persistent caches are on by default: a second process loads its programs, whole from the
executable cache when nothing that decides them changed, else through XLA's own cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from jaxserve.kernels import cpu_library

# A fresh process with no JAX cache configured: warm up a tiny engine, report how many programs
# were built, how many came from JAX's cache (an event per hit) and how many loaded whole, and
# the greedy tokens of one request.
SCRIPT = """
import sys
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
from jaxserve import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], max_num_seqs=4, max_num_batched_tokens=32,
                                max_model_len=64, num_kv_blocks=int(sys.argv[2]),
                                token_buckets=(16, 32), seq_buckets=(4,), block_buckets=(4,),
                                max_held_seqs=0))
engine.warmup()
engine.add_request("a", prompt_token_ids=[5, 9, 22, 7], params=SamplingParams(
    temperature=0.0, max_tokens=6, ignore_eos=True))
while engine.has_unfinished_requests():
    for out in engine.step():
        tokens = out.outputs[0].token_ids
print("dir", engine.runner.compilation_cache_dir)
print("compiled", engine.runner.num_compiles, "hits", len(hits))
print("loaded", engine.runner.num_loaded_executables)
print("tokens", ",".join(map(str, tokens)))
"""


def run(tiny_llama_dir, cache_env: str, num_kv_blocks: int = 16,
        tmp_dir: str | None = None) -> dict[str, str]:
    env = dict(os.environ, JAXSERVE_CACHE_DIR=cache_env)
    # The CPU kernels, built once per machine, go where the process looks for them (its cache
    # root's kernels/, or with caching off the temporary folder), so that it loads them rather
    # than compiling a copy of its own: the subject here is the caches of the step programs.
    if tmp_dir is not None:
        env["TMPDIR"] = tmp_dir
    if cpu_library.compiler():
        lib = cpu_library.build(cpu_library.compiler(), cpu_library.isa_flags())
        kernels = os.path.join(cache_env, "kernels") if cache_env else tmp_dir
        os.makedirs(kernels, exist_ok=True)
        shutil.copy(lib, kernels)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama_dir, str(num_kv_blocks)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    return dict(zip(words[::2], words[1::2], strict=True)) | {"stderr": proc.stderr}


def test_second_start_loads_programs_from_the_caches(tiny_llama_dir, tmp_path):
    first = run(tiny_llama_dir, str(tmp_path))
    assert first["dir"] == str(tmp_path / "xla")
    assert (first["compiled"], first["hits"], first["loaded"]) == ("2", "0", "0")
    entries = sorted((tmp_path / "xla" / "executables").iterdir())
    assert len(entries) == 2
    # The same engine again: both programs load whole (nothing traced, lowered or compiled)
    # and give the same tokens.
    second = run(tiny_llama_dir, str(tmp_path))
    assert (second["compiled"], second["loaded"]) == ("0", "2")
    assert second["tokens"] == first["tokens"]
    # A bigger KV pool is another program (its shapes are part of the key): built again,
    # and XLA's cache has the small jitted helpers around it.
    other = run(tiny_llama_dir, str(tmp_path), num_kv_blocks=24)
    assert (other["compiled"], other["loaded"]) == ("2", "0") and int(other["hits"]) >= 1
    # A damaged entry is removed (with a warning) and its program built again; XLA's cache
    # has it, and an executable XLA:CPU loaded from there is not stored again (it would
    # serialize without its kernels).
    entries[0].write_bytes(b"not an executable")
    again = run(tiny_llama_dir, str(tmp_path))
    assert (again["compiled"], again["loaded"]) == ("1", "1") and int(again["hits"]) >= 1
    assert "could not load" in again["stderr"] and again["tokens"] == first["tokens"]
    assert not entries[0].exists()

def test_an_empty_cache_dir_turns_it_off(tiny_llama_dir, tmp_path):
    got = run(tiny_llama_dir, "", tmp_dir=str(tmp_path))
    assert (got["dir"], got["loaded"]) == ("None", "0")
