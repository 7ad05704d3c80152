"""Wrong-typed values in every :class:`balancer.RouterConfig` field are refused as pydantic's
``ValidationError`` naming the field (a quoted count such as
``block_size: "64"`` escaped as a ``TypeError`` traceback, because pydantic reports only a
``ValueError`` raised in a validator). Fuzz by class: every field x every wrong-typed value."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from balancer import RouterConfig, TtftSlo

#: Values of the wrong type or range for (nearly) every field: strings (a quoted number, a NaN
#: text), booleans, floats (fractional, whole, NaN, the infinity, 1e30), containers, a negative,
#: a huge int, a bare object.
WRONG = ["64", "nan", True, False, 1.5, 64.0, math.nan, math.inf, 1e30, [], [1, 2], {}, {"a": 1}, -1, 10**30,
         object()]

#: The count fields: every value of WRONG but a huge int is refused there (no rounding, no parsing).
COUNTS = ["block_size", "pd_min_uncached_tokens", "index_capacity_blocks", "index_total_capacity_blocks",
          "host_index_capacity_blocks", "store_index_capacity_blocks"]


@pytest.mark.parametrize("field", sorted(RouterConfig.model_fields))
def test_every_wrong_typed_value_is_a_validation_error_naming_the_field(field: str) -> None:
    """Some fields take some of WRONG (a float TTL, a bool flag, an empty table); whatever a
    field refuses, it refuses as a ValidationError naming it: a TypeError or AttributeError
    escaping here fails the test."""
    refused = []
    for v in WRONG:
        try:
            RouterConfig.model_validate({field: v})
        except ValidationError as e:
            assert e.errors()[0]["loc"][0] == field, e
            refused.append(v)
    # the non-numeric text, a list and a bare object are refused by every field
    assert sum(1 for v in refused if isinstance(v, (str, list, object)) and not isinstance(v, (int, float, dict))) \
        >= 4, (field, refused)
    if field in COUNTS:
        assert len(refused) == len(WRONG) - 1, (field, [v for v in WRONG if v not in refused])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", "64", "block_size must be an integer >= 1, got str '64'"),
    ("block_size", True, "block_size must be an integer >= 1, got bool True"),
    ("block_size", 64.0, "block_size must be an integer >= 1, got float 64.0"),
    ("pd_min_uncached_tokens", "5", "pd_min_uncached_tokens must be an integer >= 0, got str '5'"),
    ("index_total_capacity_blocks", "1000", "index_total_capacity_blocks must be an integer >= 1, got str '1000'"),
    ("speculative_ttl_s", "5", "speculative_ttl_s must be a number of seconds > 0, got str '5'"),
    ("tier_weights", 0.5, "tier_weights must be a table of tier weights such as {host = 0.75, store = 0.5}, "
                          "got float 0.5"),
    ("tier_weights", {"host": "x"}, "tier_weights['host'] must be a number in [0, 1], got str 'x'"),
    ("ttft_slo", 2, "ttft_slo must be a table {ttft_s = SECONDS, per_1k_prompt_tokens_s = SECONDS} "
                    "(YAML: {ttft_s: 2, per_1k_prompt_tokens_s: 0.1}), a balancer.TtftSlo, or none; got int 2"),
    ("ttft_slo", {"ttft": 2}, "ttft_slo: unknown key(s) ttft; give a table"),
])
def test_messages_say_what_was_given_and_what_is_expected(field: str, value: object, message: str) -> None:
    # expected text written by hand from each validator's rule
    with pytest.raises(ValidationError) as e:
        RouterConfig.model_validate({field: value})
    assert message in str(e.value)


def test_the_table_form_of_ttft_slo_still_works() -> None:
    cfg = RouterConfig.model_validate({"ttft_slo": {"ttft_s": 2, "per_1k_prompt_tokens_s": 0.1}})
    assert cfg.ttft_slo == TtftSlo(2.0, 0.1)
    # budget of a 1000-token prompt: 2 + 0.1 * 1000 / 1000 = 2.1 s (the formula in TtftSlo's docstring)
    assert cfg.ttft_slo.budget_s(1000) == pytest.approx(2.1)


def test_a_learner_without_the_protocol_is_refused_at_construction() -> None:
    # not accepted only for the first route() to raise AttributeError 'model'
    from balancer import Router
    with pytest.raises(TypeError, match=r"learner must have model, on_dispatch, .*CostLearnerPart\), got object"):
        Router.from_config(RouterConfig(learn_cost_model=False), learner=object())


def test_load_sources_is_exported_and_checks_its_peer() -> None:
    # README's library paragraph imports it from balancer
    from balancer import LoadSources
    with pytest.raises(ValueError, match="LoadSources.peer must have bind, refresh and publish"):
        LoadSources(peer=object())
