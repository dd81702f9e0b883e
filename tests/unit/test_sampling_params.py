"""SamplingParams: parsing from JSON-like dicts and range checks that name the field."""

from __future__ import annotations

import pytest

from framework.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params).verify()


def test_defaults_verify() -> None:
    SamplingParams().verify()


def test_from_dict_accepts_a_single_stop_string() -> None:
    params = SamplingParams.from_dict({"stop": "\n", "temperature": 0})
    assert params.stop == ["\n"]
    assert params.is_greedy


@pytest.mark.parametrize(
    "params",
    [{"temperature": "hot"}, {"max_new_tokens": 1.5}, {"no_such_field": 1}, {"stop": [1]}],
)
def test_wrong_types_and_unknown_fields_are_value_errors(params: dict) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict(params)
