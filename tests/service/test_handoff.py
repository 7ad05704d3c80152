"""Connection hand-off of ``pdlb serve --processes N`` (:mod:`balancer.service.handoff`): the
parent's acceptor passes accepted sockets to the processes' channels in turn, each one served
where it lands. Here two "processes" are two protocol factories in one loop, so the expected
spread is exact: connections 0, 2, 4, ... on the first, 1, 3, 5, ... on the second."""

import asyncio
import socket

from balancer.service.handoff import Acceptor, adopt_connections, channel_pair


class _Tag(asyncio.Protocol):
    """Answers each received chunk with ``<tag>:<chunk>``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.tag.encode() + b":" + data)


async def test_connections_go_to_the_processes_in_turn_and_a_gone_one_is_skipped():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pairs = [channel_pair() for _ in range(2)]
    stops = [adopt_connections(child, lambda tag=f"p{k}": _Tag(tag)) for k, (_, child) in enumerate(pairs)]
    acceptor = Acceptor(listener, [ours for ours, _ in pairs])
    try:
        async def ask(msg: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(msg)
            out = await r.read(100)
            w.close()
            return out

        got = [await ask(f"m{i}".encode()) for i in range(6)]
        assert got == [b"p0:m0", b"p1:m1", b"p0:m2", b"p1:m3", b"p0:m4", b"p1:m5"]
        assert acceptor.handed == [3, 3]
        # process 1 goes away (its end closed): its turns fall to process 0, nothing is lost
        stops[1]()
        await asyncio.sleep(0.05)
        got = [await ask(f"n{i}".encode()) for i in range(4)]
        assert got == [b"p0:n0", b"p0:n1", b"p0:n2", b"p0:n3"]
        assert acceptor.handed == [7, 3]
    finally:
        for stop in stops:
            stop()
        acceptor.close()
    # closed: the port no longer takes connections
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


async def test_a_process_whose_channel_ends_is_told_its_parent_is_gone():
    ours, child = channel_pair()
    gone = []
    stop = adopt_connections(child, lambda: _Tag("p"), lambda: gone.append(True))
    ours.close()  # the parent died: end of file on the channel
    for _ in range(50):
        if gone:
            break
        await asyncio.sleep(0.01)
    assert gone == [True]
    stop()  # idempotent after the channel closed itself
    assert gone == [True]


async def test_a_process_told_to_stop_is_not_told_its_parent_is_gone():
    # Acceptor.close sends STOP before it closes: the process must not take the end of file that
    # follows for its parent's death (it would remove the shared folders while its siblings drain)
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ours, child = channel_pair()
    acceptor = Acceptor(listener, [ours])
    gone, stopped = [], []
    adopt_connections(child, lambda: _Tag("p"), lambda: gone.append(True), lambda: stopped.append(True))
    acceptor.close()
    for _ in range(50):
        if gone or stopped:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the end of file after STOP, if it were read, would add to gone
    assert stopped == [True] and gone == []


def _children(pid: int) -> list[int]:
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_router_processes_exit_and_clean_up_when_the_serve_parent_is_killed():
    import os
    import re
    import signal
    import sys
    import time

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    from sim.emulator.testing import spawn_engines, spawn_router

    engines = spawn_engines([("prefill",), ("decode",)])
    router = spawn_router("sglang", engines[:1], engines[1:], "--processes", "2")
    try:
        kids = [p for p in _children(router.popen.pid)
                if "spawn_main" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
        assert len(kids) == 2
        env = open(f"/proc/{kids[0]}/environ", "rb").read().split(b"\0")
        metrics_dir = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        maps = open(f"/proc/{kids[0]}/maps").read()
        prefix_dir = re.search(r"(/\S*pdlb-prefix-[^/\s]+)/", maps).group(1)
        assert os.path.isdir(metrics_dir) and os.path.isdir(prefix_dir)
        os.kill(router.popen.pid, signal.SIGKILL)  # no clean-up by the parent
        router.popen.wait(5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(map(_running, kids)):
            time.sleep(0.1)
        # before: both processes kept running with nothing to serve, and the folders stayed
        assert not any(map(_running, kids))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (os.path.exists(metrics_dir) or os.path.exists(prefix_dir)):
            time.sleep(0.1)
        assert not os.path.exists(metrics_dir) and not os.path.exists(prefix_dir)
    finally:
        router.kill()
        for p in _children(router.popen.pid):
            os.kill(p, signal.SIGKILL)
        for e in engines:
            e.stop()


async def test_a_retired_process_gets_nothing_and_its_replacement_takes_its_turn():
    """``retire(1)``: every connection goes to process 0; ``replace(1, new channel)``: the turn
    goes 0, 1, 0, 1 again, process 1's now landing on the replacement's channel (tag "p1b")."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pairs = [channel_pair() for _ in range(2)]
    stops = [adopt_connections(child, lambda tag=f"p{k}": _Tag(tag)) for k, (_, child) in enumerate(pairs)]
    acceptor = Acceptor(listener, [ours for ours, _ in pairs])
    new_ours, new_child = channel_pair()
    stops.append(adopt_connections(new_child, lambda: _Tag("p1b")))
    try:
        async def ask(msg: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(msg)
            out = await r.read(100)
            w.close()
            return out

        assert [await ask(b"a"), await ask(b"b")] == [b"p0:a", b"p1:b"]
        acceptor.retire(1)
        stops[1]()  # the dead process's end
        assert [await ask(f"r{i}".encode()) for i in range(3)] == [b"p0:r0", b"p0:r1", b"p0:r2"]
        acceptor.replace(1, new_ours)
        got = [await ask(f"n{i}".encode()) for i in range(4)]
        assert sorted(got) == [b"p0:n0", b"p0:n2", b"p1b:n1", b"p1b:n3"] or sorted(got) == [
            b"p0:n1", b"p0:n3", b"p1b:n0", b"p1b:n2"]
        assert acceptor.dead == set()
    finally:
        acceptor.close()
        for stop in stops:
            stop()


class _ExhaustedListener:
    """A listener whose ``accept()`` fails with ``EMFILE`` ``failures`` times (the process is out of
    descriptors), then waits until shut down."""

    def __init__(self, failures: int) -> None:
        import threading

        self.failures, self.times = failures, []
        self.shut = threading.Event()
        self.exhausted = threading.Event()

    def listen(self, backlog: int) -> None:
        pass

    def accept(self):  # noqa: ANN201
        import errno
        import time

        self.times.append(time.monotonic())
        if len(self.times) <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        self.exhausted.set()
        self.shut.wait(10)
        raise OSError(errno.EINVAL, "shut down")

    def shutdown(self, how: int) -> None:
        self.shut.set()

    def close(self) -> None:
        pass


def test_the_parents_failed_accepts_log_one_line_per_10_s_and_do_not_spin(caplog):
    # review finding F1's gap: the one-process path rate-limits asyncio's "out of system resource"
    # records; the parent's acceptor (pdlb serve --processes N) retried at once, silently (a busy
    # loop while the connection waits in the backlog). 50 failures: 1 line (hand count), each
    # retry after the pause
    import logging

    caplog.set_level(logging.INFO, "pdlb.handoff")
    listener = _ExhaustedListener(50)
    ours, child = channel_pair()
    acceptor = Acceptor(listener, [ours], retry_delay_s=0.002)  # type: ignore[arg-type]
    try:
        assert listener.exhausted.wait(10)
    finally:
        acceptor.close()
        child.close()
    lines = [r for r in caplog.records if r.name == "pdlb.handoff"]
    assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage() for r in lines]
    assert "Too many open files" in lines[0].getMessage() and "open-file limit" in lines[0].getMessage()
    gaps = [b - a for a, b in zip(listener.times, listener.times[1:51])]
    assert min(gaps) >= 0.002 * 0.9, min(gaps)  # paused before each retry (sleep's least duration)
