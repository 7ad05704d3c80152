"""Defects a new user found by running the README's commands (review of 2026-12-02), one test
each, every expected message written out by hand from the input."""

from __future__ import annotations

import pytest

from sim.cli import main


def _argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last stderr line of an argparse rejection; asserts exit 2 and no output."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["sim", "run"], ["sim", "compare"], ["sim", "capacity"], ["sim", "price", "--simulate"],
    ["sim", "sessions", "--out", "x.jsonl"], ["sim", "store-sweep"],
    ["sim", "workload", "ramp", "--rates", "1", "--step-s", "1", "--out", "x.jsonl"],
    ["sim", "workload", "shared-prefix", "--out", "x.jsonl"],
])
def test_a_negative_seed_names_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # was: "error: expected non-negative integer" (numpy's SeedSequence, after parsing), naming no flag
    prog = "pdlb " + " ".join(a for a in argv[:3] if not a.startswith("-") and "." not in a)
    assert _argparse_error([*argv, "--seed", "-1"], capsys) == f"{prog}: error: argument --seed: must be >= 0, got -1"
