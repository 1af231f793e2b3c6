"""SamplingParams: the one list of sampling parameters, their request types and validation."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import SamplingParams
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
    ({"n": 2}, "n"),
])
def test_from_dict_names_the_bad_field(raw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams.from_dict(raw)


def test_from_dict_can_ignore_other_keys():
    p = SamplingParams.from_dict({"model": "m", "max_tokens": 3}, allow_unknown=True)
    assert p.max_tokens == 3
