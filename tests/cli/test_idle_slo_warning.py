"""``slo_*`` policy parameters on a policy that gets no TTFT budget change nothing, and every command
that runs policies says so: ``sim run``/``compare`` (SLO-blind by default: "add --route-slo"), and,
``sim capacity --no-route-slo`` and a sweep with
``route_slo = false`` ("drop ..."). No warning where the budget reaches the policy (the router's
or the policy's own ``ttft_slo_s``), nor for parameters left at their defaults.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlb_cli.main import main

BASE = ["--scenario", "llama70b-pd-h100", "--limit", "10", "--quiet", "--no-plots"]
MSG = ("warning: ep_aware(slo_margin=0.5): slo_margin changes nothing without a TTFT budget to route against "
       "({fix}, or ttft_slo_s=S to the policy)")


def _warnings(capsys) -> list[str]:  # noqa: ANN001
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]


@pytest.mark.parametrize("argv, fix", [
    (["sim", "run", "--policy", "ep_aware:slo_margin=0.5"], "add --route-slo"),
    (["sim", "run", "--policy", "ep_aware:slo_margin=0.5", "--route-slo"], None),
    (["sim", "run", "--policy", "ep_aware:slo_margin=0.5,ttft_slo_s=2"], None),
    (["sim", "run", "--policy", "ep_aware"], None),
    (["sim", "capacity", "--jobs", "1", "--policy", "ep_aware:slo_margin=0.5", "--no-route-slo"], "drop --no-route-slo"),
    (["sim", "capacity", "--jobs", "1", "--policy", "ep_aware:slo_margin=0.5"], None),
    (["sim", "capacity", "--jobs", "1", "--policy", "ep_aware:slo_margin=0.5,ttft_slo_s=2", "--no-route-slo"], None),
    (["sim", "capacity", "--jobs", "1", "--policies", "ep_aware,kv_cost", "--no-route-slo"], None),
])
def test_run_and_capacity(argv, fix, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([*argv, *BASE, "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == ([MSG.format(fix=fix)] if fix else [])


@pytest.mark.parametrize("route_slo, fix", [("false", "drop route_slo = false"), ("true", None)])
def test_sweep(route_slo, fix, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "s.toml"
    f.write_text(f'scenario = "llama70b-pd-h100"\npolicies = ["ep_aware:slo_margin=0.5", "kv_cost"]\nrates = [1.0]\n'
                 f"limit = 10\nroute_slo = {route_slo}\n")
    assert main(["sim", "sweep", str(f), "--quiet", "--no-plots", "--jobs", "1", "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == ([MSG.format(fix=fix)] if fix else [])
