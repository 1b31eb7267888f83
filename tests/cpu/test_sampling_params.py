import math

import pytest

from torpor.engine.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[7, 9])
    assert p.stop == ("END",) and p.stop_token_ids == (7, 9)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert not SamplingParams().is_greedy and not SamplingParams().needs_filter
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0, top_k=5).needs_filter is False   # greedy ignores filters
    assert SamplingParams(top_k=5).needs_filter and SamplingParams(top_p=0.5).needs_filter
    hash(p)  # frozen and hashable after normalisation


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 3.0),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]),
    ("ignore_eos", 1), ("seed", "42"), ("seed", 1.0),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"top_k": -1}, {"top_k": 1},
    {"logprobs": 0}, {"logprobs": 20}, {"prompt_logprobs": 0}, {"seed": -5}, {"seed": 2**70},
    {"max_tokens": 1}, {"stop": None},
])
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_immutable():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]
