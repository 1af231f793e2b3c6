"""Helpers shared by the engine-level tests."""

from __future__ import annotations

from jaxserve import EngineConfig, LLMEngine
from jaxserve.config import _pow2_range


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
