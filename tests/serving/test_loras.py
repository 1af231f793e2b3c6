"""LoRA adapters through the server (serving/loras.py) on a tiny Qwen3, HF + PEFT the oracle:
--lora-modules loaded at start and listed by /v1/models; a request's model (HTTP) or lora_name
(socket) picks its adapter; adapters loaded and unloaded while requests stream; bad adapters,
names and paths refused with nothing changed; the endpoints behind the API key."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.serving.cli import main as serve_main
from jaxserve.serving.client import Client, ServerError
from jaxserve.testing.oracle import LORA_CONFIGS, make_peft_adapter, make_tiny_hf_model, peft_greedy
from tests.serving.server_fixture import RunningServer

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

N = 8
ENGINE = dict(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128, block_size=8,
              kv_cache_dtype="float32", token_buckets=(16, 32), block_buckets=(16,),
              num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(RunningServer, HF model, {name: adapter directory}, outside directory): a tiny
    Qwen3 served with key "k" as "base", adapters a1 and a2 loaded at start (one in each
    --lora-modules form), a3 and the bad ones in the allowed directory."""
    d = tmp_path_factory.mktemp("lora-serve")
    hf = make_tiny_hf_model("qwen3", str(d / "model"), seed=4)
    root = d / "adapters"
    adapters = {f"a{i}": make_peft_adapter(hf, str(root / f"a{i}"), seed=i, **conf)
                for i, conf in enumerate(LORA_CONFIGS, 1)}
    make_peft_adapter(hf, str(root / "big"), r=32, lora_alpha=32, target_modules=["q_proj"])
    for name, edit in (("shapes", {"r": 8}), ("target", {"target_modules": ["q_proj", "x"]})):
        shutil.copytree(adapters["a1"], root / name)
        conf = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps(conf | edit))
    (root / "nofile").mkdir()
    shutil.copy(root / "a1" / "adapter_config.json", root / "nofile")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(adapters["a1"], outside / "a1")
    engine = LLMEngine(EngineConfig(model=str(d / "model"), **ENGINE))
    srv = RunningServer(engine, api_key="k", model_name="base", lora_allowed_dir=str(root),
                        lora_modules=(f"a1={adapters['a1']}",
                                      json.dumps({"name": "a2", "path": adapters["a2"],
                                                  "base_model_name": "base"})))
    yield srv, hf, adapters, outside
    srv.stop()


@pytest.fixture
def client(setup):
    return openai.OpenAI(base_url=setup[0].http_url + "/v1", api_key="k", max_retries=0)


def prompts(seed: int, sizes) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=n).tolist() for n in sizes]


def post(srv, route: str, body: dict, key: str | None = "k") -> tuple[int, str]:
    req = urllib.request.Request(srv.http_url + route, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}"} if key else {},
                                 method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def models(client) -> dict[str, tuple[str | None, str | None]]:
    return {m.id: (m.model_extra["parent"], m.model_extra["root"])
            for m in client.models.list().data}


def completion_logprobs(client, model: str, ids: list[int], n: int = N) -> list[float]:
    """The greedy tokens' log-probabilities: what tells the adapters apart over HTTP."""
    out = client.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].logprobs.token_logprobs


def test_models_list_the_adapters_loaded_at_start(setup, client):
    _, _, adapters, _ = setup
    got = models(client)
    assert got["base"] == (None, "base")
    assert {k: v for k, v in got.items() if k != "base"} == {
        "a1": ("base", adapters["a1"]), "a2": ("base", adapters["a2"])}


def test_a_request_by_adapter_name_runs_the_adapter(setup, client):
    """Per adapter and for the base: a socket request's greedy tokens (lora_name) are HF +
    PEFT's, and an HTTP completion's (model) log-probabilities; unknown names refused."""
    srv, hf, adapters, _ = setup
    runs = list(zip(prompts(1, (5, 11, 17)), ("a1", "a2", None), strict=True))
    want = peft_greedy(hf, {k: adapters[k] for k in ("a1", "a2")}, runs, N)
    for (ids, name), (tokens, lps) in zip(runs, want, strict=True):
        np.testing.assert_allclose(completion_logprobs(client, name or "base", ids), lps,
                                   atol=2e-3)
        with Client("127.0.0.1", srv.port, api_key="k") as c:
            assert c.generate(prompt_token_ids=ids, lora_name=name, max_tokens=N,
                              temperature=0, ignore_eos=True)["token_ids"] == tokens
    with Client("127.0.0.1", srv.port, api_key="k") as c:
        with pytest.raises(ServerError, match="lora_name") as e:
            c.generate(prompt_token_ids=[5, 6], lora_name="nope", max_tokens=2)
        assert e.value.code == "not_found"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=[5, 6], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="base model only"):
        client.embeddings.create(model="a1", input=[5, 6, 7])


def test_load_and_unload_while_requests_stream(setup, client):
    """Socket streams on the base and a1 keep HF + PEFT's tokens while a3 is loaded and a2
    unloaded (then a2 loaded back, a3 unloaded); unloading a1 while it streams is 409."""
    srv, hf, adapters, _ = setup
    n = 96  # long enough to be running when the first unload comes
    runs = list(zip(prompts(2, (6, 9, 13)), (None, "a1", "a1"), strict=True))
    want = [t for t, _ in peft_greedy(hf, {"a1": adapters["a1"]}, runs, n)]
    got: list[list[int] | None] = [None] * len(runs)
    started = threading.Barrier(len(runs) + 1, timeout=60)

    def stream(i: int, ids: list[int], name: str | None) -> None:
        toks = []
        with Client("127.0.0.1", srv.port, api_key="k") as c:
            for k, frame in enumerate(c.generate_stream(
                    prompt_token_ids=ids, lora_name=name, max_tokens=n, temperature=0,
                    ignore_eos=True)):
                toks += frame["token_ids"] if frame["type"] == "token" else []
                if k == 0:
                    started.wait()
        got[i] = toks

    threads = [threading.Thread(target=stream, args=(i, *r)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    started.wait()
    status, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 409 and "in use" in text
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": adapters["a3"]}
                ) == (200, "Success: LoRA adapter 'a3' added successfully.")
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"}
                ) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    assert all(t.is_alive() for t in threads)  # the load and unload came while they ran
    for t in threads:
        t.join(60)
    assert got == want
    assert set(models(client)) == {"base", "a1", "a3"}
    np.testing.assert_allclose(completion_logprobs(client, "a3", runs[0][0], 4), peft_greedy(
        hf, {"a3": adapters["a3"]}, [(runs[0][0], "a3")], 4)[0][1], atol=2e-3)
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]}
                )[0] == 200
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a3"})[0] == 200
    assert set(models(client)) == {"base", "a1", "a2"}


def test_bad_loads_and_unloads_are_refused_with_nothing_changed(setup, client):
    srv, _, adapters, outside = setup
    root = adapters["a1"].rsplit("/", 1)[0]
    before = models(client)
    for body, why in (
            ({"lora_name": "x", "lora_path": f"{root}/big"}, "max_lora_rank"),
            ({"lora_name": "x", "lora_path": f"{root}/shapes"}, "shape"),
            ({"lora_name": "x", "lora_path": f"{root}/nofile"}, "safetensors"),
            ({"lora_name": "x", "lora_path": f"{root}/missing"}, "lora_path"),
            ({"lora_name": "x", "lora_path": f"{root}/target"}, "target_modules"),
            ({"lora_name": "a1", "lora_path": adapters["a3"]}, "already been loaded"),
            ({"lora_name": "base", "lora_path": adapters["a3"]}, "base model"),
            ({"lora_name": "x", "lora_path": str(outside / "a1")}, "lora-allowed-dir"),
            ({"lora_name": "x", "lora_path": f"{root}/../../outside"}, "lora-allowed-dir"),
            ({"lora_path": adapters["a3"]}, "lora_name")):
        status, text = post(srv, "/v1/load_lora_adapter", body)
        assert status == 400 and why in json.loads(text)["error"]["message"], (body, text)
    status, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "cannot be found" in text
    assert models(client) == before


def test_the_endpoints_need_the_api_key(setup, client):
    srv, _, adapters, _ = setup
    for key in (None, "wrong"):
        assert post(srv, "/v1/load_lora_adapter",
                    {"lora_name": "x", "lora_path": adapters["a3"]}, key)[0] == 401
        assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a1"}, key)[0] == 401
    assert set(models(client)) == {"base", "a1", "a2"}


@pytest.mark.parametrize("argv, why", [
    (["--lora-modules", "a=/x"], "enable-lora"),
    (["--lora-modules", "a"], "name=path"),
    (["--lora-modules", '{"name": "a"}'], "path"),
    (["--lora-modules", "a=/x", "a=/y", "--enable-lora"], "differ")])
def test_serve_refuses_lora_options_it_cannot_serve(argv, why, capsys):
    """Before any model loads."""
    with pytest.raises(SystemExit) as e:
        serve_main(argv)
    assert why in str(e.value)


def test_an_adapter_that_does_not_load_stops_the_server_at_start(setup):
    """serve.py with --lora-modules naming a bad adapter exits naming it, serving nothing."""
    srv, _, adapters, _ = setup
    bad = adapters["a1"].rsplit("/", 1)[0] + "/shapes"
    argv = ["--model", srv.server.engine.config.model, "--port", "0", "--no-warmup",
            "--enable-lora", "--max-lora-rank", "16", "--max-model-len", "128",
            "--num-kv-blocks", "64",
            "--lora-modules", f"good={adapters['a1']}", f"bad={bad}"]
    with pytest.raises(SystemExit) as e:
        serve_main(argv)
    assert "lora_modules: 'bad'" in str(e.value) and "shape" in str(e.value)


def test_a_server_without_enable_lora_refuses_adapters(setup):
    srv, _, adapters, _ = setup
    engine = LLMEngine(EngineConfig(model=srv.server.engine.config.model,
                                    **ENGINE | {"enable_lora": False}))
    plain = RunningServer(engine, api_key="k", model_name="base")
    try:
        status, text = post(plain, "/v1/load_lora_adapter",
                            {"lora_name": "a1", "lora_path": adapters["a1"]})
        error = json.loads(text)["error"]
        assert status == 400 and "--enable-lora" in error["message"]
        assert error["param"] == "lora_name"
        status, text = post(plain, "/v1/completions",
                            {"model": "a1", "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 404 and json.loads(text)["error"]["param"] == "model"
        with Client("127.0.0.1", plain.port, api_key="k") as c, \
                pytest.raises(ServerError, match="lora_name"):
            c.generate(prompt_token_ids=[5, 6, 7], lora_name="a1", max_tokens=2)
        status, text = post(plain, "/v1/completions",
                            {"model": "base", "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200
        with Client("127.0.0.1", plain.port, api_key="k") as c:
            assert c.stats()["kv_blocks_used"] == 0
    finally:
        plain.stop()


def test_data_parallel_replicas_each_load_the_adapters(setup):
    """Two replicas: --lora-modules and a runtime load reach both engines, and requests on
    either run the adapter (HF + PEFT's tokens)."""
    from jaxserve.engine import data_parallel

    srv, hf, adapters, _ = setup
    engine = srv.server.engine
    engines = data_parallel.build_replicas(
        EngineConfig(model=engine.config.model, **ENGINE | {"data_parallel_size": 2}))
    dp = RunningServer(engines, api_key="k", lora_modules=(f"a1={adapters['a1']}",))
    try:
        assert post(dp, "/v1/load_lora_adapter",
                    {"lora_name": "a3", "lora_path": adapters["a3"]})[0] == 200
        assert [[r.lora_name for r in e.list_loras()] for e in engines] == [["a1", "a3"]] * 2
        runs = list(zip(prompts(3, (4, 7, 10, 12)), ("a1", "a3", "a1", "a3"), strict=True))
        want = [t for t, _ in peft_greedy(hf, {k: adapters[k] for k in ("a1", "a3")}, runs, N)]

        def generate(run) -> list[int]:
            with Client("127.0.0.1", dp.port, api_key="k") as c:
                return c.generate(prompt_token_ids=run[0], lora_name=run[1], max_tokens=N,
                                  temperature=0, ignore_eos=True)["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
            got = list(pool.map(generate, runs))
        assert got == want
        assert all(e.metrics_snapshot()["num_requests_finished"] for e in engines)
    finally:
        dp.stop()
