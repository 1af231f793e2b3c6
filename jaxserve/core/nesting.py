"""How deeply a client's JSON nests, bounded before anything walks it.

Code that walks JSON recursively (the json module, jsonschema, the chat template, the grammar
compiler) runs out of stack on a value a few hundred levels deep, which a body of a few KB can
hold. A request's fields are measured here without recursion and refused past MAX_DEPTH levels,
naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # levels of lists and objects in one field's value
_CONTAINERS = frozenset((dict, list))  # what json and msgpack decode arrays and maps to


class TooDeep(ValueError):
    """A value nests deeper than MAX_DEPTH; `field` names it."""

    def __init__(self, field: str):
        super().__init__(f"{field} nests lists and objects deeper than {MAX_DEPTH} levels")
        self.field = field


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Levels of lists and dicts in `value` (a scalar: 0), counted at most to limit + 1."""
    level = [value] if type(value) in _CONTAINERS else []
    n = 0
    while level and n <= limit:
        n += 1
        below = []
        for v in level:
            items = v.values() if type(v) is dict else v
            if not _CONTAINERS.isdisjoint(map(type, items)):  # at C speed for flat ones
                below += [x for x in items if type(x) in _CONTAINERS]
        level = below
    return n


def check(value: Any, field: str) -> None:
    """Raise TooDeep naming `field` if `value` nests deeper than MAX_DEPTH."""
    if depth(value) > MAX_DEPTH:
        raise TooDeep(field)


def loads(text: str | bytes, field: str) -> Any:
    """json.loads, raising TooDeep naming `field` for a value deeper than MAX_DEPTH (one too
    deep for the json module itself included) and ValueError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(field) from None
    check(value, field)
    return value


def loads_body(data: bytes) -> Any:
    """A request body parsed; raises TooDeep naming the top-level field that nests deeper than
    MAX_DEPTH, ValueError if it is not JSON."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise TooDeep(_deep_field(data.decode())) from None
    if isinstance(body, dict):
        for name, value in body.items():
            check(value, name)
    return body


_SPACE = re.compile(r"[ \t\n\r]*")


def _deep_field(text: str) -> str:
    """The first top-level field of an object too deep for json.loads, found by parsing the
    fields one by one; ValueError if `text` is not such an object."""
    decoder = json.JSONDecoder()
    i = _SPACE.match(text).end()
    if not text.startswith("{", i):
        raise ValueError("not a JSON object")
    delimiter = "{"
    while delimiter in ("{", ","):
        name, i = decoder.raw_decode(text, _SPACE.match(text, i + 1).end())
        i = _SPACE.match(text, i).end()
        if not isinstance(name, str) or not text.startswith(":", i):
            raise ValueError("not a JSON object")
        try:
            _, i = decoder.raw_decode(text, _SPACE.match(text, i + 1).end())
        except RecursionError:
            return name
        i = _SPACE.match(text, i).end()
        delimiter = text[i:i + 1]
    raise ValueError("not a JSON object")
