"""The benchmarks' chat workload: its prompts, and their ids through a real chat template."""

from __future__ import annotations

from jaxserve.bench.chat import KINDS, TOPICS, chat_ids, grounded_prompts, make_prompts


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


def test_grounded_prompts_each_give_the_text_to_work_on():
    from jaxserve.bench.chat import CODE, PASSAGES, TYPOS

    prompts = grounded_prompts()
    assert len(prompts) == 4 * len(PASSAGES) + len(CODE) and len(set(prompts)) == len(prompts)
    for i, passage in enumerate(PASSAGES):
        repeat, correct, quote, summary = prompts[4 * i:4 * i + 4]
        assert repeat.endswith(passage) and quote.endswith(passage)
        assert summary.endswith(passage) and correct.endswith(passage.translate(TYPOS))
    assert all(p.endswith(c) for p, c in zip(prompts[-len(CODE):], CODE, strict=True))
