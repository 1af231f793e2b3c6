"""LLM: the offline library entry point, `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model=None` serves the bundled SmolLM2-135M-Instruct; other keyword arguments are
    `EngineConfig` fields (max_num_seqs, max_num_batched_tokens, dtype, ...).
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Returns one finished RequestOutput per prompt, in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                rid = f"gen-{self._next_id}"
                self._next_id += 1
                if isinstance(prompt, str):
                    self.engine.add_request(rid, prompt, params)
                else:
                    self.engine.add_request(rid, prompt_token_ids=list(prompt), params=params)
                ids.append(rid)
        except ValueError as e:
            for rid in ids:  # all or nothing: the prompts already queued are withdrawn
                self.engine.abort(rid)
            self.engine.step()  # drain their abort outputs
            raise ValueError(f"prompt {len(ids)}: {e}") from e
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted, done = set(ids), {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
