"""/v1/embeddings through the official `openai` client against a real server on the default
model: the vectors equal LLM.embed's, a paraphrase ranks above an unrelated sentence, and
bad bodies get a 400 in OpenAI's error shape."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from jaxserve import LLM, LLMEngine
from jaxserve.serving.client import Client
from tests.serving.test_server import engine_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "A cat was sitting on the rug.",
         "Interest rates rose sharply after the central bank's announcement."]


@pytest.fixture(scope="module")
def library(smollm):
    """LLM.embed in process over the same model and config as the server's engine."""
    return LLM.from_engines([LLMEngine(engine_config(), loaded=smollm)])


def _vectors(resp) -> list[np.ndarray]:
    return [np.asarray(d.embedding, np.float32) for d in resp.data]


def test_strings_and_token_ids_equal_the_library_and_rank_a_paraphrase_first(
        client, http_server, library):
    want = library.embed(TEXTS)
    ids = [library.tokenizer(t).input_ids for t in TEXTS]
    hidden = library.engine.model_config.hidden_size
    one = client.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="float")
    many = client.embeddings.create(model="smollm2", input=TEXTS)  # base64, the client's default
    by_ids = client.embeddings.create(model="smollm2", input=ids, dimensions=hidden)
    single_ids = client.embeddings.create(model="smollm2", input=ids[2])
    for resp, expect in ((one, want[:1]), (many, want), (by_ids, want), (single_ids, want[2:])):
        got = _vectors(resp)
        assert [d.index for d in resp.data] == list(range(len(expect)))
        for g, w in zip(got, expect, strict=True):
            assert g.shape == (hidden,)
            np.testing.assert_allclose(g, w, atol=1e-4)
            assert np.linalg.norm(g) == pytest.approx(1.0, abs=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))
    assert one.usage.prompt_tokens == len(ids[0])
    a, b, c = _vectors(many)
    assert float(a @ b) > float(a @ c)  # the paraphrase is nearer than the unrelated sentence
    assert_idle(http_server)


def assert_idle(srv) -> None:
    """Nothing left running or waiting, every KV block back (the answer came at the end)."""
    with Client(port=srv.port, api_key="k") as c:
        s = c.stats()
    assert s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0, s


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "normalize": "yes"}, "normalize"),
])
def test_bad_bodies_get_a_400_naming_the_field(http_server, body, param):
    r = requests.post(http_server.http_url + "/v1/embeddings", json=body,
                      headers={"Authorization": "Bearer k"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert_idle(http_server)


def test_unnormalized_vectors_are_the_pooled_states(http_server, library):
    r = requests.post(http_server.http_url + "/v1/embeddings",
                      json={"input": TEXTS[1], "normalize": False},
                      headers={"Authorization": "Bearer k"}, timeout=60)
    got = np.asarray(r.json()["data"][0]["embedding"], np.float32)
    np.testing.assert_allclose(got, library.embed(TEXTS[1], normalize=False)[0], atol=1e-3,
                               rtol=1e-4)
