"""Socket-protocol cases a new client runs into, on a real server over real sockets: a frame cut
short by a half-close, one request past the per-connection limit, and params nested too deeply
(msgpack decodes about a thousand levels)."""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import pytest

from jaxserve import LLMEngine
from jaxserve.serving.client import Client
from jaxserve.serving.protocol import HEADER, encode
from jaxserve.serving.server import ServerConfig
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm))  # the default limit, 64
    yield srv
    srv.stop()


def read_frame(sock: socket.socket) -> dict | None:
    """The next frame, or None when the server closed its end."""
    head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL), raw=False)


def test_truncated_frame_then_half_close_gets_bad_frame(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(struct.pack(">I", 100) + b"\x81\xa4type")  # 100 promised, 6 sent
        s.shutdown(socket.SHUT_WR)
        frame = read_frame(s)
        assert frame is not None and frame["type"] == "error"
        assert frame["code"] == "bad_frame" and "truncated" in frame["message"]
        assert read_frame(s) is None  # then the server closes
    wait_idle(server)


def test_request_past_the_connection_limit_is_refused_at_once(server):
    most = ServerConfig().max_concurrent_per_connection
    assert most == 64
    with Client(port=server.port) as c:
        steps = c.stats()["num_steps"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(b"".join(encode({"type": "generate", "id": f"r{i}", "prompt": "Once upon a",
                                   "params": {"max_tokens": 200, "ignore_eos": True}})
                           for i in range(most + 1)))
        frame = read_frame(s)
        took = time.monotonic() - t0
        assert frame["type"] == "error" and frame["id"] == f"r{most}", frame
        assert frame["code"] == "limit_exceeded"
        assert "max_concurrent_per_connection (64)" in frame["message"]
        with Client(port=server.port) as c:
            steps = c.stats()["num_steps"] - steps
        # read with the 64 before it, not after the engine took each of them between steps
        assert took < 10 and steps < 16, (took, steps)
    wait_idle(server)  # closing the connection aborted the 64 it held


def test_params_nested_too_deeply_are_refused_naming_the_field(server):
    deep: object = 1
    for _ in range(1000):
        deep = [deep]
    cases = [({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "limit_exceeded",
              "structured_outputs: invalid json: the schema nests"),
             ({"structured_outputs": {"grammar": "root ::= " + "(" * 5000 + '"a"'
                                      + ")" * 5000}}, "limit_exceeded",
              "structured_outputs: invalid grammar: nests too deeply"),
             ({"stop": deep}, "invalid_field", "params.stop nests lists and objects deeper")]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        for i, (params, code, message) in enumerate(cases):
            s.sendall(encode({"type": "generate", "id": f"r{i}", "prompt": "Hi",
                              "params": {"max_tokens": 2, **params}}))
            frame = read_frame(s)
            assert frame["type"] == "error" and frame["id"] == f"r{i}", frame
            assert frame["code"] == code and frame["message"].startswith(message), frame
        s.sendall(encode({"type": "generate", "id": "ok", "prompt": "Hi",
                          "params": {"max_tokens": 2, "ignore_eos": True}}))
        assert read_frame(s)["type"] == "done"  # the connection serves on
    wait_idle(server)
