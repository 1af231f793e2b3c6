"""Deeply nested JSON on every route of the real HTTP front: in a body's field, in a JSON string
inside one (a schema, a grammar, a call's arguments), or too deep for the body to parse at all.
Each is a 400 naming the field the client sent, never a 500, and the server serves on with
every KV block back."""

from __future__ import annotations

import json

import pytest
import requests

from jaxserve.core.nesting import MAX_DEPTH
from jaxserve.serving.client import Client

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]


def schema(levels: int) -> dict:
    """An object schema whose property holds the next, `levels` times (2 JSON levels each)."""
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def nested(levels: int):
    v = 1
    for _ in range(levels):
        v = [v]
    return v


def deep_text(levels: int) -> str:
    return "[" * levels + "]" * levels


def post(srv, route: str, body) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(srv.http_url + route, data=data, timeout=120, headers={
        "Authorization": "Bearer k", "Content-Type": "application/json"})


def assert_refused(srv, route: str, body, param: str) -> dict:
    r = post(srv, route, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


def assert_idle_and_serving(srv) -> None:
    with Client(port=srv.port, api_key="k") as c:
        s = c.stats()
        assert s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0, s
        assert c.generate("The capital of France is", max_tokens=2,
                          ignore_eos=True)["completion_tokens"] == 2


def fn(parameters: dict, flat: bool = False) -> dict:
    """A function tool in chat's nested form, or the Responses API's flat one."""
    f = {"name": "f", "parameters": parameters}
    return {"type": "function", **f} if flat else {"type": "function", "function": f}


DEEP_FIELDS = [  # a deep value in a field of the body: refused before anything walks it
    ("/v1/chat/completions", {"messages": HI, "tools": [fn(schema(120))]}, "tools"),
    ("/v1/responses", {"input": "Hi", "tools": [fn(schema(120), flat=True)]}, "tools"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema(120)}}},
     "response_format"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": schema(120)}}}, "text"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": schema(120)}, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": schema(120)}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": nested(200)}}, "logit_bias"),
    ("/v1/completions", {"prompt": nested(200)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": nested(200)}]}]}, "messages"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                  "output": nested(200)}]}, "input"),
    ("/v1/embeddings", {"input": nested(200)}, "input"),
    ("/tokenize", {"messages": [{"role": "user", "content": nested(200)}]}, "messages"),
    ("/detokenize", {"tokens": nested(200)}, "tokens"),
    ("/v1/load_lora_adapter", {"lora_name": nested(200), "lora_path": "x"}, "lora_name"),
    ("/v1/completions", {"prompt": "Hi", "user": nested(200)}, "user"),  # ignored, yet bounded
]


@pytest.mark.parametrize("route, body, param", DEEP_FIELDS,
                         ids=[f"{r}-{p}" for r, _, p in DEEP_FIELDS])
def test_a_deep_field_is_a_400_naming_it(http_server, route, body, param):
    err = assert_refused(http_server, route, {"max_tokens": 2} | body, param)
    assert f"deeper than {MAX_DEPTH} levels" in err["message"], err


def test_the_limit_is_on_each_fields_value(http_server):
    """A value MAX_DEPTH levels deep passes; one level more is refused."""
    ok = post(http_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                               "user": nested(MAX_DEPTH)})
    assert ok.status_code == 200, ok.text
    assert_refused(http_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                    "user": nested(MAX_DEPTH + 1)}, "user")


def test_a_tool_schema_as_deep_as_the_limit_allows_is_checked_and_served(http_server):
    """tools[0].function.parameters sits 3 levels down and schema(n) nests 2n + 1: n = 30 is the
    deepest accepted, and jsonschema checks it within the handler's stack."""
    for route, body, flat in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}, False),
                              ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, True)):
        ok = post(http_server, route, body | {"tools": [fn(schema(30), flat)],
                                               "tool_choice": "none"})
        assert ok.status_code == 200, ok.text[:300]
        assert_refused(http_server, route, body | {"tools": [fn(schema(31), flat)]}, "tools")


def test_a_body_too_deep_to_parse_names_its_field(http_server):
    for levels in (5_000, 200_000):
        raw = b'{"prompt": "Hi", "max_tokens": 2, "stop": ' + deep_text(levels).encode() + b"}"
        err = assert_refused(http_server, "/v1/completions", raw, "stop")
        assert f"deeper than {MAX_DEPTH} levels" in err["message"], err
    r = post(http_server, "/v1/completions", deep_text(5_000).encode())  # not even an object
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be JSON"


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep_text(5_000)}}
DEEP_STRINGS = [  # JSON (or a grammar) nested deep inside a string field
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": deep_text(5_000)}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": deep_text(5_000)}, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "guided_grammar": "root ::= " + "(" * 5_000 + '"a"'
                         + ")" * 5_000}, "guided_grammar"),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "tool_calls": [CALL]}]},
     "messages"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": deep_text(5_000)}]}, "input"),
]


@pytest.mark.parametrize("route, body, param", DEEP_STRINGS,
                         ids=[f"{r}-{p}" for r, _, p in DEEP_STRINGS])
def test_deep_json_inside_a_string_is_a_400_naming_its_field(http_server, route, body, param):
    assert_refused(http_server, route, {"max_tokens": 2} | body, param)


@pytest.mark.parametrize("parameters", [{"$ref": "#"}, {"$ref": "#/nowhere"}])
def test_a_call_against_a_schema_that_cannot_be_checked_stays_text(http_server, parameters):
    """Valid schemas a validator cannot finish: one that refers to itself sends it round in
    circles, one that refers to nothing stops it. A call the model writes against either (here
    forced by a grammar) stays text, as a call that does not validate does; never a 500."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    r = post(http_server, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 64, "tools": [fn(parameters)], "guided_choice": [call]})
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    assert message["content"] == call and not message.get("tool_calls"), message


def test_after_the_deep_bodies_the_server_is_idle_and_serves(http_server):
    assert_idle_and_serving(http_server)
