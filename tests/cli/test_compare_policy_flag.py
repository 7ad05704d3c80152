"""``pdlb sim compare --policy SPEC`` (repeatable, replaces ``--policies``), as in ``sim capacity``.

Before, compare had no ``--policy``: argparse took it as the abbreviation of ``--policy-module``
(``--policy`` is a prefix of it, not of ``--policies``), so ``pdlb sim compare --policy
ep_aware:ttft_slo_s=2`` failed with "--policy-module ep_aware:ttft_slo_s=2: cannot import".
"""

from __future__ import annotations

import json
from pathlib import Path


from pdlb_cli.main import build_parser, main


def test_compare_policy_is_a_repeatable_policy_spec() -> None:
    args = build_parser().parse_args(["sim", "compare", "--policy", "ep_aware:ttft_slo_s=2", "--policy", "kv_cost"])
    assert args.policy_specs == ["ep_aware:ttft_slo_s=2", "kv_cost"]
    assert args.policy_modules == []


def test_compare_runs_the_given_policies(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "compare", "--scenario", "llama70b-pd-h100", "--limit", "10", "--quiet", "--no-plots",
               "--policy", "ep_aware:ttft_slo_s=2", "--policy", "kv_cost", "--out", str(tmp_path)])
    assert rc == 0
    capsys.readouterr()
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [(r["policy"], r["num_requests"]) for r in runs] == [("ep_aware(ttft_slo_s=2.0)", 10), ("kv_cost", 10)]


def test_a_duplicate_names_the_flag_it_came_from(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "compare", "--limit", "5", "--quiet", "--policy", "kv_cost", "--policy",
               "kv_cost:overlap_weight=1", "--out", str(tmp_path)])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("error: --policy: kv_cost(overlap_weight=1.0) given more than once "
                                               "(the same policy as kv_cost)")
