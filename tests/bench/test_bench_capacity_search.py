"""``bench/capacity_search.py`` (README, "Sizing a cluster"): option values are checked as ``pdlb sim
capacity`` checks its own, one usage line and one ``error: argument --X: ...`` line, exit status 2,
before any search (review R7, session 16: ``--jobs 0`` silently meant every core, and negative or NaN
SLOs and tolerances ran)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
cs = pytest.importorskip("capacity_search")

BAD = [
    (["--jobs", "0"], "argument --jobs: must be >= 1, got 0"),
    (["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
    (["--tol", "0"], "argument --tol: must be a finite number > 0, got '0'"),
    (["--tol", "nan"], "argument --tol: must be a finite number > 0, got 'nan'"),
    (["--slo-ttft-s", "-2"], "argument --slo-ttft-s: must be a finite number > 0, got '-2'"),
    (["--slo-tpot-s", "inf"], "argument --slo-tpot-s: must be a finite number > 0, got 'inf'"),
    (["--slo-attainment", "1.5"], "argument --slo-attainment: must be in (0, 1] (or a percentage like 90%), got '1.5'"),
    (["--slo-ttft-per-1k-tokens-s", "-0.5"],
     "argument --slo-ttft-per-1k-tokens-s: must be a finite number >= 0, got '-0.5'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_error_line(argv, message, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        cs.main(argv)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[-1].endswith("error: " + message), err


def test_the_defaults_and_edge_values_are_taken() -> None:
    a = cs.build_parser().parse_args([])
    assert (a.tol, a.slo_ttft_s, a.slo_tpot_s, a.slo_attainment, a.slo_ttft_per_1k_tokens_s) == (0.02, 2.0, 0.1, 0.9, 0.5)
    b = cs.build_parser().parse_args(["--slo-attainment", "90%", "--slo-ttft-per-1k-tokens-s", "0", "--jobs", "1"])
    assert (b.slo_attainment, b.slo_ttft_per_1k_tokens_s, b.jobs) == (0.9, 0.0, 1)
