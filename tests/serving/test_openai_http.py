"""The OpenAI-compatible HTTP front, driven by the official `openai` package."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from tests.serving.server_fixture import RunningServer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture
def server(http_server):
    return http_server


def scrape(server, key: str | None = "k") -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(server.http_url + "/metrics",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    text = urllib.request.urlopen(req).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_completion_and_metrics_move(server, client):
    before = scrape(server)
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert "Paris" in r.choices[0].text
    after = scrape(server)
    assert after["jaxserve_generation_tokens_total"] >= before.get(
        "jaxserve_generation_tokens_total", 0) + r.usage.completion_tokens
    assert after["jaxserve_prompt_tokens_total"] > before.get("jaxserve_prompt_tokens_total", 0)
    assert after["jaxserve_time_to_first_token_seconds_count"] > before.get(
        "jaxserve_time_to_first_token_seconds_count", 0)
    assert "jaxserve_kv_cache_usage_ratio" in after and "jaxserve_num_requests_waiting" in after


def test_streamed_chat_completion(client):
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0, stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            pieces.append(delta.content)
        reasons.append(chunk.choices[0].finish_reason)
    text = "".join(pieces)
    assert "Paris" in text and len(pieces) > 1
    assert reasons[-1] == "stop"
    full = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    assert full.choices[0].message.content == text


def test_stream_options_include_usage(client):
    """The last chunk has no choices and carries the usage; the text chunks carry none."""
    kw = dict(model="smollm2", max_tokens=8, temperature=0, stream=True,
              stream_options={"include_usage": True})
    chunks = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], **kw))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert 0 < usage.completion_tokens <= 8 and usage.total_tokens == (
        usage.prompt_tokens + usage.completion_tokens)
    chunks = list(client.completions.create(prompt="The capital of France is", **kw))
    assert chunks[-1].usage.completion_tokens == 8  # plain completion: runs to max_tokens
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model="smollm2", prompt="x", max_tokens=2,
                                  stream_options={"include_usage": "yes"})


def test_errors_have_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in str(e.value)
    bad = openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    req = urllib.request.Request(server.http_url + "/v1/completions", data=b"{not json",
                                 headers={"Authorization": "Bearer k"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req)
    assert he.value.code == 400
    body = json.loads(he.value.read())
    assert body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    assert urllib.request.urlopen(server.http_url + "/health").status == 200


def test_metrics_need_the_key_unless_made_public(server, tiny_llama_dir):
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(server, key=None)
    assert e.value.code == 401
    assert "jaxserve_num_requests_running" in scrape(server)  # with the key
    from tests.helpers import make_engine

    public = RunningServer(make_engine(tiny_llama_dir), api_key="k", public_metrics=True)
    try:
        assert "jaxserve_num_requests_running" in scrape(public, key=None)
        with pytest.raises(urllib.error.HTTPError) as e:  # the API itself still needs it
            urllib.request.urlopen(public.http_url + "/v1/models")
        assert e.value.code == 401
    finally:
        public.stop()


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(server, client):
    # a long prompt leaves a short way to the end of the context (CI time)
    story = "Go on with this story. " + "The sea was calm and the sky was grey. " * 16
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": story}],
        temperature=0, extra_body={"ignore_eos": True})
    max_model_len = server.server.engine.config.max_model_len
    assert r.usage.prompt_tokens > max_model_len // 2  # the rest is still many steps
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == max_model_len - r.usage.prompt_tokens


def test_completion_logprobs_carry_tokens_and_offsets(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
        assert top[tok] == pytest.approx(chosen, abs=1e-5)  # greedy: the chosen is the best
    streamed = list(client.completions.create(model="smollm2", prompt="The capital of France is",
                                              max_tokens=6, temperature=0, logprobs=2,
                                              stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
        assert bytes(c.bytes).decode() == c.token
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=2)
    assert r.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt_and_prompt_logprobs(server, client, hf_smollm):
    """echo + logprobs: the logprobs start with the prompt's tokens (the first null), equal to
    the HF oracle's, streamed the same; vLLM's prompt_logprobs field on completions and chat."""
    import torch

    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0,
              logprobs=2)
    r = client.completions.create(echo=True, **kw)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + r.usage.completion_tokens
    assert "".join(lp.tokens) == text and text.startswith("The capital of France is")
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = server.server.engine.tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm(torch.tensor([ids])).logits[0].double(), -1)
    # The CPU block matmul scales activations to int16 (kernels/cpu_matmul.py): a prompt token
    # as unlikely as -11.5 measured 2.1e-3 from HF's float32 logprob.
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, n_prompt)], abs=5e-3)
    generated = client.completions.create(**kw).choices[0].logprobs
    assert lp.tokens[n_prompt:] == generated.tokens
    streamed = list(client.completions.create(echo=True, stream=True, **kw))
    assert [t for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text

    scored = client.completions.create(extra_body={"prompt_logprobs": 1}, **kw).choices[0]
    entries = scored.model_extra["prompt_logprobs"]
    assert len(entries) == n_prompt and entries[0] is None
    for i in range(1, n_prompt):
        mine = entries[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-5)
        assert mine["rank"] >= 1 and mine["decoded_token"] == lp.tokens[i]
        assert len(entries[i]) in (1, 2)  # the token itself and the best one (if another)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])


# ------------------------------------------------------ sampling options and structured output

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_fifty_json_schema_answers_validate(client):
    """response_format json_schema through the openai client: 25 greedy and 25 sampled chats,
    all at once; every answer parses and validates against the schema."""
    import concurrent.futures

    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(i: int) -> str:
        r = client.chat.completions.create(
            model="smollm2", max_tokens=80, response_format=fmt,
            messages=[{"role": "user", "content": f"Invent person number {i} as JSON."}],
            **(dict(temperature=0) if i < 25 else dict(temperature=0.9, seed=i)))
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(ask, range(50)))
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(answers[25:])) > 5


def test_logit_bias_penalties_and_constraints_over_http(client, smollm):
    def complete(**kw):
        r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                      max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)
        return r.choices[0]

    [paris] = smollm.tokenizer(" Paris", add_special_tokens=False).input_ids
    assert complete().text.startswith(" Paris")
    assert "Paris" not in complete(logit_bias={str(paris): -100}).text  # JSON keys: strings
    assert complete(logit_bias={str(paris): 100}, max_tokens=3).text == " Paris" * 3
    assert complete(extra_body={"guided_choice": ["yes", "no"]}).text in ("yes", "no")
    regex = complete(extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{1,8} \d"}})
    assert re.fullmatch(r"[A-Z][a-z]{1,8} \d", regex.text)
    penalized = complete(presence_penalty=2.0, frequency_penalty=2.0, max_tokens=16)
    assert penalized.text != complete(max_tokens=16).text


def test_streamed_equals_plain_with_options(client):
    kw = dict(model="smollm2", max_tokens=40, temperature=0, presence_penalty=0.8,
              logit_bias={"30": -5},
              messages=[{"role": "user", "content": "Describe Lima as JSON."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "p", "schema": PERSON}})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == plain and json.loads(plain)["city"] in PERSON["properties"]["city"]["enum"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"presence_penalty": 5}, "presence_penalty"),
])
def test_bad_options_are_400_naming_the_field(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    r = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None


LONG = "word " * 300  # more tokens than the test server's max_prompt_tokens (256)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0, "max_tokens": None},
     "max_completion_tokens"),
    ("/v1/responses", {"input": LONG}, "input"),
    ("/v1/responses", {"input": "x" * 30_000}, "input"),  # refused before it is tokenized
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": {"type": "objectx"}}}}, "text"),
    ("/v1/embeddings", {"input": [5, 10**9]}, "input"),
    ("/v1/embeddings", {"input": LONG}, "input"),
])
def test_errors_name_the_field_the_client_sent(server, route, body, param):
    """Not the engine's own name for it (prompt_token_ids, structured_outputs, logprobs,
    max_tokens, prompt): the message starts with the client's field too, when it names one."""
    base = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "input": "Hi",
            "max_tokens": 2, "max_output_tokens": 2}
    status, got = _post(server, route, {k: v for k, v in (base | body).items()
                                        if v is not None})
    assert status == 400, got
    err = got["error"]
    assert err["param"] == param, err
    internal = {"prompt_token_ids", "structured_outputs", "logprobs", "max_tokens",
                "prompt"} - {param}
    assert err["message"].split()[0].rstrip(":") not in internal, err


def test_n_samples_over_http(client):
    """n=3 chat and completions: three choices at their indices, usage counting the prompt
    once; a streamed n=2 greedy request gives each choice the text of the plain one."""
    chat = client.chat.completions.create(
        model="smollm2", n=3, temperature=1.0, seed=4, max_tokens=12,
        messages=[{"role": "user", "content": "Name a fruit."}])
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1
    assert chat.usage.completion_tokens <= 36 and chat.usage.prompt_tokens < 40
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=0, n=2)
    plain = client.completions.create(**kw)
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.choices[0].text == plain.choices[1].text
    texts, finals = {0: "", 1: ""}, {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                assert c.index not in finals  # each choice finishes once
                finals[c.index] = c.finish_reason
    assert texts == {0: plain.choices[0].text, 1: plain.choices[1].text}
    assert set(finals) == {0, 1}


def _post(server, path: str, body: dict, key: str | None = "k") -> tuple[int, dict]:
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_and_version(server, smollm):
    tok = smollm.tokenizer
    status, got = _post(server, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and got["tokens"] == tok("Hello world").input_ids
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    status, plain = _post(server, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    assert plain["tokens"] == tok("Hi", add_special_tokens=False).input_ids
    msgs = [{"role": "user", "content": "Hi"}]
    _, chat = _post(server, "/tokenize", {"messages": msgs})
    assert chat["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    status, back = _post(server, "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(got["tokens"])
    status, err = _post(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", {"prompt": "x"}, key=None)[0] == 401
    with urllib.request.urlopen(server.http_url + "/version") as r:
        import jaxserve

        assert json.loads(r.read())["version"] == jaxserve.__version__


def test_echo_continue_final_message_and_unknown_fields(client):
    """echo puts the prompt before the text (streamed too); continue_final_message goes on
    from the assistant's last message; fields this server does not know (and `user`) are
    ignored, as vLLM does."""
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0)
    base = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == "The capital of France is" + base
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(echo=True, stream=True, **kw) if c.choices)
    assert streamed == echoed
    assert client.completions.create(user="u-1", extra_body={"no_such_field": 3},
                                     **kw).choices[0].text == base
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    cont = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in cont.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="smollm2", messages=msgs[:1], max_tokens=4,
                                       extra_body={"continue_final_message": True})
