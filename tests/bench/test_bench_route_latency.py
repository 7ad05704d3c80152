"""bench/route_latency.py's decision log (``--decisions``): the evidence that a change to the hot
path keeps every decision. Small configurations (8 DP ranks, 2k-token prompts); ~3 s.

Expected values: the log is compared with itself across runs and against the numpy code path
(balancer.kernels' compiled loops off: an independent implementation of the same arithmetic);
the line format is checked against a route built here by hand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
rl = pytest.importorskip("route_latency")

from balancer import kernels  # noqa: E402
from balancer.types import Choice, ReplicaId, Route  # noqa: E402


def _log(policy: str, compiled: bool = True, rate: float = 2000.0) -> list[str]:
    log: list[str] = []
    try:
        rl.bench(policy, 8, 2048, 300, rate, 16, "cpu", compiled, decision_log=log)
    finally:
        kernels.use_compiled(True)
    return log


def test_decision_log_is_reproducible_and_kernel_independent() -> None:
    first = _log("ep_aware")
    assert len(first) == 300 and all(line.startswith("ep_aware,8,2048,m") for line in first)
    # the KV events run on the virtual clock: a second run decides the same, to the last bit
    assert _log("ep_aware") == first
    # numpy's code path (kernels off) gives the same decisions and scores
    assert _log("ep_aware", compiled=False) == first
    # and the log sees the events: without them (approximate mode) decisions or scores differ
    assert _log("ep_aware", rate=0.0) != first


def test_decision_line_names_ranks_reasons_and_exact_scores() -> None:
    p, d = ReplicaId("p0", 1), ReplicaId("d0", 2)
    route = Route("m7", p, d, 0, 0, Choice(p, {p: 0.1 + 0.2}, "ep_aware:prefill"), Choice(d, {}, "round_robin"))
    # 0.1 + 0.2 is 0.30000000000000004: repr keeps every bit; no score: empty field
    assert rl.decision_line("ep_aware", 8, 2048, route) == (
        "ep_aware,8,2048,m7,p0/dp1,ep_aware:prefill,0.30000000000000004,d0/dp2,round_robin,")
    aggregated = Route("m8", None, d, 0, 0, None, Choice(d, {d: 2.5}, "x"))
    assert rl.decision_line("x", 8, 2048, aggregated) == "x,8,2048,m8,,,,d0/dp2,x,2.5"


def test_hashing_and_prefill_kernel_lines() -> None:
    """The lines the bench prints after its table: the block hashing at the bench's block size and
    at pdlb serve's 64, and the prefill kernel on random pools (the select version and the
    branching loop, with a ratio); one per configuration."""
    lines = rl.hashing_lines([2048])
    assert [line.split(" (")[0] for line in lines] == ["block hashing of one 2048-token prompt at 64-token blocks",
                                                       "block hashing of one 2048-token prompt at 512-token blocks"]
    assert all(" us, p99 " in line for line in lines)
    pytest.importorskip("numba")
    (line,) = rl.prefill_kernel_lines([16], pools=3, rounds=1)
    assert line.startswith("ep_aware prefill kernel, 16 ranks (8 per engine), 3 random pools cycled: selects ")
    assert float(line.rsplit("ratio ", 1)[1]) > 0


def test_prefill_memo_lines() -> None:
    """The memo's lines: one per kind of pool, the memo answering every decision where the
    queues are shorter than the prompt and none where they are long and the hits differ by rank
    (the share rule hands those to the fresh kernel), with a ratio."""
    pytest.importorskip("numba")
    lines = rl.prefill_memo_lines([16], decisions=20, rounds=1)
    assert len(lines) == 2
    assert "queues under 16k tokens" in lines[0] and "(it answered 19 of 19)" in lines[0]
    assert "random queues to 60k" in lines[1] and "(it answered 0 of 19)" in lines[1]
    assert all(float(line.split("ratio ", 1)[1].split(";")[0]) > 0 for line in lines)


def test_interleaved_rounds_rotate_the_table_each_round() -> None:
    """``--repeat``: round k measures every configuration once, starting k*C/N into the table.
    Expected order by hand: C=4, N=2 -> starts 0 and 2; C=3, N=3 -> starts 0, 1, 2."""
    seen: list[str] = []

    def measure(c: str) -> tuple[str, int]:
        seen.append(c)
        return c, len(seen)

    rounds: list[int] = []
    out = rl.interleaved_rounds(["a", "b", "c", "d"], 2, measure, lambda k, _s: rounds.append(k))
    assert seen == ["a", "b", "c", "d", "c", "d", "a", "b"]
    assert rounds == [0, 1]
    # each configuration's results in round order (the call number shows when it was measured)
    assert out == {"a": [("a", 1), ("a", 7)], "b": [("b", 2), ("b", 8)], "c": [("c", 3), ("c", 5)],
                   "d": [("d", 4), ("d", 6)]}
    seen.clear()
    rl.interleaved_rounds(["x", "y", "z"], 3, measure)
    assert seen == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]
    seen.clear()
    assert rl.interleaved_rounds(["x"], 1, measure) == {"x": [("x", 1)]}
    for bad in ((["x"], 0), ([], 2), (["x", "x"], 2)):
        with pytest.raises(ValueError):
            rl.interleaved_rounds(*bad, measure)


def test_summarise_rounds_medians_and_ranges() -> None:
    # by hand: p50s 10, 12, 11 -> median 11, range 10-12; p99s 30, 90, 40 -> median 40 (the 90 burst
    # is one round's), range 30-90; fills 0.5, 0.5, 0.6 -> 0.5
    r = rl.summarise_rounds([(10.0, 30.0, 0.5), (12.0, 90.0, 0.5), (11.0, 40.0, 0.6)])
    assert r == {"p50": 11.0, "p99": 40.0, "fill": 0.5, "p50_min": 10.0, "p50_max": 12.0,
                 "p99_min": 30.0, "p99_max": 90.0}
    # an even count: the mean of the middle two
    assert rl.summarise_rounds([(10.0, 30.0, 1.0), (20.0, 50.0, 1.0)])["p99"] == 40.0
    with pytest.raises(ValueError):
        rl.summarise_rounds([])


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"replica_counts": [8], "prompt_sizes": [32768], "repeat": 3, **kw})


def test_repeated_table_prints_medians_of_the_rounds(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The table's rows from a fake ``bench`` whose values per round are given by hand: the
    printed median, range and ratio are those of the hand values (round_robin measured as the
    baseline even when not asked for)."""
    values = {"round_robin": [(5.0, 10.0, 0.25), (6.0, 20.0, 0.25), (7.0, 10.0, 0.25)],
              "kv_cost": [(20.0, 40.0, 0.5), (30.0, 400.0, 0.5), (25.0, 50.0, 0.75)]}
    calls: dict[str, int] = {"round_robin": 0, "kv_cost": 0}

    def fake_bench(policy: str, replicas: int, prompt: int, *conf: object) -> tuple[float, float, float]:
        assert (replicas, prompt, conf) == (8, 32768, (20, 0.0, 0, "cpu"))
        calls[policy] += 1
        return values[policy][calls[policy] - 1]

    monkeypatch.setattr(rl, "bench", fake_bench)
    lines = rl.repeated_table(_args(), ["kv_cost"], (20, 0.0, 0, "cpu"))
    assert calls == {"round_robin": 3, "kv_cost": 3}
    assert [ln.startswith("round ") for ln in capsys.readouterr().out.splitlines()] == [True] * 3
    assert lines[0].startswith("medians of 3 rounds")
    assert lines[1].split()[:5] == ["policy", "replicas", "prompt", "p50", "us"]
    # kv_cost: p50 median 25, p99 median 50 (range 40-400); round_robin's median p99 10 -> ratio 5.00;
    # fill median 0.5 -> 50%
    assert lines[2].split() == ["kv_cost", "8", "32768", "25.0", "50.0", "20.0-30.0", "40.0-400.0", "5.00", "50%"]
    assert len(lines) == 3


def test_repeated_table_tiny_real_run() -> None:
    """A real, tiny run (8 ranks, 32k prompts: a short warm-up; 30 decisions; 2 rounds; ~2 s): one
    row per policy, each median inside its own range, round_robin's ratio 1.00."""
    lines = rl.repeated_table(_args(repeat=2), ["round_robin", "least_load"], (30, 0.0, 4, "cpu"))
    rows = [ln.split() for ln in lines[2:]]
    assert [r[:3] for r in rows] == [["round_robin", "8", "32768"], ["least_load", "8", "32768"]]
    for r in rows:
        p50, p99 = float(r[3]), float(r[4])
        (lo50, hi50), (lo99, hi99) = ([float(x) for x in r[i].split("-")] for i in (5, 6))
        assert 0 < lo50 <= p50 <= hi50 and 0 < lo99 <= p99 <= hi99
        # two rounds: the median is the mean of the two, the range's ends (to the printed digit)
        assert abs(p99 - (lo99 + hi99) / 2) <= 0.1
    assert rows[0][7] == "1.00"
