"""scripts/make_lora_adapters.py writes adapters the engine reads, each changing the model's
greedy tokens its own way."""

from __future__ import annotations

import os
import runpy
import sys

from jaxserve import LLM, SamplingParams
from jaxserve.core.lora import LoRARequest
from jaxserve.testing.tiny import write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_written_adapters_load_and_change_the_tokens(tmp_path, capsys, monkeypatch):
    (tmp_path / "model").mkdir()
    model = write_tiny_llama(tmp_path / "model", 512, seed=1)
    argv = ["make_lora_adapters.py", "--model", model, "--out", str(tmp_path / "lora"),
            "--count", "2", "--rank", "8"]
    monkeypatch.setattr(sys, "argv", argv)  # the script in this process: no second JAX start
    runpy.run_path(os.path.join(ROOT, "scripts", "make_lora_adapters.py"), run_name="__main__")
    names = capsys.readouterr().out.split()[-2:]
    assert names == [f"a{i}={tmp_path / 'lora' / f'a{i}'}" for i in (1, 2)]
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=32,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29]] * 3
    requests = [None] + [LoRARequest(f"a{i}", i, str(tmp_path / "lora" / f"a{i}"))
                         for i in (1, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=requests)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert len({tuple(t) for t in tokens}) == 3, tokens  # base, a1, a2: each its own
