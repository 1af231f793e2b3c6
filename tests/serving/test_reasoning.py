"""Reasoning output: the splitter of each format, whole and streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.serving import reasoning
from jaxserve.serving.reasoning import CLOSE, OPEN, ReasoningSplitter, split

# ------------------------------------------------------------------------------ the splitter

@pytest.mark.parametrize("text, want", [
    (f"{OPEN}abc{CLOSE}xyz", ("abc", "xyz")),
    (f" \n{OPEN}\nabc\n{CLOSE}\n\nxyz", ("\nabc\n", "\n\nxyz")),
    (f"{OPEN}abc{CLOSE}", ("abc", None)),
    (f"{OPEN}{CLOSE}xyz", ("", "xyz")),
    (f"{OPEN}cut off", ("cut off", None)),
    (f"{OPEN}a{CLOSE}b{CLOSE}c", ("a", f"b{CLOSE}c")),
    ("plain answer", (None, "plain answer")),
    ("", (None, "")),
    ("<thi", (None, "<thi")),
    (f"an answer {OPEN}x{CLOSE}", (None, f"an answer {OPEN}x{CLOSE}")),
    (f"{CLOSE}x", (None, f"{CLOSE}x")),
])
def test_qwen3_reasons_only_in_a_block_that_opens_the_output(text, want):
    assert split("qwen3", text) == want


@pytest.mark.parametrize("text, want", [
    (f"abc{CLOSE}xyz", ("abc", "xyz")),
    (f"{OPEN}abc{CLOSE}xyz", ("abc", "xyz")),
    (f"\n{OPEN}abc{CLOSE}", ("abc", None)),
    ("abc", ("abc", None)),
    ("", ("", None)),
    (f"a {OPEN}b{CLOSE}c", (f"a {OPEN}b", "c")),
])
def test_deepseek_r1_starts_inside_the_reasoning(text, want):
    assert split("deepseek_r1", text) == want


PIECES = [OPEN, CLOSE, "<", "</", "<th", "think", ">", "a", " ", "\n", "{"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(reasoning.ReasoningParser)),
       st.lists(st.sampled_from(PIECES), max_size=12).map("".join),
       st.lists(st.integers(0, 60), max_size=8))
def test_any_cut_into_deltas_splits_as_the_whole(parser, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = ReasoningSplitter(parser)
    deltas = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas.append(splitter.finish())
    thought, content = split(parser, text)
    assert "".join(r for r, _ in deltas) == (thought or "")
    assert "".join(c for _, c in deltas) == (content or "")
    # no reasoning after the answer began (a pair's reasoning comes before its content)
    first_content = next((i for i, (_, c) in enumerate(deltas) if c), len(deltas))
    assert not any(r for r, _ in deltas[first_content + 1:])


def test_the_splitter_holds_back_only_what_may_be_a_tag():
    s = ReasoningSplitter("qwen3")
    assert s.feed(" <th") == ("", "")  # maybe <think>
    assert s.feed("ink>ab</") == ("ab", "")  # maybe </think>
    assert s.feed("b") == ("</b", "")
    assert s.feed("</think>x<") == ("", "x<")  # after the reasoning nothing is held
    assert s.has_reasoning and s.finish() == ("", "")
    plain = ReasoningSplitter("qwen3")
    assert plain.feed("<b") == ("", "<b") and not plain.has_reasoning
