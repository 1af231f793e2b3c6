"""`python scripts/serve.py` as a process: options, warmup, the listening line, graceful stop,
the API key's sources."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests

from jaxserve.launch import free_port
from jaxserve.serving import engine_secret
from jaxserve.serving.api_key import ENV
from jaxserve.serving.cli import parse_args, split_config
from jaxserve.serving.client import Client, ServerError
from tests.helpers import TINY_SERVE, wait_for_line

LISTENING = r"listening on socket 127\.0\.0\.1:(\d+)"


def test_the_command_lists_its_subcommands_and_bench_takes_its_options():
    out = subprocess.run([sys.executable, "-m", "jaxserve", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    assert "{serve,bench,generate,launch}" in out
    bench = subprocess.run([sys.executable, "-m", "jaxserve", "bench", "--help"],
                           capture_output=True, text=True, timeout=120).stdout
    assert bench.startswith("usage: jaxserve bench") and "--out-dir" in bench


@pytest.mark.parametrize("command", [["scripts/serve.py"], ["-m", "jaxserve", "serve"]])
def test_help_lists_engine_and_server_options(command):
    out = subprocess.run([sys.executable, *command, "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for opt in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--dtype",
                "--scheduling-policy", "--preemption-mode", "--attention-backend", "--port",
                "--http-port", "--api-key", "--max-frame-bytes", "--max-tokens-limit",
                "--shutdown-timeout-s"):
        assert opt in out
    # What and why, never a measurement: figures live in docs/performance.md.
    flat = " ".join(out.split())
    assert not re.search(r"measured|~ ?\d|\d ?%|\d(\.\d+)? ?(ms|us|tok/s|GB/s)\b|"
                         r"\d(\.\d+)?x (faster|slower)", flat), flat


def test_serve_warms_up_listens_and_stops_cleanly(tiny_llama_dir):
    """Its socket's door is --api-key alone: the engines' secret of disaggregated serving, even
    one too short to be read, means nothing to a plain server."""
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--model", tiny_llama_dir, "--port", "0",
         "--http-port", "0", *TINY_SERVE, "--api-key", "k"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, **{engine_secret.ENV: "x"}))
    try:
        m, lines = wait_for_line(proc, LISTENING)
        port = int(m[1])
        assert any("warmup compiled 2 programs" in ln for ln in lines), "".join(lines)
        # the memory plan, printed at start: 32 blocks of 16 tokens hold 4 sequences of 128
        assert any("memory plan per device" in ln and "= 32 blocks of 16 tokens, 4 sequences "
                   "of max_model_len 128" in ln for ln in lines), "".join(lines)
        with Client(port=port, api_key="k") as c:
            done = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=5, ignore_eos=True)
            assert done["completion_tokens"] == 5
        with Client(port=port) as c, pytest.raises(ServerError, match="^unauthorized"):
            c.generate(prompt_token_ids=[5, 6, 7], max_tokens=5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
        assert "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_with_a_stuck_stream_exits_0_within_the_shutdown_timeout(tiny_llama_dir):
    """An SSE client that never reads holds its handler in a write; SIGTERM still ends the
    process with status 0, no traceback, within --shutdown-timeout-s and a little."""
    import socket

    from tests.serving.test_hardening import post_completion

    with socket.socket() as probe:  # a free port for the HTTP front (0 turns it off)
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--model", tiny_llama_dir, "--port", "0",
         "--http-port", str(free_port), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-model-len", "1024", "--num-kv-blocks", "128", "--token-buckets", "16", "32",
         "--seq-buckets", "4", "--block-buckets", "64", "--shutdown-timeout-s", "2",
         "--max-held-seqs", "0",
         "--write-stall-timeout-s", "600"],
        stderr=subprocess.PIPE, text=True)
    try:
        m, _ = wait_for_line(proc, "listening on")
        assert f"http://127.0.0.1:{free_port}/v1" in m.string, m.string
        http_port = free_port
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", http_port))
        post_completion(s, {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True,
                            "stream": True, "logprobs": 5})
        time.sleep(3)  # generating, its writes blocked: the client reads nothing
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        took = time.time() - t0
        rest = proc.stderr.read()
        s.close()
        assert rc == 0, rest
        assert "Traceback" not in rest, rest
        assert took <= 2 + 5, took
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_launched_server_gets_the_key_through_the_environment_not_argv(tiny_llama_dir):
    """`launch -- serve MODEL --api-key KEY` (the installed command's own server, its model
    given first): the server's command line, which any local user reads with `ps`, does not
    hold the key; both fronts still require it."""
    key, http_port = "s3cret-7d1f", free_port()
    env = {k: v for k, v in os.environ.items() if k != ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve", "launch", "--num-processes", "1", "--",
         "serve", tiny_llama_dir, "--api-key", key, "--port", "0",
         "--http-port", str(http_port), *TINY_SERVE], stderr=subprocess.PIPE, text=True, env=env)
    try:
        port, lines = wait_for_line(proc, LISTENING)
        started = re.compile(r"\[launch\] process 0 of 1: pid (\d+)")
        pids = [m[1] for m in map(started.search, lines) if m]
        assert pids, "".join(lines)
        with open(f"/proc/{pids[0]}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        assert argv[1:5] == ["-m", "jaxserve", "serve", tiny_llama_dir], argv
        assert "--api-key" not in argv, argv
        assert not any(key in a for a in argv), argv
        port = int(port.group(1))
        with pytest.raises(ServerError, match="invalid api_key"):
            Client(port=port, api_key="wrong")
        with Client(port=port, api_key=key) as c:
            assert c.generate(prompt_token_ids=[5, 6], max_tokens=2,
                              ignore_eos=True)["completion_tokens"] == 2
        url = f"http://127.0.0.1:{http_port}/v1/models"
        assert requests.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert requests.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # the launcher relays SIGTERM: its server goes too
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_key_file_and_its_refusals(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("from-file\n")
    monkeypatch.setenv(ENV, "from-env")
    assert split_config(parse_args(["--api-key-file", str(path)]))[1].api_key == "from-file"
    assert split_config(parse_args([]))[1].api_key == "from-env"
    assert split_config(parse_args(["--api-key", "flag"]))[1].api_key == "flag"
    # both flag forms: refused by the process before it loads a model
    out = subprocess.run([sys.executable, "scripts/serve.py", "--api-key", "a",
                          "--api-key-file", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "serve.py: error: api_key: give --api-key or --api-key-file, not both" in out.stderr
