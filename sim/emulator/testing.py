"""Helpers to run emulated engines and the router, in-process or as real processes (tests, benches).

* :func:`inprocess_cluster`: engines and router as aiohttp test servers in the current event loop.
* :class:`Proc` / :func:`spawn_engine` / :func:`spawn_router`: real ``pdlb engine`` / ``pdlb serve``
  processes on 127.0.0.1, port 0; the ready line on stdout gives the port. Always ``stop()`` them.
  Each starts in its own session (its own process group, with the processes it starts: ``pdlb
  serve``'s router processes), so that :func:`stop_spawned` can end every one still running, its
  group included, when the caller cannot run its ``finally`` blocks (the test suite's SIGTERM
  handler and session end, ``tests/spawn_guard.py``), and a terminal's Ctrl-C reaches only the caller.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestServer

from balancer.service.app import create_app
from balancer.service.config import ServiceConfig
from sim.emulator.app import STATE, create_engine_app
from sim.emulator.config import EmulatorConfig

_READY = re.compile(rb"ready on http://([\d.]+):(\d+)")


@dataclass
class InProcessCluster:
    """Servers of an in-process cluster (``engines[i].app[STATE]`` is an engine's state)."""

    router: TestServer
    prefill: list[TestServer]
    decode: list[TestServer]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.port}"

    @property
    def engines(self) -> list[TestServer]:
        return self.prefill + self.decode

    def state(self, server: TestServer):  # noqa: ANN201
        return server.app[STATE]


@contextlib.asynccontextmanager
async def inprocess_cluster(protocol: str = "sglang", num_prefill: int = 2, num_decode: int = 2,
                            engine: dict[str, Any] | None = None, router: dict[str, Any] | None = None
                            ) -> AsyncIterator[InProcessCluster]:
    """Start ``num_prefill`` + ``num_decode`` emulated engines and a router in this loop.

    ``engine`` / ``router``: extra :class:`EmulatorConfig` / :class:`ServiceConfig` fields.
    With ``protocol="none"`` the decode engines are mixed and there is no prefill pool.
    """
    engine = engine or {}
    servers: list[TestServer] = []
    try:
        prefill, decode = [], []
        for role, n, out in (("prefill", num_prefill if protocol != "none" else 0, prefill),
                             ("decode" if protocol != "none" else "mixed", num_decode, decode)):
            for _ in range(n):
                s = TestServer(create_engine_app(EmulatorConfig(role=role, **engine)), host="127.0.0.1")
                await s.start_server()
                s.app[STATE].port = s.port
                servers.append(s)
                out.append(s)
        workers = [{"url": f"http://127.0.0.1:{s.port}", "role": "prefill", "bootstrap_port": s.port} for s in prefill]
        workers += [{"url": f"http://127.0.0.1:{s.port}", "role": "decode" if protocol != "none" else "mixed"} for s in decode]
        cfg = ServiceConfig.model_validate({"pd_protocol": protocol, "workers": workers, "port": 0,
                                            "health_check": {"enabled": False}, **(router or {})})
        r = TestServer(create_app(cfg), host="127.0.0.1")
        await r.start_server()
        servers.append(r)
        yield InProcessCluster(r, prefill, decode)
    finally:
        for s in reversed(servers):
            await s.close()


# ---------------------------------------------------------------------- real processes
@dataclass
class Proc:
    """A ``pdlb`` child process on 127.0.0.1."""

    popen: subprocess.Popen
    port: int
    args: Sequence[str] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        if self.popen.stdout:
            self.popen.stdout.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL at once (a crash)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)


#: the processes :func:`_start` made whose process group may still have members, by pid (= their
#: group's id); pruned at each start, emptied by :func:`stop_spawned` (also at interpreter exit: a
#: bench ended by Ctrl-C, which no longer reaches its servers); a forked child starts with none
_SPAWNED: dict[int, subprocess.Popen] = {}
os.register_at_fork(after_in_child=_SPAWNED.clear)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _start(args: Sequence[str], prelude: str = "") -> subprocess.Popen:
    """``pdlb ARGS`` in a new process, in a session (and process group) of its own;
    ``prelude``: Python statements it runs first (a test's patch)."""
    code = "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", f"{prelude}\n{code}" if prelude else code, *args]
    for pid in [pid for pid, p in _SPAWNED.items() if p.poll() is not None and not _group_alive(pid)]:
        del _SPAWNED[pid]  # finished, and nothing it started is left
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy(),
                             start_new_session=True)
    _SPAWNED[popen.pid] = popen
    return popen


def stop_spawned(timeout_s: float = 5.0) -> list[int]:
    """End every process group :func:`_start` made that still has a member: SIGTERM to the group
    (``pdlb serve`` then stops its router processes itself), SIGKILL to what is left of it after
    ``timeout_s`` in all, then reap. For callers that cannot stop their :class:`Proc` one by one
    (a test session ending or being terminated). Returns the groups signalled (their leaders' pids)."""
    groups = [pid for pid, p in _SPAWNED.items() if p.poll() is None or _group_alive(pid)]
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for pgid in groups:
        while _group_alive(pgid) and time.monotonic() < deadline:
            _SPAWNED[pgid].poll()  # reap the leader once it exits (a zombie stays a member)
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            _SPAWNED[pgid].wait(timeout_s)
    _SPAWNED.clear()
    return groups


atexit.register(stop_spawned)


def _spawn(args: Sequence[str], timeout_s: float = 30.0, popen: subprocess.Popen | None = None) -> Proc:
    if popen is None:
        popen = _start(args)
    assert popen.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(popen.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = _READY.search(buf)
            if m:
                return Proc(popen, int(m.group(2)), tuple(args))
    finally:
        sel.close()
    popen.kill()
    popen.wait(5)
    raise RuntimeError(f"pdlb {' '.join(args)} did not start: {buf.decode(errors='replace')[-2000:]}")


def spawn_engine(role: str, *extra: str) -> Proc:
    """Start ``pdlb engine --role ROLE --port 0 EXTRA...``; waits until it listens."""
    return _spawn(["engine", "--role", role, "--port", "0", *extra])


def spawn_engines(specs: Sequence[Sequence[str]]) -> list[Proc]:
    """Start several engines at once (``specs``: ``[role, *extra]`` each); all or none are returned."""
    arglists = [["engine", "--role", spec[0], "--port", "0", *spec[1:]] for spec in specs]
    popens = [_start(a) for a in arglists]
    procs: list[Proc] = []
    try:
        for a, p in zip(arglists, popens):
            procs.append(_spawn(a, popen=p))
    except BaseException:
        for p in popens:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        raise
    return procs


def spawn_router(protocol: str, prefill: Sequence[Proc], decode: Sequence[Proc], *extra: str,
                 mixed: Sequence[Proc] = (), prelude: str = "") -> Proc:
    """Start ``pdlb serve`` in front of engine processes (prefill bootstrap port = its HTTP port);
    one router process unless ``extra`` gives ``--processes`` (``pdlb serve``'s default is one
    per core: tests want one process's state unless they ask for more); ``prelude``: Python
    statements the router process runs first (a test's patch)."""
    args = ["serve", "--port", "0", "--pd-protocol", protocol]
    if "--processes" not in extra:
        args += ["--processes", "1"]
    if prefill:
        args += ["--prefill", *[f"{p.url},bootstrap={p.port}" for p in prefill]]
    if decode:
        args += ["--decode", *[d.url for d in decode]]
    if mixed:
        args += ["--mixed", *[m.url for m in mixed]]
    args += extra
    return _spawn(args, popen=_start(args, prelude) if prelude else None)
