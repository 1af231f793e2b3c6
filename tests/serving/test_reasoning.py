"""Reasoning output: the splitter and the grammar on their own, the flag, then a real server over
a tiny Qwen3 with Qwen3's chat template whose greedy answer is planted (it thinks "Let me
think." and answers " Paris is the capital!"), through the official `openai` client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import LLMEngine
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.serving import reasoning, tools
from jaxserve.serving.cli import parse_args, split_config
from jaxserve.serving.core import ServerConfig
from jaxserve.serving.reasoning import CLOSE, OPEN, ReasoningSplitter, split
from jaxserve.testing.chat_templates import QWEN3
from jaxserve.testing.tiny import write_successor_model
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config
from tests.serving.test_tools import ASK, SCHEMAS, TOOLS

openai = pytest.importorskip("openai")

THOUGHT, ANSWER = "Let me think.", " Paris is the capital!"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------------------ the splitter

@pytest.mark.parametrize("text, want", [
    (f"{OPEN}abc{CLOSE}xyz", ("abc", "xyz")),
    (f" \n{OPEN}\nabc\n{CLOSE}\n\nxyz", ("\nabc\n", "\n\nxyz")),
    (f"{OPEN}abc{CLOSE}", ("abc", None)),
    (f"{OPEN}{CLOSE}xyz", ("", "xyz")),
    (f"{OPEN}cut off", ("cut off", None)),
    (f"{OPEN}a{CLOSE}b{CLOSE}c", ("a", f"b{CLOSE}c")),
    ("plain answer", (None, "plain answer")),
    ("", (None, "")),
    ("<thi", (None, "<thi")),
    (f"an answer {OPEN}x{CLOSE}", (None, f"an answer {OPEN}x{CLOSE}")),
    (f"{CLOSE}x", (None, f"{CLOSE}x")),
])
def test_qwen3_reasons_only_in_a_block_that_opens_the_output(text, want):
    assert split("qwen3", text) == want


@pytest.mark.parametrize("text, want", [
    (f"abc{CLOSE}xyz", ("abc", "xyz")),
    (f"{OPEN}abc{CLOSE}xyz", ("abc", "xyz")),
    (f"\n{OPEN}abc{CLOSE}", ("abc", None)),
    ("abc", ("abc", None)),
    ("", ("", None)),
    (f"a {OPEN}b{CLOSE}c", (f"a {OPEN}b", "c")),
])
def test_deepseek_r1_starts_inside_the_reasoning(text, want):
    assert split("deepseek_r1", text) == want


PIECES = [OPEN, CLOSE, "<", "</", "<th", "think", ">", "a", " ", "\n", "{"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(reasoning.ReasoningParser)),
       st.lists(st.sampled_from(PIECES), max_size=12).map("".join),
       st.lists(st.integers(0, 60), max_size=8))
def test_any_cut_into_deltas_splits_as_the_whole(parser, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = ReasoningSplitter(parser)
    deltas = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas.append(splitter.finish())
    thought, content = split(parser, text)
    assert "".join(r for r, _ in deltas) == (thought or "")
    assert "".join(c for _, c in deltas) == (content or "")
    # no reasoning after the answer began (a pair's reasoning comes before its content)
    first_content = next((i for i, (_, c) in enumerate(deltas) if c), len(deltas))
    assert not any(r for r, _ in deltas[first_content + 1:])


def test_the_splitter_holds_back_only_what_may_be_a_tag():
    s = ReasoningSplitter("qwen3")
    assert s.feed(" <th") == ("", "")  # maybe <think>
    assert s.feed("ink>ab</") == ("ab", "")  # maybe </think>
    assert s.feed("b") == ("</b", "")
    assert s.feed("</think>x<") == ("", "x<")  # after the reasoning nothing is held
    assert s.has_reasoning and s.finish() == ("", "")
    plain = ReasoningSplitter("qwen3")
    assert plain.feed("<b") == ("", "<b") and not plain.has_reasoning


# ------------------------------------------------------------------------------ the grammar

def matcher_run(grammars: GrammarCompiler, tok, spec: dict, pieces: list) -> tuple[bool, bool]:
    """Feed `pieces` (each text, tokenized, or a token id) to a matcher of `spec`: (every token
    accepted, the grammar complete)."""
    m = grammars.matcher(spec)
    for piece in pieces:
        ids = [piece] if isinstance(piece, int) else tok.encode(piece, add_special_tokens=False)
        if not all(m.consume_token(t) for t in ids):
            return False, False
    return True, m.is_accepting()


@pytest.mark.slow
def test_structured_output_applies_after_the_reasoning(thinking_model, smollm):
    """With `<think>` and `</think>` single tokens (Qwen3's case): free reasoning of any
    length, the close tag only as its token, then the schema; with a tokenizer that has no
    such tokens the tags are text."""
    _, tok = thinking_model
    grammars = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    open_id, close_id = tok.convert_tokens_to_ids([OPEN, CLOSE])

    def run(spec, pieces):
        return matcher_run(grammars, tok, spec, pieces)

    qwen3 = reasoning.grammar_after("qwen3", {"json": CITY}, tok)
    free = "not JSON { at all </thinking> \n"
    assert run(qwen3, [open_id, free, close_id, "\n\n", '{"city":"Rome"}']) == (True, True)
    assert run(qwen3, [open_id, "a" * 3000, close_id, '{"city":"Lima"}']) == (True, True)
    assert run(qwen3, ['{"city":"Paris"}']) == (True, True)  # no reasoning at all
    assert run(qwen3, [open_id, free, close_id, '{"town":'])[0] is False
    assert run(qwen3, ["Paris"])[0] is False
    assert run(qwen3, [open_id, "x", close_id, " " * 9])[0] is False  # whitespace is bounded
    spelled = tok.convert_tokens_to_ids(["</", "think", ">"])
    assert run(qwen3, [open_id, "x", *spelled])[0] is False
    r1 = reasoning.grammar_after("deepseek_r1", {"json": CITY}, tok)
    assert run(r1, ['{"city":"Rome"}', close_id, '{"city":"Rome"}']) == (True, True)
    assert run(r1, [open_id, "x", close_id, '{"city":"Rome"}']) == (True, True)
    assert run(r1, ['{"city":"Rome"}']) == (True, False)  # still reasoning
    forced = reasoning.grammar_after("qwen3", {"grammar": tools.parse_tool_choice(
        {"tools": TOOLS, "tool_choice": "required"}).grammar()}, tok)
    call = '<tool_call>\n{"name":"get_time","arguments":{"city":"Lima"}}\n</tool_call>'
    assert run(forced, [open_id, "x", close_id, call]) == (True, True)
    regex = reasoning.grammar_after("deepseek_r1", {"regex": "[0-9]+"}, tok)
    assert run(regex, ["x", close_id, "42"]) == (True, True)
    with pytest.raises(ValueError, match="invalid json"):
        reasoning.grammar_after("qwen3", {"json": "{not json"}, tok)
    plain = smollm.tokenizer  # the tags are several tokens each
    text_tags = reasoning.grammar_after("qwen3", {"json": CITY}, plain)
    plain_grammars = GrammarCompiler(plain, smollm.config.vocab_size, {2})
    assert matcher_run(plain_grammars, plain, text_tags,
                       [f"{OPEN}x {OPEN}{CLOSE}\n", '{"city":"Rome"}']) == (True, True)
    assert matcher_run(plain_grammars, plain, text_tags, [f"{OPEN}x{CLOSE}{CLOSE}"])[0] is False


# ------------------------------------------------------------------------------ the flag

def test_the_flag_takes_vllm_names_and_refuses_others(capsys):
    _, server = split_config(parse_args(["--reasoning-parser", "deepseek_r1"]))
    assert server.reasoning_parser is reasoning.ReasoningParser.DEEPSEEK_R1
    assert split_config(parse_args([]))[1].reasoning_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "qwen"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "qwen3" in err and "deepseek_r1" in err
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        ServerConfig(reasoning_parser="qwen")


# ------------------------------------------------------------------------------ the server

@pytest.fixture(scope="module")
def thinking_model(smollm, tmp_path_factory):
    """(directory, tokenizer): a tiny Qwen3 with the default model's tokenizer plus `<think>`
    and `</think>` (added tokens, not special ones, as in Qwen3's) and Qwen3's chat template.
    After the generation prompt it greedily writes `<think>Let me think.</think> Paris is the
    capital!`, then ends; after the prompt with thinking off, the answer alone."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("thinking-qwen3")
    smollm.tokenizer.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens([OPEN, CLOSE])
    tok.chat_template = QWEN3
    tok.save_pretrained(d)
    reply = tok.encode(OPEN + THOUGHT + CLOSE + ANSWER, add_special_tokens=False)
    on, off = (tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=thinking) for thinking in (True, False))
    on_last, off_last = (tok.encode(p, add_special_tokens=False)[-1] for p in (on, off))
    path = [on_last, *reply, tok.eos_token_id]
    assert len(set(path)) == len(path) and off_last not in path
    answer_start = reply[reply.index(tok.convert_tokens_to_ids(CLOSE)) + 1]
    successors = dict(zip(path, path[1:], strict=False)) | {off_last: answer_start}
    write_successor_model(d, len(tok), successors, architectures=["Qwen3ForCausalLM"],
                          head_dim=32)
    return str(d), tok


@pytest.fixture(scope="module")
def server(thinking_model):
    srv = RunningServer(LLMEngine(engine_config(model=thinking_model[0], max_model_len=512)),
                        reasoning_parser="qwen3")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)


def blocks_back(srv) -> None:
    """Every request finished and every KV block back in the pool."""
    engine = srv.server.engine
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()


def post(srv, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.http_url + route, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def streamed(client, **kw) -> dict[int, tuple[str | None, str | None, list]]:
    """A streamed chat: per choice, (its reasoning, its content, each None if empty; its deltas
    in order as (field, value))."""
    got: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            row = got.setdefault(c.index, [])
            row += [("reasoning", d.reasoning_content)] if getattr(
                d, "reasoning_content", None) else []
            row += [("content", d.content)] if d.content else []
            row += [("call", t) for t in d.tool_calls or []]
            row += [("finish", c.finish_reason)] if c.finish_reason else []
    return {i: ("".join(v for k, v in row if k == "reasoning") or None,
                "".join(v for k, v in row if k == "content") or None, row)
            for i, row in got.items()}


@pytest.mark.slow
def test_chat_gives_reasoning_apart_streamed_as_whole(client, server):
    kw = dict(model="jaxserve", messages=QUESTION, temperature=0, max_tokens=30)
    [whole] = client.chat.completions.create(**kw).choices
    assert (whole.message.reasoning_content, whole.message.content) == (THOUGHT, ANSWER)
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    for thought, content, row in streamed(client, n=2, **kw).values():
        assert (thought, content) == (THOUGHT, ANSWER)
        kinds = [k for k, _ in row]
        assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
        assert row[-1] == ("finish", "stop")
    # cut off inside the reasoning: it is all reasoning, and max_tokens alone bounds it
    [cut] = client.chat.completions.create(**kw | {"max_tokens": 3}).choices
    assert (cut.message.reasoning_content, cut.message.content) == ("Let me", None)
    assert cut.finish_reason == "length"
    assert streamed(client, **kw | {"max_tokens": 3})[0][:2] == ("Let me", None)
    blocks_back(server)


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(client, server, thinking_model):
    _, tok = thinking_model
    kw = dict(model="jaxserve", messages=QUESTION, temperature=0, max_tokens=30)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    on_r = client.chat.completions.create(**kw)
    off_r = client.chat.completions.create(**kw, extra_body=off)
    [msg] = [c.message for c in off_r.choices]
    assert (msg.reasoning_content, msg.content) == (None, ANSWER)
    on_ids = post(server, "/tokenize", {"messages": QUESTION})[1]["tokens"]
    off_ids = post(server, "/tokenize", {"messages": QUESTION, **off})[1]["tokens"]
    think = tok.convert_tokens_to_ids([OPEN, CLOSE])
    assert not set(think) & set(on_ids) and set(think) <= set(off_ids)
    assert (on_r.usage.prompt_tokens, off_r.usage.prompt_tokens) == (len(on_ids), len(off_ids))
    answer = client.responses.create(model="jaxserve", input=QUESTION[0]["content"],
                                     max_output_tokens=30, extra_body=off)
    assert [o.type for o in answer.output] == ["message"] and answer.output_text == ANSWER
    assert answer.usage.input_tokens == len(off_ids)
    blocks_back(server)


@pytest.mark.slow
def test_bad_fields_are_refused_by_name(server):
    def refused(route: str, body: dict) -> dict:
        status, answer = post(server, route, body)
        assert status == 400, answer
        return answer["error"]

    chat = {"model": "jaxserve", "messages": QUESTION, "max_tokens": 4}
    for bad in ("yes", ["enable_thinking"]):
        assert refused("/v1/chat/completions", chat | {"chat_template_kwargs": bad})[
            "param"] == "chat_template_kwargs"
    e = refused("/v1/chat/completions", chat | {"chat_template_kwargs": {
        "tokenize": True, "add_generation_prompt": False, "enable_thinking": False}})
    assert e["param"] == "chat_template_kwargs"
    assert "add_generation_prompt, tokenize" in e["message"]
    assert refused("/tokenize", {"messages": QUESTION, "chat_template_kwargs": {
        "messages": []}})["param"] == "chat_template_kwargs"
    e = refused("/v1/chat/completions", chat | {"messages": QUESTION + [
        {"role": "assistant", "content": "", "reasoning_content": 5}]})
    assert e["param"] == "messages" and "reasoning_content" in e["message"]
    e = refused("/v1/responses", {"model": "jaxserve", "input": [
        {"type": "reasoning", "content": "thoughts"}]})
    assert e["param"] == "input" and "input[0]" in e["message"]
    assert refused("/v1/responses", {"model": "jaxserve", "input": "Hi",
                                     "chat_template_kwargs": 1})["param"] == "chat_template_kwargs"
    # the server goes on answering
    status, ok = post(server, "/v1/chat/completions", chat)
    assert status == 200 and ok["choices"][0]["message"]["reasoning_content"] == "Let me think"
    blocks_back(server)


@pytest.mark.slow
def test_structured_output_and_tool_calls_follow_the_reasoning(client, server):
    kw = dict(model="jaxserve", messages=QUESTION, temperature=0, max_tokens=40,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "city", "schema": CITY}})
    [whole] = client.chat.completions.create(**kw).choices
    assert whole.message.reasoning_content == THOUGHT and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), CITY)
    assert streamed(client, **kw)[0][:2] == (THOUGHT, whole.message.content)
    calls = dict(model="jaxserve", messages=ASK, tools=TOOLS, temperature=0, max_tokens=100,
                 tool_choice="required", parallel_tool_calls=False)
    [called] = client.chat.completions.create(**calls).choices
    assert called.message.reasoning_content == THOUGHT and called.message.content is None
    [call] = called.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert called.finish_reason == "tool_calls"
    thought, content, row = streamed(client, **calls)[0]
    assert (thought, content) == (THOUGHT, None)
    assert [v.function.arguments for k, v in row if k == "call" and v.function.arguments] == [
        call.function.arguments]
    # under auto nothing is forced: the planted answer, which calls nothing
    [auto] = client.chat.completions.create(**calls | {"tool_choice": "auto"}).choices
    assert (auto.message.reasoning_content, auto.message.content) == (THOUGHT, ANSWER)
    assert auto.message.tool_calls is None
    blocks_back(server)


@pytest.mark.slow
def test_responses_put_a_reasoning_item_before_the_message(client, server):
    kw = dict(model="jaxserve", input=QUESTION[0]["content"], max_output_tokens=30,
              temperature=0)
    r = client.responses.create(**kw)
    rs, msg = r.output
    assert rs.type == "reasoning" and rs.summary == [] and rs.status == "completed"
    assert [(c.type, c.text) for c in rs.content] == [("reasoning_text", THOUGHT)]
    assert msg.type == "message" and r.output_text == ANSWER
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    done = kinds.index("response.reasoning_text.done")
    assert set(kinds[4:done]) == {"response.reasoning_text.delta"}
    assert "".join(e.delta for e in events[4:done]) == events[done].text == THOUGHT
    assert kinds[done + 1:done + 5] == ["response.content_part.done",
                                        "response.output_item.done",
                                        "response.output_item.added",
                                        "response.content_part.added"]
    assert events[done + 3].item.type == "message" and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    # the output goes back as input, reasoning item included, or by previous_response_id
    again = client.responses.create(**kw | {"input": [
        QUESTION[0], *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "And of Italy?"}]})
    follow = client.responses.create(**kw | {"input": "And of Italy?",
                                             "previous_response_id": r.id})
    assert again.usage.input_tokens == follow.usage.input_tokens > r.usage.input_tokens
    shaped = client.responses.create(**kw | {"max_output_tokens": 40, "text": {"format": {
        "type": "json_schema", "name": "city", "schema": CITY}}})
    assert shaped.output[0].content[0].text == THOUGHT
    jsonschema.validate(json.loads(shaped.output_text), CITY)
    blocks_back(server)


@pytest.mark.slow
def test_messages_put_a_thinking_block_before_the_text(server):
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.http_url, api_key="none", max_retries=0)
    kw = dict(model="jaxserve", max_tokens=30, messages=QUESTION, extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (THOUGHT, ANSWER)
    assert m.stop_reason == "end_turn"
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    kinds = [d.type for d in deltas]
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    # Anthropic's thinking switch reaches the template; a thinking block goes back as input
    off = claude.messages.create(**kw | {"extra_body": {"temperature": 0,
                                                        "thinking": {"type": "disabled"}}})
    assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]
    assert off.usage.input_tokens > m.usage.input_tokens
    again = claude.messages.create(**kw | {"messages": [
        *QUESTION, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "And of Italy?"}]})
    assert again.content[0].type == "thinking"
    blocks_back(server)
