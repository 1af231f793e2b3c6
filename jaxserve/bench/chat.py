"""The chat workload of the offline benchmarks: open-ended prompts through the chat template."""

from __future__ import annotations

TOPICS = ["the ocean", "a robot", "ancient Rome", "prime numbers", "a lighthouse", "coffee",
          "the moon", "a violin", "winter", "volcanoes", "a library", "chess", "bees", "rain",
          "a train journey", "gardening"]
KINDS = ["Write a short story about {}.", "Explain {} to a child.",
         "List some facts about {}:", "Describe {} in detail."]


def make_prompts(n: int) -> list[str]:
    """`n` user messages, each kind of request over each topic in turn."""
    return [KINDS[i % len(KINDS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a one-message chat, through `tokenizer`'s template, ready to answer."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for p in prompts]
