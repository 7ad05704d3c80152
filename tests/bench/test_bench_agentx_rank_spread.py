"""bench/agentx_rank_spread.py: its variants build, its per-rank summary is right by hand on a made-up
result, and bad list options are refused by class.

Expected values: hand calculations on made-up per-rank records (correlation -1 and slope -10 where
one rank's idle seconds are the other ranks' prefill-only records)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import agentx_rank_spread as b  # noqa: E402

from sim.workload.agentic import AgenticWorkloadConfig  # noqa: E402


@pytest.mark.parametrize("name", list(b.VARIANTS))
def test_every_variant_builds(name) -> None:
    c = AgenticWorkloadConfig(**b.workload_fields(name))
    assert c.routing_key == ("lane" if "lane" in name else "session")
    assert c.warmup_barrier == ("bar" in name)
    assert (c.warmup_max_output_tokens == 1) == ("cap" in name)
    assert (c.primer_lead_quantiles_s is not None) == name.startswith("spread")
    assert c.warmup_primer == (not name.startswith(("defaults", "lane")))


def test_summarize_by_hand() -> None:
    # 3 ranks over a 100 s run; active 90 / 80 / 70 s -> idle 10 / 20 / 30 s; prefill-only records
    # 300 / 200 / 100: every idle second is 10 records fewer (slope -10, corr -1), max/min 3;
    # mixed 100 each: no-decode share 600 / 900; the warm-up (window opens at 40 s): active 40 / 30 / 20
    r = SimpleNamespace(
        rank_class_steps=np.array([[300, 1000, 100], [200, 1000, 100], [100, 1000, 100]]),
        rank_active_s=np.array([90.0, 80.0, 70.0]), end_s=100.0, measure_start_s=40.0,
        warmup_rank_class_steps=np.array([[200, 0, 0], [100, 0, 0], [50, 0, 0]]),
        warmup_rank_active_s=np.array([40.0, 30.0, 20.0]), rank_requests=[30, 20, 10])
    s = b.summarize(r)
    assert s["all_corr"] == pytest.approx(-1.0) and s["all_slope"] == pytest.approx(-10.0)
    assert s["all_max_min"] == pytest.approx(3.0) and s["all_no_decode_share"] == pytest.approx(600 / 900)
    # warm-up: idle 0 / 10 / 20 s against 200 / 100 / 50 records: slope by least squares
    # (deviations -10, 0, 10 and 83.3, -16.7, -66.7: cov sum -1500, var sum 200) = -7.5
    assert s["warm_slope"] == pytest.approx(-7.5) and s["warm_no_decode_share"] == pytest.approx(1.0)
    assert s["mixed_max_min"] == pytest.approx(1.0)  # 100 mixed records on every rank
    assert s["requests_max_min"] == pytest.approx(3.0) and s["warmup_s"] == pytest.approx(40.0)
    assert s["po_0"] == 300 and s["idle_2"] == pytest.approx(30.0)


@pytest.mark.parametrize("argv", [["--variants", "nope"], ["--seeds", "-1"], ["--seeds", "x"], ["--jobs", "0"]])
def test_bad_options_are_refused(argv) -> None:
    with pytest.raises(SystemExit):
        b.main(argv)
