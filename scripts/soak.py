"""Soak the server: many clients behaving well and badly at once, then check nothing is lost.

    python scripts/soak.py [--duration-s 600] [--clients 64] [-- serve.py options...]

Starts `scripts/serve.py` as a process (the options after `--` go to it), then runs `--clients`
concurrent clients for `--duration-s` seconds. Each client picks, again and again, one of:
a streamed or plain socket request, a streamed (SSE) or plain HTTP completion, a request whose
client disconnects part-way, one it aborts, one read by a slow reader, a batch of bad frames
followed by a good request, or several requests pipelined on one connection. A bystander checks
health every 50 ms throughout.

Afterwards it checks: the server is idle (0 running, 0 waiting, 0 KV blocks used) within a few
seconds; every well-formed request whose client stayed got exactly one final answer and nothing
after it; streamed tokens add up to the final answer; every bad frame got an error naming its
request. It prints a JSON report (requests, disconnects, tokens generated after disconnects,
health latency) and exits 1 if any check failed. SIGTERM then stops the server, which must exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from jaxserve.serving.protocol import ProtocolError, encode, read_frame

PROMPTS = ("Tell me about the sea.", "Write a haiku about rain.", "What is 2 + 2?",
           "List three colours.", "Explain gravity to a child.", "def fib(n):")


class Soak:
    def __init__(self, port: int, http_port: int, duration_s: float, max_tokens: int,
                 seed: int):
        self.port, self.http_port = port, http_port
        self.t_end = time.monotonic() + duration_s
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.health_rtts: list[float] = []

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def params(self, **kw) -> dict:
        return {"temperature": self.rng.choice((0, 0.8)), "max_tokens":
                self.rng.randint(1, self.max_tokens), **kw}

    # ----------------------------------------------------------------------- socket clients

    async def open(self):
        return await asyncio.open_connection("127.0.0.1", self.port)

    def generate(self, rid: str, stream: bool, **params) -> bytes:
        return encode({"type": "generate", "id": rid, "prompt": self.rng.choice(PROMPTS),
                       "stream": stream, "params": self.params(**params)})

    async def answers(self, reader, ids: set[str], stop_after: int | None = None,
                      slow_s: float = 0.0) -> dict[str, list[dict]]:
        """Frames per request id until every id has its final frame (or `stop_after` frames)."""
        frames: dict[str, list[dict]] = {i: [] for i in ids}
        final = set()
        n = 0
        while final != ids and (stop_after is None or n < stop_after):
            msg = await asyncio.wait_for(read_frame(reader, 1 << 24), 300)
            if msg is None:
                raise ConnectionError("server closed the connection")
            frames.setdefault(msg.get("id"), []).append(msg)
            if msg.get("id") in final:
                self.fail(f"frame after the final one: {msg}")
            if msg["type"] in ("done", "error"):
                final.add(msg.get("id"))
            n += 1
            if slow_s:
                await asyncio.sleep(slow_s)
        return frames

    def check_answered(self, frames: dict[str, list[dict]], ids) -> None:
        for rid in ids:
            got = frames.get(rid, [])
            finals = [f for f in got if f["type"] in ("done", "error")]
            if len(finals) != 1:
                self.fail(f"request {rid}: {len(finals)} final answers")
                continue
            self.counts["answered"] += 1
            done = finals[0]
            if done["type"] == "error":
                self.fail(f"well-formed request {rid} got an error: {done}")
                continue
            streamed = [t for f in got if f["type"] == "token" for t in f["token_ids"]]
            if streamed and done["finish_reason"] != "abort" and streamed != done["token_ids"]:
                self.fail(f"request {rid}: streamed tokens differ from the final answer")

    async def socket_request(self, stream: bool) -> None:
        reader, writer = await self.open()
        writer.write(self.generate("a", stream))
        self.counts["requests"] += 1
        self.check_answered(await self.answers(reader, {"a"}), ["a"])
        writer.close()

    async def pipelined(self) -> None:
        reader, writer = await self.open()
        ids = {f"p{i}" for i in range(self.rng.randint(2, 6))}
        writer.write(b"".join(self.generate(i, self.rng.random() < 0.5) for i in sorted(ids)))
        self.counts["requests"] += len(ids)
        self.check_answered(await self.answers(reader, ids), ids)
        writer.close()

    async def disconnect(self) -> None:
        reader, writer = await self.open()
        n = self.rng.randint(1, 4)
        writer.write(b"".join(self.generate(f"d{i}", True, max_tokens=self.max_tokens,
                                            ignore_eos=True) for i in range(n)))
        self.counts["requests"] += n
        self.counts["disconnected_requests"] += n
        await self.answers(reader, {f"d{i}" for i in range(n)}, stop_after=self.rng.randint(0, 3))
        writer.transport.abort()
        self.counts["disconnects"] += 1

    async def abort(self) -> None:
        reader, writer = await self.open()
        writer.write(self.generate("x", True, max_tokens=self.max_tokens, ignore_eos=True))
        self.counts["requests"] += 1
        first = await self.answers(reader, {"x"}, stop_after=1)
        if any(f["type"] == "done" for f in first["x"]):
            self.check_answered(first, ["x"])
            return writer.close()
        writer.write(encode({"type": "abort", "id": "x"}))
        rest = await self.answers(reader, {"x"})
        frames = {"x": first["x"] + rest["x"]}
        self.check_answered(frames, ["x"])
        self.counts["aborts"] += 1
        writer.close()

    async def slow_reader(self) -> None:
        reader, writer = await self.open()
        writer.write(self.generate("s", True))
        self.counts["requests"] += 1
        try:  # reads, slowly: it makes progress, so it is never cut off
            self.check_answered(await self.answers(reader, {"s"}, slow_s=0.2), ["s"])
            self.counts["slow_readers"] += 1
        except ConnectionError:
            self.fail("a slow but reading client was cut off")
        writer.close()

    async def bad_frames(self) -> None:
        reader, writer = await self.open()
        bad = [
            (encode({"type": "generate", "id": "b1", "prompt": "x",
                     "params": {"temperature": float("nan")}}), "b1"),
            (encode({"type": "generate", "id": "b2", "prompt": "x", "params": {"top_k": 2**40}}),
             "b2"),
            (encode({"type": "generate", "id": "b3", "prompt": 5}), "b3"),
            (encode({"type": "generate", "id": "b4", "prompt": "x",
                     "params": {"max_tokens": 0}}), "b4"),
            (encode({"type": "abort", "id": "nobody"}), "nobody"),
            (encode({"type": "launch"}), None),
            (len(b"\xc1").to_bytes(4, "big") + b"\xc1", None),  # not msgpack
        ]
        for frame, _ in bad:
            writer.write(frame)
        # each is answered with an error naming it; a request's parameters are checked where
        # it is admitted, after frames refused on arrival, so the order is not the frames'
        want = sorted((rid or "") for _, rid in bad)
        got = []
        for _ in bad:
            msg = await asyncio.wait_for(read_frame(reader, 1 << 24), 300)
            if msg is None or msg["type"] != "error":
                self.fail(f"a bad frame answered {msg}")
                break
            got.append(msg.get("id") or "")
        if sorted(got) != want:
            self.fail(f"bad frames answered for {sorted(got)}, sent {want}")
        self.counts["bad_frames"] += len(bad)
        writer.write(self.generate("good", False))  # the connection still serves
        self.counts["requests"] += 1
        self.check_answered(await self.answers(reader, {"good"}), ["good"])
        writer.close()

    # ------------------------------------------------------------------------- HTTP clients

    async def http_request(self, session, stream: bool, leave: bool = False) -> None:
        body = {"prompt": self.rng.choice(PROMPTS), "stream": stream, **self.params()}
        if leave:
            body.update(max_tokens=self.max_tokens, ignore_eos=True)
        self.counts["requests"] += 1
        async with session.post(f"http://127.0.0.1:{self.http_port}/v1/completions",
                                json=body) as r:
            if r.status != 200:
                return self.fail(f"HTTP {r.status}: {await r.text()}")
            if not stream:
                out = await r.json()
                if len(out["choices"]) != 1 or out["choices"][0]["finish_reason"] is None:
                    return self.fail(f"HTTP answer without a finish: {out}")
                self.counts["answered"] += 1
                return
            finals = 0
            n = 0
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                n += 1
                if leave and n >= 2:
                    self.counts["disconnected_requests"] += 1
                    self.counts["disconnects"] += 1
                    return r.close()  # drops the connection mid-stream
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return self.fail(f"SSE error: {chunk}")
                finals += chunk["choices"][0]["finish_reason"] is not None
            if finals != 1:
                return self.fail(f"SSE stream with {finals} finishing chunks")
            self.counts["answered"] += 1

    # --------------------------------------------------------------------------------- loop

    async def client(self, session) -> None:
        actions = [
            lambda: self.socket_request(True), lambda: self.socket_request(False),
            lambda: self.http_request(session, False), lambda: self.http_request(session, True),
            lambda: self.http_request(session, True, leave=True), self.disconnect, self.abort,
            self.slow_reader, self.bad_frames, self.pipelined,
        ]
        while time.monotonic() < self.t_end:
            try:
                await self.rng.choice(actions)()
            except (TimeoutError, ConnectionError, ProtocolError) as e:
                self.fail(f"{type(e).__name__}: {e}")

    async def bystander(self) -> None:
        reader, writer = await self.open()
        while time.monotonic() < self.t_end:
            t = time.perf_counter()
            writer.write(encode({"type": "health"}))
            msg = await read_frame(reader, 1 << 20)
            self.health_rtts.append(time.perf_counter() - t)
            if msg is None or msg.get("status") != "ok":
                self.fail(f"health: {msg}")
            await asyncio.sleep(0.05)
        writer.close()

    async def stats(self) -> dict:
        reader, writer = await self.open()
        writer.write(encode({"type": "stats"}))
        msg = await read_frame(reader, 1 << 20)
        writer.close()
        return msg

    async def run(self, clients: int) -> dict:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(self.bystander(), *(self.client(session)
                                                     for _ in range(clients)))
        t0 = time.monotonic()
        while True:
            s = await self.stats()
            if s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0:
                break
            if time.monotonic() - t0 > 10:
                self.fail(f"not idle 10 s after the soak: {s}")
                break
            await asyncio.sleep(0.05)
        rtts = np.array(self.health_rtts) * 1e3
        return {**dict(self.counts), "idle_after_s": round(time.monotonic() - t0, 3),
                "server": {k: s[k] for k in ("num_running", "num_waiting", "kv_blocks_used",
                                             "num_disconnects", "tokens_after_disconnect",
                                             "num_slow_readers_cut_off", "generation_tokens",
                                             "num_requests_finished")},
                "health_ms_p50_p99_max": [round(float(np.percentile(rtts, q)), 2)
                                          for q in (50, 99, 100)],
                "failures": self.failures[:20], "num_failures": len(self.failures)}


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, int, int]:
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py"),
           "--port", str(ports[0]), "--http-port", str(ports[1]), *serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if re.search(r"listening on", line):
            break
    else:
        raise RuntimeError(f"server exited with {proc.wait()}")
    # Keep reading its log (a full pipe would block the server); the tail is checked at stop.
    proc.log_tail = collections.deque(maxlen=200)
    threading.Thread(target=lambda: proc.log_tail.extend(proc.stderr), daemon=True).start()
    return proc, ports[0], ports[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=600)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(own)

    proc, port, http_port = start_server(serve_args)
    try:
        soak = Soak(port, http_port, args.duration_s, args.max_tokens, args.seed)
        t0 = time.monotonic()
        report = asyncio.run(soak.run(args.clients))
        report["duration_s"] = round(time.monotonic() - t0, 1)
        proc.send_signal(signal.SIGTERM)
        report["server_exit_code"] = proc.wait(120)
        time.sleep(0.5)  # the log reader takes the last lines
        tail = "".join(proc.log_tail)
        if report["server_exit_code"] != 0 or "Traceback" in tail:
            report["failures"].append(f"server stop: {tail[-2000:]}")
            report["num_failures"] += 1
    finally:
        if proc.poll() is None:
            proc.kill()
    print(json.dumps(report, indent=1))
    return 1 if report["num_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
