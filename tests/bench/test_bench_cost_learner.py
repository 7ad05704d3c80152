"""``bench/cost_learner.py`` (README, "The live router"): bad option values are one usage line and
one ``error: argument --X: ...`` line with exit status 2, by class (review R7, session 16: ``--n 0``
ended in ZeroDivisionError, ``--n -5`` and ``--noise -1`` in numpy's ValueErrors, ``--outliers 2``
and ``nan`` ran and printed nonsense); a short run prints its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("cost_learner_bench", ROOT / "bench" / "cost_learner.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


BAD = [
    (["--n", "0"], "argument --n: must be >= 1, got 0"),
    (["--n", "-5"], "argument --n: must be >= 1, got -5"),
    (["--n", "1.5"], "argument --n: expected an integer >= 1, got '1.5'"),
    (["--outliers", "1"], "argument --outliers: must be a share in [0, 1), got '1'"),
    (["--outliers", "2"], "argument --outliers: must be a share in [0, 1), got '2'"),
    (["--outliers", "-0.1"], "argument --outliers: must be a share in [0, 1), got '-0.1'"),
    (["--outliers", "nan"], "argument --outliers: must be a share in [0, 1), got 'nan'"),
    (["--outliers", "x"], "argument --outliers: must be a share in [0, 1), got 'x'"),
    (["--noise", "-1"], "argument --noise: must be a finite number >= 0, got '-1'"),
    (["--noise", "inf"], "argument --noise: must be a finite number >= 0, got 'inf'"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_error_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    mod = _load()
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and "Traceback" not in "\n".join(lines)
    assert lines[-1].endswith("error: " + message), lines


def test_edge_values_are_taken_and_a_short_run_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _load()
    a = mod.build_parser().parse_args(["--outliers", "0", "--noise", "0", "--n", "1"])
    assert (a.outliers, a.noise, a.n) == (0.0, 0.0, 1)
    assert mod.main(["--n", "300", "--outliers", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "300 observations, 10% absurd, noise sigma 0.05; prior 2x off"
    assert out[-1].startswith("ratio robust/baseline: time ")
