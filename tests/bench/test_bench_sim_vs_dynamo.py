"""``bench/sim_vs_dynamo.py`` (README, "Checked against an independent simulator"): counts below 1 are
one usage line and one ``error: argument --X: ...`` line, exit status 2, before Dynamo is installed
or anything simulated (review R7, session 16: ``--workers 0`` ended in a pydantic traceback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
svd = pytest.importorskip("sim_vs_dynamo")


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "argument --workers: must be >= 1, got 0"),
    (["--workers", "-3"], "argument --workers: must be >= 1, got -3"),
    (["--limit", "0"], "argument --limit: must be >= 1, got 0"),
    (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["--repeats", "two"], "argument --repeats: expected an integer >= 1, got 'two'"),
])
def test_counts_below_one_are_one_error_line(argv, message, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        svd.main(argv)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[-1].endswith("error: " + message), err


def test_defaults_are_kept() -> None:
    a = svd.build_parser().parse_args([])
    assert (a.workers, a.limit, a.repeats, a.kv_accounting) == (8, None, 1, "shared")
