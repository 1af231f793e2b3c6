"""HF transformers baselines on the same workload: `generate` in static batches, and HF's own
continuous batching (the manager behind `generate_batch`). Torch is needed only here."""

from __future__ import annotations

import time

from jaxserve.bench.workload import BenchRequest, progress_bar
from jaxserve.core.outputs import RequestMetrics


class _TimingStreamer:
    """A transformers streamer that only records when each generation step emits tokens."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_static(model, workload: list[BenchRequest], batch_size: int = 8, progress: bool = True):
    """HF `generate` in static batches of arrival order: a batch starts when its last member
    has arrived and the previous batch is done, and runs until its longest member finishes."""
    import torch

    reqs = sorted(workload, key=lambda r: r.arrival_s)
    results = {}
    bar = progress_bar(len(reqs), "hf static", progress)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        wait = t0 + max(r.arrival_s for r in batch) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in batch)
        streamer = _TimingStreamer()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, streamer=streamer)
        for r in batch:
            results[r.request_id] = RequestMetrics(
                r.request_id, t0 + r.arrival_s, len(r.prompt_token_ids),
                first_scheduled_time=started,
                token_times=streamer.times[:r.max_tokens],  # its own; the rest is batch waste
                finished_time=streamer.times[-1],  # answered when the batch returns
                finish_reason="length")
        bar.update(len(batch))
    bar.close()
    return [results[r.request_id] for r in workload], time.perf_counter() - t0


def run_continuous(model, workload: list[BenchRequest], progress: bool = True):
    """HF transformers' own continuous batching (the manager behind `generate_batch`), with
    each request's own max_new_tokens and its arrival time."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(r.max_tokens for r in workload), do_sample=False,
                          eos_token_id=-1, pad_token_id=0)
    pending = sorted(workload, key=lambda r: r.arrival_s)
    done: dict[str, object] = {}
    sent: dict[str, float] = {}
    bar = progress_bar(len(workload), "hf continuous", progress)
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=10,
                                                   warmup=False) as manager:
        # The manager's thread takes seconds to start serving; wait for one tiny request so
        # that start-up is not billed to the workload.
        manager.add_request(workload[0].prompt_token_ids, request_id="warmup", max_new_tokens=1,
                            eos_token_id=-1)
        while (out := manager.get_result(timeout=1)) is None or not out.is_finished():
            if not manager.is_running():
                raise RuntimeError("HF continuous batching manager stopped")
        t0 = time.perf_counter()
        while len(done) < len(workload):
            now = time.perf_counter()
            while pending and t0 + pending[0].arrival_s <= now:
                r = pending.pop(0)
                manager.add_request(r.prompt_token_ids, request_id=r.request_id,
                                    max_new_tokens=r.max_tokens, record_timestamps=True,
                                    eos_token_id=-1)
                sent[r.request_id] = t0 + r.arrival_s
            out = manager.get_result(timeout=0.01)
            if out is not None and out.is_finished():
                done[out.request_id] = out
                bar.update(1)
            elif not manager.is_running():
                raise RuntimeError("HF continuous batching manager stopped")
        duration = time.perf_counter() - t0
    bar.close()
    results = []
    for r in workload:
        rid = r.request_id
        out = done[rid]
        times = list(out.timestamps or [])
        if len(times) != len(out.generated_tokens):
            raise RuntimeError(f"{rid}: {len(out.generated_tokens)} tokens but "
                               f"{len(times)} timestamps")
        results.append(RequestMetrics(
            rid, sent[rid], len(r.prompt_token_ids),
            first_scheduled_time=out.lifespan[0] if out.lifespan[0] > 0 else None,
            token_times=times, finished_time=times[-1] if times else None,
            finish_reason="length" if out.error is None else out.error))
    return results, duration
