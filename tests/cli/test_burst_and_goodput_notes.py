"""Notes on bursts and goodput: a capacity or sweep answer that is a burst says so without advising
the flag already given, and a workload arriving at one instant shows goodput as ``-`` with the
reason. Expected notes are written out by hand from the inputs.
"""

from __future__ import annotations

from pathlib import Path


def test_capacity_burst_note_does_not_advise_the_flag_already_given() -> None:
    # The note told a user who had passed --duration-s 30 to "search over a fixed window
    # (--duration-s S ...)". A run of 341 requests over 29.7 s that finishes at 69.5 s is a burst
    # (69.5 > 2 x 29.7, sim.run.metrics.BURST_MAKESPAN_RATIO).
    from types import SimpleNamespace

    from pdlb_cli.sim.capacity import _burst_note

    r = SimpleNamespace(best=SimpleNamespace(summary={"num_requests": 341, "arrival_window_s": 29.7, "makespan_s": 69.5}))
    given = _burst_note(r, 30.0)
    assert given.startswith("at the answer the 341 requests arrive over 29.7 s and the last finishes at 69.5 s")
    assert given.endswith("; search over a longer window than --duration-s 30 or a longer trace")
    assert "--duration-s S" in _burst_note(r) and "--duration-s S" not in given


def test_sweep_burst_message_does_not_advise_the_key_already_set() -> None:
    from sim.search.sweep import burst_message

    row = {"policy": "kv_cost", "rate_scale": 2.0, "seed": 0}
    note = "the 100 requests arrive over 10 s and the last finishes at 50 s"
    assert "set a longer duration_s than 10 in the sweep file or use a longer trace" in \
        burst_message([(row, note)], 4, duration_s=10)
    assert "set duration_s = S in the sweep file" in burst_message([(row, note)], 4)


def test_a_burst_at_one_instant_shows_no_goodput_as_a_dash_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    # README: `pdlb sim workload shared-prefix` puts every request at t = 0, replayed with
    # --spread-s 0. The arrival window is then 0 s and goodput NaN (sim.run.metrics): the table and
    # summary.md printed "nan" with no word on why.
    import json

    from pdlb_cli.main import main

    rec = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(rec) for _ in range(3)) + "\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["sim", "run", "--trace", "t.jsonl", "--spread-s", "0", "--scenario", "llama8b-agg-h100", "--quiet",
               "--no-plots", "--out", "o", "--policy", "round_robin"])
    out = capsys.readouterr().out
    assert rc == 0 and "nan" not in out
    assert ("goodput: - because the 3 requests arrive at one instant (arrival window 0 s; goodput counts "
            "SLO-meeting requests per second of it)") in " ".join(out.split())
    row = (tmp_path / "o" / "summary.md").read_text().splitlines()[2].split(" | ")
    assert row[8] == "-" and row[7] == "100.0%"  # goodput column; attainment still printed
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["runs"][0]["goodput_rps"] is None


def test_goodput_note_only_for_a_zero_window() -> None:
    from sim.run.report import goodput_note

    assert goodput_note({"policy": "p", "num_requests": 5, "arrival_window_s": 2.0}) == ""
    assert goodput_note({"policy": "p", "num_requests": 0, "num_rejected": 3, "arrival_window_s": None}) == ""
    assert goodput_note({"policy": "p", "num_requests": 1, "arrival_window_s": float("nan")}).startswith(
        "goodput: - because the 1 request arrives at one instant")
