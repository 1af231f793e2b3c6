"""Admission (core/admission.py): the one check of a request's SamplingParams and the one
filling of its max_tokens, on plain values."""

from __future__ import annotations

import pytest

from jaxserve.core.admission import LimitError, Limits, admit
from jaxserve.core.sampling_params import ParamError, SamplingParams

LIMITS = Limits(max_model_len=100, max_logprobs=5)


def test_a_bad_field_is_named_and_the_callers_params_are_untouched():
    with pytest.raises(ParamError, match="^temperature"):
        admit(SamplingParams(temperature=-1), 10, LIMITS)
    with pytest.raises(ParamError, match="^logprobs must be an int in \\[0, 5\\]"):
        admit(SamplingParams(logprobs=6), 10, LIMITS)
    params = SamplingParams(max_tokens=None)
    assert admit(params, 10, LIMITS).max_tokens == 90
    assert params.max_tokens is None


def test_max_tokens_fills_the_room_the_context_and_the_pool_leave():
    open_ended = SamplingParams(max_tokens=None)
    assert admit(open_ended, 30, LIMITS, most_tokens_held=50).max_tokens == 20
    assert admit(open_ended, 30, LIMITS, most_tokens_held=500).max_tokens == 70
    given = SamplingParams(max_tokens=7)
    assert admit(given, 30, LIMITS) is given
    with pytest.raises(ValueError, match="prompt has 100 tokens: no room left"):
        admit(open_ended, 100, LIMITS)


def test_the_servers_cap_refuses_more_and_bounds_the_default():
    capped = Limits(max_model_len=100, max_logprobs=5, max_tokens_limit=8)
    with pytest.raises(LimitError, match="max_tokens 9 exceeds the server's max_tokens_limit") as e:
        admit(SamplingParams(max_tokens=9), 10, capped)
    assert e.value.param == "max_tokens"
    assert admit(SamplingParams(max_tokens=None), 10, capped).max_tokens == 8
    assert admit(SamplingParams(max_tokens=None), 95, capped).max_tokens == 5


def test_a_front_whose_pool_is_elsewhere_leaves_the_default_to_that_engine():
    params = SamplingParams(max_tokens=None)
    assert admit(params, 10, LIMITS, pool_elsewhere=True).max_tokens is None
    capped = Limits(max_model_len=100, max_logprobs=5, max_tokens_limit=8)
    assert admit(params, 10, capped, pool_elsewhere=True).max_tokens == 8
    with pytest.raises(ParamError, match="^n must be"):  # checked here all the same
        admit(SamplingParams(n=0), 10, LIMITS, pool_elsewhere=True)
