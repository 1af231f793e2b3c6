"""The OpenAI HTTP server the HTTP tests share: the default model, API key "k", model id
"smollm2" (one per test worker)."""

from __future__ import annotations

import pytest

from jaxserve import LLMEngine
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config


@pytest.fixture(scope="session")
def http_server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), api_key="k",
                        model_name="smollm2")
    yield srv
    srv.stop()


@pytest.fixture
def client(http_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=http_server.http_url + "/v1", api_key="k", max_retries=0)
