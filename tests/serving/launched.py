"""Disaggregated serving as a user starts it, for the tests that need it: `python -m jaxserve
launch --prefill N --decode N -- scripts/serve.py ...` with a tiny model, its processes, ports
and log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from jaxserve.launch import free_port

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=2048, num_kv_blocks=600,
              block_size=8, token_buckets=(16, 32), seq_buckets=(2,), block_buckets=(256,),
              kv_cache_dtype="float32")


def flags(cfg: dict) -> list[str]:
    out = []
    for k, v in cfg.items():
        out += [f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, tuple) else (v,))]
    return out


class Launched:
    """The launcher and its processes; the front's ports, every process's pid and each
    engine's socket address."""

    def __init__(self, model: str, engines: int = 2, launch: tuple = (), serve: tuple = ()):
        """`engines` prefill and as many decode engines; `launch` and `serve`: more flags for
        the launcher and for scripts/serve.py."""
        self.http_port = free_port()
        cache = os.environ.get("JAXSERVE_TEST_XLA_CACHE",
                               os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "launch", "--prefill", str(engines), "--decode",
             str(engines), *launch, "--", "scripts/serve.py", "--model", model, "--port", "0",
             "--http-port", str(self.http_port), "--log-stats-interval-s", "0",
             "--compilation-cache-dir", cache, *flags(ENGINE), *serve],
            stderr=subprocess.PIPE, text=True)
        self.pids: dict[str, int] = {}
        self.addresses: dict[str, str] = {}
        self.lines: list[str] = []
        self.port = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if m := re.match(r"\[launch\] (prefill|decode|front)( \d)?: pid (\d+)"
                                 r"(?: \((\S+)\))?", line):
                    name = m[1] + (f"-{m[2].strip()}" if m[2] else "")
                    self.pids[name] = int(m[3])
                    if m[4]:
                        self.addresses[name] = m[4]
                if m := re.search(r"listening on socket 127\.0\.0\.1:(\d+), OpenAI", line):
                    self.port = int(m[1])
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not ready.wait(400) or self.port is None:
            self.stop()
            raise RuntimeError("the front did not start:\n" + "".join(self.lines[-40:]))
        self.url = f"http://127.0.0.1:{self.http_port}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.url + "/metrics").read().decode()
        return {s.name + (json.dumps({k: v for k, v in s.labels.items() if k == "engine"})
                          if s.labels else ""): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def engine_value(self, key: str, engine: str) -> float:
        return self.metrics().get(f'jaxserve_engine_{key}{{"engine": "{engine}"}}', -1.0)

    def all_blocks_back(self, engines: list[str]) -> None:
        """Wait until `engines` hold no block, no request and no handover."""
        deadline = time.time() + 30
        while any(self.engine_value(k, e) != 0 for e in engines
                  for k in ("kv_blocks_used", "handover_held", "num_running")):
            assert time.time() < deadline, self.metrics()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.reader.join(10)  # every line of the log read
