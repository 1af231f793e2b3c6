"""`python scripts/bench_openai.py` as a process against a real server: the API key from the
environment or a file, never needed on the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxserve import LLMEngine
from jaxserve.serving.api_key import ENV
from tests.serving.server_fixture import RunningServer
from tests.serving.test_server import engine_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm):
    srv = RunningServer(LLMEngine(engine_config(), loaded=smollm), api_key="k")
    yield srv
    srv.stop()


def bench(server, *flags: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV} | ({ENV: key} if key else {})
    return subprocess.run(
        [sys.executable, "scripts/bench_openai.py", "--base-url", server.http_url + "/v1",
         "--num-prompts", "1", "--concurrency", "1", "--max-tokens", "2", *flags],
        capture_output=True, text=True, timeout=300, env=env)


def test_the_key_comes_from_the_environment_or_a_file(server, tmp_path):
    assert "AuthenticationError" in bench(server, key="wrong").stderr
    ok = bench(server, key="k")
    assert ok.returncode == 0 and "1 requests at concurrency 1" in ok.stdout, ok.stderr
    path = tmp_path / "key"
    path.write_text("k\n")
    assert bench(server, "--api-key-file", str(path), key="wrong").returncode == 0


def test_the_grounded_workload_runs(server):
    r = bench(server, "--workload", "grounded", key="k")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout
