"""Tool calling in chat completions: the parser on its own, then the official `openai` client
against a real server (tool_choice auto, required, a named function; streamed and not; a
follow-up with the tool's result)."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import pytest

from jaxserve.serving import tools

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CITY}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CITY}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def choice_of(**body) -> tools.ToolChoice:
    return tools.parse_tool_choice({"tools": TOOLS, **body})


def test_parser_takes_valid_calls_and_leaves_the_rest_as_text():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima"}}\n</tool_call>'
    bad_json = '<tool_call>{"name": "get_time", "arguments": {</tool_call>'
    bad_args = '<tool_call>{"name": "get_time", "arguments": {"town": "Lima"}}</tool_call>'
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    text = f"Let me see.\n{call}\n{bad_json}{bad_args}{unknown}"
    auto = choice_of()
    content, calls = tools.split_calls(text, auto)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time",
                                                                          {"city": "Lima"})]
    assert content == f"Let me see.\n{bad_json}{bad_args}{unknown}"
    assert tools.split_calls("Hi <tool", auto) == ("Hi <tool", [])
    assert tools.split_calls("  plain text", auto) == ("  plain text", [])
    assert tools.split_calls(call, auto)[0] is None
    one = choice_of(parallel_tool_calls=False)
    assert len(tools.split_calls(call + call, one)[1]) == 1
    assert len(tools.split_calls(call + "\n" + call, auto)[1]) == 2
    # fed in pieces of any size, the same events
    for size in (1, 3, 7):
        parser = tools.CallParser(auto)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])]
        events += parser.finish()
        assert "".join(e for k, e in events if k == "text") == content
        assert [e["arguments"] for k, e in events if k == "call"] == [calls[0]["arguments"]]


def test_forced_grammar_and_the_default_template_rendering(smollm):
    named = choice_of(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.is_forced and named.forced == "get_time"
    assert "get_weather" not in named.grammar()
    assert 'start: call ("\\n" call)*' in choice_of(tool_choice="required").grammar()
    assert "start: call\n" in choice_of(tool_choice="required",
                                        parallel_tool_calls=False).grammar()
    history = tools.check_messages(ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "10:00"}])
    assert not tools.takes_tools(smollm.tokenizer.chat_template)
    msgs, extra = tools.render(history, choice_of(), native=False)
    assert extra == {} and msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_time", '
                                                       '"arguments": {"city": "Paris"}}\n'
                                                       "</tool_call>"}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n10:00\n</tool_response>"}
    assert tools.render(history, choice_of(tool_choice="none"), False)[0][0]["role"] == "user"
    native, extra = tools.render(history, choice_of(), native=True)
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "get_time"]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[2]["role"] == "tool"


# ------------------------------------------------------------------------ the real server


def check(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed(client, **kw) -> tuple[str, list[dict], str, list]:
    """A streamed chat's (text, calls, finish reason, tool-call deltas)."""
    text, calls, deltas, finish = "", {}, [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            deltas.append(d)
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish, deltas


@pytest.mark.slow
def test_required_call_then_the_tools_result_then_an_answer(client):
    """The weather conversation: a forced call (plain and streamed give the same call, in
    OpenAI's chunk shape), the tool's result sent back, an answer under auto."""
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=48)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = check(call)
    text, calls, finish, deltas = streamed(client, **kw)
    assert text == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(call.function.name,
                                                                         args)]
    head, rest = deltas[0], deltas[1:]
    assert head.id and head.type == "function" and head.function.name == call.function.name
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    for stream in (False, True):
        kw = dict(model="smollm2", messages=follow, tools=TOOLS, tool_choice="auto",
                  temperature=0, max_tokens=20)
        if stream:
            text, calls, finish, _ = streamed(client, **kw)
        else:
            m = client.chat.completions.create(**kw).choices[0]
            text, calls, finish = m.message.content, m.message.tool_calls or [], m.finish_reason
        # whatever the model chooses: text, or calls that validate
        assert finish in ("stop", "length", "tool_calls")
        assert text or calls
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"] if stream else c.function.arguments),
                                SCHEMAS[c["name"] if stream else c.function.name])


@pytest.mark.slow
def test_auto_and_named_function_streamed_equal_plain(client):
    for tool_choice in ("auto", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=16 if tool_choice == "auto" else 40)
        m = client.chat.completions.create(**kw).choices[0]
        text, calls, finish, _ = streamed(client, **kw)
        assert finish == m.finish_reason
        assert text == (m.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in m.message.tool_calls or ()]
        if tool_choice != "auto":
            assert [check(c) for c in m.message.tool_calls] and finish == "tool_calls"
            assert {c.function.name for c in m.message.tool_calls} == {"get_time"}


@pytest.mark.slow
def test_fifty_required_calls_validate(client):
    """25 greedy and 25 sampled forced calls, all at once: every call's arguments parse and
    validate against its function's schema."""
    def ask(i: int):
        r = client.chat.completions.create(
            model="smollm2", tools=TOOLS, tool_choice="required", max_tokens=48,
            parallel_tool_calls=i % 5 == 0,
            messages=[{"role": "user", "content": f"Weather or time in city number {i}?"}],
            **(dict(temperature=0) if i < 25 else dict(temperature=0.8, seed=i)))
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(ask, range(50)))
    for a in answers:
        assert a.message.tool_calls, a
        for call in a.message.tool_calls:
            check(call)
        assert a.finish_reason in ("tool_calls", "length")
    assert len({c.function.arguments for a in answers[25:] for c in a.message.tool_calls}) > 3


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages"),
])
def test_bad_tool_fields_are_400_naming_the_field(client, extra, param):
    import openai

    body = {"messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", max_tokens=2,
                                       messages=body.pop("messages"), extra_body=body)
    assert err.value.body["param"] == param, err.value.body
