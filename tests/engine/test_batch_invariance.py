"""Batch invariance: a request's greedy tokens and the logits behind them, bit for bit, do not
depend on what shares its steps (how many rows, its position among them, the other rows'
lengths, the bucket a step pads to), on every CPU kernel path this machine can run.

Each path runs in its own process (the kernels are built and registered once per process):
JAXSERVE_CPU_ISA forces the paths of CPUs with fewer instructions (cpu_library.ISA_FLAGS), so
one machine checks the AVX2 and portable paths as well as its own. A step's logits are seen
through each token's top logprobs (a log-softmax of the whole row) and, for the prompt rows,
the prompt logprobs, compared as exact floats."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import jax
import pytest

from jaxserve.kernels import cpu_library
from tests.kernels.test_cpu_library import x86

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels")]

PROMPTS = ["The sky is", "One, two, three,", "Hello", "def add(a, b):", "Roses are red,",
           "The capital of France is", "import numpy as np\n", "Once upon a time, in a land far",
           "SELECT name FROM users WHERE", "To be or not to be", "Water boils at", "Dear Sir,",
           "The derivative of x^2 is", "My favourite food is", "In 1905, Einstein",
           "A list of prime numbers: 2, 3, 5,"]


def decode_everywhere(num_prompts: int, max_tokens: int, seed: int = 0) -> dict:
    """Greedy-decode PROMPTS[:num_prompts] with the engine at its defaults: each alone, then
    in batches of 2 to all of them, in shuffled positions -> {run: {prompt: result}}, a result
    being the token ids, each token's top logprobs and the prompt logprobs."""
    from jaxserve import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=llm.engine.config.max_logprobs, prompt_logprobs=5)

    def run(prompts: list[str]) -> dict:
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        return {o.prompt: {"tokens": o.outputs[0].token_ids,
                           "logprobs": [sorted(d["top"].items()) for d in o.outputs[0].logprobs],
                           "prompt": [sorted(d["top"].items()) if d else None
                                      for d in o.prompt_logprobs]}
                for o in outs}

    prompts = PROMPTS[:num_prompts]
    runs = {"alone": {}}
    for p in prompts:
        runs["alone"].update(run([p]))
    rng = random.Random(seed)
    for size in sorted({s for s in (2, 3, 5, num_prompts // 2, num_prompts) if s <= num_prompts}):
        batch = rng.sample(prompts, size)
        runs[f"batch of {size}: {batch}"] = run(batch)
    runs["all, reversed"] = run(prompts[::-1])
    return runs


def decode_on_path(isa: str, num_prompts: int, max_tokens: int) -> dict:
    """decode_everywhere in a process whose CPU kernels take path `isa`."""
    env = dict(os.environ, JAXSERVE_CPU_ISA=isa)
    code = ("import json, os, tempfile\n"
            "from jaxserve.runtime import compile_cache\n"
            "compile_cache.enable(os.environ.get('JAXSERVE_TEST_XLA_CACHE', os.path.join("
            "tempfile.gettempdir(), 'jaxserve-test-xla-cache')))\n"
            "from tests.engine.test_batch_invariance import decode_everywhere\n"
            f"print(json.dumps(decode_everywhere({num_prompts}, {max_tokens})))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def assert_invariant(runs: dict) -> None:
    alone = runs.pop("alone")
    for name, results in runs.items():
        for prompt, got in results.items():
            want = alone[prompt]
            assert got["tokens"] == want["tokens"], (name, prompt)
            for i, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
                assert a == b, f"{name}: {prompt!r}, token {i}: {a[:3]} vs alone {b[:3]}"
            assert got["prompt"] == want["prompt"], (name, prompt)


# The paths this machine runs: its own, and (on x86) those of CPUs with fewer instructions.
# The portable loops are scalar and slow: fewer prompts and tokens there.
PATHS = [("native", 12, 8), pytest.param("avx2", 6, 6, marks=x86),
         pytest.param("portable", 4, 3, marks=x86)]


@pytest.mark.parametrize("isa, num_prompts, max_tokens", PATHS)
def test_greedy_tokens_and_logits_do_not_depend_on_the_batch(isa, num_prompts, max_tokens):
    assert_invariant(decode_on_path(isa, num_prompts, max_tokens))


def test_an_unknown_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_library.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="JAXSERVE_CPU_ISA must be one of native, avx2, "
                                         "portable; got 'avx9000'"):
        cpu_library.isa_flags()
