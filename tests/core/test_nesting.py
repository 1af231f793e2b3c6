"""The nesting bound on a client's JSON: depth measured without recursion, equal to the plain
recursive definition, and bodies refused naming the field that nests too deeply (one too deep
for the json module to parse included)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.nesting import MAX_DEPTH, TooDeep, depth, loads, loads_body

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=4),
    max_leaves=40)


def recursive_depth(v) -> int:
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, list):
        return 1 + max(map(recursive_depth, v), default=0)
    return 0


def nested(levels: int):
    v = 0
    for _ in range(levels):
        v = [v]
    return v


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_depth_is_the_recursive_definition(value):
    assert depth(value) == recursive_depth(value)
    assert depth([value, {"k": value}]) == recursive_depth(value) + 2


def test_depth_stops_counting_past_the_limit():
    assert [depth(nested(n)) for n in (0, 1, MAX_DEPTH, MAX_DEPTH + 1)] == [
        0, 1, MAX_DEPTH, MAX_DEPTH + 1]
    assert depth(nested(100_000)) == MAX_DEPTH + 1  # no recursion, however deep
    assert depth(nested(10), limit=3) == 4
    assert depth(list(range(100_000))) == 1


def test_a_body_names_its_deep_field():
    body = {"prompt": "x", "tools": [{"parameters": nested(MAX_DEPTH)}]}
    with pytest.raises(TooDeep, match=f"^tools nests lists and objects deeper than "
                                      f"{MAX_DEPTH} levels$") as e:
        loads_body(json.dumps(body).encode())
    assert e.value.field == "tools"
    ok = {"prompt": "x", "stop": nested(MAX_DEPTH)}
    assert loads_body(json.dumps(ok).encode()) == ok


@pytest.mark.parametrize("levels", [5_000, 500_000])
def test_a_body_too_deep_for_json_names_its_field(levels):
    deep = b"[" * levels + b"]" * levels
    raw = b'{"prompt": "x", "n": 1 , "stop"\n:\t' + deep + b', "later": 1}'
    with pytest.raises(TooDeep) as e:
        loads_body(raw)
    assert e.value.field == "stop"


@pytest.mark.parametrize("raw", [b"[" * 5_000 + b"]" * 5_000, b'{"a": 1 "b": ' + b"[" * 5_000,
                                 b"{not json", b"\xff"])
def test_what_is_not_a_json_object_is_a_plain_value_error(raw):
    with pytest.raises(ValueError) as e:
        loads_body(raw)
    assert not isinstance(e.value, TooDeep)


def test_loads_bounds_json_inside_a_string():
    assert loads(json.dumps(nested(MAX_DEPTH)), "x") == nested(MAX_DEPTH)
    for levels in (MAX_DEPTH + 1, 100_000):
        with pytest.raises(TooDeep, match="^arguments nests"):
            loads("[" * levels + "]" * levels, "arguments")
    with pytest.raises(ValueError):
        loads("{not json", "x")
