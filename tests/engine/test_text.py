"""Text-level behaviour on the real default model: detokenization, stop strings, LLM.generate."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from tests.helpers import run_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm):
    return LLMEngine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  num_kv_blocks=64), loaded=smollm)


def test_incremental_detokenizer_handles_multibyte(smollm):
    tok = smollm.tokenizer
    text = "naïve café — 你好，世界! 🙂👍 ∑x² done"
    ids = tok(text).input_ids
    prompt = tok("Say:").input_ids
    detok = IncrementalDetokenizer(TokenDecoder(tok), prompt)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)


def _two_decodes(tok, prompt: list[int], tokens: list[int], skip: bool) -> list[str]:
    """The detokenizer's rule written plainly: both windows decoded by the tokenizer at each
    token."""
    ids, prefix, read, pieces = list(prompt[-5:]), 0, len(prompt[-5:]), []
    for t in tokens:
        ids.append(t)
        before = tok.decode(ids[prefix:read], skip_special_tokens=skip)
        after = tok.decode(ids[prefix:], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            pieces.append("")
            continue
        prefix, read = read, len(ids)
        pieces.append(after[len(before):])
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_matches_decoding_both_windows(smollm, skip):
    tok = smollm.tokenizer
    rng = np.random.default_rng(0)
    decoder = TokenDecoder(tok)  # shared, as by an engine's sequences
    multibyte = tok("你好 🙂 naïve — ∑", add_special_tokens=False).input_ids
    for i in range(30):
        prompt = rng.integers(0, tok.vocab_size, 1 + i % 7).tolist()
        pool = multibyte + list(tok.all_special_ids) if i % 2 else list(range(tok.vocab_size))
        tokens = [int(t) for t in rng.choice(pool, 40)]
        detok = IncrementalDetokenizer(decoder, prompt, skip)
        assert [detok.add(t) for t in tokens] == _two_decodes(tok, prompt, tokens, skip)


def test_stream_text_equals_final_text_and_stop_string_trims(engine):
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("free", "The capital of France is", p)
    streamed = []
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.outputs[0].new_text)
            if out.finished:
                done[out.request_id] = out
    free = done["free"].outputs[0]
    assert "".join(streamed) == free.text
    assert free.text == engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    # Choose a stop string from the middle of the free-running text.
    words = free.text.split()
    stop = words[len(words) // 2]
    engine.add_request("stop", "The capital of France is",
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    out = run_all(engine)["stop"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(free.token_ids)


def test_chat_prompt_stops_on_eos(engine):
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine.add_request("chat", prompt, SamplingParams(temperature=0, max_tokens=64))
    out = run_all(engine)["chat"].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_token_ids
    assert "Paris" in out.text


def test_llm_generate_returns_in_input_order(smollm):
    llm = LLM.from_engines([LLMEngine(EngineConfig(max_num_seqs=3, max_num_batched_tokens=64,
                                                   max_model_len=256, num_kv_blocks=64),
                                      loaded=smollm)])
    prompts = ["One, two, three,", "Hello", "The sky is", "def add(a, b):", "Roses are red,"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 6, 4, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 6, 4, 7]
    # The same prompt alone gives the same tokens (order and batching do not matter).
    again = llm.generate(prompts[2], params[2], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_cli_generate_streams_text():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "generate", "What is the capital of France?", "--chat",
         "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish_reason=stop" in proc.stderr
