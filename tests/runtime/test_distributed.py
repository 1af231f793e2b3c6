"""One engine over two processes on localhost (2 forced CPU devices each, TP 4 across both,
gloo collectives), started by the documented launch command: the tokens of one process at
TP 1, an orderly shutdown, and a clear exit (no hang) when either process is killed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime import distributed
from jaxserve.serving.client import AsyncClient, Client
from tests.models.test_hf_equivalence import run_staggered

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                   token_buckets=(16, 64), seq_buckets=(8,), block_buckets=(4, 16),
                   num_kv_blocks=64, log_stats_interval_s=0)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time",
           "Water boils at", "The largest planet is", "1, 2, 3, 4,"]
NEW_TOKENS = 12


def _flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, tuple) else (v,))]
    return out


class Launched:
    """`python -m jaxserve launch --num-processes 2 --cpu-devices-per-process 2 --
    scripts/serve.py --tensor-parallel-size 4 ...` as the README gives it. Without the
    compilation cache: a process killed while writing an entry would leave it cut short."""

    def __init__(self):
        cmd = [sys.executable, "-m", "jaxserve", "launch", "--num-processes", "2",
               "--cpu-devices-per-process", "2", "--", os.path.join(ROOT, "scripts", "serve.py"),
               "--tensor-parallel-size", "4", "--port", "0", "--http-port", "0",
               "--no-warmup", "--compilation-cache-dir", "", *_flags(**ENGINE_ARGS)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self.port: int | None = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if m := re.search(r"\[launch\] process (\d+) of 2: pid (\d+)", line):
                    self.pids[int(m[1])] = int(m[2])
                if m := re.search(r"listening on socket 127\.0\.0\.1:(\d+)", line):
                    self.port = int(m[1])
                if self.port and "running process 0's steps" in self.text:
                    ready.set()  # the leader serves and the follower follows
            ready.set()  # the launcher ended

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.port is None:
            self.kill()
            raise AssertionError("the two processes did not start:\n" + self.text)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.text}") from None

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def one_process_tokens(smollm) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(**ENGINE_ARGS), smollm)
    ids = [smollm.tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = run_staggered(engine, ids, params, arrivals=[0] * len(ids))
    return {p: got[f"r{i}"] for i, p in enumerate(PROMPTS)}


async def _generate_all(port: int) -> list[dict]:
    async with AsyncClient("127.0.0.1", port) as c:  # all at once: they batch in the same steps
        return await asyncio.gather(*(c.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                 ignore_eos=True) for p in PROMPTS))


def test_two_processes_at_tp4_give_one_process_tokens_then_stop_in_order(one_process_tokens):
    srv = Launched()
    try:
        frames = asyncio.run(_generate_all(srv.port))
        for p, frame in zip(PROMPTS, frames, strict=True):
            assert frame["token_ids"] == one_process_tokens[p], p
        srv.proc.send_signal(signal.SIGTERM)  # to the launcher: it relays to both
        assert srv.wait(60) == 0, srv.text
    finally:
        if srv.proc.poll() is None:
            srv.kill()
    assert "[launch] exit statuses: [0, 0]" in srv.text
    assert "process 0 stopped; exiting" in srv.text


@pytest.mark.parametrize("victim", [1, 0])
def test_killing_one_process_makes_the_other_exit_with_a_clear_error(victim):
    srv = Launched()
    survivor = 1 - victim
    try:
        if victim == 1:  # the leader is serving: a request is in flight when its peer dies
            stream = Client("127.0.0.1", srv.port).generate_stream(
                PROMPTS[0], max_tokens=200, temperature=0, ignore_eos=True)
            assert next(stream)["type"] == "token"
        t0 = time.monotonic()
        os.kill(srv.pids[victim], signal.SIGKILL)
        code = srv.wait(60)
        took = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.kill()
    assert code == 128 + signal.SIGKILL, srv.text  # the launcher reports the first failure
    statuses = re.search(r"exit statuses: \[(-?\d+), (-?\d+)\]", srv.text)
    assert int(statuses[survivor + 1]) == distributed.EXIT_PEER_LOST
    assert int(statuses[victim + 1]) == -signal.SIGKILL
    assert (f"jaxserve: process {survivor} of 2:" in srv.text
            and "another process of this engine has exited or failed" in srv.text), srv.text
    assert took < 30, took
