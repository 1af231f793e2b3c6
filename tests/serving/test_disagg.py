"""Disaggregated serving as a user starts it: `python -m jaxserve launch --prefill 2 --decode 2
-- scripts/serve.py ...`, real processes and sockets, driven through the official `openai`
client and the socket protocol. The greedy tokens equal one colocated engine's; the decode
side finds a shared system prompt in its prefix cache; /metrics carries the handovers' bytes
and time; a prefill engine killed while it holds a request for its handover, and a decode
engine killed during a stream, fail only their own requests, with errors naming them; the
survivors serve on and every block comes back."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime.kv_cache import bytes_per_block
from jaxserve.serving.client import Client, ServerError
from jaxserve.testing.oracle import LORA_CONFIGS, load_hf_model, make_peft_adapter, peft_greedy
from tests.helpers import run_all
from tests.serving.launched import ENGINE, Launched

openai = pytest.importorskip("openai")

SYSTEM = [(7 * i) % 400 + 3 for i in range(40)]  # a shared system prompt: 5 blocks of 8
PROMPTS = [SYSTEM + [11, 12, 13], SYSTEM + [21, 22], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
           [300, 301, 302]]
MAX_TOKENS = 12
# Long answers (LONG tokens) keep a decode engine busy long enough to kill something meanwhile.
LONG = 1500


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """(HF model, {name: PEFT adapter directory}) of two adapters for the tiny Llama."""
    pytest.importorskip("peft")
    hf = load_hf_model(tiny_llama_dir)
    root = tmp_path_factory.mktemp("disagg-adapters")
    return hf, {f"a{i}": make_peft_adapter(hf, str(root / f"a{i}"), seed=i, **conf)
                for i, conf in enumerate(LORA_CONFIGS[:2], 1)}


@pytest.fixture(scope="module")
def launched(tiny_llama_dir, adapters):
    """Two prefill and two decode engines serving the tiny Llama and adapter a1."""
    run = Launched(tiny_llama_dir, serve=("--enable-lora", "--max-loras", "2",
                                          "--max-lora-rank", "16",
                                          "--lora-modules", f"a1={adapters[1]['a1']}"))
    yield run
    with Client(port=run.port) as c:  # the front holds nothing once every request ended
        stats = c.stats()
    t0 = time.time()
    run.stop()
    assert (stats["front_requests"], stats["front_tasks"]) == (0, 0)
    assert run.proc.returncode is not None and time.time() - t0 < 30


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=tiny_llama_dir, **ENGINE))


@pytest.fixture(scope="module")
def expected(colocated):
    """The colocated engine's greedy tokens for PROMPTS."""
    engine = colocated
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=ids, params=SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    done = run_all(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]


def _tokens(logprobs) -> list[int]:
    return [int(t) for t in logprobs.tokens]  # a model without a tokenizer names ids


def _ask(client, ids, stream: bool, max_tokens: int = MAX_TOKENS) -> list[int]:
    kw = dict(model="jaxserve", prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return _tokens(client.completions.create(**kw).choices[0].logprobs)
    chunks = list(client.completions.create(stream=True, **kw))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    return [t for c in chunks if c.choices and c.choices[0].logprobs
            for t in _tokens(c.choices[0].logprobs)]


def test_greedy_tokens_equal_the_colocated_engine(launched, expected):
    client = launched.client()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda a: _ask(client, PROMPTS[a[0]], a[1]),
                            [(i, s) for s in (False, True) for i in range(len(PROMPTS))]))
    assert got == expected + expected
    with Client(port=launched.port) as c:  # the socket protocol, with n = 2 samples
        done = c.generate(prompt_token_ids=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                          ignore_eos=True, n=2)
    assert [ch["token_ids"] for ch in done["choices"]] == [expected[2]] * 2


def test_engines_split_over_devices_of_their_own(tiny_llama_dir, expected, colocated):
    """`--devices-per-engine 2` gives each engine two devices of its own and
    `--tensor-parallel-size 2` splits its kv heads over them: greedy tokens, streamed and not,
    equal the colocated single-device engine's, and a handover carries the model's heads.
    Under --api-key too: the clients bring the key, the front proves the engines' secret."""
    run = Launched(tiny_llama_dir, engines=1, launch=("--devices-per-engine", "2"),
                   serve=("--tensor-parallel-size", "2", "--api-key", "k", "--public-metrics"))
    try:
        assert sum("tensor parallel: mesh {'model': 2} over ['cpu:0', 'cpu:1']" in line
                   for line in run.lines) == 2  # each engine on devices of its own
        client = run.client()
        got = [_ask(client, PROMPTS[i], s) for s in (False, True) for i in range(len(PROMPTS))]
        assert got == expected + expected
        m = run.metrics()
        assert m["jaxserve_handovers_total"] == 2 * len(PROMPTS)
        assert m["jaxserve_handover_last_bytes"] == bytes_per_block(
            colocated.model_config, 8, colocated.runner.kv_dtype)  # [300, 301, 302]: 1 block
        run.all_blocks_back(["prefill-0", "decode-0"])
    finally:
        run.stop()
    assert run.proc.returncode == 0


def test_decode_side_hits_its_prefix_cache_and_metrics_show_handovers(launched, colocated):
    client = launched.client()
    _ask(client, SYSTEM + [40, 41, 42], False)  # the system prompt reaches a decode engine
    before = launched.metrics()
    _ask(client, SYSTEM + [50, 51, 52], False)
    after = launched.metrics()
    assert after["jaxserve_handovers_total"] == before["jaxserve_handovers_total"] + 1
    # its 5 system-prompt blocks were found by name on the decode side: only the last moved
    assert (after["jaxserve_handover_blocks_cached_total"]
            == before["jaxserve_handover_blocks_cached_total"] + 5)
    assert after["jaxserve_handover_last_bytes"] == bytes_per_block(
        colocated.model_config, 8, colocated.runner.kv_dtype)
    hits = [after[f'jaxserve_engine_prefix_cache_hits{{"engine": "decode-{i}"}}']
            for i in range(2)]
    assert max(hits) >= 40
    assert after["jaxserve_handover_bytes_total"] > before["jaxserve_handover_bytes_total"]
    assert 0 < after["jaxserve_handover_last_seconds"] < 5
    assert after["jaxserve_handover_seconds_total"] > before["jaxserve_handover_seconds_total"]


def test_adapters_run_on_both_sides_of_the_handover(launched, adapters):
    """a1 from --lora-modules and a2 loaded at runtime through the front, mixed with base
    requests: HF + PEFT's greedy tokens. A prefix cached under the base model is not found
    by name for an adapter's request on the decode side; a2 unloaded is refused by name."""
    hf, dirs = adapters
    client = launched.client()
    assert {m.id for m in client.models.list().data} == {"jaxserve", "a1"}
    load = urllib.request.Request(launched.url + "/v1/load_lora_adapter", method="POST",
                                  data=json.dumps({"lora_name": "a2",
                                                   "lora_path": dirs["a2"]}).encode())
    assert urllib.request.urlopen(load).status == 200
    runs = [(PROMPTS[2], "a1"), (PROMPTS[3], "a2"), (PROMPTS[2], None), (PROMPTS[1], "a2")]
    want = [t for t, _ in peft_greedy(hf, dirs, runs, MAX_TOKENS)]

    def generate(run) -> list[int]:
        with Client(port=launched.port) as c:
            return c.generate(prompt_token_ids=run[0], lora_name=run[1], max_tokens=MAX_TOKENS,
                              temperature=0, ignore_eos=True)["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        assert list(pool.map(generate, runs)) == want
    _ask(client, SYSTEM + [60, 61], False)  # the base model's system prompt, decoded
    before = launched.metrics()["jaxserve_handover_blocks_cached_total"]
    generate((SYSTEM + [60, 61], "a1"))
    assert launched.metrics()["jaxserve_handover_blocks_cached_total"] == before
    unload = urllib.request.Request(launched.url + "/v1/unload_lora_adapter", method="POST",
                                    data=json.dumps({"lora_name": "a2"}).encode())
    assert urllib.request.urlopen(unload).status == 200
    with Client(port=launched.port) as c, pytest.raises(ServerError, match="lora_name"):
        c.generate(prompt_token_ids=PROMPTS[3], lora_name="a2", max_tokens=2)
    launched.all_blocks_back(["prefill-0", "prefill-1", "decode-0", "decode-1"])


def test_aborts_refusals_and_disconnects_free_every_block(launched):
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(5000\) exceeds max_model_len"):
        launched.client().completions.create(model="jaxserve", prompt=[1, 2, 3],
                                             max_tokens=5000)
    with Client(port=launched.port) as c:
        frames = c.generate_stream(prompt_token_ids=SYSTEM + [90], request_id="a",
                                   max_tokens=LONG, temperature=0, ignore_eos=True)
        next(frames), next(frames)  # the prefill engine's token, then the decode engine's
        c.abort("a")
        last = list(frames)[-1]
    assert last["finish_reason"] == "abort" and len(last["token_ids"]) < LONG
    stream = launched.client().completions.create(
        model="jaxserve", prompt=[91, 92, 93], max_tokens=LONG, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client leaves mid-stream
    launched.all_blocks_back(["prefill-0", "prefill-1", "decode-0", "decode-1"])


def test_a_prefill_engine_killed_while_holding_a_handover_fails_only_that_request(launched):
    client = launched.client()
    # Fill both decode engines (2 sequences each), so the next request waits, prefilled, on
    # its prefill engine for a decode engine with room.
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        long = [pool.submit(_ask, client, [60 + i, 61, 62], False, LONG) for i in range(4)]
        deadline = time.time() + 60
        while sum(launched.engine_value("num_running", f"decode-{i}") for i in range(2)) < 4:
            assert time.time() < deadline and not any(f.done() for f in long)
            time.sleep(0.05)
        waiting = pool.submit(_ask, client, [70, 71, 72, 73], False)
        holder = None
        while holder is None:
            assert time.time() < deadline and not waiting.done()
            holder = next((f"prefill-{i}" for i in range(2)
                           if launched.engine_value("handover_held", f"prefill-{i}") == 1),
                          None)
            time.sleep(0.02)
        os.kill(launched.pids[holder], signal.SIGKILL)
        with pytest.raises(openai.APIError, match=f"the prefill engine {holder} .* is gone"):
            waiting.result(60)
        assert all(len(f.result(300)) == LONG for f in long)  # the others finish whole
    health = urllib.request.urlopen
    with pytest.raises(urllib.error.HTTPError) as e:
        health(launched.url + "/health")
    body = json.loads(e.value.read())
    assert body["status"] == "error" and body["engines"][holder]["status"] == "gone"
    assert launched.metrics()[f'jaxserve_engine_up{{"engine": "{holder}"}}'] == 0


def test_a_decode_engine_killed_during_a_stream_fails_only_that_stream(launched, expected):
    client = launched.client()
    stream = client.completions.create(model="jaxserve", prompt=[80, 81, 82], max_tokens=LONG,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    up, deadline = [], time.time() + 30
    while not up:  # the decode engine that took it over
        assert time.time() < deadline
        up = [f"decode-{i}" for i in range(2)
              if launched.engine_value("num_running", f"decode-{i}") == 1]
    os.kill(launched.pids[up[0]], signal.SIGKILL)
    with pytest.raises(openai.APIError, match=f"the decode engine {up[0]} .* is gone"):
        for _ in stream:
            pass
    # the survivors serve on, as the colocated engine would, and hold no block
    assert _ask(client, PROMPTS[3], True) == expected[3]
    m = launched.metrics()
    alive = [e for e in ("prefill-0", "prefill-1", "decode-0", "decode-1")
             if m[f'jaxserve_engine_up{{"engine": "{e}"}}'] == 1]
    assert len(alive) == 2
    launched.all_blocks_back(alive)
