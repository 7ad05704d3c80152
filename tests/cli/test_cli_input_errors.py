"""One clear error line for inputs the commands cannot use: a summary with nothing simulated, a
figure or sweep point given twice, a nested scenario check; and ``pdlb policies`` lists a policy
whose module has no docstring. Expected messages are written out by hand from the inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def test_price_from_a_summary_whose_runs_were_all_refused_says_so(tmp_path: Path, capsys) -> None:
    # a compare of requests over max_model_len writes runs with no rates; pricing it said
    # "key 'input_tokens_per_s_per_gpu' is missing or not a finite number >= 0 (got None)"
    import json

    from pdlb_cli.main import main

    f = tmp_path / "summary.json"
    f.write_text(json.dumps({"runs": [{"policy": "round_robin", "num_requests": 0, "num_finished": 0,
                                       "num_rejected": 2, "rejected": {"max_model_len": 2},
                                       "input_tokens_per_s_per_gpu": None}]}))
    assert main(["sim", "price", "--from-summary", str(f)]) == 2
    assert capsys.readouterr().err == (f"error: {f} run 0 (round_robin): nothing was simulated, all 2 requests were "
                                       "refused at arrival (2 over max_model_len); nothing to price\n")


def test_pdlb_policies_lists_a_registered_policy_whose_module_has_no_docstring(capsys) -> None:
    # `pdlb policies` took the first line of the module docstring: IndexError for a user module without one
    import types
    import sys
    from dataclasses import dataclass

    from balancer.policies.base import _REGISTRY, Policy, register
    from pdlb_cli.main import main

    mod = types.ModuleType("r9_nodoc")  # a module without a docstring
    sys.modules["r9_nodoc"] = mod
    try:
        @register
        @dataclass(frozen=True)
        class NoDoc(Policy):
            name = "r9_nodoc"
            k: int = 3

            def select(self, request, cands, ctx):  # pragma: no cover - never routed
                raise AssertionError

        NoDoc.__module__ = "r9_nodoc"
        assert main(["policies"]) == 0
        assert "r9_nodoc(k=3)" in capsys.readouterr().out
    finally:
        _REGISTRY.pop("r9_nodoc", None)
        sys.modules.pop("r9_nodoc", None)


def test_validate_refuses_a_figure_given_twice(capsys) -> None:
    # `--figures sglang-prefill-1k,sglang-prefill-1k` ran it twice and reported "2 of 2 held-out
    # figures within +-15%" for one figure
    from pdlb_cli.main import main

    assert main(["sim", "validate", "--figures", "sglang-prefill-1k, sglang-prefill-1k"]) == 2
    assert capsys.readouterr().err == "error: --figures: sglang-prefill-1k given more than once\n"


@pytest.mark.parametrize("extra, where", [
    ('policies = ["round_robin", "round_robin"]\nrates = [1]\n', "round_robin x1 seed 0"),
    ('policies = ["round_robin"]\nrates = [1, 1.0]\n', "round_robin x1 seed 0"),
    ('policies = ["round_robin"]\nrates = [2]\nseeds = [3, 3]\n', "round_robin x2 seed 3"),
    ('policies = ["round_robin"]\nrates = [1]\n[grid]\n"mixed.num_engines" = [2, 2]\n', "round_robin x1 seed 0 mixed.num_engines=2"),
])
def test_a_sweep_point_listed_twice_is_an_error_before_running(extra: str, where: str, tmp_path: Path, capsys) -> None:
    # was: run twice under one point id ("2 of 2 points"), while compare and capacity refuse a
    # policy given twice
    from pdlb_cli.main import main

    f = tmp_path / "s.toml"
    f.write_text('scenario = "llama8b-agg-h100"\nlimit = 5\n' + extra)
    assert main(["sim", "sweep", str(f), "--out", str(tmp_path / "o"), "--jobs", "1", "--quiet", "--no-plots"]) == 2
    assert capsys.readouterr().err == (f"error: {f}: point {where} is listed more than once (a value repeated in "
                                       "policies, rates, seeds, traces, [grid] or [[points]]); list each once\n")
    assert not (tmp_path / "o" / "points.jsonl").exists()


def test_a_nested_check_naming_its_own_path_is_not_prefixed_twice(tmp_path: Path, capsys) -> None:
    # was "spx.toml: speculative: speculative.acceptance: every entry must be in [0, 1], got [2.0]"
    from pdlb_cli.main import main

    f = tmp_path / "spx.toml"
    f.write_text('name = "x"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 1\n'
                 "[speculative]\ndraft_tokens = 1\nacceptance = [2.0]\n")
    assert main(["sim", "run", "--scenario", str(f), "--limit", "5", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: {f}: speculative.acceptance: every entry must be in [0, 1], got [2.0]\n"
    # a plain field error keeps its path
    f.write_text('name = "x"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 0\n')
    assert main(["sim", "run", "--scenario", str(f), "--limit", "5", "--quiet", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: {f}: mixed.num_engines: Input should be greater than or equal to 1\n"
