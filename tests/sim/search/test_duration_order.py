"""``--duration-s`` counts simulated time (after ``--rate-scale``) in every command: ``pdlb sim
run`` and the points of capacity searches and sweeps (:class:`sim.search.point.WorkloadSpec`) cut the
same way, through :func:`sim.workload.loader.scale_and_cut`.

Expected counts are by hand (arrivals at 0, 1, 2, ... s) or by an independent filter of the
trace (``(t - t0) / rate_scale < duration_s``).
"""

from __future__ import annotations

import json
from pathlib import Path

from balancer.types import Request
from pdlb_cli.main import main
from sim.search.point import SLO, Point, PolicyPair, WorkloadSpec, evaluate_point
from sim.scenario import load_scenario
from sim.workload import read_trace, spread_batches, take_slice
from sim.workload.loader import read_trace_cut, scale_and_cut
from sim.workload.writer import write_mooncake


def test_scale_then_cut_by_hand(tmp_path: Path) -> None:
    reqs = [Request(f"r{i}", float(i), 512, (i,), max_output_tokens=4) for i in range(100)]
    # rate x2: arrivals at 0, 0.5, 1, ...; the first 10 s of those are the requests of t < 20
    got = scale_and_cut(reqs, 2.0, 10.0)
    assert [r.request_id for r in got] == [f"r{i}" for i in range(20)]
    assert got[-1].arrival_time_s == 9.5
    # x0.5: arrivals every 2 s; 10 s hold t = 0, 2, 4, 6, 8 -> the first 5 requests
    assert len(scale_and_cut(reqs, 0.5, 10.0)) == 5
    # --limit comes first: 15 requests at x2 span 7 s, inside the 10 s window
    path = tmp_path / "t.jsonl"
    write_mooncake(reqs, path)
    got, fmt = read_trace_cut(str(path), limit=15, rate_scale=2.0, duration_s=10.0)
    assert fmt == "mooncake" and len(got) == 15


def test_sim_run_and_a_capacity_point_cut_the_same_requests(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["sim", "run", "--policy", "least_load", "--limit", "300", "--rate-scale", "2", "--duration-s", "30",
            "--quiet", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    (run,) = json.loads((out / "summary.json").read_text())["runs"]
    point = evaluate_point(Point(load_scenario("dsv3-pd-h200"), WorkloadSpec(limit=300, duration_s=30.0),
                                 PolicyPair("least_load"), rate_scale=2.0, slo=SLO(ttft_s=2.0, tpot_s=0.1)))
    # independently: the first 300 requests, spread as every command spreads them, then 30 s at x2
    base = spread_batches(take_slice(read_trace(), 0, 300), 3.0, seed=0)
    t0 = min(r.arrival_time_s for r in base)
    expected = sum(1 for r in base if (r.arrival_time_s - t0) / 2.0 < 30.0)
    assert 0 < expected < 300  # the window cuts: a check that can fail
    cut_first = sum(1 for r in base if r.arrival_time_s - t0 < 30.0)  # the points' earlier order: 30 s of trace time
    assert cut_first < expected
    assert run["num_requests"] == point.num_requests == expected
    # the same requests, the same simulation: the two paths agree on the figures too
    assert point.attainment == run["slo_attainment"]
