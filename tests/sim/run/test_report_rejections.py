"""A run whose requests are all rejected at arrival says so instead of printing a table of NaNs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlb_cli.main import main


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], max_model_len: int) -> tuple[int, str, str]:
    out = tmp_path / f"run{max_model_len}"
    rc = main(["sim", "run", "--policy", "round_robin", "--limit", "6", "--set", f"max_model_len={max_model_len}",
               "--quiet", "--no-plots", "--out", str(out)])
    return rc, " ".join(capsys.readouterr().out.split()), (out / "summary.md").read_text()


def test_all_rejected_prints_the_rejection_not_a_table_of_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the first 6 embedded requests need 2,606 to 8,030 prompt + output tokens: all over 100
    rc, printed, md = _run(tmp_path, capsys, 100)
    assert rc == 0 and "nan" not in printed and "TTFT mean" not in printed  # was: a row of nan / nan%
    assert ("round_robin: all 6 requests rejected at arrival (6 over max_model_len; max_model_len 100): nothing was "
            "simulated; raise the scenario's max_model_len (--set max_model_len=N) or its KV capacity, or use "
            "shorter requests") in printed
    assert "nan" not in md and "| round_robin | - | - |" in md  # summary.md: no figures, not NaN ones


def test_some_rejected_keeps_the_table_and_the_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # max_model_len 7,000: by hand, 6758+500, 7322+490 and 7236+794 exceed it; 2290+316, 6760+3 and 4834+173 run
    rc, printed, md = _run(tmp_path, capsys, 7000)
    assert rc == 0 and "TTFT mean" in printed and "nan" not in printed
    assert "round_robin: 3 requests rejected at arrival (3 over max_model_len; max_model_len 7000), not simulated" in printed
    assert "| round_robin | - |" not in md
