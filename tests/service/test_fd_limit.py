"""The open-file limit of ``pdlb serve`` (issue 25 review finding F1): a soft ``RLIMIT_NOFILE``
below what ``max_connections`` needs is raised toward the hard limit, the cap is lowered to what
the descriptors can hold, and failed accepts log one line per 10 s, not a traceback each."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from balancer.service import fd_limit
from balancer.service.fd_limit import FD_RESERVE, effective_max_connections, install_accept_error_limit
from sim.emulator.testing import spawn_engines, spawn_router


def test_effective_cap_by_hand():
    # hand calculation: (soft - 128) // 2, never above max_connections, at least 1
    assert effective_max_connections(10_000, 1024) == (1024 - 128) // 2 == 448
    assert effective_max_connections(10_000, 256) == 64
    assert effective_max_connections(100, 20_000) == 100
    assert effective_max_connections(10_000, 2 * 10_000 + FD_RESERVE) == 10_000
    assert effective_max_connections(5, 10) == 1


def test_hard_limit_below_the_need_lowers_the_cap_with_one_warning():
    # a fresh interpreter whose soft and hard limits are 256: nothing to raise, so the cap
    # becomes (256 - 128) // 2 = 64 and one warning says so
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
            "from balancer.service.config import ServiceConfig\n"
            "from balancer.service.launch import _fit_open_file_limit\n"
            "print(_fit_open_file_limit(ServiceConfig()).max_connections)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["64"]
    assert out.stderr.count("warning: the open-file limit (256") == 1
    assert "max_connections=64" in out.stderr


def test_soft_limit_is_raised_toward_the_hard_limit():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))\n"
            "from balancer.service.fd_limit import raise_nofile_limit\n"
            "print(raise_nofile_limit(10_000), resource.getrlimit(resource.RLIMIT_NOFILE)[0],"
            " raise_nofile_limit(10))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # 10,000 connections want 2 * 10,000 + 128 > 4096: raised to the hard limit; never lowered after
    assert out.stdout.split() == ["4096", "4096", "4096"]


def test_accept_errors_log_one_line_per_interval(caplog, monkeypatch):
    monkeypatch.setattr(fd_limit, "ACCEPT_ERRORS_LOG", fd_limit.RateLimitedLog(fd_limit.log, interval_s=10.0))
    loop = asyncio.new_event_loop()
    try:
        install_accept_error_limit(loop)
        with caplog.at_level(logging.DEBUG):
            for _ in range(1000):  # what CPython's _accept_connection reports once per backlog slot
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            loop.call_exception_handler({"message": "something else"})  # still reaches the default handler
    finally:
        loop.close()
    accept_lines = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(accept_lines) == 1 and accept_lines[0].exc_info is None
    assert any("something else" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # ~15 s on a quiet host (engine + router start, 300 connections)
def test_serve_with_a_low_soft_limit_survives_a_connection_flood():
    # soft limit 256, hard 4096: without raising it, 300 idle connections exhaust the descriptors,
    # the request below gets no answer and asyncio logs a traceback per failed accept (F1)
    engines = spawn_engines([("prefill", "--speed", "20"), ("decode", "--speed", "20")])
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))"
    router = None
    socks: list[socket.socket] = []
    try:
        router = spawn_router("sglang", engines[:1], engines[1:], prelude=prelude)
        log = bytearray()
        assert router.popen.stdout is not None
        reader = threading.Thread(target=lambda: [log.extend(c) for c in iter(
            lambda: router.popen.stdout.read1(65536), b"")], daemon=True)
        reader.start()
        socks = [socket.create_connection(("127.0.0.1", router.port), timeout=5) for _ in range(300)]
        time.sleep(1.0)

        async def one() -> int:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
                async with s.post(f"{router.url}/v1/completions",
                                  json={"model": "m", "prompt": "flood test", "max_tokens": 2}) as r:
                    await r.read()
                    return r.status

        assert asyncio.run(one()) == 200
        assert router.alive()
        assert len(log) < 20_000, bytes(log[-2000:])
        assert b"Too many open files" not in log
    finally:
        for s in socks:
            s.close()
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
