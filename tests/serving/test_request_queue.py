"""The four classes that take a request in share one declared signature
(core/admission.RequestQueue): the engine, and the serving core's three async sets over it."""

from __future__ import annotations

import inspect

import pytest

from jaxserve.core.admission import RequestQueue
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.disagg import DisaggSet
from jaxserve.serving.replicas import ReplicaSet

# Parameters an implementation may add beyond the protocol's: keyword-only, with a default.
EXTRA = {LLMEngine: {"arrival_time"}}


def _params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("cls", [LLMEngine, AsyncEngine, ReplicaSet, DisaggSet])
def test_add_request_has_the_protocols_signature(cls):
    want = _params(RequestQueue.add_request)
    got = _params(cls.add_request)
    extra = [p for p in got if p.name in EXTRA.get(cls, set())]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra)
    got = [p for p in got if p not in extra]
    assert [(p.name, p.kind, p.default, p.annotation) for p in got] == [
        (p.name, p.kind, p.default, p.annotation) for p in want]


@pytest.mark.parametrize("cls", [AsyncEngine, ReplicaSet, DisaggSet])
def test_the_serving_sets_return_the_requests_stream(cls):
    assert inspect.iscoroutinefunction(cls.add_request)
    assert inspect.signature(cls.add_request).return_annotation == "RequestStream"

