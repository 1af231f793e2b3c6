"""SimExecutor: drives the real Scheduler and BlockManager with a fake model (no jax).

Used by the scheduler's property tests and the host-overhead benchmark. Its step runs the
engine's own postprocess, so the stop rules and progress updates are the engine's. The fake
model "samples" token f(request, index), so every request's expected output is known in advance,
and it keeps a tag in every KV slot it writes, on the device pool and the host swap pool alike,
so a test can check that each sequence's cached context is really its own after any mix of
chunking, preemption and swapping. The tag is (request id, position); with prefix caching, where
requests share blocks, it is what the K/V of a position depends on: the position and every token
up to it (a running hash), so a block taken from the cache must hold exactly this sequence's
prefix.
"""

from __future__ import annotations

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import Sequence
from jaxserve.core.swap_space import SwapSpace
from jaxserve.engine.postprocess import Postprocessor


def fake_token(request_id: str, index: int) -> int:
    return (hash(request_id) * 31 + index * 7919) % 50_000


class SimExecutor:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int = 16,
                 num_host_blocks: int = 0, check_kv: bool = True, clock=None,
                 enable_caching: bool = False):
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size, enable_caching)
        swap = SwapSpace(num_host_blocks) if num_host_blocks else None
        kw = {"clock": clock} if clock is not None else {}
        self.scheduler = Scheduler(config, self.block_manager, swap, **kw)
        self.postprocessor = Postprocessor(self.scheduler, config.max_model_len)
        self.check_kv = check_kv
        self.device: dict[int, list] = {}  # block id -> slot tags
        self.host: dict[int, list] = {}
        self.requests: dict[str, Sequence] = {}
        self.finished: dict[str, Sequence] = {}
        self.num_steps = 0
        self._arrivals = 0

    def add(self, request_id: str, prompt_len: int, max_tokens: int, priority: int = 0,
            arrival_time: float | None = None, prompt: list[int] | None = None) -> Sequence:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(request_id, prompt if prompt is not None else [1] * prompt_len, params,
                       self._arrivals, 0, priority,
                       arrival_time if arrival_time is not None else self.scheduler.clock())
        self._arrivals += 1
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id)
        self.scheduler.finish(seq, "abort")
        self.finished[request_id] = seq

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.execute(out)
        return out

    def execute(self, out: SchedulerOutput) -> None:
        """What the engine does with a schedule: swap copies, the (fake) forward, postprocess."""
        for c in out.copies:  # in order, as the engine makes them
            for d, h in zip(c.device_ids, c.host_ids, strict=True):
                if c.to_host:
                    self.host[h] = list(self.device.get(d, []))
                else:
                    self.device[d] = list(self.host[h])
        # a row samples a token per decode step (several in a step of several)
        tokens = [[fake_token(s.seq.request_id, s.seq.num_output_tokens + i)
                   for i in range(s.num_steps)] if s.samples else [] for s in out.scheduled]
        if self.check_kv:
            for sch, row in zip(out.scheduled, tokens, strict=True):
                self._check_and_write(sch.seq, sch.start, sch.end - sch.start, row)
        for u in self.postprocessor.apply(out.scheduled, tokens, self.scheduler.clock()):
            if u.finished:
                self.finished[u.seq.request_id] = self.requests.pop(u.seq.request_id)
        self.num_steps += 1

    def _tags(self, seq: Sequence, end: int, ahead: list[int]) -> list:
        """The tags of positions 0..end-1; `ahead`: the tokens this step samples, the inputs
        of the later decode steps of a step of several."""
        if not self.block_manager.enable_caching:
            return [(seq.request_id, pos) for pos in range(end)]
        tags, h, known = [], 0, seq.num_prompt_tokens + seq.num_output_tokens
        for pos in range(end):
            h = hash((h, seq.token_at(pos) if pos < known else ahead[pos - known]))
            tags.append((pos, h))
        return tags

    def _check_and_write(self, seq: Sequence, start: int, n: int, ahead: list[int]) -> None:
        b = self.block_size
        want = self._tags(seq, start + n, ahead)
        for pos in range(start):  # the context this step reads must be this sequence's own
            tags = self.device.get(seq.block_table[pos // b])
            got = tags[pos % b] if tags is not None else None
            if got != want[pos]:
                raise AssertionError(f"{seq.request_id}: slot for position {pos} holds {got}")
        for pos in range(start, start + n):
            tags = self.device.setdefault(seq.block_table[pos // b], [None] * b)
            tags[pos % b] = want[pos]

    def run(self, max_steps: int = 100_000) -> None:
        while self.requests:
            self.step()
            if self.num_steps > max_steps:
                raise AssertionError(f"not done after {max_steps} steps: {self.requests}")
