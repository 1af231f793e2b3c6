"""The server against hostile-but-fair clients: real sockets, the real default model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from jaxserve import LLMEngine
from jaxserve.serving.client import Client
from jaxserve.serving.protocol import encode
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config

pytestmark = pytest.mark.slow

MAX_SEQS = 8  # one step's worth of tokens: at most one per running sequence


@pytest.fixture(scope="module")
def server(smollm):
    cfg = engine_config(max_num_seqs=MAX_SEQS, seq_buckets=(MAX_SEQS,), num_kv_blocks=128)
    engine = LLMEngine(cfg, loaded=smollm)
    engine.warmup()  # as serve.py does: no compile inside the timed windows below
    srv = RunningServer(engine, write_stall_timeout_s=1.0)
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------ helpers

def connect(srv, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connect, so the window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", srv.port))
    s.settimeout(60)
    return s


def read_frame(s: socket.socket) -> dict:
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf
    (n,) = struct.unpack(">I", exact(4))
    return msgpack.unpackb(exact(n), raw=False)


PROMPT = "Tell me a long story about a cat."


def gen(rid: str, max_tokens: int = 200, stream: bool = True, **params) -> bytes:
    return encode({"type": "generate", "id": rid, "prompt": PROMPT,
                   "stream": stream, "params": {"temperature": 0, "max_tokens": max_tokens,
                                                "ignore_eos": True, **params}})


def stats(srv) -> dict:
    with srv.client() as c:
        return c.stats()


def wait_idle(srv, timeout: float) -> float:
    """Seconds until nothing runs or waits and every KV block is back."""
    t0 = time.monotonic()
    with srv.client() as c:
        while True:
            s = c.stats()
            if s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"not idle after {timeout}s: {s}")
            time.sleep(0.02)


def wait_until(srv, what: str, done, timeout: float = 60) -> None:
    """Poll the server's stats until done(stats) holds."""
    deadline = time.monotonic() + timeout
    while not done(stats(srv)):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def idle_within_a_second(srv, t_left: float, who: str) -> None:
    """Every KV block is back within a second of the client leaving at t_left."""
    wait_idle(srv, 10)
    took = time.monotonic() - t_left
    print(f"KV back to 0 {took:.3f} s after the {who} left")
    assert took <= 1.0


def post_completion(s: socket.socket, body: dict) -> None:
    """Send a raw HTTP POST /v1/completions on `s` (the test then reads, or does not)."""
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)


def http(srv, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=120)
    conn.request(method, path, body=body,
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


def assert_serves(srv) -> None:
    with srv.client() as c:
        assert c.health()["status"] == "ok"
        done = c.generate("The capital of France is", temperature=0, max_tokens=4,
                          ignore_eos=True)
        assert done["completion_tokens"] == 4


# ------------------------------------------------------------------- 0 and 5: refused values

@pytest.mark.parametrize("params, field", [
    ({"seed": -1}, "seed"), ({"top_k": 2**31}, "top_k"), ({"temperature": float("nan")},
                                                              "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 10**6}, "logprobs"),
])
def test_socket_refuses_out_of_range_values(server, params, field):
    s = connect(server)
    s.sendall(gen("x", **{"max_tokens": 4, **params}))
    f = read_frame(s)
    s.close()
    assert f["type"] == "error" and f["code"] == "invalid_field" and f["id"] == "x"
    assert f["message"].startswith(f"params.{field}")


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "hi", "top_k": 2147483648}', "top_k"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "hi", "top_p": -1}', "top_p"),
])
def test_http_refuses_out_of_range_values(server, body, param):
    status, err = http(server, "POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == param, err


def test_http_deeply_nested_json_is_a_400_in_openai_shape(server):
    status, err = http(server, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert_serves(server)


def test_big_seed_within_range_generates(server):
    s = connect(server)
    s.sendall(gen("x", 4, stream=False, seed=2**40, temperature=1.0))
    f = read_frame(s)
    s.close()
    assert f["type"] == "done" and f["completion_tokens"] == 4


# -------------------------------------------------------- 0: a failure inside the engine step

def test_a_request_failing_inside_the_step_fails_alone(server):
    s = connect(server)
    for rid in "abc":
        s.sendall(gen(rid, 40, stream=False))
    wait_until(server, "three running", lambda st: st["num_running"] >= 3)

    def corrupt(engine):  # a bug that touches one request: its top_k no longer fits int32
        [rid] = [r for r in engine.requests if r.endswith("-b")]
        seq = engine.requests[rid]
        seq.params = dataclasses.replace(seq.params, top_k=2**40)

    asyncio.run_coroutine_threadsafe(server.server.replicas.call_all(corrupt),
                                     server.loop).result(30)
    frames = {f["id"]: f for f in (read_frame(s) for _ in range(3))}
    s.close()
    assert frames["b"]["type"] == "error" and frames["b"]["code"] == "internal_error"
    assert "OverflowError" in frames["b"]["message"]
    for rid in "ac":
        assert frames[rid]["type"] == "done" and frames[rid]["completion_tokens"] == 40
    wait_idle(server, 5)
    assert_serves(server)


# ------------------------------------------------------------- 1: clients that leave mid-way

def test_pipelined_requests_of_a_departed_client_stop_at_once(server, smollm):
    before = stats(server)
    s = connect(server)
    s.sendall(b"".join(gen(f"r{i}", 200) for i in range(24)))  # 8 run, 16 wait
    while read_frame(s)["type"] != "token":  # the batch is generating
        pass
    s.close()
    idle_within_a_second(server, time.monotonic(), "client")
    after = stats(server)
    # Only requests queued before the client left count; frames still unread never start.
    assert 1 <= after["num_disconnects"] - before["num_disconnects"] <= 24
    late = after["tokens_after_disconnect"] - before["tokens_after_disconnect"]
    # At most the step in flight when the client left: a token per running sequence, and a
    # first token per waiting request whose prompt it computed (held prefills, up to
    # max_num_seqs of them by default).
    assert late <= 2 * MAX_SEQS
    # Nothing else moved: beyond those, the waiting requests never started (all 24 prompts
    # would be 24 of these).
    prompt = len(smollm.tokenizer.encode(PROMPT)) + 2  # the engine's special tokens, if any
    assert after["prompt_tokens"] - before["prompt_tokens"] <= 2 * MAX_SEQS * prompt


def test_http_client_that_disconnects_stops_its_completion(server):
    before = stats(server)
    s = socket.create_connection(("127.0.0.1", server.server.http_port))
    post_completion(s, {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                        "temperature": 0})
    wait_until(server, "generating", lambda st: st["generation_tokens"]
               - before["generation_tokens"] >= 5)
    s.close()
    idle_within_a_second(server, time.monotonic(), "HTTP client")
    after = stats(server)
    assert after["num_disconnects"] - before["num_disconnects"] == 1
    assert after["tokens_after_disconnect"] - before["tokens_after_disconnect"] <= 1
    assert after["generation_tokens"] - before["generation_tokens"] < 200


# ------------------------------------------------------------------ 2: clients that stop reading

def test_socket_client_that_stops_reading_is_cut_off(server):
    before = stats(server)
    s = connect(server, rcvbuf=4096)
    s.sendall(b"".join(gen(f"r{i}", 200) for i in range(4)))
    wait_until(server, "cut off", lambda st: st["num_slow_readers_cut_off"]
               > before["num_slow_readers_cut_off"])
    wait_idle(server, 5)
    after = stats(server)
    assert after["generation_tokens"] - before["generation_tokens"] < 4 * 200
    s.close()
    assert_serves(server)


def test_sse_stream_that_is_not_read_is_cut_off_and_its_handler_ends(server):
    before = stats(server)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.server.http_port))
    post_completion(s, {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                        "temperature": 0, "stream": True, "logprobs": 5})
    wait_until(server, "cut off", lambda st: st["num_slow_readers_cut_off"]
               > before["num_slow_readers_cut_off"])
    wait_idle(server, 5)
    assert stats(server)["generation_tokens"] - before["generation_tokens"] < 200
    s.close()
    assert_serves(server)


# ------------------------------------------------------------ 3: big inputs and the event loop

def _health_rtts(srv, stop: threading.Event, out: list[float]) -> None:
    with Client(port=srv.port) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.health()
            out.append(time.perf_counter() - t)
            time.sleep(0.01)


def _assert_loop_responsive(rtts: np.ndarray) -> None:
    """Most health checks answered within 50 ms. A stalled event loop slows nearly every sample
    (tokenizing one ~1 MB prompt on it takes ~0.6 s, and the attacks send dozens); a few slow
    samples are this test process's own threads and the other test worker holding the
    machine's few cores (on two cores, one CI run saw three samples at 38-79 ms), hence the 90th
    percentile rather than the slowest."""
    assert len(rtts) >= 20
    assert np.percentile(rtts, 90) <= 0.050, np.percentile(rtts, [50, 90, 99])


def _with_bystander(srv, attack) -> np.ndarray:
    stop, rtts = threading.Event(), []
    t = threading.Thread(target=_health_rtts, args=(srv, stop, rtts))
    t.start()
    try:
        attack()
    finally:
        stop.set()
        t.join()
    return np.array(rtts)


def test_big_inputs_are_refused_without_stalling_the_loop(server):
    huge = "word " * 200_000  # ~1 MB: refused by its size, never tokenized
    big = "word " * 4_000  # 20 kB: under the size bound, tokenized off the loop, too long
    answers = []

    frames = [encode({"type": "generate", "id": str(j), "prompt": p,
                      "params": {"max_tokens": 4}}) for j, p in enumerate((huge, big, huge, big))]
    t_end = time.monotonic() + 2.0

    def attacker(i):
        while time.monotonic() < t_end:  # 4 pipelined frames a round, a fresh connection each
            s = connect(server)
            s.sendall(b"".join(frames))
            answers.extend(read_frame(s) for _ in frames)
            s.close()

    def attack():
        threads = [threading.Thread(target=attacker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    rtts = _with_bystander(server, attack)
    print(f"{len(answers)} refused; health p50/p99 ms", np.percentile(rtts, [50, 99]) * 1e3)
    assert len(answers) >= 16 and len(answers) % 4 == 0
    assert all(a["type"] == "error" and a["code"] == "limit_exceeded" for a in answers)
    _assert_loop_responsive(rtts)


def test_health_stays_fast_under_full_load(server):
    def load():
        async def main():
            from jaxserve.serving.client import AsyncClient

            async def one(i):
                async with AsyncClient(port=server.port) as c:
                    await c.generate(f"Count to {i}:", temperature=0, max_tokens=24,
                                     ignore_eos=True)
            await asyncio.gather(*(one(i) for i in range(32)))
        asyncio.run(main())

    rtts = _with_bystander(server, load)
    print("health under load p50/p99 ms", np.percentile(rtts, [50, 99]) * 1e3)
    _assert_loop_responsive(rtts)
