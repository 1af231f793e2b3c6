"""Model families as plug-ins: a family registered from a test is served end to end, and an
architecture nobody registered is refused naming the registered ones."""

from __future__ import annotations

import json

import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.models import families
from jaxserve.models.families import ARCHITECTURES, Family
from jaxserve.models.llama import Transformer
from jaxserve.models.loader import load_model
from jaxserve.testing.tiny import write_tiny_llama
from tests.helpers import make_engine, run_all

PROMPTS = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 2, 64]]


class Renamed(Transformer):
    """The Llama decoder under an architecture name of its own."""


@pytest.fixture
def renamed(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "RenamedForCausalLM",
                        Family("renamed", model=f"{__name__}:Renamed"))


def greedy_tokens(path: str) -> tuple[list[list[int]], object]:
    engine = make_engine(path, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                         num_kv_blocks=16, token_buckets=(16,), seq_buckets=(2,),
                         block_buckets=(4,), max_held_seqs=0)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt_token_ids=ids,
                           params=SamplingParams(temperature=0, max_tokens=6))
    done = run_all(engine)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks  # all came back
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))], engine.runner


def test_a_registered_family_serves_the_llama_paths_tokens(renamed, tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "renamed").mkdir()
    llama = write_tiny_llama(tmp_path / "llama", seed=4)
    other = write_tiny_llama(tmp_path / "renamed", seed=4, architectures=["RenamedForCausalLM"],
                             model_type="renamed")
    want, llama_runner = greedy_tokens(llama)
    got, runner = greedy_tokens(other)
    assert type(runner.model) is Renamed and type(llama_runner.model) is Transformer
    assert runner.model_config.architecture == "RenamedForCausalLM"
    assert got == want and all(len(t) == 6 for t in got)


def test_an_unknown_architecture_is_refused_listing_the_registered_ones(renamed, tmp_path):
    d = write_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["NoSuchForCausalLM"], "nosuch"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture \['NoSuchForCausalLM'\]; "
                                         r"supported: \[.*'RenamedForCausalLM'"):
        load_model(d)
    with pytest.raises(ValueError, match=r"unsupported architecture 'NoSuchForCausalLM'; "
                                         r"supported: \[.*'LlamaForCausalLM'"):
        families.family("NoSuchForCausalLM")


def test_the_gguf_table_is_the_registrys():
    assert families.gguf_architectures() == {
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3moe": "Qwen3MoeForCausalLM"}
