"""AsyncEngine on a tiny model: thread-safe submission, routing, and the slow-consumer cut-off."""

from __future__ import annotations

import asyncio

from jaxserve import SamplingParams
from jaxserve.serving.async_engine import AsyncEngine
from tests.helpers import make_engine


def test_concurrent_requests_route_to_their_streams(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ae = AsyncEngine(engine)
    ae.start()

    async def one(i):
        s = await ae.add_request(f"r{i}", prompt_token_ids=[5 + i, 6, 7],
                                 params=SamplingParams(temperature=0, max_tokens=3 + i,
                                                       ignore_eos=True))
        outs = [o async for o in s]
        assert {o.request_id for o in outs} == {f"r{i}"}
        return len(outs[-1].outputs[0].token_ids)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(10)))

    try:
        assert asyncio.run(main()) == [3 + i for i in range(10)]
    finally:
        ae.stop()


def test_consumer_that_stops_reading_is_aborted(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ae = AsyncEngine(engine, max_queue_per_request=2)
    ae.start()

    async def main():
        s = await ae.add_request("slow", prompt_token_ids=[5, 6, 7],
                                 params=SamplingParams(temperature=0, max_tokens=60,
                                                       ignore_eos=True))
        for _ in range(200):  # never read; the engine must not wait for us
            if s.overflowed:
                break
            await asyncio.sleep(0.02)
        assert s.overflowed
        for _ in range(200):
            if not await ae.call(lambda e: e.num_unfinished_requests):
                break
            await asyncio.sleep(0.02)
        return await ae.call(lambda e: (e.num_unfinished_requests,
                                        e.block_manager.num_free_blocks,
                                        e.block_manager.num_blocks))

    try:
        unfinished, free, total = asyncio.run(main())
        assert unfinished == 0 and free == total
    finally:
        ae.stop()
