"""``loop_poll_us`` (:mod:`balancer.service.loop_poll`): after bytes arrive the event loop keeps
polling for the window, then may block again; the lean front and the lean upstream client kick it;
answers are the same with it on and off.

Expected values: the window rule by hand on a clock the test sets; the live counts from what the
test sends (each request is one read from the client and at least one from the engine); the
answers against the same router with the poller off (the reference)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time

import pytest

from balancer.service.config import ServiceConfig
from balancer.service.loop_poll import LOOP_POLL_MAX_US, LoopPoller
from pdlb_cli.main import build_parser
from pdlb_cli.serve import config_from_args

from tests.service.test_lean_front import cluster_fronts, post


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_the_window_rule_by_hand_on_a_set_clock():
    loop = asyncio.get_running_loop()
    clock = Clock()
    p = LoopPoller(loop, 0.01, clock)
    assert not p.polling and p.passes == 0
    p.kick()  # bytes at t = 0: poll until t = 0.010
    assert p.polling and (p.kicks, p.spells) == (1, 1)
    await _passes(5)
    assert p.polling and p.passes >= 4  # one polling pass per loop pass while the window is open
    clock.now = 0.006
    p.kick()  # more bytes: the window now ends at 0.016; the same spell goes on
    assert (p.kicks, p.spells) == (2, 1)
    clock.now = 0.0155  # 0.0155 - 0.006 = 0.0095 < 0.010: still polling
    await _passes(3)
    assert p.polling
    clock.now = 0.0165  # 0.0105 since the last bytes: not < 0.010, the next pass stops
    await _passes(2)
    assert not p.polling
    stopped = p.passes
    await _passes(5)
    assert p.passes == stopped  # nothing queued any more: the loop may block
    p.kick()  # a later kick starts a second spell
    assert (p.kicks, p.spells) == (3, 2) and p.polling
    clock.now = 10.0
    await _passes(2)
    assert not p.polling


async def test_the_loop_polls_for_about_the_window_on_the_real_clock():
    loop = asyncio.get_running_loop()
    p = LoopPoller(loop, 0.01)
    t0 = time.perf_counter()
    p.kick()
    while p.polling:
        await asyncio.sleep(0.001)  # a timer: while polling, the loop does not block for it either
        assert time.perf_counter() - t0 < 5.0
    took = time.perf_counter() - t0
    assert took >= 0.01  # never stops before the window
    assert p.passes >= 2


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, LOOP_POLL_MAX_US / 1e6 * 1.01, "0.001", None])
def test_a_bad_window_is_refused(bad):
    with pytest.raises(ValueError, match="window_s"):
        LoopPoller(asyncio.new_event_loop(), bad)  # type: ignore[arg-type]


def test_config_and_cli():
    assert ServiceConfig().loop_poll_us == 0.0  # off by default
    assert ServiceConfig(loop_poll_us=50).loop_poll_us == 50.0
    for bad in (-1, 10_001, math.nan, math.inf):
        with pytest.raises(ValueError, match="loop_poll_us"):
            ServiceConfig(loop_poll_us=bad)
    args = build_parser().parse_args(["serve", "--mixed", "http://127.0.0.1:9", "--loop-poll-us", "75"])
    assert config_from_args(args).loop_poll_us == 75.0
    args = build_parser().parse_args(["serve", "--mixed", "http://127.0.0.1:9"])
    assert config_from_args(args).loop_poll_us == 0.0
    args = build_parser().parse_args(["serve", "--mixed", "http://127.0.0.1:9", "--loop-poll-us", "20000"])
    with pytest.raises(ValueError, match="loop_poll_us"):
        config_from_args(args)


async def _answers(port: int, n: int) -> list[tuple[bytes, dict]]:
    """``n`` requests on one keep-alive connection: (status line, body with its ids dropped) each."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    out = []
    try:
        for _ in range(n):
            w.write(post())
            await w.drain()
            head = await r.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            body = json.loads(await r.readexactly(length))
            body.pop("id", None)
            body.pop("created", None)
            out.append((head.split(b"\r\n", 1)[0], body))
    finally:
        w.close()
    return out


class Recording(LoopPoller):
    """A poller that records which protocol kicked it."""

    __slots__ = ("by",)

    def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **kw)
        self.by: list[str] = []

    def kick(self) -> None:
        self.by.append(type(sys._getframe(1).f_locals.get("self")).__name__)
        super().kick()


async def test_both_ends_kick_it_and_the_answers_are_the_same():
    """The same requests to a router with ``loop_poll_us: 200`` and without (reference): same
    statuses and bodies (less the per-request ids); with it, each request's bytes from the client
    kicked the poller from the lean front, and the engine's answer from the upstream client (at
    least once per request each); without it there is no poller."""
    async with cluster_fronts(loop_poll_us=200) as on, cluster_fronts() as off:
        port_on, svc_on, _ = on["lean"]
        port_off, svc_off, _ = off["lean"]
        assert svc_off.loop_poller is None and svc_off.proxy.client.poller is None
        made = svc_on.loop_poller
        assert made is not None and made.window_s == pytest.approx(200e-6)
        assert svc_on.proxy.client.poller is made  # the upstream client got the same one
        # the same window, recording the kicks' sources (before any connection: both ends read it then)
        poller = svc_on.loop_poller = svc_on.proxy.client.poller = Recording(asyncio.get_running_loop(), made.window_s)
        got_on = await _answers(port_on, 5)
        got_off = await _answers(port_off, 5)
        assert got_on == got_off
        assert all(status == b"HTTP/1.1 200 OK" for status, _ in got_on)
        assert poller.by.count("LeanProtocol") >= 5 and poller.by.count("_Connection") >= 5
        assert set(poller.by) == {"LeanProtocol", "_Connection"}
        assert poller.kicks == len(poller.by) and poller.spells >= 1 and poller.passes >= 1
        await asyncio.sleep(0.05)
        assert not poller.polling  # quiet for longer than the window: back to blocking
