"""Connection placement of ``pdlb serve --processes N`` (:mod:`balancer.service.processes.placement`).

The rule (grow at once, shrink after passes in a row, hold after a change), the parent's pick
(the active process holding the fewest connections), the processes' give-back (everything outside
the active set, the parent's target inside it), the lean front's ``Connection: close`` on a
given-back answer, and a live ``pdlb serve --processes 3`` whose load moves onto one process and
back onto three when it grows, without a failed request. Expected values by hand from the rule's
constants (TARGET_UTIL 0.7, GROW_UTIL 0.85, SATURATED_UTIL 0.95, SHRINK_PASSES 3, SHRINK_MIN_CORES
0.1, HOLD_PASSES 2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from balancer.service.processes.placement import (HOLD_PASSES, LOG_INTERVAL_S, REBALANCE_EXPIRE_PASSES, REBALANCE_GAP,
                                                  SHRINK_PASSES,
                                                  PlacementBlock, PlacementControl, PlacementView, next_active,
                                                  process_cpu_s, rebalance)


# ---------------------------------------------------------------------- the rule
def test_the_rule_by_hand():
    # 8 processes at 0.5 cores each (4.0): ceil(4.0 / 0.7) = 6 wanted; shrink only on the third pass
    u = [0.5] * 8
    assert next_active(8, 8, u, 0) == (8, 1, "")
    assert next_active(8, 8, u, 1) == (8, 2, "")
    assert next_active(8, 8, u, 2) == (6, 0, "shrink")
    # a pass that wants k again resets the count
    assert next_active(6, 8, [0.7] * 6 + [0, 0], 2) == (6, 0, "")
    # idle (0.05 cores in all, under SHRINK_MIN_CORES): never shrinks
    assert next_active(8, 8, [0.05 / 8] * 8, 5) == (8, 0, "")
    # 2 active at 0.9 each (mean over 0.85, not saturated): ceil(1.8 / 0.7) = 3, at least k + 1 = 3
    assert next_active(2, 8, [0.9, 0.9] + [0.0] * 6, 0) == (3, 0, "grow")
    # 2 active at 1.0 (saturated): every process at once (ceil(2.0 / 0.7) = 3 would be the size)
    assert next_active(2, 8, [1.0, 1.0] + [0.0] * 6, 0) == (8, 0, "grow")
    assert next_active(1, 8, [0.96] + [0.0] * 7, 2) == (8, 0, "grow")
    # just under saturation (0.9): ceil(0.9 / 0.7) = 2 = k + 1
    assert next_active(1, 8, [0.9] + [0.0] * 7, 0) == (2, 0, "grow")
    # all 8 busy: nothing to grow into, nothing to shrink
    assert next_active(8, 8, [1.0] * 8, 0) == (8, 0, "")
    # the inactive ones' CPU counts in the total (still serving connections not yet given back)
    assert next_active(1, 4, [0.3, 0.3, 0.3, 0.3], 0) == (1, 0, "")  # want 2 > k: no shrink, mean 0.3: no grow


def test_the_block_and_a_view():
    block = PlacementBlock(3)
    try:
        assert block.active == 3
        peer = PlacementBlock(3, block.name)  # a router process attaches
        v = PlacementView(peer, 2)
        v.connection_opened()
        v.connection_opened()
        v.adopted()
        assert (block.field(2, 2), block.field(2, 3)) == (2, 1)
        v.connection_closed()
        assert block.field(2, 2) == 1
        assert not v.give_back()  # active, no target
        block.q[0] = 2  # process 2 left out: gives every connection back
        assert [v.give_back() for _ in range(3)] == [True, True, True]
        block.q[0] = 3
        block.set_field(2, 0, block.field(2, 1) + 2)  # asked for 2
        assert [v.give_back() for _ in range(4)] == [True, True, False, False]
        # a replacement of process 2 owes nothing its predecessor was asked
        block.set_field(2, 0, block.field(2, 1) + 5)
        v2 = PlacementView(peer, 2)
        assert not v2.give_back() and block.field(2, 2) == 0
        with pytest.raises(ValueError):
            PlacementView(peer, 3)
        peer.close()
    finally:
        block.close()
    with pytest.raises(ValueError):
        PlacementBlock(0)


def test_pick_takes_the_active_process_holding_the_fewest():
    block = PlacementBlock(4)
    try:
        c = PlacementControl(block)
        views = [PlacementView(PlacementBlock(4, block.name), i) for i in range(4)]
        # a burst of 8 connections before any is adopted: in transit counts, so 2 each, in index order
        picks = []
        for _ in range(8):
            k = c.pick()
            picks.append(k)
            c.handed(k)
        assert picks == [0, 1, 2, 3, 0, 1, 2, 3]
        for v in views:  # adopted and open: 2 each
            for _ in range(2):
                v.adopted()
                v.connection_opened()
        views[1].connection_closed()
        assert c.pick() == 1  # the fewest
        block.q[0] = 2  # only 0 and 1 active: 1 (holding 1) beats 0 (2); 2 and 3 are never picked
        assert c.pick() == 1
        assert c.pick(dead={1}) == 0
        assert c.pick(dead={0, 1}) == 2  # every active one dead: a live inactive one
        assert c.pick(dead={0, 1, 2, 3}) is None
        c.reset(1)
        assert c.sent[1] == 0
        for v in views:
            v.block.close()
    finally:
        block.close()


def test_tick_measures_cpu_shares_and_asks_the_active_ones_for_the_new_ones_share():
    block = PlacementBlock(4)
    try:
        c = PlacementControl(block)
        views = [PlacementView(PlacementBlock(4, block.name), i) for i in range(4)]
        for v, n in zip(views, [12, 12, 12, 12]):
            for _ in range(n):
                v.connection_opened()
        cpu = [0.0] * 4
        t = 100.0
        assert c.tick(t, cpu) == 4  # the first pass only sets the clocks
        # 0.2 s passes at 0.1 cores each (0.4 in all: want ceil(0.4/0.7) = 1): shrink on the third
        for n in range(SHRINK_PASSES):
            t += 0.2
            cpu = [x + 0.02 for x in cpu]
            k = c.tick(t, cpu)
            assert k == (4 if n < SHRINK_PASSES - 1 else 1)
        assert block.active == 1 and c.changes[-1][1:] == (4, 1, "shrink")
        assert [block.field(i, 0) for i in range(4)] == [0, 0, 0, 0]  # the left-out ones give all back anyway
        # held for HOLD_PASSES whatever the load (process 0 saturated meanwhile)
        for _ in range(HOLD_PASSES):
            t += 0.2
            cpu[0] += 0.2
            assert c.tick(t, cpu) == 1
        # saturated (1.0 cores): all 4 at once; process 0 (12 open) gives back 12 x (4-1)/4 = 9
        t += 0.2
        cpu[0] += 0.2
        assert c.tick(t, cpu) == 4 and c.changes[-1][1:] == (1, 4, "grow")
        assert block.field(0, 0) - block.field(0, 1) == 9
        assert [views[0].give_back() for _ in range(10)] == [True] * 9 + [False]
        # a process whose clock is unreadable (None) counts 0 cores and restarts its clock: 3 x 0.1
        # cores wants 1 again, and shrinks on the third pass after the hold
        for n in range(HOLD_PASSES + SHRINK_PASSES):
            t += 0.2
            cpu = [cpu[0] + 0.02, cpu[1], cpu[2] + 0.02, cpu[3] + 0.02]
            assert c.tick(t, [cpu[0], None, cpu[2], cpu[3]]) == (4 if n < HOLD_PASSES + SHRINK_PASSES - 1 else 1)
        for v in views:
            v.block.close()
    finally:
        block.close()


def test_the_even_out_rule_by_hand():
    # issue 26 (pdtail): held connections of the active processes, and what each still owes.
    # most - fewest >= REBALANCE_GAP (2): the one holding the most gives back half the gap, rounded down
    assert REBALANCE_GAP == 2
    assert rebalance([12, 4], [0, 0]) == (0, 4)  # 12 - 4 = 8 -> 4: then 8 and 8
    assert rebalance([4, 6, 3, 3], [0, 0, 0, 0]) == (1, 1)  # 6 - 3 = 3 -> 1 (then 4/5/4/3, next pass 5 - 3 -> 1)
    assert rebalance([5, 5, 3], [0, 0, 0]) == (0, 1)  # ties: the lowest index
    assert rebalance([4, 3, 3, 3, 3], [0] * 5) is None  # 16 over 5: a gap of 1 is as even as it gets
    assert rebalance([8], [0]) is None  # one active process: nothing to even out
    assert rebalance([], []) is None
    # a move not yet done (any active process still owes a give-back): nothing new asked
    assert rebalance([12, 4], [0, 1]) is None
    assert rebalance([12, 4], [3, 0]) is None


def test_tick_evens_out_the_active_processes_once_their_moves_are_done():
    # 2 active of 3 (k set by hand), 12 and 4 open connections, a load that keeps k (1.6 cores on 2 active:
    # want ceil(1.6/0.7) = 3 > k: no shrink; mean 0.8 <= 0.85: no grow): a pass that changes nothing asks
    # the fuller one for half the gap, and nothing more until that is done
    block = PlacementBlock(3)
    try:
        c = PlacementControl(block, even_out=True)
        block.q[0] = 2
        views = [PlacementView(PlacementBlock(3, block.name), i) for i in range(3)]
        for v, n in zip(views, [12, 4, 0]):
            for _ in range(n):
                v.connection_opened()
        t, cpu = 100.0, [0.0, 0.0, 0.0]
        assert c.tick(t, cpu) == 2 and c.rebalanced == 0  # the first pass sets the clocks: no load seen yet
        t, cpu = t + 0.2, [cpu[0] + 0.16, cpu[1] + 0.16, 0.0]
        assert c.tick(t, cpu) == 2
        assert block.field(0, 0) - block.field(0, 1) == 4 and c.rebalanced == 4  # (12 - 4) // 2
        t, cpu = t + 0.2, [cpu[0] + 0.16, cpu[1] + 0.16, 0.0]
        assert c.tick(t, cpu) == 2 and c.rebalanced == 4  # still owed: nothing more asked
        # process 0 answers 4 requests with Connection: close, then keeps the rest
        assert [views[0].give_back() for _ in range(5)] == [True] * 4 + [False]
        for _ in range(4):  # their clients reconnect; the parent places them on the fewest (process 1)
            views[0].connection_closed()
            k = c.pick()
            assert k == 1
            c.handed(k)
            views[1].adopted()
            views[1].connection_opened()
        assert [c.held(i) for i in range(3)] == [8, 8, 0]
        t, cpu = t + 0.2, [cpu[0] + 0.16, cpu[1] + 0.16, 0.0]
        assert c.tick(t, cpu) == 2 and c.rebalanced == 4  # even: nothing asked; process 2 (inactive) not counted
        assert not views[0].give_back() and not views[1].give_back()
        for v in views:
            v.block.close()
    finally:
        block.close()


def test_without_the_opt_in_the_placement_never_asks_to_even_out():
    # the default (placement_even_out off): the same 12 vs 4 split under a load that keeps k asks nothing on
    # any pass, so the shared block holds what the placement before the rule wrote (targets = done = 0)
    block = PlacementBlock(3)
    try:
        c = PlacementControl(block)
        assert c.even_out is False
        block.q[0] = 2
        views = [PlacementView(PlacementBlock(3, block.name), i) for i in range(3)]
        for v, n in zip(views, [12, 4, 0]):
            for _ in range(n):
                v.connection_opened()
        t, cpu = 100.0, [0.0, 0.0, 0.0]
        for _ in range(30):
            assert c.tick(t, cpu) == 2
            t, cpu = t + 0.2, [cpu[0] + 0.16, cpu[1] + 0.16, 0.0]
        assert c.rebalanced == 0
        assert [block.field(i, f) for i in range(3) for f in (0, 1)] == [0] * 6
        assert not views[0].give_back()
        for v in views:
            v.block.close()
    finally:
        block.close()


def test_an_even_out_ask_on_idle_connections_expires_and_an_idle_router_asks_nothing():
    block = PlacementBlock(2)
    try:
        c = PlacementControl(block, even_out=True)
        views = [PlacementView(PlacementBlock(2, block.name), i) for i in range(2)]
        for v, n in zip(views, [6, 2]):
            for _ in range(n):
                v.connection_opened()
        t, cpu = 100.0, [0.0, 0.0]
        c.tick(t, cpu)
        # idle (0.05 cores in all, under SHRINK_MIN_CORES = 0.1): 6 vs 2 stays as it is
        for _ in range(3):
            t, cpu = t + 0.2, [cpu[0] + 0.005, cpu[1] + 0.005]
            assert c.tick(t, cpu) == 2
        assert c.rebalanced == 0 and block.field(0, 0) == block.field(0, 1)
        # 1.2 cores in all (0.6 each: want ceil(1.2/0.7) = 2 = k; mean 0.6: no grow): process 0 asked for 2
        t, cpu = t + 0.2, [cpu[0] + 0.12, cpu[1] + 0.12]
        assert c.tick(t, cpu) == 2 and block.field(0, 0) - block.field(0, 1) == 2
        # its connections carry nothing: REBALANCE_EXPIRE_PASSES passes later the ask is dropped (target = done) ...
        for n in range(1, REBALANCE_EXPIRE_PASSES + 1):
            t, cpu = t + 0.2, [cpu[0] + 0.12, cpu[1] + 0.12]
            c.tick(t, cpu)
            owed = block.field(0, 0) - block.field(0, 1)
            assert owed == (2 if n < REBALANCE_EXPIRE_PASSES else 0), n
        # ... and the next pass may ask again (the split is still 6 vs 2)
        t, cpu = t + 0.2, [cpu[0] + 0.12, cpu[1] + 0.12]
        c.tick(t, cpu)
        assert block.field(0, 0) - block.field(0, 1) == 2 and c.rebalanced == 4
        for v in views:
            v.block.close()
    finally:
        block.close()


def test_changes_of_k_are_logged_at_info_at_most_once_a_minute(caplog):
    # review R5 (session 16): a bursty load changed k every few passes, each an INFO line. Now one INFO
    # line per LOG_INTERVAL_S of the passes' own clock, the changes between at DEBUG and counted in the
    # next INFO line. Driven by hand: saturated (1 core each) -> 4, idle-ish (0.1 cores in all) -> 1,
    # alternating; each change needs HOLD_PASSES + SHRINK_PASSES (shrink) or HOLD_PASSES + 1 (grow) passes
    block = PlacementBlock(4)
    try:
        c = PlacementControl(block)
        t, cpu = 100.0, [0.0] * 4
        c.tick(t, cpu)  # sets the clocks
        caplog.set_level(logging.DEBUG, logger="pdlb.placement")
        k = 4
        while t < 100.0 + 1.5 * LOG_INTERVAL_S:  # 90 s of 0.2 s passes
            t += 0.2
            load = 0.2 if k == 1 else 0.01  # per process and pass: 1.0 core each (saturated), 0.2 cores in all on 4
            cpu = [x + load for x in cpu]
            k = c.tick(t, cpu)
        changes = [r for r in caplog.records if r.name == "pdlb.placement" and "active router processes" in r.message]
        info = [r for r in changes if r.levelno == logging.INFO]
        debug = [r for r in changes if r.levelno == logging.DEBUG]
        # the passes' clock: a change at most every HOLD_PASSES + SHRINK_PASSES passes (1 s), so over 90 s
        # there are far more than two; INFO at the first change and once 60 s after it: exactly 2
        assert len(changes) >= 40 and len(info) == 2, (len(changes), len(info))
        assert len(debug) == len(changes) - 2
        first, second = info
        assert "more changes" not in first.message
        # every change between the two INFO lines was logged at DEBUG and is counted in the second
        between = changes.index(second) - changes.index(first) - 1
        assert between > 0 and second.message.endswith(f"; {between} more changes since the last such line (DEBUG)")
        # by hand: the first INFO line is a shrink (4 -> 1) at t1; then a grow 3 passes (0.6 s: 2 held, then
        # saturated) after each shrink and a shrink 5 passes (1.0 s: 2 held + SHRINK_PASSES) after each grow,
        # so change j after t1 comes at 0.8 j s (j even) or 0.8 j - 0.2 s (j odd): j = 75 at 59.8 s is
        # still DEBUG, j = 76 at 60.8 s >= LOG_INTERVAL_S is the second INFO line, 75 changes between
        assert between == 75
        assert len(c.changes) == min(64, len(changes))  # all kept for /metrics and the tests
    finally:
        block.close()


def test_process_cpu_s_reads_this_process():
    # 0.3 s of CPU on this (main) thread, by the thread's own CPU clock (schedstat counts the same
    # nanoseconds; the /proc/PID/stat fallback 10 ms ticks)
    t0, c0 = process_cpu_s(os.getpid()), time.thread_time()
    end = c0 + 0.3
    while time.thread_time() < end:
        pass
    t1, c1 = process_cpu_s(os.getpid()), time.thread_time()
    assert t0 is not None and t1 is not None and t1 - t0 == pytest.approx(c1 - c0, abs=0.02)
    assert process_cpu_s(2 ** 22 + 12345) is None  # no such pid


# ---------------------------------------------------------------------- the lean front gives back
class _Server:
    """The RouterServer hooks the lean front calls (registry, cap, placement)."""

    def __init__(self, give: list[bool]) -> None:
        self.give = give
        self.made = self.lost = 0

    def connection_made(self, handler, transport) -> None:  # noqa: ANN001
        self.made += 1

    def connection_lost(self, handler, exc) -> None:  # noqa: ANN001
        self.lost += 1

    def give_back(self) -> bool:
        return self.give.pop(0) if self.give else False


async def _lean_server(give: list[bool], stream: bool):  # noqa: ANN202
    from aiohttp import web

    from balancer.service.lean_front import LeanProtocol

    server = _Server(give)

    async def handler(request, endpoint):  # noqa: ANN001, ANN202
        if stream:
            s = request.open_stream(200, {"Content-Type": "text/event-stream"})
            await s.write(b"data: 1\n\n")
            await s.write_eof()
            return s
        return web.json_response({"ok": True})

    def factory() -> LeanProtocol:
        return LeanProtocol(server, handler, {b"/v1/completions": "completions"}, max_body_bytes=1 << 20,
                            idle_timeout_s=5.0, body_timeout_s=5.0,
                            body_timeout_answer=lambda p, h: web.json_response({}, status=408))

    srv = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    return srv, server


_REQ = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}")


async def _exchange(port: int, n: int) -> tuple[list[bytes], bool]:
    """Send up to ``n`` requests one after another on one connection: the heads, and whether the
    router closed the connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    heads = []
    closed = False
    for _ in range(n):
        w.write(_REQ)
        head = await r.readuntil(b"\r\n\r\n")
        heads.append(head)
        if b"chunked" in head:
            await r.readuntil(b"0\r\n\r\n")
        else:
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await r.readexactly(length)
        if b"Connection: close" in head:
            closed = await r.read(1) == b""
            break
    w.close()
    return heads, closed


@pytest.mark.parametrize("stream", [False, True])
async def test_a_given_back_connection_says_close_after_its_answer_and_closes(stream):
    srv, server = await _lean_server([False, False, True], stream)
    port = srv.sockets[0].getsockname()[1]
    try:
        heads, closed = await _exchange(port, 5)
        # two kept-alive answers, the third says close (and the connection ends after it, whole)
        assert len(heads) == 3 and closed
        assert [b"Connection: close" in h for h in heads] == [False, False, True]
        assert all(h.startswith(b"HTTP/1.1 200") for h in heads)
        heads, closed = await _exchange(port, 3)  # a new connection: kept alive (nothing to give back)
        assert len(heads) == 3 and not closed
    finally:
        srv.close()
        await srv.wait_closed()


async def test_a_connection_with_a_pipelined_request_waiting_is_not_given_back():
    srv, server = await _lean_server([True, True, True], False)
    port = srv.sockets[0].getsockname()[1]
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_REQ * 2)  # two at once: the first answer must not close (the second was sent)
        heads = []
        for _ in range(2):
            head = await r.readuntil(b"\r\n\r\n")
            heads.append(head)
            await r.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        assert [b"Connection: close" in h for h in heads] == [False, True]
        assert await r.read(1) == b""
        w.close()
    finally:
        srv.close()
        await srv.wait_closed()


# ---------------------------------------------------------------------- live
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            if int(raw[raw.rfind(b")") + 2:].split()[1]) == pid:
                out.append(int(d))
    return out


def _client_sockets(pid: int, port: int) -> int:
    """TCP sockets of ``pid`` connected on local port ``port`` (its client connections)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01" and cols[9] in inodes:
                n += 1
    return n


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
@pytest.mark.parametrize("placement", ["follow_load", "round_robin"])
async def test_pdlb_serve_moves_a_light_load_onto_one_process(placement):
    # pdlb serve --processes 3, 12 keep-alive connections at ~300-600 requests/s in all (a fifth of
    # a core or so: over SHRINK_MIN_CORES, under TARGET_UTIL): follow_load shrinks to 1 active
    # process after 3 passes and the other two give their connections back at their next answer,
    # so soon every client connection is on one process; round_robin (the control arm) keeps 4 on
    # each. No request fails either way (a given-back connection closes after its answer).
    import aiohttp

    from sim.emulator.testing import spawn_engines, spawn_router

    engines = spawn_engines([("mixed", "--zero-delay")])
    r = spawn_router("none", [], [], "--processes", "3", "--connection-placement", placement, mixed=engines)
    port = int(r.url.rsplit(":", 1)[1])
    try:
        routers = [p for p in _children(r.popen.pid) if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(routers) == 3
        body = {"model": "pdlb-emulated", "prompt": "hi " * 50, "max_tokens": 4}
        failed: list[str] = []

        async def client(s: aiohttp.ClientSession, until: float, pause_s: float) -> int:
            n = 0
            while time.monotonic() < until:
                try:
                    async with s.post(r.url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            failed.append(str(resp.status))
                except (aiohttp.ClientError, OSError) as e:
                    failed.append(repr(e))
                n += 1
                await asyncio.sleep(pause_s)
            return n

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=12)) as s:
            # 1 s steps until the connections sit on one process (follow_load: within 10 s; the
            # first requests' one-off work, e.g. compiling kernels, may hold the processes busy a
            # while first) or 3 s (round_robin)
            sent = 0
            first_where: list[int] = []  # where the connections sat after the first step
            steps = 0
            for _ in range(10 if placement == "follow_load" else 3):
                steps += 1
                until = time.monotonic() + 1.0
                sent += sum(await asyncio.gather(*(client(s, until, 0.02) for _ in range(12))))
                where = [_client_sockets(p, port) for p in routers]
                first_where = first_where or where
                if max(where) == 12:
                    break
            # a given-back connection's server side may stay ESTABLISHED a moment after the client
            # reconnected elsewhere (13 counted for 12 clients, seen under load): let it settle
            for _ in range(20):
                if sum(where) == 12:
                    break
                await asyncio.sleep(0.1)
                where = [_client_sockets(p, port) for p in routers]
            text = await (await s.get(r.url + "/metrics")).text()
        # every client had at least one answer per 1 s step (the load is ~600 req/s on an idle host; the
        # move can be over within the first step, and a loaded host answered 290 in it once: a floor
        # of 300 in all failed there)
        assert failed == [] and sent >= 12 * steps, (sent, steps)
        assert sum(where) == 12, where
        if placement == "follow_load":
            assert sorted(where) == [0, 0, 12], where
            # every connection that sat on a process left out at the end was given back (the
            # client keeps its connections alive for 15 s, longer than the test): at least the
            # connections counted there after the first step (often 0: the move may be over within
            # that step), and at least one, since the 12 connections opened while all 3 took them
            import re

            assert re.search(r"^pdlb_router_processes_active 1\.0$", text, re.M), text[-2000:]
            back = sum(float(v) for v in re.findall(r'^pdlb_connections_given_back_total\{reason="\w+"\} (\S+)$', text, re.M))
            left_out = sum(n for n, now in zip(first_where, where) if now == 0)
            assert back >= max(1, left_out), (first_where, where, back)
            # both reasons' series exist from the start (at 0 until counted: review2)
            assert re.search(r'^pdlb_connections_given_back_total\{reason="rebalance"\} \S+$', text, re.M), text[-2000:]
        else:
            assert where == [4, 4, 4], where
            # every process takes new connections under round robin (the gauge read 0 before: review2)
            import re

            assert re.search(r"^pdlb_router_processes_active 3\.0$", text, re.M), text[-2000:]
    finally:
        r.stop()
        for e in engines:
            e.stop()
