"""Helpers shared by the engine-level tests."""

from __future__ import annotations

from jaxserve import EngineConfig, LLMEngine


def make_engine(path, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                num_kv_blocks=128, enable_step_trace=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def run_all(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done
