"""The pure helpers of bench/router_scaling.py (py-spy collapsing, tail description, /proc/stat
deltas); expected values counted by hand from the inputs written here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
rs = pytest.importorskip("router_scaling")


def test_collapse_counts_leaf_functions_and_areas(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (x.py:1);Proxy.handle (balancer/service/proxy.py:10);ClientSession._request (aiohttp/client.py:5) 7\n"
        "main (x.py:1);Proxy.handle (balancer/service/proxy.py:12);ClientSession._request (aiohttp/client.py:9) 3\n"
        "main (x.py:1);Router._route (balancer/router.py:3);SharedLoad.refresh (balancer/service/processes/shared_load.py:150) 4\n"
        "main (x.py:1);BaseEventLoop._run_once (asyncio/base_events.py:1);EpollSelector.select (selectors.py:468) 6\n"
        "not a sample line\n")
    col = rs.collapse(raw)
    # 7 + 3 + 4 + 6 samples; the two aiohttp leaves differ only by line, so they are one function
    assert col["samples"] == 20
    assert col["self"][0] == ("ClientSession._request (aiohttp/client.py)", 10)
    assert dict(col["self"])["SharedLoad.refresh (balancer/service/processes/shared_load.py)"] == 4
    assert col["areas"] == {"aiohttp client": 10, "pdlb shared": 4, "epoll wait": 6}


def test_tail_report_counts_clustered_slow_requests() -> None:
    # 200 requests of 1 ms, two of 10 ms ending 5 ms apart on connections 0 and 1
    lat = [(i * 0.01, 0.001, i % 4) for i in range(200)]
    lat[50] = (0.500, 0.010, 0)
    lat[51] = (0.505, 0.010, 1)
    q = rs.tail_report(lat, "test", None)
    assert q["n"] == 200
    assert q["p50"] == pytest.approx(1.0)
    assert q["max"] == pytest.approx(10.0)
    # the slowest 1% (>= p99) are exactly the two 10 ms requests, within 10 ms of each other
    assert q["slow"] == 2 and q["slow_clustered"] == 2 and q["slow_connections"] == 2
    # they end at 0.510 and 0.515 s: the sixth 100 ms of the second
    assert q["slow_by_100ms_of_second"][5] == 2


def test_stat_delta_busy_and_steal() -> None:
    # fields: user nice system idle iowait irq softirq steal
    a = {0: [0] * 8, 1: [0] * 8}
    b = {0: [50, 0, 10, 30, 0, 0, 0, 10], 1: [0, 0, 0, 100, 0, 0, 0, 0]}
    d = rs._stat_delta(a, b, {0, 1})
    # CPU 0: busy (100 - 30 idle - 10 steal) / 100 = 0.6, steal 0.1; CPU 1 idle: means 0.3 and 0.05
    assert d["busy"] == pytest.approx(0.3)
    assert d["steal"] == pytest.approx(0.05)
