"""One-line pydantic error messages (balancer.validation); expected strings written by hand."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from balancer.validation import format_validation_error
from sim.scenario import Scenario


def _err(data: dict) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Scenario.model_validate(data)
    return info.value


def test_unknown_field_suggests_the_closest_valid_name():
    e = _err({"prefill": {"num_engine": 2}, "decode": {}})
    assert format_validation_error(e, "bad.toml", Scenario) == (
        "bad.toml: prefill.num_engine: unknown field (did you mean 'num_engines'?)")


def test_unknown_field_without_a_close_match_lists_the_valid_ones():
    e = _err({"prefill": {}, "decode": {}, "zzz": 1})
    msg = format_validation_error(e, None, Scenario)
    assert msg.startswith("zzz: unknown field (valid: ") and "block_size" in msg and "\n" not in msg


def test_several_problems_on_one_line_in_pydantic_order():
    e = _err({"prefill": {"num_engines": -2}, "decode": {}, "block_size": 0})
    assert format_validation_error(e, "x.toml") == (
        "x.toml: block_size: Input should be greater than or equal to 1; "
        "prefill.num_engines: Input should be greater than or equal to 1")


def test_model_validator_messages_lose_the_value_error_prefix():
    e = _err({"prefill": {}})  # PD needs both pools (Scenario._check_pools)
    assert format_validation_error(e, "s.toml") == "s.toml: a PD scenario needs both a prefill and a decode pool"
