"""The engines' doors under `python -m jaxserve launch --prefill 1 --decode 1`: a stranger on the
prefill engine's socket, on the decode engine's socket, or at the prefill engine's transfer
server with an offer's name is refused, holds nothing and gets no token; the front serves on,
exactly, and every block comes back. A front refuses an engine that cannot prove the secret,
and a clean shutdown logs no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
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


def _talk(address: str, frames: list[dict], held, answer=None, wait_s: float = 3.0):
    """Connect to `address`, send `frames` (after `answer(challenge)`'s frame when the engine
    sends a challenge first) and read until the engine closes or `wait_s` passes: (frames
    read, whether it closed, the local port, `held()` before this side closes)."""
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
        return got, closed, s.getsockname()[1], held()


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
    # nothing sent behind a hello: a frame the engine never reads turns its close into a
    # reset, which may drop the error frame
    got, closed, port, held = _talk(launched.addresses["prefill-0"],
                                    [] if answer else [GENERATE],
                                    lambda: _held(launched, "prefill-0"), answer)
    assert not [f for f in got if f["type"] == "token"]
    assert held == (0, 0)
    assert [f["type"] for f in got] == ["challenge", "error"] and closed
    assert got[1]["code"] == "unauthorized"
    _refused(launched, port, "its hello's proof is wrong" if answer else
             "its first frame is 'generate', not a hello")
    _serves_on(launched, reference)


def test_a_stranger_on_the_decode_engine_socket_is_refused(launched, reference):
    accept = GENERATE | {"type": "accept", "first_token": 5}
    got, closed, port, held = _talk(launched.addresses["decode-0"], [accept],
                                    lambda: _held(launched, "decode-0"))
    assert not [f for f in got if f["type"] in ("reserved", "token")]
    assert held == (0, 0)
    assert [f["type"] for f in got] == ["challenge", "error"] and closed
    _refused(launched, port, "its first frame is 'accept', not a hello")
    _serves_on(launched, reference)


# A stranger at a transfer server: pulls each number it may try for an offer, and says which
# it got. A pull of a number never offered waits on, so the test kills it.
STRANGER = """
import datetime, sys, threading
import jax
from jax.experimental import transfer
address, dtype, shape, *uuids = sys.argv[1:]
shape = tuple(int(n) for n in shape.split(","))
device = jax.devices()[0]
server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
conn = server.connect(address)
spec = jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
def pull(uuid):
    later = datetime.datetime.now() + datetime.timedelta(seconds=30)
    jax.block_until_ready(conn.pull(int(uuid), [spec, spec], timeout=later))
    print("pulled", uuid, flush=True)
for uuid in uuids:
    threading.Thread(target=pull, args=(uuid,), daemon=True).start()
print("pulling", flush=True)
threading.Event().wait()
"""


def _stranger_pulls(address: str, uuids: list[int], shape: tuple, dtype: str) -> list[str]:
    """The numbers a stranger pulled from `address` within a few seconds of asking."""
    proc = subprocess.Popen([sys.executable, "-c", STRANGER, address, dtype,
                             ",".join(map(str, shape)), *map(str, uuids)],
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 60
        while "pulling\n" not in lines:
            assert time.time() < deadline and proc.poll() is None, lines
            time.sleep(0.05)
        time.sleep(3)  # an offer it can name comes at once
    finally:
        proc.kill()
        proc.wait()
    reader.join(5)
    return [line.split()[1] for line in lines if line.startswith("pulled")]


def _front_secret(launched) -> bytes:
    """The secret as the launcher handed it to the front: a process of the same user can read
    another's environment, as it could attach a debugger to it."""
    with open(f"/proc/{launched.pids['front']}/environ", "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    return env[engine_secret.ENV.encode()]


def test_a_stranger_who_knows_an_offers_name_cannot_pull_its_blocks(launched, reference,
                                                                     tiny_llama_dir):
    """The test plays a second front of the launch and lets a stranger see the name of its
    offer: the numbers the stranger can make of the name without the secret take nothing;
    the decode engine then pulls the blocks, and decodes the reference's tokens."""
    secret = _front_secret(launched)
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        cfg = json.load(f)

    async def hand_over() -> tuple[list[str], list[int]]:
        p = EngineLink("p", "prefill", launched.addresses["prefill-0"], secret=secret)
        d = EngineLink("d", "decode", launched.addresses["decode-0"], secret=secret)
        try:
            await asyncio.gather(p.connect(30), d.connect(30))
            pq, dq = p.open("x"), d.open("x")
            p.send(GENERATE)
            first = await pq.get()
            d.send(GENERATE | {"type": "accept", "first_token": first["token_ids"][0]})
            reserved = await dq.get()
            assert reserved["type"] == "reserved" and reserved["num_blocks"] == 1, reserved
            offer = {"type": "offer", "id": "x", "first_block": reserved["first_block"],
                     "num_blocks": 1}
            p.send(offer | {"name": 5})
            refused = await pq.get()
            assert refused["code"] == "invalid_request", refused
            assert refused["message"].startswith("offer: name: must be a string"), refused
            name = engine_secret.offer_name()
            p.send(offer | {"name": name})
            offered = await pq.get()
            shape = (cfg["num_hidden_layers"], 1, 8, cfg["num_key_value_heads"],
                     cfg["hidden_size"] // cfg["num_attention_heads"])
            itemsize = offered["bytes"] // (2 * shape[0] * shape[2] * shape[3] * shape[4])
            guesses = [int(name, 16) % 2**64, int(name[:16], 16),
                       engine_secret.transfer_uuid(WRONG, name),
                       engine_secret.transfer_uuid(None, name)]
            stolen = await asyncio.to_thread(
                _stranger_pulls, p.info["transfer_address"], guesses, shape,
                {4: "float32", 2: "bfloat16"}[itemsize])
            assert stolen == []
            d.send({"type": "pull", "id": "x", "name": name,
                    "address": p.info["transfer_address"]})
            while (msg := await dq.get())["type"] != "done":
                assert msg["type"] in ("pulled", "token"), msg
            p.send({"type": "release", "id": "x"})
            assert (await pq.get())["finish_reason"] == "handover"
            return stolen, msg["token_ids"]
        finally:
            p.close()
            d.close()

    stolen, tokens = asyncio.run(hand_over())
    assert (stolen, tokens) == ([], reference)
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


def test_a_clean_shutdown_logs_no_traceback(launched):
    """With clients still connected to the front (the socket protocol, and HTTP keeping its
    connection alive), as a server has them when it is told to stop."""
    http = launched.client()
    http.completions.create(model="jaxserve", prompt=PROMPT, max_tokens=2)
    with Client(port=launched.port):
        launched.stop()
    http.close()
    assert launched.proc.returncode == 0
    log = "".join(launched.lines)
    assert "exit statuses: [0, 0, 0]" in log
    assert "Traceback" not in log and "CancelledError" not in log, log
