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


# ep_aware ignores the TTFT budget where every engine of the pool it applies to is wide EP, unless
# slo_wide_ep (its default is off): on dsv3-pd-h800 (3 prefill engines of 16 EP ranks) slo_* and the
# policy's own ttft_slo_s change nothing even with --route-slo (was: no warning there), and the
# advice "add --route-slo" alone would not help (it now says slo_wide_ep=true too)
WIDE = ["--scenario", "dsv3-pd-h800", "--limit", "10", "--quiet", "--no-plots"]
WIDE_BUDGET = ("warning: ep_aware({params}): {names} change{s} nothing: ep_aware routes SLO-blind where every engine is "
               "wide EP, as here (slo_wide_ep=true to the policy routes against the TTFT budget there too)")
WIDE_NO_BUDGET = ("warning: ep_aware(slo_margin=0.5): slo_margin changes nothing without a TTFT budget to route against "
                  "(add --route-slo, or ttft_slo_s=S to the policy; and slo_wide_ep=true: every engine here is wide "
                  "EP, where ep_aware routes SLO-blind by default)")


@pytest.mark.parametrize("argv, want", [
    (["--policy", "ep_aware:slo_margin=0.5", "--route-slo"],
     WIDE_BUDGET.format(params="slo_margin=0.5", names="slo_margin", s="s")),
    (["--policy", "ep_aware:ttft_slo_s=2,slo_margin=0.5"],
     WIDE_BUDGET.format(params="slo_margin=0.5,ttft_slo_s=2.0", names="ttft_slo_s, slo_margin", s="")),
    (["--policy", "ep_aware:slo_margin=0.5"], WIDE_NO_BUDGET),
    (["--policy", "ep_aware:slo_margin=0.5,slo_wide_ep=true", "--route-slo"], None),
    (["--policy", "ep_aware", "--route-slo"], None),
])
def test_wide_ep_pools(argv, want, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main(["sim", "run", *argv, *WIDE, "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == ([want] if want else [])


def test_the_warned_parameters_do_change_nothing_on_wide_ep(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    # the warning's claim, checked by running: with --route-slo, slo_margin=0.5 gives the same
    # per-request results as no parameter on dsv3-pd-h800 (and, as a control, slo_wide_ep=true
    # with it is a different run)
    outs = {}
    for name, policy in (("plain", "ep_aware"), ("margin", "ep_aware:slo_margin=0.5"),
                         ("wide", "ep_aware:slo_margin=0.5,slo_wide_ep=true")):
        assert main(["sim", "run", "--policy", policy, "--route-slo", "--scenario", "dsv3-pd-h800", "--limit", "300",
                     "--no-plots", "--quiet", "--out", str(tmp_path / name)]) == 0
        outs[name] = [(tmp_path / name / f.name).read_bytes() for f in sorted((tmp_path / name).glob("requests*.csv"))]
    capsys.readouterr()
    assert outs["plain"] == outs["margin"]
    assert outs["wide"] != outs["plain"]


def test_the_title_says_ep_aware_routes_slo_blind_on_wide_ep(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    # review R3: with --route-slo on an all-wide-EP scenario the title said "routed against the
    # TTFT SLO by ep_aware", though the run is the SLO-blind one (byte-identical, test above)
    assert main(["sim", "run", "--policy", "ep_aware", "--route-slo", *WIDE, "--out", str(tmp_path / "a")]) == 0
    assert main(["sim", "run", "--policy", "ep_aware:slo_wide_ep=true", "--route-slo", *WIDE,
                 "--out", str(tmp_path / "b")]) == 0
    assert main(["sim", "run", "--policy", "ep_aware", "--route-slo", *BASE, "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out  # the three tables' titles
    assert "routed SLO-blind where every engine is wide EP (slo_wide_ep=false): ep_aware" in out
    assert "routed against the TTFT SLO by ep_aware(slo_wide_ep=True)" in out
    assert out.count("routed against the TTFT SLO by ep_aware") == 2  # b (wide EP, slo_wide_ep) and c (dense)
