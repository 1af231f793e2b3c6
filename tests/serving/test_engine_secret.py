"""The engines' doors under `python -m jaxserve launch --prefill 1 --decode 1`: a stranger on the
prefill engine's socket or on the decode engine's socket is refused, holds nothing and gets no
token; the front serves on, exactly, and every block comes back. A front refuses an engine that
cannot prove the secret."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from jaxserve.serving import engine_secret
from jaxserve.serving.client import Client
from jaxserve.serving.disagg import EngineLink
from jaxserve.serving.protocol import HEADER, decode_body, encode, read_frame
from tests.serving.launched import Launched

PROMPT = [300, 301, 302]  # one block of 8: always sent in a handover
PARAMS = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
ENGINES = ["prefill-0", "decode-0"]
WRONG = b"a secret of some other launch, long enough to pass"


@pytest.fixture(scope="module")
def launched(tiny_llama_dir):
    run = Launched(tiny_llama_dir, engines=1)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def reference(launched) -> list[int]:
    """The front's greedy tokens for PROMPT before any stranger came."""
    return _ask(launched)


def _ask(launched) -> list[int]:
    with Client(port=launched.port) as c:
        return c.generate(prompt_token_ids=PROMPT, **PARAMS)["token_ids"]


def _serves_on(launched, reference) -> None:
    assert _ask(launched) == reference
    launched.all_blocks_back(ENGINES)


def _talk(address: str, frames: list[dict], answer=None, wait_s: float = 3.0):
    """Connect to `address`, send `frames` (after `answer(challenge)`'s frame when the engine
    sends a challenge first) and read until the engine closes or `wait_s` passes: (frames
    read, whether it closed, the local port, what the engine holds meanwhile)."""
    host, port = address.rsplit(":", 1)
    got, closed = [], False
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        if answer is not None:
            got.append(_read(s))
            s.sendall(encode(answer(got[0])))
        for f in frames:
            s.sendall(encode(f))
        deadline = time.time() + wait_s
        try:
            while time.time() < deadline:
                frame = _read(s)
                if frame is None:
                    closed = True
                    break
                got.append(frame)
        except TimeoutError:
            pass
        return got, closed, s.getsockname()[1]


def _read(s: socket.socket) -> dict | None:
    head = s.recv(HEADER.size, socket.MSG_WAITALL)
    if len(head) < HEADER.size:
        return None
    return decode_body(s.recv(HEADER.unpack(head)[0], socket.MSG_WAITALL))


def _held(launched, engine: str) -> tuple[float, float]:
    return (launched.engine_value("kv_blocks_used", engine),
            launched.engine_value("handover_held", engine))


def _refused(launched, local_port: int, reason: str) -> None:
    """The engine logged the refusal of the connection from `local_port`, with its reason."""
    deadline = time.time() + 10
    while not any(f"from 127.0.0.1:{local_port}: {reason}" in line for line in launched.lines):
        assert time.time() < deadline, "".join(launched.lines[-20:])
        time.sleep(0.05)


def _wrong_hello(challenge: dict) -> dict:
    """What a process holding another secret answers the challenge with."""
    mine = engine_secret.nonce()
    return {"type": "hello", "nonce": mine,
            "proof": engine_secret.proof(WRONG, "front", challenge["nonce"], mine)}


GENERATE = {"type": "generate", "id": "x", "prompt_token_ids": PROMPT, "params": PARAMS,
            "stream": True}


@pytest.mark.parametrize("answer", [None, _wrong_hello], ids=["no-hello", "wrong-secret"])
def test_a_stranger_on_the_prefill_engine_socket_is_refused(launched, reference, answer):
    got, closed, port = _talk(launched.addresses["prefill-0"], [GENERATE], answer)
    held = _held(launched, "prefill-0")
    assert not [f for f in got if f["type"] == "token"]
    assert held == (0, 0)
    assert [f["type"] for f in got] == ["challenge", "error"] and closed
    assert got[1]["code"] == "unauthorized"
    _refused(launched, port, "its hello's proof is wrong" if answer else
             "its first frame is 'generate', not a hello")
    _serves_on(launched, reference)


def test_a_stranger_on_the_decode_engine_socket_is_refused(launched, reference):
    accept = GENERATE | {"type": "accept", "first_token": 5}
    got, closed, port = _talk(launched.addresses["decode-0"], [accept])
    held = _held(launched, "decode-0")
    assert not [f for f in got if f["type"] in ("reserved", "token")]
    assert held == (0, 0)
    assert [f["type"] for f in got] == ["challenge", "error"] and closed
    _refused(launched, port, "its first frame is 'accept', not a hello")
    _serves_on(launched, reference)


def test_a_front_refuses_an_engine_that_cannot_prove_the_secret():
    """A process on an engine's port that answers the hello with another secret's proof (one
    that took the port first, say) gets no request: the front's connect fails naming it."""
    async def impostor(reader, writer):
        writer.write(encode({"type": "challenge", "nonce": engine_secret.nonce()}))
        hello = await read_frame(reader, 1 << 16)
        writer.write(encode({"type": "hello", "proof": engine_secret.proof(
            WRONG, "engine", "any", hello["nonce"])}))
        await reader.read()

    async def run():
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = EngineLink("prefill-0", "prefill", f"127.0.0.1:{port}",
                          secret=b"the launch's own secret, long enough to pass")
        try:
            with pytest.raises(ConnectionError, match=f"prefill engine prefill-0 at "
                                                      f"127.0.0.1:{port} did not prove"):
                await link.connect(5)
        finally:
            link.close()
            server.close()

    asyncio.run(run())


def test_the_secret_leaves_the_environment_as_it_is_read():
    env = {engine_secret.ENV: "s" * 32, "OTHER": "1"}
    assert engine_secret.from_env(env) == b"s" * 32 and env == {"OTHER": "1"}
    assert engine_secret.from_env(env) is None
    with pytest.raises(ValueError, match=f"^{engine_secret.ENV}: give at least 32 characters"):
        engine_secret.from_env({engine_secret.ENV: "short"})
