"""The OpenAI-compatible HTTP front, driven by the official `openai` package."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from jaxserve import LLMEngine
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), api_key="k",
                        model_name="smollm2")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="k", max_retries=0)


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
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story."}],
        temperature=0, extra_body={"ignore_eos": True})
    max_model_len = server.server.engine.config.max_model_len
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
