"""The Responses API: the store on its own, then the official `openai` client's
`responses.create` and `responses.stream` against a real server."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.serving.openai.response_builder import ResponseStore
from tests.serving.test_tools import ASK, SCHEMAS, TOOLS

openai = pytest.importorskip("openai")
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_store_evicts_the_oldest_past_its_count_and_bytes():
    store = ResponseStore(max_count=3, max_bytes=400)
    for i in range(4):
        store.put(f"r{i}", {"x": i})
    assert store.get("r0") is None and [store.get(f"r{i}") for i in (1, 2, 3)] == [
        {"x": 1}, {"x": 2}, {"x": 3}]
    store.get("r1")  # read: now the newest
    store.put("big", {"x": "y" * 300})
    assert store.get("r2") is None and store.get("r1") is not None
    assert store.num_bytes <= 400 and store.num_evicted == 2
    store.put("huge", {"x": "y" * 500})  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big")
    assert ResponseStore(0, 1000).put("a", {}) is None and len(ResponseStore(0, 1000)) == 0


@pytest.mark.slow
def test_create_remembers_the_conversation_and_honours_store(client):
    kw = dict(model="smollm2", max_output_tokens=12, temperature=0)
    first = client.responses.create(input="What is the capital of France?", **kw)
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.output[0].type == "message" and first.usage.output_tokens > 0
    second = client.responses.create(input="And of Italy?", previous_response_id=first.id,
                                     **kw)
    assert "Rome" in second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.total_tokens  # the first turn came along
    assert client.responses.retrieve(first.id).output_text == first.output_text
    told = client.responses.create(input="Hi", instructions="Answer in one word.",
                                   store=False, **kw)
    assert told.instructions == "Answer in one word."
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="Hi", previous_response_id=told.id, **kw)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    cut = client.responses.create(input="Tell me a long story.", model="smollm2",
                                  max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_json_schema_and_tools(client):
    r = client.responses.create(
        model="smollm2", input="Invent a person.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    call = client.responses.create(model="smollm2", input=ASK, tools=FLAT_TOOLS,
                                   tool_choice="required", parallel_tool_calls=False,
                                   max_output_tokens=48, temperature=0)
    [fc] = call.output
    assert fc.type == "function_call" and fc.call_id.startswith("call_")
    jsonschema.validate(json.loads(fc.arguments), SCHEMAS[fc.name])
    after = client.responses.create(
        model="smollm2", previous_response_id=call.id, tools=FLAT_TOOLS, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "21 C"}])
    assert after.status in ("completed", "incomplete") and after.output


@pytest.mark.slow
def test_stream_events_build_the_plain_response(client):
    kw = dict(model="smollm2", input="What is the capital of France?", max_output_tokens=12,
              temperature=0)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text == final.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    calls = list(client.responses.create(stream=True, model="smollm2", input=ASK,
                                         tools=FLAT_TOOLS, max_output_tokens=48,
                                         tool_choice={"type": "function", "name": "get_time"}))
    kinds = [e.type for e in calls]
    assert "response.function_call_arguments.delta" in kinds
    done = calls[-1].response.output[0]
    assert calls[-1].type == "response.completed" and done.name == "get_time"
    jsonschema.validate(json.loads(done.arguments), SCHEMAS["get_time"])


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [
    ({"input": 3}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "schema": 3}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text"),
    ({"instructions": ["x"]}, "instructions"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"store": "yes"}, "store"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_bad_fields_are_400_naming_the_field(client, extra, param):
    body = {"input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smollm2", max_output_tokens=body.pop(
            "max_output_tokens", 2), input=body.pop("input"), extra_body=body)
    assert err.value.body["param"] == param, err.value.body
