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
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 3), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", 7), ("stop_token_ids", 7.0),
    ("ignore_eos", 1), ("seed", "42"), ("seed", 1.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", math.nan),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01), ("frequency_penalty", "1"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),
    ("skip_special_tokens", 0), ("include_stop_str_in_output", "yes"),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {1: math.nan}), ("logit_bias", [1, 2]), ("logit_bias", 3), ("logit_bias", [(1, 1.0), (1, 2.0)]),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"top_k": -1}, {"top_k": 1},
    {"logprobs": 0}, {"logprobs": 20}, {"prompt_logprobs": 0}, {"seed": -5}, {"seed": 2**70},
    {"max_tokens": 1}, {"stop": None},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 5}, {"presence_penalty": -2}, {"frequency_penalty": 2.0},
    {"min_p": 0}, {"min_p": 1}, {"min_tokens": 16}, {"max_tokens": 3, "min_tokens": 3},
    {"logit_bias": {0: -100, 7: 100}}, {"logit_bias": {}}, {"skip_special_tokens": False},
])
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_immutable():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_logit_bias_is_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={9: 1.5, 2: -3})
    assert p.logit_bias == ((2, -3), (9, 1.5)) and SamplingParams(logit_bias=p.logit_bias) == p
    hash(p)
    assert SamplingParams(logit_bias=None).logit_bias == ()
    p.check_vocab(10)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 9\).*\[9\]"):
        p.check_vocab(9)


def test_options_that_need_processing():
    assert not SamplingParams().needs_logits_processing
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0, min_p=0.5).needs_logits_processing
    for kw in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
               {"logit_bias": {1: 0.5}}, {"min_tokens": 1}):
        assert SamplingParams(**kw).needs_logits_processing, kw
    assert SamplingParams(presence_penalty=0.1).needs_history and not SamplingParams(min_tokens=2).needs_history
