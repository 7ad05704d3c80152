"""bench/route_latency.py's decision log (``--decisions``): the evidence that a change to the hot
path keeps every decision. Small configurations (8 DP ranks, 2k-token prompts); ~3 s.

Expected values: the log is compared with itself across runs and against the numpy code path
(balancer.kernels' compiled loops off: an independent implementation of the same arithmetic);
the line format is checked against a route built here by hand."""

from __future__ import annotations

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
