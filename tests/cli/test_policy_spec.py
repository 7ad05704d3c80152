"""Policy specs (``name:k=v,...``, :mod:`balancer.policies.spec`) on every flag and config that
names a policy: the parser itself, ``pdlb sim run`` / ``compare``, ``pdlb serve`` and its config.

Expected values are the parameters written in the spec (typed by the policy's defaults, read off
the dataclass: ``cache_aware`` has ``cache_threshold=0.3, balance_abs=64, balance_rel=1.5``);
behaviour is checked against the same policy built directly with ``make_policy`` (an independent
path to the same object), not against recorded numbers.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.policies import available_policies, make_policy
from balancer.policies.spec import (
    build_policy,
    format_policy_spec,
    parse_param_value,
    parse_policy_spec,
    split_policy_list,
)
from balancer.service.config import config_warnings, load_service_config
from pdlb_cli.main import build_parser, main
from pdlb_cli.serve import config_from_args

CACHE_AWARE_ACCEPTED = "balance_abs=64, balance_rel=1.5, cache_threshold=0.3"
POLICIES = ", ".join(available_policies())


# ---------------------------------------------------------------------- the parser
def test_values_are_typed_by_the_defaults() -> None:
    assert parse_policy_spec("cache_aware") == ("cache_aware", {})
    assert parse_policy_spec(" cache_aware : cache_threshold=0.5 , balance_abs=8 ") == (
        "cache_aware", {"cache_threshold": 0.5, "balance_abs": 8})
    name, params = parse_policy_spec("cache_aware:balance_rel=2")
    assert params == {"balance_rel": 2.0} and isinstance(params["balance_rel"], float)  # float default: 2 -> 2.0
    assert parse_policy_spec("least_load:metric=kv_tokens") == ("least_load", {"metric": "kv_tokens"})
    assert build_policy("cache_aware:cache_threshold=0.5") == make_policy("cache_aware", cache_threshold=0.5)
    assert parse_param_value("yes", False) is True and parse_param_value("0", True) is False
    assert parse_param_value("none") is None and parse_param_value("7") == 7 and parse_param_value("x") == "x"


@pytest.mark.parametrize("text, message", [
    ("cache_aware:cache_treshold=0.5",
     f"policy 'cache_aware' has no parameter 'cache_treshold' (did you mean 'cache_threshold'?); accepted: "
     f"{CACHE_AWARE_ACCEPTED}"),
    ("cache_aware:zzz=1", f"policy 'cache_aware' has no parameter 'zzz'; accepted: {CACHE_AWARE_ACCEPTED}"),
    ("round_robin:x=1", "policy 'round_robin' has no parameter 'x'; accepted: none"),
    ("cache_aware:balance_abs=1.5", "policy 'cache_aware': balance_abs: expected an integer, got '1.5'"),
    ("cache_aware:cache_threshold=high", "policy 'cache_aware': cache_threshold: expected a number, got 'high'"),
    ("cache_aware:cache_threshold", f"policy 'cache_aware': expected param=value, got 'cache_threshold'; "
                                    f"accepted: {CACHE_AWARE_ACCEPTED}"),
    ("cache_aware:balance_abs=1,balance_abs=2", "policy 'cache_aware': parameter 'balance_abs' given more than once"),
    # the policy's own check, prefixed once
    ("cache_aware:cache_threshold=2", "policy 'cache_aware': cache_threshold must be in [0, 1], got 2.0"),
    ("cache-aware", f"unknown policy 'cache-aware' (did you mean 'cache_aware'?); valid policies: {POLICIES}"),
    (":x=1", "policy spec ':x=1': missing the policy name before ':'"),
])
def test_errors_name_the_bad_part_and_the_accepted_parameters(text: str, message: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_policy_spec(text)
    assert str(ei.value) == message


def test_policy_lists_split_between_specs_not_inside_them() -> None:
    assert split_policy_list("round_robin,cache_aware:cache_threshold=0.5,balance_abs=8,least_load") == [
        "round_robin", "cache_aware:cache_threshold=0.5,balance_abs=8", "least_load"]
    assert split_policy_list(" a , ,b:x=1 ") == ["a", "b:x=1"]
    assert split_policy_list("") == []
    with pytest.raises(ValueError, match=r"policy parameter 'x=1': 'a' has no ':'; write name:x=1"):
        split_policy_list("a,x=1")
    with pytest.raises(ValueError, match="no policy comes before it"):
        split_policy_list("x=1,a")
    assert format_policy_spec("cache_aware", {"cache_threshold": 0.5, "balance_abs": 8}) == (
        "cache_aware(balance_abs=8,cache_threshold=0.5)")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("abc_:=,.0123456789 -xyz"), max_size=40)
       | st.sampled_from(available_policies()).flatmap(
           lambda n: st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz_=,.0123456789-"), max_size=30)
           .map(lambda rest: f"{n}:{rest}")))
def test_any_text_parses_or_fails_with_one_value_error(text: str) -> None:
    # class-level property: whatever the text, a (name, params) the registry accepts, or one ValueError line
    try:
        name, params = parse_policy_spec(text)
    except ValueError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert make_policy(name, **params).params() == {**make_policy(name).params(), **params}


# ---------------------------------------------------------------------- pdlb sim run / compare
def _summary(out) -> list[dict]:
    return json.loads((out / "summary.json").read_text())["runs"]


def test_sim_run_takes_parameters_and_they_reach_the_policy(tmp_path) -> None:
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize
    from sim.scenario import load_scenario
    from sim.workload import spread_batches, take_slice
    from sim.workload.loader import read_trace

    out = tmp_path / "run"
    rc = main(["sim", "run", "--prefill-policy", "cache_aware:cache_threshold=0.9,balance_abs=4",
               "--decode-policy", "least_load:metric=requests", "--limit", "80", "--quiet", "--no-plots",
               "--out", str(out)])
    assert rc == 0
    (row,) = _summary(out)
    assert row["prefill_policy"] == "cache_aware(balance_abs=4,cache_threshold=0.9)"
    assert row["decode_policy"] == "least_load(metric=requests)"
    # the same run through the library with the policies built directly: identical figures
    reqs = spread_batches(take_slice(read_trace(), 0, 80), 3.0, seed=0)
    res = simulate(load_scenario("dsv3-pd-h200"), reqs, make_policy("cache_aware", cache_threshold=0.9, balance_abs=4),
                   make_policy("least_load", metric="requests"), seed=0)
    direct = summarize(res)
    for key in ("ttft_s", "tpot_s", "prefix_hit_rate", "slo_attainment", "goodput_rps"):
        assert row[key] == pytest.approx(direct[key], rel=1e-12), key


def test_sim_compare_runs_two_parameterisations_of_one_policy(tmp_path, capsys) -> None:
    out = tmp_path / "cmp"
    rc = main(["sim", "compare", "--policies", "cache_aware,cache_aware:cache_threshold=0.9,balance_abs=0",
               "--limit", "80", "--quiet", "--no-plots", "--out", str(out)])
    assert rc == 0
    # the printed table names each variant in full (folded over lines, never cut to 'cache_aware(bal…')
    printed = capsys.readouterr().out
    first_column = "".join(line.split("│")[1].strip() for line in printed.splitlines() if line.startswith("│"))
    assert first_column == "cache_awarecache_aware(balance_abs=0,cache_threshold=0.9)"
    assert "…" not in printed
    rows = _summary(out)
    assert [r["policy"] for r in rows] == ["cache_aware", "cache_aware(balance_abs=0,cache_threshold=0.9)"]
    # balance_abs=0 falls back to least-load on any imbalance: a different policy, so different routing
    assert (out / "requests_cache_aware.csv").read_text() != (
        out / "requests_cache_aware-balance_abs=0-cache_threshold=0.9.csv").read_text()


@pytest.mark.parametrize("argv, message", [
    (["sim", "run", "--policy", "cache_aware:bogus=1"],
     f"error: --policy: policy 'cache_aware' has no parameter 'bogus'; accepted: {CACHE_AWARE_ACCEPTED}"),
    (["sim", "run", "--decode-policy", "least_load:metric=tokens"],
     "error: --decode-policy: policy 'least_load': unknown load metric 'tokens'; valid: auto, requests, "
     "prefill_tokens, kv_tokens"),
    (["sim", "compare", "--policies", "round_robin,cache_aware:balance_abs=x"],
     "error: --policies: policy 'cache_aware': balance_abs: expected an integer, got 'x'"),
    (["sim", "compare", "--policies", "round_robin,balance_abs=3"],
     "error: --policies: policy parameter 'balance_abs=3': 'round_robin' has no ':'; write name:balance_abs=3"),
    (["sim", "compare", "--policies", "cache_aware:balance_abs=64,cache_aware"],
     "error: --policies: cache_aware given more than once (the same policy as cache_aware(balance_abs=64))"),
    (["sim", "compare", "--policies", "random,round_robin,random"], "error: --policies: random given more than once"),
    (["sim", "run", "--policy-module", "no_such_mod_q"], "error: --policy-module no_such_mod_q: cannot import: "
     "ModuleNotFoundError: No module named 'no_such_mod_q'"),
])
def test_sim_policy_flag_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main([*argv, "--limit", "5", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err == message + "\n"
    assert list(tmp_path.iterdir()) == []  # nothing simulated or written


# ---------------------------------------------------------------------- pdlb serve
def _serve_cfg(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_flags_take_parameters() -> None:
    cfg = _serve_cfg("--prefill-policy", "cache_aware:cache_threshold=0.5,balance_abs=8",
                     "--decode-policy", "least_load:metric=kv_tokens")
    r = cfg.router
    assert (r.prefill_policy.name, r.prefill_policy.kwargs) == ("cache_aware", {"cache_threshold": 0.5, "balance_abs": 8})
    assert (r.decode_policy.name, r.decode_policy.kwargs) == ("least_load", {"metric": "kv_tokens"})
    assert _serve_cfg("--prefill-policy", "round_robin").router.prefill_policy.kwargs == {}
    assert config_warnings(cfg) == []  # flags are not deprecated keys


def test_serve_config_file_takes_a_spec_string_or_a_table(tmp_path) -> None:
    f = tmp_path / "pdlb.yaml"
    f.write_text("prefill_policy: 'cache_aware:cache_threshold=0.5'\n"
                 "decode_policy: {name: cache_aware, params: {cache_threshold: 0.5}}\n")
    for text in ("router:\n  prefill_policy: 'cache_aware:cache_threshold=0.5'\n"
                 "  decode_policy: {name: cache_aware, params: {cache_threshold: 0.5}}\n",
                 # the form before the router: section: read into it, with a deprecation warning
                 "prefill_policy: 'cache_aware:cache_threshold=0.5'\n"
                 "decode_policy: {name: cache_aware, params: {cache_threshold: 0.5}}\n"):
        f.write_text(text)
        cfg = load_service_config(f)
        assert cfg.router.prefill_policy == cfg.router.decode_policy
        assert cfg.router.prefill_policy.kwargs == {"cache_threshold": 0.5}
        legacy = text.startswith("prefill")
        assert config_warnings(cfg) == ([
            "warning: deprecated top-level setting(s) prefill_policy, decode_policy: they are router settings now; "
            "put them under router: (read there this time)"] if legacy else [])
        # through pdlb serve's flags too (the file's deprecated keys are still reported)
        assert config_warnings(_serve_cfg("--config", str(f))) == config_warnings(cfg)
    f.write_text("router:\n  decode_policy: {name: cache_aware, params: {cache_treshold: 0.5}}\n")
    with pytest.raises(ValueError) as ei:
        load_service_config(f)
    assert str(ei.value) == (f"{f}: router.decode_policy: policy 'cache_aware' has no parameter(s) 'cache_treshold'; "
                             f"accepted: {CACHE_AWARE_ACCEPTED}")
    f.write_text("block_size: 16\nrouter: {block_size: 32}\n")
    with pytest.raises(ValueError, match="block_size given both at the top level and under router:"):
        load_service_config(f)


def test_serve_policy_errors_are_one_line(capsys) -> None:
    rc = main(["serve", "--port", "0", "--prefill-policy", "cache_aware:balance_abs=-1"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err == ("error: router.prefill_policy: policy 'cache_aware': balance_abs must be >= 0 and "
                            "balance_rel >= 1\n")


def test_capacity_policies_list_takes_specs_too() -> None:
    from pdlb_cli.sim.capacity import policy_specs

    args = build_parser().parse_args(["sim", "capacity", "--policies",
                                      "round_robin,cache_aware:cache_threshold=0.5,balance_abs=8"])
    assert [s.label for s in policy_specs(args)] == ["round_robin", "cache_aware(balance_abs=8,cache_threshold=0.5)"]


@pytest.mark.parametrize("argv, warned", [
    (["--policy", "ep_aware:slo_doomed_cap=2"], "slo_doomed_cap changes nothing"),
    (["--policy", "ep_aware:slo_doomed_cap=2,slo_intrinsic=blind"], "slo_doomed_cap, slo_intrinsic change nothing"),
    (["--policy", "ep_aware:slo_doomed_cap=2,slo_aware=false", "--route-slo"], "slo_doomed_cap changes nothing"),
    (["--policy", "ep_aware:slo_doomed_cap=2", "--route-slo"], None),
    (["--policy", "ep_aware:slo_doomed_cap=2,ttft_slo_s=3"], None),
    (["--policy", "ep_aware:horizon_weight=2"], None),
    (["--policy", "cache_aware"], None),
])
def test_slo_parameters_without_a_budget_are_warned_about(argv, warned, tmp_path, capsys) -> None:
    # a dense scenario: on the default one (dsv3-pd-h200, every prefill engine wide EP) ep_aware
    # ignores the budget unless slo_wide_ep, and the warning says so even with one
    # (tests/cli/test_idle_slo_warning.py, test_wide_ep_pools)
    rc = main(["sim", "run", *argv, "--scenario", "llama70b-pd-h100", "--limit", "5", "--quiet", "--no-plots",
               "--out", str(tmp_path / "o")])
    assert rc == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    meta = json.loads((tmp_path / "o" / "summary.json").read_text())["meta"]
    assert meta["route_slo"] is ("--route-slo" in argv)  # the results say how they were routed
    if warned is None:
        assert err == []
    else:
        assert len(err) == 1 and warned in err[0] and "--route-slo" in err[0], err
