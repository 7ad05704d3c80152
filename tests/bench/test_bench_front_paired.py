"""bench/front_paired.py's argument handling (the measurement itself is run by hand: docs/serving.md,
"HTTP front"); expected values by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
fp = pytest.importorskip("front_paired")


def test_cpu_sets_are_read_as_taskset_writes_them():
    def cpus(text: str):  # noqa: ANN202
        return fp.parse_args([f"{ROOT}::", "--router-cpus", text]).router_cpus

    assert cpus("0") == {0}
    assert cpus("0-3") == {0, 1, 2, 3}
    assert cpus("0-1,6,8-9") == {0, 1, 6, 8, 9}
    assert fp.parse_args([f"{ROOT}::"]).router_cpus is None  # not given: no pinning


@pytest.mark.parametrize("argv, message", [
    (["/nonexistent::"], "is not a pdlb checkout"),
    ([f"{ROOT}::", "--router-cpus", "0,,1"], "--router-cpus: expected CPU numbers"),  # was a traceback (review F8)
    ([f"{ROOT}::", "--rounds", "0"], "must be >= 1"),
    ([f"{ROOT}::", "--duration-s", "nan"], "argument --duration-s: must be a finite number > 0"),
    ([f"{ROOT}::", "--concurrency", "0"], "must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        fp.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_front_floor_refuses_bad_arguments(capsys):
    ff = pytest.importorskip("front_floor")
    for argv, message in ((["--rounds", "0"], "argument --rounds: must be >= 1"),
                          (["--concurrency", "0"], "argument --concurrency: must be >= 1"),
                          (["--duration-s", "inf"], "argument --duration-s: must be a finite number > 0")):
        with pytest.raises(SystemExit) as e:
            ff.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
