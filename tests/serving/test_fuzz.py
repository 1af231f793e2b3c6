"""Property-based fuzzing of what clients send: frames, generate requests, HTTP JSON bodies.

Whatever arrives gets an answer in the protocol's error shape (or a result), and the server stays
healthy and leaks nothing."""

from __future__ import annotations

import asyncio
import json
import socket

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import LLMEngine
from jaxserve.core.sampling_params import SamplingParams, param_names
from jaxserve.serving.protocol import ProtocolError, decode_body, parse_generate, read_frame
from tests.serving.server_fixture import RunningServer
from tests.serving.test_hardening import assert_serves, wait_idle
from tests.serving.test_hardening import read_frame as read_sock_frame
from tests.serving.test_server import engine_config

# Values of every JSON/msgpack kind, edge numbers included.
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4), max_leaves=12)
FIELDS = (*param_names(), "prompt", "prompt_token_ids", "id", "stream", "priority", "params",
          "cache_salt")


def field_maps(extra=values):
    """Maps whose keys are mostly real field names, with values of any kind."""
    return st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), extra, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | msgpack_values.map(lambda v: msgpack.packb(v)))
def test_frame_body_decodes_or_is_a_protocol_error(body):
    try:
        msg = decode_body(body)
    except ProtocolError as e:
        assert e.code == "bad_frame"
    else:
        assert isinstance(msg, dict) and isinstance(msg["type"], str)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=96))
def test_read_frame_on_any_byte_stream(data):
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        frames = []
        while True:
            try:
                msg = await read_frame(reader, max_bytes=64)
            except ProtocolError as e:
                if e.fatal:
                    return frames
                continue
            if msg is None:
                return frames
            frames.append(msg)

    for msg in asyncio.run(run()):
        assert isinstance(msg, dict)


@settings(max_examples=500, deadline=None)
@given(field_maps(), field_maps(msgpack_values))
def test_generate_request_parses_and_validates_or_names_its_field(top, params):
    msg = {"type": "generate", **top}
    if top.get("params") is None:
        msg["params"] = params
    try:
        req = parse_generate(msg)
    except ProtocolError as e:
        assert e.code == "invalid_field" and ":" in e.message
        return
    try:
        req.params.validate(max_logprobs=20)
    except ValueError as e:
        assert str(e).split()[0] in param_names()
    else:
        assert isinstance(req.params, SamplingParams)


# -------------------------------------------------------------------------- the real server

@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), max_tokens_limit=4,
                        max_frame_bytes=4096)
    yield srv
    srv.stop()


statuses: list[int] = []


def post(server, route: str, body) -> tuple[int, str, str]:
    """(status, body text, content type) of a JSON POST; the status is kept in `statuses`."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=120)
    conn.request("POST", route, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, r.read().decode()
    conn.close()
    statuses.append(status)
    return status, data, r.getheader("Content-Type", "")


def _body_maps():
    keys = st.sampled_from(("prompt", "messages", "max_tokens", "temperature", "top_p", "top_k",
                            "seed", "stop", "logprobs", "top_logprobs", "stream", "n", "model",
                            "stream_options", "max_completion_tokens", "ignore_eos", "echo",
                            "cache_salt"))
    # A valid body for either route, then up to two of its fields set to anything.
    good = {"prompt": "Hello", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0}
    return st.one_of(values, st.dictionaries(keys, values, max_size=2).map(
        lambda d: {**good, **d}))


@pytest.mark.slow
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_body_maps(), route=st.sampled_from(("/v1/completions", "/v1/chat/completions")))
def test_http_any_json_body_gets_a_result_or_an_openai_error(server, body, route):
    status, data, kind = post(server, route, body)
    if status == 200 and kind.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in data.split("\n\n") if e]
        assert events[-1] == "[DONE]", data
        for e in events[:-1]:
            assert "choices" in json.loads(e), e
        return
    answer = json.loads(data)
    if status == 200:
        assert answer["choices"], answer
    else:
        assert 400 <= status < 500, (status, answer)
        err = answer["error"]
        assert isinstance(err["message"], str) and err["type"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def _tool_bodies():
    """Chat bodies with tools, and Responses bodies, whose tool and input fields are set to
    anything (items of the right shapes among them)."""
    items = st.fixed_dictionaries({"type": st.sampled_from(
        ("message", "function_call", "function_call_output", "x")),
        "role": st.sampled_from(("user", "assistant", "system", "tool")),
        "content": values, "call_id": st.text(max_size=4), "name": st.just("f"),
        "arguments": values, "output": values})
    fields = {"tools": st.just([TOOL]) | values | st.lists(values, max_size=2),
              "tool_choice": st.sampled_from(("none", "auto", "required", "x")) | values
              | st.just({"type": "function", "function": {"name": "f"}}),
              "parallel_tool_calls": values,
              "messages": st.lists(items | values, max_size=3),
              "input": st.text(max_size=8) | st.lists(items | values, max_size=3) | values,
              "text": values | st.just({"format": {"type": "json_schema", "schema": {}}}),
              "instructions": values, "previous_response_id": values, "store": values,
              "max_output_tokens": values}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL], "max_tokens": 2}
    resp = {"input": "Hi", "tools": [TOOL], "max_output_tokens": 2}
    changes = st.dictionaries(st.sampled_from(sorted(fields)), values, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: fields[k] for k in d}))
    return st.tuples(st.sampled_from((("/v1/chat/completions", chat), ("/v1/responses", resp))),
                     changes, st.booleans())


@pytest.mark.slow
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_tool_bodies())
def test_http_tools_and_responses_bodies_get_a_result_or_an_openai_error(server, case):
    (route, good), change, stream = case
    status, data, _ = post(server, route, {**good, **change, "stream": stream})
    assert status == 200 or 400 <= status < 500, (status, data)
    if status == 200 and stream:
        events = [e for e in data.split("\n\n") if e]
        assert events and "error" not in events[-1].split("\n")[0], data
    elif status != 200:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["type"] and err["param"], err


ANTHROPIC_TOOL = {"name": "f", "input_schema": TOOL["function"]["parameters"]}


def _messages_bodies():
    """Messages bodies (for /v1/messages and its count_tokens) whose fields are set to
    anything: content blocks of every kind, tools and tool choices of the right shapes among
    them."""
    text = st.text(max_size=8) | values
    blocks = st.fixed_dictionaries({
        "type": st.sampled_from(("text", "tool_use", "tool_result", "image", "x")),
        "text": text, "id": st.text(max_size=4), "name": st.just("f"), "input": values,
        "tool_use_id": st.text(max_size=4), "content": text | st.lists(values, max_size=2),
        "is_error": values})
    content = text | st.lists(blocks | values, max_size=3)
    messages = st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(("user", "assistant", "system")) | values,
        "content": content}) | values, max_size=3)
    fields = {"messages": messages | values, "system": text | st.lists(blocks, max_size=2),
              "tools": st.just([ANTHROPIC_TOOL]) | st.lists(values, max_size=2) | values,
              "tool_choice": st.fixed_dictionaries({
                  "type": st.sampled_from(("auto", "any", "tool", "none", "x")),
                  "name": st.just("f") | values, "disable_parallel_tool_use": values}) | values,
              "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | values,
              "max_tokens": st.integers(-1, 6) | values, "model": st.just("jaxserve") | values,
              "temperature": values, "top_p": values, "top_k": values,
              "metadata": st.fixed_dictionaries({"user_id": values}) | values}
    changes = st.dictionaries(st.sampled_from(sorted(fields)), values, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: fields[k] for k in d}))
    return st.tuples(st.sampled_from(("/v1/messages", "/v1/messages/count_tokens")), changes,
                     st.booleans())


@pytest.mark.slow
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_messages_bodies())
def test_http_messages_bodies_get_a_result_or_an_anthropic_error(server, case):
    route, change, stream = case
    good = {"model": "jaxserve", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0}
    status, data, kind = post(server, route, {**good, **change, "stream": stream})
    assert status == 200 or 400 <= status < 500, (status, data)
    if status != 200:
        answer = json.loads(data)
        assert answer["type"] == "error" and isinstance(answer["error"]["message"], str)
        assert answer["error"]["type"].endswith("_error"), answer
    elif kind.startswith("text/event-stream"):
        events = [json.loads(e.split("\n")[1].removeprefix("data: "))
                  for e in data.split("\n\n") if e]
        assert events[0]["type"] == "message_start", data
        assert events[-1]["type"] == "message_stop", data
    else:
        answer = json.loads(data)
        assert answer.get("type") == "message" or answer["input_tokens"] > 0, answer


def _embedding_bodies():
    """Embeddings bodies with input, encoding_format, dimensions and normalize set to anything
    (good values among them)."""
    ids = st.lists(st.integers(-5, 60000), max_size=4)
    fields = {"input": st.text(max_size=8) | ids | st.lists(st.text(max_size=6) | ids,
                                                             max_size=3) | values,
              "encoding_format": st.sampled_from(("float", "base64", "x")) | values,
              "dimensions": st.sampled_from((576, 64)) | values,
              "normalize": values, "model": values}
    changes = st.dictionaries(st.sampled_from(sorted(fields)), values, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: fields[k] for k in d}))
    return changes.map(lambda d: {"input": "Hi", **d})


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_embedding_bodies())
def test_http_embeddings_bodies_get_vectors_or_an_openai_error(server, body):
    status, data, _ = post(server, "/v1/embeddings", body)
    answer = json.loads(data)
    if status == 200:
        assert answer["data"] and answer["usage"]["prompt_tokens"] > 0, answer
    else:
        assert 400 <= status < 500, (status, answer)
        err = answer["error"]
        assert isinstance(err["message"], str) and err["type"], err


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.binary(max_size=200) | st.lists(
    msgpack_values | field_maps(msgpack_values).map(lambda m: {"type": "generate", **m}),
    max_size=4).map(lambda vs: b"".join(len(b).to_bytes(4, "big") + b
                                        for b in map(msgpack.packb, vs))))
def test_socket_any_bytes_get_error_frames_and_the_server_stays_healthy(server, data):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(0.5)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    try:
        while True:
            f = read_sock_frame(s)
            assert f["type"] in ("error", "done", "token", "health"), f
            if f["type"] == "error":
                assert isinstance(f["code"], str) and isinstance(f["message"], str)
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        s.close()


@pytest.mark.slow
def test_after_the_fuzzing_the_server_is_healthy_and_empty(server):
    assert 200 in statuses and 400 in statuses  # the bodies reached both outcomes
    wait_idle(server, 10)
    assert_serves(server)
