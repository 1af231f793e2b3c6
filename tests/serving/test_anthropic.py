"""Anthropic's Messages API: the conversation mapping on its own, then the official `anthropic`
client and raw HTTP against a real server (key "k", model "smollm2")."""

from __future__ import annotations

import http.client
import json
import socket
import time

import jsonschema
import pytest

from jaxserve.serving.openai import messages as messages_api
from tests.serving.test_hardening import stats, wait_idle, wait_until
from tests.serving.test_tools import CITY, SCHEMAS, WEATHER

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": WEATHER},
         {"name": "get_time", "input_schema": CITY}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer takes sampling kwargs


def test_blocks_map_onto_chat_messages_with_tool_calls_and_results():
    body = {"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Hi."}],
            "messages": ASK + [
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_time",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "10:00"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "such"}]},
                    {"type": "text", "text": "Thanks."}]},
                {"role": "assistant", "content": "It is"}]}
    assert messages_api.conversation(body) == [
        {"role": "system", "content": "Be brief.\nHi."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "name": "get_time", "arguments": '{"city": "Paris"}'}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "10:00"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no\nsuch"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "It is"}]
    choice = messages_api.tool_choice({"tools": TOOLS, "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}})
    assert choice.mode == "required" and not choice.parallel
    assert [t.name for t in choice.tools] == ["get_weather", "get_time"]
    assert messages_api.tool_choice({"tools": TOOLS, "tool_choice": {
        "type": "tool", "name": "get_time"}}).forced == "get_time"
    assert messages_api.tool_choice({"tools": TOOLS}).mode == "auto"
    assert messages_api.tool_choice({"tool_choice": {"type": "none"}}) is None


# ------------------------------------------------------------------------ the real server

@pytest.fixture
def claude(http_server):
    return anthropic.Anthropic(base_url=http_server.http_url, api_key="k", max_retries=0)


def post(server, path: str, body, key: str | None = "k") -> tuple[int, str]:
    """(status, body text) of a POST carrying `key` in x-api-key."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"}
                 | ({"x-api-key": key} if key is not None else {}))
    r = conn.getresponse()
    status, data = r.status, r.read().decode()
    conn.close()
    return status, data


def events(data: str) -> list[dict]:
    """A typed SSE stream's events; each one's `event:` line names its type."""
    out = []
    for block in filter(None, data.split("\n\n")):
        kind, payload = block.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert kind == f"event: {event['type']}", block
        out.append(event)
    return out


@pytest.mark.slow
def test_plain_and_streamed_greedy_messages_agree(http_server, claude):
    kw = dict(model="smollm2", max_tokens=16, messages=FRANCE, metadata={"user_id": "u1"},
              system=[{"type": "text", "text": "You answer questions."}], **GREEDY)
    plain = claude.messages.create(**kw)
    assert plain.id.startswith("msg_") and plain.type == "message" and plain.role == "assistant"
    [block] = plain.content
    assert block.type == "text" and "Paris" in block.text
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.stop_sequence is None
    assert 0 < plain.usage.output_tokens <= 16 and plain.usage.input_tokens > 0
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == block.text
    assert final.usage == plain.usage and final.stop_reason == plain.stop_reason
    status, data = post(http_server, "/v1/messages", {
        "model": "smollm2", "max_tokens": 16, "messages": FRANCE, "stream": True,
        "temperature": 0, "system": "You answer questions."})
    assert status == 200
    got = events(data)
    kinds = [e["type"] for e in got]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"} and len(kinds) > 7
    assert got[0]["message"]["usage"] == {"input_tokens": plain.usage.input_tokens,
                                          "output_tokens": 0}
    assert got[2] == {"type": "content_block_start", "index": 0,
                      "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for e in got[3:-3]) == block.text
    assert got[-2]["delta"] == {"stop_reason": plain.stop_reason, "stop_sequence": None}
    assert got[-2]["usage"] == {"output_tokens": plain.usage.output_tokens}


@pytest.mark.slow
def test_stop_sequences_and_a_prefilled_answer(claude):
    kw = dict(model="smollm2", max_tokens=16, messages=FRANCE, stop_sequences=["Paris", "zz"],
              **GREEDY)
    stopped = claude.messages.create(**kw)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == "The capital of France is "
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")
    # a last assistant message is the start of the answer, which goes on from it
    prefilled = claude.messages.create(
        model="smollm2", max_tokens=6, messages=FRANCE + [
            {"role": "assistant", "content": "The capital of France is"}], **GREEDY)
    assert prefilled.content[0].text.startswith(" Paris")


@pytest.mark.slow
def test_forced_tool_use_then_its_result_then_an_answer(claude):
    kw = dict(model="smollm2", max_tokens=48, messages=ASK, tools=TOOLS,
              system="You help with the weather.", **GREEDY)
    call = claude.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  **kw)
    [use] = call.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS[use.name])
    assert call.stop_reason == "tool_use"
    # count_tokens counts the prompt the request ran: system and tools included
    counted = claude.messages.count_tokens(model="smollm2", messages=ASK, tools=TOOLS,
                                           system="You help with the weather.")
    assert counted.input_tokens == call.usage.input_tokens
    bare = claude.messages.count_tokens(model="smollm2", messages=ASK,
                                        system="You help with the weather.")
    hidden = claude.messages.count_tokens(model="smollm2", messages=ASK, tools=TOOLS,
                                          tool_choice={"type": "none"},
                                          system="You help with the weather.")
    assert bare.input_tokens == hidden.input_tokens < counted.input_tokens

    with claude.messages.stream(tool_choice={"type": "tool", "name": "get_time"},
                                **kw) as stream:
        got = list(stream)
        named = stream.get_final_message()
    deltas = [e.delta.partial_json for e in got if e.type == "content_block_delta"]
    [use2] = named.content
    assert use2.name == "get_time" and json.loads("".join(deltas)) == use2.input
    jsonschema.validate(use2.input, CITY)

    follow = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                      for b in call.content]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": use.id,
                         "content": [{"type": "text", "text": "21 C and sunny"}]}]}]
    answer = claude.messages.create(model="smollm2", max_tokens=24, messages=follow,
                                    tools=TOOLS[:1], **GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens > call.usage.input_tokens
    for b in answer.content:
        if b.type == "tool_use":
            jsonschema.validate(b.input, SCHEMAS[b.name])
        else:
            assert b.type == "text" and b.text


DEEP_SCHEMA: dict = {"type": "object"}
for _ in range(150):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}
DEEP_CONTENT: list = [{"type": "text", "text": "x"}]
for _ in range(150):
    DEEP_CONTENT = [{"type": "tool_result", "tool_use_id": "t", "content": DEEP_CONTENT}]


@pytest.mark.slow
@pytest.mark.parametrize("change, status, kind, field", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"model": None}, 400, "invalid_request_error", "model"),
    ({"model": "claude-nope"}, 404, "not_found_error", "model"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "Hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": 3}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].content"),
    ({"messages": [{"role": "user", "content": DEEP_CONTENT}]}, 400, "invalid_request_error",
     "messages"),
    ({"system": 3}, 400, "invalid_request_error", "system"),
    ({"temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    ({"top_k": -5}, 400, "invalid_request_error", "top_k"),
    ({"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
    ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    ({"stream": "yes"}, 400, "invalid_request_error", "stream"),
    ({"metadata": {"user_id": 3}}, 400, "invalid_request_error", "metadata"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 400,
     "invalid_request_error", "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools[0]"),
    ({"tools": [{"name": "f", "input_schema": DEEP_SCHEMA}]}, 400, "invalid_request_error",
     "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": ["any"]}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": False}, 400, "invalid_request_error", "tool_choice"),
])
def test_bad_requests_get_anthropic_errors_naming_the_field(http_server, change, status, kind,
                                                            field):
    body = {"model": "smollm2", "max_tokens": 4, "messages": FRANCE} | change
    body = {k: v for k, v in body.items() if v is not None}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        got_status, data = post(http_server, path, body)
        if path.endswith("count_tokens") and field.startswith(("max_tokens", "temperature",
                                                               "top_k", "stop_", "stream",
                                                               "metadata")):
            assert got_status == 200, data  # count_tokens reads only what the prompt is made of
            continue
        assert got_status == status, data
        answer = json.loads(data)
        assert answer["type"] == "error" and answer["error"]["type"] == kind, answer
        assert answer["error"]["message"].startswith(field), answer


@pytest.mark.slow
def test_a_schema_nested_to_the_depth_limit_passes_every_check(http_server):
    def nested(levels: int) -> dict:  # tools' depth: 3 + 2 * levels
        schema: dict = {"type": "object"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    for levels in (30, 31):
        status, data = post(http_server, "/v1/messages/count_tokens", {
            "model": "smollm2", "messages": FRANCE,
            "tools": [{"name": "f", "input_schema": nested(levels)}]})
        message = json.loads(data)["error"]["message"]
        if levels == 30:  # checked, rendered, tokenized: longer than the context
            assert status == 400 and message.startswith("messages: prompt has"), data
        else:
            assert status == 400
            assert message == "tools nests lists and objects deeper than 64 levels"


@pytest.mark.slow
def test_the_client_raises_on_anthropic_errors_and_x_api_key_is_the_key(http_server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2", max_tokens=4,
                               messages=[{"role": "tool", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=FRANCE)
    wrong = anthropic.Anthropic(base_url=http_server.http_url, api_key=None, max_retries=0,
                                default_headers={"x-api-key": "wrong"})
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.count_tokens(model="smollm2", messages=FRANCE)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid or missing API key"}}
    for key, want in (("wrong", 401), (None, 401), ("k", 200)):
        assert post(http_server, "/v1/messages/count_tokens",
                    {"model": "smollm2", "messages": FRANCE}, key)[0] == want
    # unknown routes under /v1/messages answer in Anthropic's shape, the OpenAI routes in theirs
    status, data = post(http_server, "/v1/messages/nope", {})
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"
    status, data = post(http_server, "/v1/chat/completions", {}, key="wrong")
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_aborts_its_request(http_server):
    before = stats(http_server)
    s = socket.create_connection(("127.0.0.1", http_server.server.http_port))
    data = json.dumps({"model": "smollm2", "max_tokens": 200, "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]})
    s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: k\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
              + data.encode())
    s.settimeout(60)
    got = b""
    while b"content_block_delta" not in got:
        got += s.recv(4096)
    s.close()
    t_left = time.monotonic()
    wait_until(http_server, "the disconnect seen",
               lambda st: st["num_disconnects"] > before["num_disconnects"])
    wait_idle(http_server, 10)
    after = stats(http_server)
    assert time.monotonic() - t_left < 5
    assert after["num_disconnects"] - before["num_disconnects"] == 1
    assert after["generation_tokens"] - before["generation_tokens"] < 200
