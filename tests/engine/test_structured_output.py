"""Structured output on the default model: every output matches its JSON schema, regex, choice
or grammar, greedy and sampled, mixed in one batch with free requests; bad grammars are refused
with a clear error; the same tokens with asynchronous scheduling."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import buckets_from_8, run_all

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TOPICS = ["a chef", "a pilot", "my aunt", "a student", "a painter", "a doctor", "a poet",
          "a sailor", "an engineer", "a farmer", "a singer", "a nurse", "a baker"]


def _engine(smollm, **kw) -> LLMEngine:
    args = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=256,
                num_kv_blocks=256, log_stats_interval_s=0)
    return LLMEngine(EngineConfig(**buckets_from_8(args | kw)), smollm)


def _prompt(smollm, text: str) -> str:
    return smollm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                tokenize=False, add_generation_prompt=True)


def _generate(engine, requests: list[tuple[str, SamplingParams]]):
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = run_all(engine)
    assert engine.block_manager.num_used_blocks == 0
    return [done[f"r{i}"].outputs[0] for i in range(len(requests))]


def test_json_outputs_parse_and_validate(smollm):
    """12 greedy and 12 sampled requests under the schema, with free requests in the same
    steps (which must stay free: the mask is per row). The fifty of the OpenAI front's test
    run the same schema through the server."""
    engine = _engine(smollm)
    so = {"json": SCHEMA}
    reqs = [(_prompt(smollm, f"Describe {TOPICS[i % len(TOPICS)]} as JSON (case {i})."),
             SamplingParams(temperature=0 if i < 12 else 0.9, seed=i, max_tokens=96,
                            structured_outputs=so)) for i in range(24)]
    free = [(_prompt(smollm, "Say hello."), SamplingParams(temperature=0, max_tokens=8))] * 2
    outs = _generate(engine, reqs + free)
    for out in outs[:24]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs[12:24]}) > 3  # the sampled ones differ
    assert not outs[24].text.startswith("{")


def test_regex_choice_grammar_and_json_object(smollm):
    engine = _engine(smollm)
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    ebnf = 'root ::= "(" [0-9]+ ")"'
    outs = _generate(engine, [
        (_prompt(smollm, "Give me a phone number."),
         SamplingParams(temperature=0.7, seed=2, max_tokens=20,
                        structured_outputs={"regex": r"\d{3}-\d{4}"})),
        (_prompt(smollm, "Is the sky green?"),
         SamplingParams(temperature=0, max_tokens=10,
                        structured_outputs={"choice": ["yes", "no", "maybe"]})),
        (_prompt(smollm, "Is water wet?"),
         SamplingParams(temperature=0, max_tokens=20, structured_outputs={"grammar": grammar})),
        (_prompt(smollm, "A number in brackets:"),
         SamplingParams(temperature=0, max_tokens=8, structured_outputs={"grammar": ebnf})),
        (_prompt(smollm, "Describe Paris as a JSON object with two keys."),
         SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json_object": True})),
    ])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"The answer is (yes|no)\.", outs[2].text)
    assert re.fullmatch(r"\([0-9]+\)?", outs[3].text)  # may run out of tokens before ")"
    if outs[4].finish_reason == "stop":
        assert isinstance(json.loads(outs[4].text), dict)
    else:
        assert outs[4].text.startswith("{")


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "objectx"}}, "invalid json"),
    ({"json": "{not json"}, "invalid json"),
    ({"regex": "[a-z"}, "invalid regex"),
    ({"grammar": "start: undefined_rule"}, "invalid grammar"),
    ({"choice": []}, "invalid choice"),
    # JSON in a string, and GBNF, too deep for the code that reads them to recurse through
    ({"json": "[" * 5000 + "]" * 5000}, "invalid json: the schema nests lists and objects "
                                        "deeper than 64 levels"),
    ({"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}, "invalid grammar: nests too "
                                                                   "deeply"),
])
def test_a_bad_grammar_is_refused_and_harms_nothing(smollm, spec, message):
    engine = _engine(smollm)
    engine.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=f"structured_outputs: {message}"):
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    done = run_all(engine)
    assert list(done) == ["ok"] and len(done["ok"].outputs[0].token_ids) == 4


def test_async_scheduling_gives_the_same_tokens(smollm):
    """A constrained or penalized row sits out the step after each of its own (its mask
    needs the token the device is still sampling): the tokens do not change."""
    reqs = [(_prompt(smollm, f"Describe {t} as JSON."),
             SamplingParams(temperature=0.8, seed=7, max_tokens=64,
                            structured_outputs={"json": SCHEMA})) for t in TOPICS[:3]]
    reqs += [(_prompt(smollm, "Tell me a story."),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                             frequency_penalty=0.4)),
             (_prompt(smollm, "Count to ten."), SamplingParams(temperature=0, max_tokens=24))]
    got = {}
    for mode in (False, True):
        got[mode] = [o.token_ids for o in _generate(_engine(smollm, async_scheduling=mode),
                                                   reqs)]
    assert got[True] == got[False]


def test_speculation_under_a_grammar(smollm):
    """n-gram proposals for constrained requests: the grammar cuts each proposal at the first
    token it refuses, and every verified position is masked by the grammar's state after the
    proposals before it. Greedy tokens are those without speculation; sampled outputs still
    validate; proposals were made, accepted and cut."""
    reqs = [(_prompt(smollm, f"Describe {TOPICS[i]} as JSON, with tags."),
             SamplingParams(temperature=0 if i < 6 else 0.9, seed=i, max_tokens=96,
                            structured_outputs={"json": SCHEMA})) for i in range(9)]
    reqs.append((_prompt(smollm, "Is the sky green? Answer yes or no, then again."),
                 SamplingParams(temperature=0, max_tokens=20, structured_outputs={
                     "regex": r"(yes|no), (yes|no), (yes|no)\."})))
    plain = _generate(_engine(smollm), reqs)
    # one-token matches too: more proposals, more of them for the grammar to cut
    engine = _engine(smollm, speculative_method="ngram", speculative_adaptive=False,
                     prompt_lookup_min=1)
    spec = _generate(engine, reqs)
    greedy = [i for i, (_, p) in enumerate(reqs) if p.temperature == 0]
    assert [spec[i].token_ids for i in greedy] == [plain[i].token_ids for i in greedy]
    for out in spec[:9]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert re.fullmatch(r"(yes|no), (yes|no), (yes|no)\.", spec[9].text)
    snap = engine.metrics_snapshot()
    assert snap["spec_accepted_tokens"] > 0
    assert snap["spec_cut_by_grammar_tokens"] > 0
