"""LLM: the offline library entry point, `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import data_parallel
from jaxserve.engine.llm_engine import LLMEngine


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model=None` serves the bundled SmolLM2-135M-Instruct; other keyword arguments are
    `EngineConfig` fields (max_num_seqs, max_num_batched_tokens, dtype, ...). With
    `data_parallel_size` > 1 there is one engine per replica (`engines`), each prompt goes
    where the router sends it and the replicas step on threads of their own; `engine` is the
    first replica.
    """

    def __init__(self, model: str | None = None, **engine_args):
        self._use(data_parallel.build_replicas(EngineConfig(model=model, **engine_args)))

    @classmethod
    def from_engines(cls, engines: list[LLMEngine]) -> LLM:
        """An LLM over engines built elsewhere (one, or the replicas of build_replicas)."""
        llm = cls.__new__(cls)
        llm._use(engines)
        return llm

    def _use(self, engines: list[LLMEngine]) -> None:
        self.engines = engines
        self.router = data_parallel.make_router(engines)
        self._next_id = 0

    @property
    def engine(self) -> LLMEngine:
        return self.engines[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Returns one finished RequestOutput per prompt, in input order. `lora_request`: the
        LoRA adapter every prompt runs under, or one per prompt (None: the base model); the
        engine needs enable_lora."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        # only the finished outputs are returned: the engine need not build the others
        sampling_params = [dataclasses.replace(p, output_kind="final_only")
                           if isinstance(p, SamplingParams) else p for p in sampling_params]
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"lora_request has {len(lora_request)} entries for "
                             f"{len(prompts)} prompts")
        pairs = list(zip(prompts, zip(sampling_params, lora_request, strict=True), strict=True))
        return self._run_all(pairs, lambda engine, rid, text, ids, args: engine.add_request(
            rid, text, args[0], prompt_token_ids=ids, lora_request=args[1]), "generate",
            use_tqdm)

    def embed(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
              pooling: str | None = None, normalize: bool = True,
              use_tqdm: bool = False) -> list[np.ndarray]:
        """Each prompt's final hidden states pooled (`pooling`: "mean" or "last"; default:
        the engine's `pooling`), L2-normalized unless `normalize` is False: one (D,) float32
        array per prompt, in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outs = self._run_all([(p, None) for p in prompts],
                             lambda engine, rid, text, ids, _: engine.add_embedding_request(
                                 rid, text, prompt_token_ids=ids, pooling=pooling),
                             "embed", use_tqdm)
        return [normalized(o.embedding) if normalize else o.embedding for o in outs]

    def _run_all(self, pairs: list[tuple], add, desc: str,
                 use_tqdm: bool) -> list[RequestOutput]:
        """Queue each (prompt, params) with add(engine, request id, text, token ids, params)
        on the replica the router picks (all or none), then step until all are finished."""
        ids: list[str] = []
        placed: list[list[str]] = [[] for _ in self.engines]  # request ids per replica
        try:
            for prompt, params in pairs:
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                text = prompt if isinstance(prompt, str) else None
                token_ids = self.engine.prompt_ids(text, None if text else list(prompt))
                i = self.router.route(rid, token_ids)
                try:
                    add(self.engines[i], rid, text, token_ids, params)
                except ValueError:
                    self.router.finished(rid)
                    raise
                ids.append(rid)
                placed[i].append(rid)
        except ValueError as e:
            for engine, rids in zip(self.engines, placed, strict=True):
                for rid in rids:  # all or nothing: the prompts already queued are withdrawn
                    engine.abort(rid)
                    self.router.finished(rid)
                engine.step()  # drain their abort outputs
            raise ValueError(f"prompt {len(ids)}: {e}") from e
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
            busy = [(e, rids) for e, rids in zip(self.engines, placed, strict=True) if rids]
            if len(busy) == 1:
                done = self._run(*busy[0], bar)
            else:  # a thread per replica: each steps at its own pace, on its own devices
                with concurrent.futures.ThreadPoolExecutor(len(busy)) as pool:
                    done = {}
                    for part in pool.map(lambda b: self._run(*b, bar), busy):
                        done.update(part)
        return [done[i] for i in ids]

    def _run(self, engine: LLMEngine, ids: list[str], bar) -> dict[str, RequestOutput]:
        wanted, done = set(ids), {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    self.router.finished(out.request_id)
                    bar.update(1)
        return done


def normalized(v: np.ndarray) -> np.ndarray:
    """v / its L2 norm (a zero vector stays zero)."""
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v
