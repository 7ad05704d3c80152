"""A one-process ``pdlb serve`` killed with SIGKILL leaves no body-worker processes behind (issue 25
review finding F7: its fork server, worker and resource tracker lived on, ~336 MB)."""

from __future__ import annotations

import json
import os
import time

import pytest

from sim.emulator.hostile import children, http_request, spawn_fake_engine
from sim.emulator.testing import spawn_router


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps re-parented processes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # ~10 s on a quiet host (router start, the worker's start, up to 10 s wait)
def test_sigkilled_one_process_serve_leaves_no_body_workers():
    engines = [spawn_fake_engine(), spawn_fake_engine()]
    try:
        r = spawn_router("sglang", engines[:1], engines[1:], "--processes", "1")
        try:
            body = json.dumps({"prompt": "big " * 100_000, "max_tokens": 2}).encode()  # 400 kB: offloaded
            assert http_request(r.url, "POST", "/v1/completions", body)[0] == 200
            left = _descendants(r.popen.pid)
            assert len(left) >= 2, left  # the fork server and its worker (and the resource tracker)
            r.kill()
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(_running(p) for p in left):
                time.sleep(0.2)
            alive = [p for p in left if _running(p)]
        finally:
            r.stop()
        for p in alive:  # clean up what the test found, then fail
            os.kill(p, 9)
        assert not alive, alive
    finally:
        for e in engines:
            e.stop()
