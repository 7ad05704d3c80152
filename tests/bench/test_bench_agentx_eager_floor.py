"""bench/agentx_eager_floor.py: its warm-up variants build, its step-class summary is right by hand,
the capture's figures are read as published, and bad list options are refused by class.

Expected values: hand calculations on made-up records, and the published capture
(aisimulate job-4228930-comparison.json ``fpm``: 16,225 prefill-only and 46,119 mixed records)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import agentx_eager_floor as b  # noqa: E402

from sim.workload.agentic import AgenticWorkloadConfig  # noqa: E402


@pytest.mark.parametrize("name", list(b.WARMUPS))
def test_every_warmup_builds(name) -> None:
    c = AgenticWorkloadConfig(**b.workload_fields(name))
    assert c.warmup_primer == (not name.startswith("defaults"))
    assert (c.warmup_max_output_tokens == 1) == ("cap" in name)
    assert (c.primer_lead_quantiles_s is not None) == name.startswith("spread")
    assert c.warmup_barrier == name.endswith("bar")


def test_class_stats_by_hand() -> None:
    # 2 ranks; prefill-only records 0.1, 0.3 s; mixed 0.2 s (x2); decode-only 0.03 s (x4)
    it = {"prefill_only": np.array([0.1, 0.3]), "mixed": np.array([0.2, 0.2]), "decode_only": np.full(4, 0.03)}
    s = b.class_stats(it, ranks=2)
    assert s["prefill_only"]["count"] == 2 and s["prefill_only"]["min"] == pytest.approx(100.0)
    assert s["prefill_only"]["p50"] == pytest.approx(200.0)  # midpoint of 100 and 300 ms
    assert s["prefill_only"]["p90"] == pytest.approx(280.0)  # 100 + 0.9 * 200 (linear interpolation)
    assert s["prefill_only"]["s_per_rank"] == pytest.approx(0.2)  # 0.4 s over 2 ranks
    assert s["decode_only"]["s_per_rank"] == pytest.approx(0.06)
    assert s["no_decode_share"]["value"] == pytest.approx(0.5)  # 2 of the 4 records with prefill
    empty = b.class_stats({"decode_only": np.ones(3)}, ranks=1)
    assert empty["prefill_only"]["count"] == 0 and np.isnan(empty["no_decode_share"]["value"])


def test_published_class_stats_are_the_capture() -> None:
    p = b.published_class_stats()
    assert p["prefill_only"]["count"] == 16225 and p["mixed"]["min"] == pytest.approx(115.94, abs=0.01)
    assert p["no_decode_share"]["value"] == pytest.approx(16225 / (16225 + 46119))
    # seconds per rank: count x mean / 8 ranks (aisimulate's sum_rank_seconds 4,175.95 / 8)
    assert p["prefill_only"]["s_per_rank"] == pytest.approx(4175.95 / 8, rel=1e-4)


@pytest.mark.parametrize("argv", [["--floor", "on,,off"], ["--floor", "maybe"], ["--variants", "VX"],
                                  ["--seeds", "-1"], ["--seeds", "1,1"], ["--jobs", "0"]])
def test_bad_options_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        b.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_print_rows_by_hand(capsys) -> None:
    # two runs, two rows; expected text by hand: errors as signed percent to one decimal, then the count of
    # |error| <= 0.15 per run (run a: 0.10 and -0.20 -> 1; run b: 0.15 and 0.0 -> 2, the bound inclusive)
    tasks = ["a", "b"]
    rows = {"a": {"ttft_p50": 0.10, "itl_p50": -0.20}, "b": {"ttft_p50": 0.15, "itl_p50": 0.0}}
    b.print_rows(tasks, {"a": "run a", "b": "run b"}, rows)
    assert capsys.readouterr().out.splitlines() == [
        "row,run a,run b", "ttft_p50,+10.0,+15.0", "itl_p50,-20.0,+0.0", "rows within 15%,1,2"]
