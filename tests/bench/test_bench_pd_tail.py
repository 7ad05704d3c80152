"""bench/pd_tail.py (issue 26: where pdlb's PD added p99 comes from) and its router-side probe
(bench/pd_tail_probe/sitecustomize.py).

- the window analysis on records written here, expected values worked out by hand from them
  (numpy's linear-interpolation percentile, the stage differences, which requests a GC pause
  overlaps, connections and requests per process, the placement's k changes);
- the probe's file format read back;
- the row option refused by class (no ``=``, a name twice, an unclosed quote);
- live (slow): ``pdlb serve`` in vLLM PD with the probe on: every answered request has a record
  whose times nest inside the client's (one clock for the host: CLOCK_MONOTONIC) and whose legs
  run in vLLM's order (prefill answered before the decode leg starts).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
pt = pytest.importorskip("pd_tail")


def _window() -> tuple[list[tuple], tuple[dict, dict]]:
    # 100 requests, seq i = 1..100: sent at 1000 + 0.01 i, answered i ms later; new connections: seq 99 and 100
    recs = [(i, 1000 + 0.01 * i, 1000 + 0.01 * i + 0.001 * i, i in (99, 100)) for i in range(1, 101)]
    reqs: dict[int, dict] = {}
    for i, t0, t1, _ in recs:
        pid = 1 if i <= 60 else 2
        # handler from 1 ms after the send to 0.5 ms before the answer; prefill leg 0.1 ms in, 0.2 ms long;
        # decode leg right after it for 0.3 ms; one upstream connection made (a pool miss) for seq 100 only
        h0 = t0 + 0.001
        reqs[i] = {"pid": pid, "h0": h0, "h1": t1 - 0.0005, "port": (i % 3) + 1 if pid == 1 else 5,
                   "legs": [("prefill", h0 + 0.0001, h0 + 0.0003), ("decode", h0 + 0.0003, h0 + 0.0006)],
                   "conn": [0.0002] if i == 100 else []}
    # the parent: k 8 -> 2 half a second before the window's first send (1000.01), two picks in it
    reqs[-1] = {"placement": [1000.01 - 0.5, -1, 8, 2, 1000.02, 0, 2, 302, 1000.03, 1, 2, 403]}
    # pid 2: a 1 ms collection at 1001.002 (gen 0); pid 1: a 0.2 ms one (not a pause: < 0.5 ms)
    gcs = {1: [(1000.5, 0.0002, 0)], 2: [(1001.002, 0.001, 0)]}
    return recs, (reqs, gcs)


def test_analyse_by_hand() -> None:
    recs, probe = _window()
    out = pt.analyse(recs, probe)
    # latencies 1..100 ms: p50 at rank 49.5 -> 50.5 ms; p99 at rank 98.01 -> 99 + 0.01 = 99.01 ms
    assert out["n"] == 100 and out["p50"] == pytest.approx(50.5) and out["p99"] == pytest.approx(99.01)
    assert out["n_slow"] == 1  # only the 100 ms request is >= 99.01
    assert out["new_conn_slow"] == 1.0 and out["new_conn_all"] == pytest.approx(0.02)
    # new connections: seqs 99 and 100 (median 99.5 ms); kept: 1..98 ms (median 49.5)
    assert out["new_conn_p50"] == pytest.approx(99.5) and out["kept_conn_p50"] == pytest.approx(49.5)
    # stages: before 1 ms, after 0.5 ms for every request; the slow one's handler 100 - 1.5 = 98.5 ms
    assert out["before_med_ms"] == pytest.approx(1.0) and out["before_slow_ms"] == pytest.approx(1.0)
    assert out["after_slow_ms"] == pytest.approx(0.5) and out["handler_slow_ms"] == pytest.approx(98.5)
    assert out["to_first_leg_slow_ms"] == pytest.approx(0.1)
    assert out["prefill_leg_slow_ms"] == pytest.approx(0.2) and out["decode_leg_slow_ms"] == pytest.approx(0.3)
    assert out["pool_miss_slow"] == 1.0 and out["pool_miss_all"] == pytest.approx(0.01)
    # the 1 ms pause of pid 2 at 1001.002-1001.003 overlaps pid 2's requests still running then:
    # answered at 1000 + 0.011 i > 1001.002 -> i >= 92: seqs 92..100 (9 of 100), the slow one among them
    assert out["gc_slow"] == 1.0 and out["gc_all"] == pytest.approx(0.09)
    assert out["gc_pauses"] == 1 and out["gc_pause_max_ms"] == pytest.approx(1.0)
    assert (out["gc0_n"], out["gc1_n"], out["gc2_n"]) == (2, 0, 0)  # both collections fall inside the window
    # pid 1 served seqs 1..60 on ports 1, 2, 3; pid 2 seqs 61..100 on port 5
    assert out["per_process"] == [60, 40] and out["conns_per_process"] == [3, 1]
    assert out["busiest_share_all"] == pytest.approx(0.6) and out["busiest_share_slow"] == 0.0
    assert out["processes"] == 2
    assert out["clustered_other_process"] == 0.0  # one slow request: nothing near it
    assert out["k_changes"] == ["-0.50s 8->2"]
    assert out["picks"] == {0: 1, 1: 1}
    # the loads pick saw, of 8 processes in base 100 (302 = ...00/03/02): the first k = 2 of them
    assert out["pick_trace"] == ["+0.010s->0 [0/0]", "+0.020s->1 [0/0]"]


def test_slow_requests_near_each_other_in_other_processes_count_as_clustered() -> None:
    # 97 requests of 1 ms, one of 40 ms, two of 62.5 ms ending 7.8 ms apart (times exact in binary):
    # sorted, ranks 98 and 99 are 62.5 ms, so the p99 (rank 0.99 x 99 = 98.01) is 62.5 ms and both are
    # slow; served by different processes -> both clustered; by the same one -> neither
    recs = [(i, 10.0 + i, 10.0 + i + 0.001, False) for i in range(97)]
    recs += [(499, 300.0, 300.04, False), (500, 500.0, 500.0625, False), (501, 500.0078125, 500.0703125, False)]
    for pids, want in (((1, 2), 1.0), ((1, 1), 0.0)):
        reqs = {r[0]: {"pid": 1, "h0": r[1], "h1": r[2], "legs": [], "conn": [], "port": 1} for r in recs}
        reqs[500]["pid"], reqs[501]["pid"] = pids
        out = pt.analyse(recs, (reqs, {}))
        assert out["n_slow"] == 2 and out["clustered_other_process"] == want


def test_read_probe_reads_the_flat_records(tmp_path: Path) -> None:
    # one router process: two requests (the second with no prefill leg and two pool misses), one collection
    r1 = [7, 1.0, 2.0, 1.1, 1.2, 1.3, 1.9, 0, 0.0, 40001]
    r2 = [8, 3.0, 4.0, 0, 0, 3.1, 3.9, 2, 0.004, 40002]
    (tmp_path / "11.json").write_text(json.dumps({"pid": 11, "requests": r1 + r2, "gc": [5.0, 0.001, 2]}))
    (tmp_path / "10.json").write_text(json.dumps({"pid": 10, "requests": [], "gc": [], "placement": [1, -1, 8, 4]}))
    reqs, gcs = pt.read_probe(tmp_path)
    assert reqs[7] == {"pid": 11, "h0": 1.0, "h1": 2.0, "legs": [("prefill", 1.1, 1.2), ("decode", 1.3, 1.9)],
                       "conn": [], "port": 40001}
    assert reqs[8]["legs"] == [("decode", 3.1, 3.9)] and reqs[8]["conn"] == [0.004, 0.004]
    assert reqs[-1]["placement"] == [1, -1, 8, 4]
    assert gcs == {11: [(5.0, 0.001, 2)], 10: []}


@pytest.mark.parametrize("bad", ["x8", "=--processes 8", "a b=--processes 2", "x@y=", "x8=--processes '8"])
def test_bad_rows_are_refused(bad: str) -> None:
    ap = pt.ArgumentParser()
    with pytest.raises(SystemExit) as e:
        pt.parse_rows(ap, [bad])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        pt.parse_rows(ap, ["x8=--processes 8", "x8=--processes 4"])  # a name twice
    assert pt.parse_rows(ap, ["x8=--processes 8 --connection-placement round_robin"]) == [
        ("x8", ["--processes", "8", "--connection-placement", "round_robin"])]


def test_a_second_baseline_is_refused(capsys) -> None:
    """review5 U3 (session 17): only the first --baseline ever ran (and for the first row only, where
    the help said each row); a second one was ignored without a word. Now: exit status 2, one line."""
    root = str(Path(__file__).resolve().parents[2])
    with pytest.raises(SystemExit) as e:
        pt.main(["--baseline", root, "--baseline", root])
    assert e.value.code == 2
    assert "--baseline: give one checkout (it runs the first row), got 2" in capsys.readouterr().err


@pytest.mark.slow
def test_the_probe_records_every_request_inside_the_clients_times(tmp_path: Path) -> None:
    # ~10 s: a prefill and a decode engine (zero-delay), pdlb serve (vLLM PD, one process) with the probe
    from sim.emulator.testing import spawn_engines

    engines = spawn_engines([("prefill", "--zero-delay"), ("decode", "--zero-delay")])
    try:
        router = pt.spawn_row("vllm-pd", engines, ["--processes", "1"], tmp_path, None)
        try:
            recs, errors = asyncio.run(pt.closed_loop(router.url, 2, 0.5, 0))
        finally:
            router.stop(30)
    finally:
        for e in engines:
            e.stop()
    assert errors == 0 and len(recs) >= 10
    reqs, gcs = pt.read_probe(tmp_path)
    assert len(gcs) >= 1  # the router process's file (its start-up collections at least)
    for seq, t0, t1, _ in recs:
        r = reqs[seq]
        (role_p, p0, p1), (role_d, d0, d1) = r["legs"]
        assert (role_p, role_d) == ("prefill", "decode")
        # one clock: the handler runs inside the client's send..answer, the legs inside the handler,
        # vLLM's order: the prefill leg's headers came before the decode leg was sent
        assert t0 <= r["h0"] <= p0 <= p1 <= d0 <= d1 <= r["h1"] <= t1
    assert sum(1 for r in reqs.values() if r.get("conn")) >= 1  # the pools' first connections were made
