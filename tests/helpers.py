"""Helpers shared by the engine-level tests."""

from __future__ import annotations

import re
import time

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.config import _pow2_range

# Server options for the tiny Llama that compile little: 4 sequences of up to 128 tokens.
TINY_SERVE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128",
              "--num-kv-blocks", "32", "--token-buckets", "16", "32", "--seq-buckets", "4",
              "--block-buckets", "8", "--max-held-seqs", "0"]


def wait_for_line(proc, pattern: str, timeout_s: float = 240) -> tuple[re.Match, list[str]]:
    """Read the process's stderr (text) up to the first line matching `pattern`: the match and
    every line read. Fails with those lines if the stream ends or `timeout_s` passes first."""
    lines, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(pattern, line):
            return m, lines
    raise AssertionError(f"no line matched {pattern!r}:\n" + "".join(lines))


def buckets_from_8(args: dict) -> dict:
    """`args` (EngineConfig fields, with max_num_batched_tokens) with token buckets from 8 up
    to that budget unless they name their own, for tests whose subject is not the smallest
    steps: each bucket is one more program to compile (about 4 s of CPU on a cold cache), and
    a test that runs a few sequences to their ends would pass through 4, 2 and 1 as well. The
    default buckets from 1 are run by the tests of the default configuration (the HF oracle,
    the random workload, the compile cache, the scripts)."""
    # The default buckets' own range, started at 8 (it ends at the budget however large).
    return {"token_buckets": _pow2_range(8, args["max_num_batched_tokens"])} | args


def make_engine(path, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                num_kv_blocks=128, enable_step_trace=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**buckets_from_8(args)))


def run_all(engine: LLMEngine, step=None) -> dict[str, object]:
    """Step until done (`step`: engine.step, or another stepping method of it); the finished
    outputs by request id."""
    step = step or engine.step
    done = {}
    while engine.has_unfinished_requests():
        for out in step():
            if out.finished:
                done[out.request_id] = out
    return done


def check_lora_mix(hf_model, adapter_dir, prompt_ids: list[list[int]], n: int, tol: float,
                   b_std: float, loaded=None, **engine_args) -> LLMEngine:
    """Every prompt under the base model and under each of three PEFT adapters
    (oracle.LORA_CONFIGS, their B random with `b_std`), all in one batch: greedy tokens equal
    HF + PEFT's and their logprobs within `tol`; each adapter changes some prompt's tokens and
    no KV block is left in use. Returns the engine."""
    from jaxserve.core.lora import LoRARequest
    from jaxserve.testing.oracle import LORA_CONFIGS, make_peft_adapter, peft_greedy

    adapters = {f"a{i}": make_peft_adapter(hf_model, str(adapter_dir / f"a{i}"), seed=i,
                                           b_std=b_std, **conf)
                for i, conf in enumerate(LORA_CONFIGS, 1)}
    choices = [None] + [LoRARequest(name, i, path)
                        for i, (name, path) in enumerate(adapters.items(), 1)]
    engine = LLMEngine(EngineConfig(**(dict(enable_lora=True, max_loras=3, max_lora_rank=16,
                                            max_logprobs=1) | engine_args)), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    runs = [(ids, lora) for ids in prompt_ids for lora in choices]
    for i, (ids, lora) in enumerate(runs):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params, lora_request=lora)
    done = run_all(engine)
    want = peft_greedy(hf_model, adapters, [(ids, lora and lora.lora_name)
                                            for ids, lora in runs], n)
    for i, (tokens, logprobs) in enumerate(want):
        got = done[f"r{i}"].outputs[0]
        assert got.token_ids == tokens, f"run {i} (adapter {runs[i][1]})"
        for j, entry in enumerate(got.logprobs):
            assert abs(entry["logprob"] - logprobs[j]) < tol, (i, j)
    for a in range(1, len(choices)):  # each adapter changes the tokens of some prompt
        assert any(want[p * len(choices) + a][0] != want[p * len(choices)][0]
                   for p in range(len(prompt_ids))), f"adapter {a} changes nothing"
    assert engine.block_manager.num_used_blocks == 0
    return engine
