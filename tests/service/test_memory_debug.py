"""``GET /debug/memory`` (:mod:`balancer.service.memory_debug`, issue 25 item 1's tool): off unless
``PDLB_DEBUG_MEMORY=1``, on the admin API's access rules, and its counts right (hand-made
garbage: the number of objects made is the number reported)."""

from __future__ import annotations

import gc

from aiohttp.test_utils import TestClient, TestServer

from balancer.service import memory_debug
from balancer.service.app import create_app
from balancer.service.config import ServiceConfig


class _Marker:
    """An object in a reference cycle with itself."""

    def __init__(self) -> None:
        self.me = self


def test_enabled_only_by_the_environment_flag() -> None:
    assert memory_debug.enabled({}) is False
    assert memory_debug.enabled({"PDLB_DEBUG_MEMORY": "0"}) is False
    assert memory_debug.enabled({"PDLB_DEBUG_MEMORY": "1"}) is True


def test_the_garbage_report_counts_hand_made_cycles() -> None:
    gc.collect()
    gc.disable()
    try:
        for _ in range(7):
            _Marker()  # 7 self-cycles: 7 _Marker objects become garbage
        r = memory_debug.memory_report(collect=True, garbage=True)
    finally:
        gc.enable()
    assert r["garbage_types"].get("_Marker") == 7
    # the report's pass kept them (DEBUG_SAVEALL) and let them go: the collection then frees them
    # (7 markers, plus their instance dicts where the interpreter made them)
    assert r["collected"] >= 7 and gc.garbage == []
    assert r["rss_bytes"] > 0 and r["python"]["gc_objects"] > 0
    pm = r["pymalloc"]
    assert pm is None or (pm["arenas"] >= 1 and pm["arena_bytes"] >= pm["allocated_bytes"] > 0)
    sm = r["smaps"]
    assert sm is None or sm["Rss"] >= sm["Anonymous"] > 0


def test_trim_reports_rss_before_and_after() -> None:
    r = memory_debug.memory_report(trim=True)
    assert r["rss_before_trim_bytes"] > 0 and r["rss_bytes"] > 0
    m = r["malloc"]
    assert m is None or (m["arenas"] >= 1 and m["uordblks"] > 0)


async def _get(monkeypatch, flag: str | None, headers: dict[str, str]) -> int:  # noqa: ANN001
    if flag is None:
        monkeypatch.delenv("PDLB_DEBUG_MEMORY", raising=False)
    else:
        monkeypatch.setenv("PDLB_DEBUG_MEMORY", flag)
    cfg = ServiceConfig(admin_api_key="k3y")
    async with TestClient(TestServer(create_app(cfg), host="127.0.0.1")) as c:
        r = await c.get("/debug/memory?collect=1", headers=headers)
        if r.status == 200:
            body = await r.json()
            assert body["rss_bytes"] > 0 and "collected" in body and "types" in body["python"]
        return r.status


async def test_the_endpoint_is_off_by_default_and_admin_only(monkeypatch) -> None:  # noqa: ANN001
    auth = {"Authorization": "Bearer k3y"}
    assert await _get(monkeypatch, None, auth) == 404
    assert await _get(monkeypatch, "1", {}) == 401
    assert await _get(monkeypatch, "1", {"Authorization": "Bearer wrong"}) == 401
    assert await _get(monkeypatch, "1", auth) == 200
