"""SamplingParams: the one list of sampling parameters, their request types and validation."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import SamplingParams
from jaxserve.core.nesting import MAX_DEPTH
from jaxserve.core.sampling_params import param_names, param_types


def test_names_and_types_come_from_the_dataclass():
    assert param_names() == tuple(f.name for f in dataclasses.fields(SamplingParams))
    types = param_types()
    assert set(types) == set(param_names())
    assert types["temperature"] == (float, int)
    assert types["top_k"] == (int,)
    assert types["stop"] == (list, str)
    assert types["ignore_eos"] == (bool,)
    assert types["seed"] == (int,)


def test_from_dict_builds_and_normalizes():
    p = SamplingParams.from_dict({"temperature": 1, "stop": "x", "top_k": -1, "seed": None})
    assert (p.temperature, p.stop, p.top_k, p.seed) == (1, ["x"], 0, None)


@pytest.mark.parametrize("raw, field", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": True}, "max_tokens"),  # a bool is not an int here
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"n": "2"}, "n"),
])
def test_from_dict_names_the_bad_field(raw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams.from_dict(raw)


def test_from_dict_refuses_values_nested_too_deeply():
    """What a socket frame can carry (msgpack decodes about a thousand levels) is bounded before
    code that walks it recursively sees it."""
    deep: object = "x"
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert SamplingParams.from_dict({"stop": deep}).stop == deep
    for name, value in (("stop", [deep]), ("logit_bias", {"5": [deep]}),
                        ("structured_outputs", {"json": {"items": [deep]}})):
        with pytest.raises(ValueError, match=f"^{name} nests lists and objects deeper than "):
            SamplingParams.from_dict({name: value})


def test_from_dict_can_ignore_other_keys():
    p = SamplingParams.from_dict({"model": "m", "max_tokens": 3}, allow_unknown=True)
    assert p.max_tokens == 3


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5),
    ("temperature", 1e5), ("top_p", float("nan")), ("top_p", 0.0), ("top_p", float("inf")),
    ("top_k", 2**31), ("top_k", -2), ("max_tokens", 0), ("max_tokens", 2**31),
    ("seed", 2**64), ("seed", -1), ("logprobs", 21), ("stop", ["x"] * 17), ("stop", ["x" * 257]),
    ("stop_token_ids", [2**31]), ("stop_token_ids", [-1]), ("stop_token_ids", list(range(1025))),
    ("output_kind", "delta"), ("output_kind", None),
])
def test_validate_refuses_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value}).validate(max_logprobs=20)


@pytest.mark.parametrize("field, value", [
    ("temperature", 0), ("temperature", 1e4), ("top_k", 2**31 - 1), ("max_tokens", None),
    ("seed", 2**64 - 1), ("stop", ["x"] * 16), ("stop_token_ids", [0, 2**31 - 1]),
])
def test_validate_accepts_the_edges(field, value):
    SamplingParams(**{field: value}).validate(max_logprobs=20)


def test_fold_seed_keeps_32_bit_seeds_and_fits_the_rest():
    from jaxserve.core.sampling_params import fold_seed

    assert [fold_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    assert all(0 <= fold_seed(s) < 2**32 for s in (2**32, 2**63 + 5, 2**64 - 1))
    assert fold_seed(2**32) != fold_seed(0)
