"""``--admission-wait-model policy`` (or ``max``) with routing policies that predict no TTFT
gives one warning line in ``pdlb sim run`` and ``pdlb serve``, and
none when a policy predicts (``ep_aware``: balancer.policies.ep_aware implements TtftPredictor)."""

from __future__ import annotations

import pytest

from balancer.deadline_admission import wait_model_warning
from balancer.policies.base import policy_class
from balancer.service.config import config_warnings, load_service_config
from pdlb_cli.main import main

LINE = ("warning: admission wait model 'policy' but no routing policy here predicts TTFT (policy least_load; "
        "ep_aware does): the gate uses the backlog model")


def test_sim_run_warns_once_for_a_policy_without_prediction(capsys) -> None:
    assert main(["sim", "run", "--policy", "least_load", "--admission", "--admission-wait-model", "policy",
                 "--limit", "30", "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines() == [LINE]


@pytest.mark.parametrize(("wait_model", "prefill", "decode", "warns"), [
    ("policy", "least_load", "least_load", True),
    ("max", "cache_aware", "least_load", True),
    ("policy", "ep_aware", "least_load", False),
    ("backlog", "least_load", "least_load", False),
])
def test_serve_config_warns_when_nothing_predicts(wait_model, prefill, decode, warns) -> None:
    cfg = load_service_config(None, {"router": {"prefill_policy": prefill, "decode_policy": decode},
                                     "admission": {"enabled": True, "wait_model": wait_model}})
    lines = [w for w in config_warnings(cfg) if "admission wait model" in w]
    assert lines == ([f"warning: admission wait model {wait_model!r} but no routing policy here predicts TTFT "
                      f"(prefill {prefill}, decode {decode}; ep_aware does): the gate uses the backlog model"]
                     if warns else [])


def test_classes_and_objects_are_both_read() -> None:
    assert wait_model_warning("policy", {"p": policy_class("ep_aware")()}) is None
    assert wait_model_warning("policy", {"p": policy_class("least_load")}) is not None
