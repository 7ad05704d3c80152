"""bench/agentx_mixed_steps.py: a short run's step shares are consistent (the cadence opens one step
in 8 at most, the three reasons split the steps with prefill), sampling the counters does not change
the run (its SLO share and ITL p50 equal ``bench/agentx_policies.py``'s run of the same point, an
independent path through ``simulate_440246``), and bad options are refused before any run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
ms = pytest.importorskip("agentx_mixed_steps")
ap = pytest.importorskip("agentx_policies")


def test_a_short_run_splits_the_steps_with_prefill_and_changes_nothing():
    x = ms.run("ep_aware", 8, 30.0, 3)
    assert x["steps"] > 0
    # interval 8: at most one step in 8 is open (+ one for a window that starts on an open step)
    assert 0.0 < x["open"] <= 1 / 8 + 1 / x["steps"]
    assert x["bound"] >= 0 and x["idle"] >= 0 and x["open"] + x["bound"] + x["idle"] <= 1.0
    # the eager floor: a step with prefill lasts >= 83.50 ms (115.94 ms where some rank decodes; at 8 lanes
    # many steps have none), a decode-only one far less
    assert 0.0 < x["time"] < 1.0 and x["step_p_ms"] >= 83.50 > x["step_d_ms"]
    y = ap.run("ep_aware", 8, 30.0, 10.0, 30.0, 3, True, {}, ap.FRONTEND_S_PER_TOKEN_MEASURED)
    assert x["slo"] == y["att"] and x["itl50"] == y["itl50"]


def test_the_table_prints(capsys):
    assert ms.main(["--lanes", "8", "--duration-s", "30", "--seeds", "3", "--policies", "ep_aware"]) == 0
    out = capsys.readouterr().out
    assert "| policy | seed | SLO |" in out and "| ep_aware | 3 |" in out


@pytest.mark.parametrize("args, msg", [(["--lanes", "0"], "--lanes"), (["--lanes", "2000"], "--lanes"),
                                       (["--seeds", "a"], "--seeds"), (["--seeds", ""], "--seeds"),
                                       (["--seeds", "-1"], "--seeds"), (["--duration-s", "1e9"], "--duration-s"),
                                       (["--policies", "ep_aware:nope=1"], "no parameter 'nope'"),
                                       (["--jobs", "100"], "--jobs")])
def test_bad_arguments_are_refused_before_any_run(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        ms.main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
