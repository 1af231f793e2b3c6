"""The server over real loopback sockets, on the real default model."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import time

import msgpack
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.serving.client import AsyncClient, Client, ServerError
from jaxserve.serving.protocol import encode
from tests.serving.server_fixture import RunningServer

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at",
           "The largest planet is", "import numpy as np\n", "My favourite colour is",
           "1, 2, 3, 4,"]
MAX_TOKENS = 12


def engine_config(**kw) -> EngineConfig:
    args = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=256,
                num_kv_blocks=256, token_buckets=(32, 64, 256), seq_buckets=(8, 32),
                block_buckets=(4, 16))
    args.update(kw)
    return EngineConfig(**args)


@pytest.fixture(scope="module")
def expected(smollm):
    """LLM.generate (in process) output for the prompts: the reference for the server."""
    from jaxserve import LLM

    llm = LLM.from_engines([LLMEngine(engine_config(), loaded=smollm)])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    return {p: (o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(PROMPTS, outs,
                                                                           strict=True)}


@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), max_frame_bytes=4096,
                        max_tokens_limit=128, max_concurrent_per_connection=8)
    yield srv
    srv.stop()


def wait_idle(srv, timeout=30):
    """Stats until nothing runs and every block is back."""
    deadline = time.time() + timeout
    with Client(port=srv.port) as c:
        while time.time() < deadline:
            s = c.stats()
            if s["num_running"] == s["num_waiting"] == s["num_held"] == s["kv_blocks_used"] == 0:
                return s
            time.sleep(0.05)
    raise AssertionError(f"server not idle: {s}")


async def stream_one(port: int, prompt: str) -> tuple[list[int], str, dict]:
    async with AsyncClient(port=port) as c:
        ids, text, done = [], "", None
        async for f in c.generate_stream(prompt, temperature=0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True):
            if f["type"] == "token":
                ids += f["token_ids"]
                text += f["text"]
            else:
                done = f
        return ids, text, done


def test_streams_equal_llm_generate_for_32_concurrent_clients(server, expected):
    async def main():
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
        return prompts, await asyncio.gather(*(stream_one(server.port, p) for p in prompts))

    prompts, results = asyncio.run(main())
    for p, (ids, text, done) in zip(prompts, results, strict=True):
        want_ids, want_text = expected[p]
        assert ids == want_ids and done["token_ids"] == want_ids
        assert text == want_text == done["text"]
        assert done["finish_reason"] == "length" and done["completion_tokens"] == MAX_TOKENS
        assert 0 < done["ttft"] <= done["e2e"]
    wait_idle(server)


def test_sync_client_generate_and_health(server, expected):
    with Client(port=server.port) as c:
        assert c.health()["status"] == "ok"
        done = c.generate(PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert done["token_ids"] == expected[PROMPTS[0]][0]


def test_abort_by_frame_and_by_disconnect_free_blocks(server):
    with Client(port=server.port) as c:
        frames = c.generate_stream(PROMPTS[1], temperature=0, max_tokens=100, ignore_eos=True,
                                   request_id="long")
        first = next(frames)
        assert first["type"] == "token"
        assert c.stats()["kv_blocks_used"] > 0
        c.abort("long")
        last = list(frames)[-1]
        assert last["type"] == "done" and last["finish_reason"] == "abort"
    wait_idle(server)
    # Disconnect: start a long request and close the socket without a word.
    c = Client(port=server.port)
    frames = c.generate_stream(PROMPTS[2], temperature=0, max_tokens=100, ignore_eos=True)
    next(frames)
    c.close()
    stats = wait_idle(server)
    assert stats["kv_blocks_used"] == 0


def test_held_requests_stream_their_first_token_and_free_their_blocks(smollm, expected):
    """Two decode slots taken by long answers: two more requests get their first token while
    held; one disconnects and one is aborted while held, a third, held in turn, runs to the
    end with the tokens it always has, and every block comes back."""
    srv = RunningServer(LLMEngine(engine_config(max_num_seqs=2, max_held_seqs=2,
                                                seq_buckets=(4,)), loaded=smollm))
    long = dict(temperature=0, max_tokens=120, ignore_eos=True)
    try:
        runners = [Client(port=srv.port) for _ in range(2)]
        longs = [r.generate_stream(PROMPTS[i], request_id=f"long{i}", **long)
                 for r, i in zip(runners, (1, 2), strict=True)]
        assert all(next(f)["type"] == "token" for f in longs)
        gone, aborted = Client(port=srv.port), Client(port=srv.port)
        held = [gone.generate_stream(PROMPTS[3], **long),
                aborted.generate_stream(PROMPTS[4], request_id="held", **long)]
        assert all(next(f)["type"] == "token" for f in held)  # their first token, held
        with Client(port=srv.port) as c:
            assert c.stats()["num_held"] == 2
        gone.close()
        aborted.abort("held")
        assert list(held[1])[-1]["finish_reason"] == "abort"
        with Client(port=srv.port) as c:
            third = c.generate_stream(PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
                                      ignore_eos=True)
            assert next(third)["type"] == "token"
            for r, f, i in zip(runners, longs, (1, 2), strict=True):
                r.abort(f"long{i}")
                assert list(f)[-1]["finish_reason"] == "abort"
            assert list(third)[-1]["token_ids"] == expected[PROMPTS[0]][0]
        for c in (*runners, aborted):
            c.close()
        assert wait_idle(srv)["kv_blocks_used"] == 0
    finally:
        srv.stop()


def test_limits_and_errors_name_the_problem(server):
    with Client(port=server.port) as c:
        with pytest.raises(ServerError, match="max_tokens_limit") as e:
            c.generate("hi", max_tokens=1000)
        assert e.value.code == "limit_exceeded"
        with pytest.raises(ServerError, match="max_prompt_tokens"):
            c.generate(prompt_token_ids=[5] * 300, max_tokens=4)
        with pytest.raises(ServerError, match="top_p"):
            c.generate("hi", top_p=2.0)
        with pytest.raises(ServerError, match="temperature"):
            c.generate("hi", temperature="hot")
        with pytest.raises(ServerError, match="vocabulary"):
            c.generate(prompt_token_ids=[10**9], max_tokens=2)
        c._send({"type": "teleport"})
        with pytest.raises(ServerError, match="unknown frame type"):
            c.health()

    async def too_many():
        async with AsyncClient(port=server.port) as ac:
            streams = [ac.generate_stream(PROMPTS[0], max_tokens=50, ignore_eos=True,
                                          request_id=f"x{i}") for i in range(9)]
            firsts = await asyncio.gather(*(s.__anext__() for s in streams[:8]))
            assert all(f["type"] == "token" for f in firsts)
            with pytest.raises(ServerError, match="max_concurrent_per_connection"):
                await streams[8].__anext__()
            for i in range(8):
                await ac.abort(f"x{i}")

    asyncio.run(too_many())
    wait_idle(server)


def test_fuzz_does_not_disturb_a_good_client(server, expected):
    rng = random.Random(0)

    def garbage(i: int) -> bytes:
        kind = i % 6
        if kind == 0:
            return os.urandom(rng.randint(1, 64))
        if kind == 1:  # truncated frame: header promises more than comes
            return struct.pack(">I", 100) + b"\x81\xa4type"
        if kind == 2:  # oversized frame
            return struct.pack(">I", 10**6) + b"x" * 100
        if kind == 3:  # valid frame, wrong field types
            return encode({"type": "generate", "id": 5, "prompt": ["x"], "params": "hot"})
        if kind == 4:  # valid msgpack that is not a map
            body = msgpack.packb([1, 2, 3])
            return struct.pack(">I", len(body)) + body
        return encode({"type": "generate", "id": "g", "prompt": "hi",
                       "params": {"max_tokens": True, "top_k": 1.5}})

    async def attacker(i: int):
        try:
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(garbage(i))
            await w.drain()
            await asyncio.wait_for(r.read(4096), 2)
            w.close()
        except (TimeoutError, ConnectionError):
            pass

    async def main():
        good = asyncio.gather(*(stream_one(server.port, p) for p in PROMPTS[:4]))
        bad = asyncio.gather(*(attacker(i) for i in range(60)))
        return (await asyncio.gather(good, bad))[0]

    results = asyncio.run(main())
    for p, (ids, text, done) in zip(PROMPTS[:4], results, strict=True):
        assert ids == expected[p][0] and text == expected[p][1]
        assert done["token_ids"] == ids
    with Client(port=server.port) as c:
        assert c.health()["status"] == "ok"
    wait_idle(server)


def test_load_every_request_completes_or_is_refused(smollm):
    srv = RunningServer(LLMEngine(engine_config(max_waiting_requests=8), loaded=smollm))
    try:
        async def one(i):
            try:
                async with AsyncClient(port=srv.port) as c:
                    n = 0
                    async for f in c.generate_stream(PROMPTS[i % 8], temperature=0,
                                                     max_tokens=4 + i % 5, ignore_eos=True):
                        n += f["type"] == "token"
                    assert n == 4 + i % 5 and f["finish_reason"] == "length"
                    return "done"
            except ServerError as e:
                assert e.code == "queue_full" and "max_waiting_requests" in str(e)
                return "refused"

        async def main():
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(80))), 300)

        results = asyncio.run(main())
        assert len(results) == 80
        assert results.count("done") >= 8 and results.count("done") + results.count(
            "refused") == 80
        wait_idle(srv)
    finally:
        srv.stop()


def test_api_key_required(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), api_key="s3cret")
    try:
        with Client(port=srv.port) as c, pytest.raises(ServerError, match="auth"):
            c.generate("hi", max_tokens=2)
        with pytest.raises(ServerError, match="invalid api_key"):
            Client(port=srv.port, api_key="wrong")
        with Client(port=srv.port, api_key="s3cret") as c:
            assert c.generate("hi", max_tokens=2)["completion_tokens"] == 2
    finally:
        srv.stop()


def test_socket_raw_oversized_frame_gets_error_then_close(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(struct.pack(">I", 5000) + b"x" * 10)
    data = s.recv(4096)
    (n,) = struct.unpack(">I", data[:4])
    frame = msgpack.unpackb(data[4:4 + n])
    assert frame["code"] == "frame_too_large" and "max_frame_bytes" in frame["message"]
    assert s.recv(4096) == b""  # closed
    s.close()


def test_n_samples_over_the_socket(server):
    """A token frame per sample that moved (with its index); the done frame carries every
    sample under "choices" and counts all their tokens."""
    with Client("127.0.0.1", server.port) as c:
        frames = list(c.generate_stream("Once upon a time", n=3, temperature=1.0, seed=9,
                                        max_tokens=6, ignore_eos=True))
    done = frames[-1]
    assert done["type"] == "done" and [ch["index"] for ch in done["choices"]] == [0, 1, 2]
    for ch in done["choices"]:
        streamed = [t for f in frames[:-1] if f["index"] == ch["index"]
                    for t in f["token_ids"]]
        assert streamed == ch["token_ids"] and len(streamed) == 6
    assert done["completion_tokens"] == 18 and done["token_ids"] == done["choices"][0]["token_ids"]


def test_logprobs_and_prompt_logprobs_over_the_socket(server):
    """Token frames carry their tokens' logprobs; the done frame all of them and the prompt's
    (each top list best first, as [token id, logprob] pairs)."""
    with Client("127.0.0.1", server.port) as c:
        frames = list(c.generate_stream("The capital of France is", temperature=0,
                                        max_tokens=4, logprobs=2, prompt_logprobs=1))
    done = frames[-1]
    streamed = [e for f in frames[:-1] for e in f["logprobs"]]
    assert streamed == done["logprobs"] and len(streamed) == 4
    for e, token in zip(done["logprobs"], done["token_ids"], strict=True):
        assert len(e["top"]) == 2 and e["top"][0][0] == token  # greedy: the best
        assert e["top"][0][1] == pytest.approx(e["logprob"])
    prompt = done["prompt_logprobs"]
    assert len(prompt) == done["prompt_tokens"] and prompt[0] is None
    assert all(e["rank"] >= 1 and len(e["top"]) == 1 and e["logprob"] <= e["top"][0][1]
               for e in prompt[1:])
