"""The chat workloads of the benchmarks: open-ended prompts, and grounded ones that copy or edit
a text they give; through the chat template for the offline ones."""

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


PASSAGES = [
    "The harbour town wakes early. Fishing boats leave before dawn, and by seven the market "
    "stalls are full of mackerel, crab and bright orange mussels. Visitors who arrive by the "
    "morning ferry can walk the cliff path to the lighthouse, which opens at ten.",
    "To make the bread, mix 500 grams of flour with 10 grams of salt and 7 grams of yeast. "
    "Add 350 millilitres of warm water and knead for ten minutes. Let the dough rise for one "
    "hour, shape it, rise again for forty minutes, then bake at 220 degrees for thirty minutes.",
    "The library moved to the old railway station in 2019. Its reading room sits under the "
    "glass roof of the former hall, the children's section fills the ticket office, and the "
    "archive of local newspapers is kept in the cool rooms below the platforms.",
    "Our team meets on Mondays at nine to plan the week. Each person names one goal and one "
    "risk. On Fridays at four we look at what was finished, what slipped and why, and we write "
    "one sentence about what we would do differently next time.",
]
CODE = [
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "def count_words(text):\n    total = {}\n    for word in text.split():\n"
    "        total[word] = total.get(word, 0) + 1\n    return total\n",
]
TYPOS = str.maketrans({"e": "3"})  # a text to correct: every 'e' made a '3'


def grounded_prompts() -> list[str]:
    """Requests that copy, correct, quote, rename or summarize a text they give: the output
    repeats much of the prompt (what prompt-lookup speculation proposes from)."""
    out = []
    for p in PASSAGES:
        out.append(f"Repeat the following text exactly, word for word:\n\n{p}")
        out.append(f"Every letter e in this text was typed as 3. Write the corrected text:"
                   f"\n\n{p.translate(TYPOS)}")
        out.append(f"Quote the sentence of this text that gives a time or a number, "
                   f"exactly:\n\n{p}")
        out.append(f"Summarize this text in one sentence:\n\n{p}")
    for c in CODE:
        out.append(f"Rename the variable `total` to `acc` in this Python function and return "
                   f"the whole function:\n\n{c}")
    return out
