"""``bench/policy_goodput.py`` stops its worker pool before ``main`` returns, whatever happens (last
session's finding: after writing its results the run ended with an OSError from the process pool,
which was left to the interpreter's exit). Checked with a stand-in executor that records the call:
a run that stops early (an unknown workload, SystemExit after the pool exists) and one whose
planning fails with an exception; the real pool's shutdown is sim.search.executor's (tested there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
pg = pytest.importorskip("policy_goodput")


class _Recorder:
    """An executor that runs nothing and records how it was stopped."""

    def __init__(self) -> None:
        self.stopped: list[bool] = []

    def submit(self, point):  # noqa: ANN001, ANN201
        raise AssertionError("nothing is submitted in these runs")

    def shutdown(self, kill: bool = False) -> None:
        self.stopped.append(kill)


def _fails_in_the_run(name: str) -> None:
    raise KeyError(f"nosuch ({name})")  # a failure once the pool exists (was: an unknown scenario, refused up front since R11)


@pytest.mark.parametrize("raises", [SystemExit, KeyError])
def test_the_pool_is_stopped_when_main_ends(raises, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    import sim.search.executor as executor_module

    made: list[_Recorder] = []

    def make_executor(kind: str, **kw) -> _Recorder:  # noqa: ANN003
        made.append(_Recorder())
        return made[-1]

    def fail(name: str) -> None:
        raise raises("nosuch")

    monkeypatch.setattr(executor_module, "make_executor", make_executor)
    monkeypatch.setattr(pg, "scenario_of", fail)
    with pytest.raises(raises):
        pg.main(["--rows", "mooncake:default", "--no-fair-slo", "--seeds", "1", "--jobs", "2",
                 "--no-explain", "--out", str(tmp_path / "o")])
    assert len(made) == 1 and made[0].stopped == [True]  # stopped once, at once (was: never)


def test_with_one_job_the_real_error_surfaces(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    # review R8 (session 16): with --jobs 1 make_executor gives the serial executor, whose shutdown took
    # no ``kill``: main's finally raised TypeError over whatever happened (and after every successful run)
    monkeypatch.setattr(pg, "scenario_of", _fails_in_the_run)
    with pytest.raises(KeyError, match="nosuch") as e:  # the failure itself (was: TypeError)
        pg.main(["--rows", "mooncake:default", "--no-fair-slo", "--seeds", "1", "--jobs", "1",
                 "--no-explain", "--out", str(tmp_path / "o")])
    assert not isinstance(e.value, TypeError)


@pytest.mark.parametrize("rows, message", [
    ("mooncake:nosuch", "--rows: unknown scenario 'nosuch' in 'mooncake:nosuch'; valid: default, p16,"),  # R11
    ("nosuch:default", "--rows: unknown workload 'nosuch' in 'nosuch:default'; valid: mooncake,"),
    ("mooncake", "--rows: expected workload:scenario, got 'mooncake'"),
    ("mooncake:default:x", "--rows: expected workload:scenario, got 'mooncake:default:x'"),
])
def test_unknown_rows_are_refused_before_the_pool_starts(rows, message, monkeypatch, capsys) -> None:  # noqa: ANN001
    import sim.search.executor as executor_module

    made: list[object] = []
    monkeypatch.setattr(executor_module, "make_executor", lambda *a, **k: made.append(1))
    with pytest.raises(SystemExit) as e:
        pg.main(["--rows", rows, "--no-fair-slo", "--seeds", "1", "--jobs", "2"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and "error: " + message in last and made == []


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "argument --seeds: must be >= 1, got 0"),  # ran nothing, then failed deep in the fair SLO
    (["--jobs", "0"], "argument --jobs: must be >= 1, got 0"),
    (["--jobs", "-2"], "argument --jobs: must be >= 1, got -2"),
])
def test_counts_below_one_are_refused(argv, message, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        pg.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith("error: " + message)


def test_policy_specs_with_several_options_are_one_policy(monkeypatch) -> None:
    # session 16: --policies split "ep_aware:a=true,b=true" at the comma ("unknown policy 'b=true'")
    seen: list = []

    def stop(rows, seeds, policies, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(list(policies))
        raise SystemExit(0)

    monkeypatch.setattr(pg, "fair_slos", stop)
    with pytest.raises(SystemExit):
        pg.main(["--rows", "shared_prefix:default", "--policies",
                 "ep_aware:session_forecast=true,prefill_at_once=true,scored", "--jobs", "1", "--no-gpus"])
    assert seen == [["ep_aware:session_forecast=true,prefill_at_once=true", "scored"]]
    with pytest.raises(SystemExit):
        pg.main(["--rows", "shared_prefix:default", "--policies", "scored,scored", "--jobs", "1"])
