"""The benchmarks' chat workload: its prompts, and their ids through a real chat template."""

from __future__ import annotations

from jaxserve.bench.chat import KINDS, TOPICS, chat_ids, make_prompts


def test_prompts_take_every_kind_over_every_topic_in_turn():
    prompts = make_prompts(32)
    assert len(prompts) == 32 and len(set(prompts)) == 16  # 16 topics, 4 kinds: lcm 16
    assert prompts[:3] == ["Write a short story about the ocean.",
                           "Explain a robot to a child.", "List some facts about ancient Rome:"]
    assert make_prompts(5) == prompts[:5]
    assert all(p == KINDS[i % 4].format(TOPICS[i % 16]) for i, p in enumerate(prompts))


def test_chat_ids_are_the_models_template_ready_for_its_answer(smollm):
    tok = smollm.tokenizer
    ids = chat_ids(tok, make_prompts(2))
    assert len(ids) == 2 and all(isinstance(i, int) for row in ids for i in row)
    text = tok.decode(ids[1])
    assert "<|im_start|>user\nExplain a robot to a child.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
