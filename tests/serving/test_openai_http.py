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


def scrape(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.http_url + "/metrics").read().decode()
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
