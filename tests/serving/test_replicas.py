"""Data parallelism behind the server: two replicas on disjoint forced CPU devices, driven
through the official `openai` client and the socket protocol."""

from __future__ import annotations

import concurrent.futures

import jax
import pytest

from jaxserve.engine import data_parallel
from jaxserve.serving.client import Client
from tests.serving.server_fixture import RunningServer
from tests.serving.test_openai_http import scrape
from tests.serving.test_server import MAX_TOKENS, PROMPTS, engine_config, expected  # noqa: F401

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (forced) devices")]


@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(data_parallel.build_replicas(engine_config(data_parallel_size=2),
                                                     smollm), api_key="k")
    yield srv
    srv.stop()


def _routed(metrics: dict) -> list[float]:
    return [metrics.get(f'jaxserve_replica_requests_routed_total{{"replica": "{i}"}}', 0.0)
            for i in range(2)]


def test_every_request_answered_once_as_one_engine_would(server, expected):  # noqa: F811
    """24 concurrent completions (plain and streamed) over the 8 prompts: each gets exactly one
    answer, the text one engine gives, and the router spreads them over both replicas."""
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="k", max_retries=0)
    before = _routed(scrape(server))

    def ask(i: int) -> tuple[str, str, int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        kw = dict(model="jaxserve", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        if i % 2:
            chunks = list(client.completions.create(stream=True, **kw))
            finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
            return prompt, "".join(c.choices[0].text for c in chunks if c.choices), len(finals)
        r = client.completions.create(**kw)
        return prompt, r.choices[0].text, len(r.choices)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    for prompt, text, finals in answers:
        assert finals == 1
        assert text == expected[prompt][1]
    after = scrape(server)
    spread = [a - b for a, b in zip(_routed(after), before, strict=True)]
    assert sum(spread) == 24 and min(spread) >= 6, spread
    assert after["jaxserve_generation_tokens_total"] >= 24 * MAX_TOKENS
    for i in range(2):
        assert after[f'jaxserve_replica_requests_in_flight{{"replica": "{i}"}}'] == 0
    assert after["jaxserve_kv_blocks_used"] == 0


def test_socket_stats_sum_the_replicas_and_list_each(server):
    with Client("127.0.0.1", server.port, api_key="k") as c:
        for p in PROMPTS[:4]:
            c.generate(p, max_tokens=4, temperature=0)
        s = c.stats()
    reps = s["replicas"]
    assert len(reps) == 2
    for key in ("num_requests_finished", "generation_tokens", "kv_blocks_total"):
        assert s[key] == reps[0][key] + reps[1][key]
    assert all(r["num_requests_finished"] > 0 for r in reps)
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0
