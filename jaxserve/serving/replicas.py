"""The server's engines: one AsyncEngine per data-parallel replica, behind one router.

Every replica steps on its own thread. A request goes to the replica the router picks
(core/router.py) and stays there: its aborts follow it, and its final output (whatever the
finish reason) takes it off that replica's load. With one replica this is a thin wrapper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from jaxserve.core.admission import Limits
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.router import Router
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import data_parallel
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.serving.async_engine import AsyncEngine, RequestStream


class ReplicaSet:
    def __init__(self, engines: list[LLMEngine], router: Router, max_queue_per_request: int,
                 on_step: Callable[[int, LLMEngine, list[RequestOutput]], None]):
        """`on_step(replica, engine, outputs)` runs on that replica's thread after each step."""
        self.router = router

        def hook(i: int):
            def after_step(engine: LLMEngine, outputs: list[RequestOutput]) -> None:
                for out in outputs:
                    if out.finished:
                        router.finished(out.request_id)
                on_step(i, engine, outputs)
            return after_step

        self.replicas = [AsyncEngine(e, max_queue_per_request, on_step=hook(i))
                         for i, e in enumerate(engines)]

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    @property
    def tokens_after_disconnect(self) -> int:
        return sum(r.tokens_after_disconnect for r in self.replicas)

    async def add_request(self, request_id: str, prompt: str | None = None,
                          params: SamplingParams | None = None, *,
                          prompt_token_ids: list[int] | None = None, priority: int = 0,
                          cache_salt: str | None = None, pooling: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        lora = None if lora_request is None else str(lora_request.lora_int_id)
        i = self.router.route(request_id, prompt_token_ids, cache_salt, lora)
        try:
            return await self.replicas[i].add_request(
                request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                priority=priority, cache_salt=cache_salt, pooling=pooling,
                lora_request=lora_request)
        except BaseException:  # refused (or its caller left): it holds no place there
            self.router.finished(request_id)
            raise

    async def take_over(self, request_id: str, **kwargs):
        """A decode engine takes a prefilled request over (AsyncEngine.take_over), counted on
        the replica the router picks like any request, so its abort finds it."""
        i = self.router.route(request_id)
        try:
            return await self.replicas[i].take_over(request_id, **kwargs)
        except BaseException:
            self.router.finished(request_id)
            raise

    def abort(self, request_id: str) -> None:
        i = self.router.owner(request_id)
        if i is not None:  # else it finished already: nothing to abort
            self.replicas[i].abort(request_id)

    async def call_all(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """fn(engine) on every replica's thread between its steps; the results in order."""
        return await asyncio.gather(*(r.call(fn) for r in self.replicas))

    # What the serving core asks of any set of engines (serving/disagg.py has the other).

    def admit_under(self, limits: Limits) -> None:
        """Admit requests under the server's limits (its max_tokens_limit); before start."""
        for r in self.replicas:
            r.engine.limits = limits

    async def add_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter on every engine: ValueError (the first engine's) with
        it taken back from every engine."""
        def add(engine):
            try:
                return engine.add_lora(lora)
            except ValueError as e:  # every replica is tried and undone alike
                return e
        errors = [r for r in await self.call_all(add) if isinstance(r, Exception)]
        if errors:
            await self.remove_lora(lora.lora_int_id)
            raise errors[0]

    async def lora_in_use(self, lora_id: int) -> bool:
        return any(await self.call_all(lambda e: e.is_lora_in_use(lora_id)))

    async def remove_lora(self, lora_id: int) -> None:
        await self.call_all(lambda e: e.remove_lora(lora_id))

    async def connect(self) -> None:
        pass

    def health(self) -> dict:
        return {}

    async def poll(self) -> None:
        pass  # the exporter is updated after every step

    async def snapshot(self) -> dict:
        return data_parallel.merge_snapshots(await self.call_all(lambda e: e.metrics_snapshot()))

    async def num_unfinished(self) -> int:
        return sum(await self.call_all(lambda e: e.num_unfinished_requests))

    async def abort_all(self) -> None:
        await self.call_all(lambda e: [e.abort(r) for r in list(e.requests)])
