"""Tools to attack a router on loopback and watch it (issue 25's tests and ``bench/hostile_soak.py``).

* :class:`Probe`: a child process that sends ``GET /health`` every ``interval_s`` on one keep-alive
  connection and reports each answer's latency, so that the latency a client sees is measured
  outside the process under test (and outside the one sending the hostile traffic).
* :func:`rss_bytes` / :func:`tree_rss_bytes`: resident memory of a process (and its children:
  the router's body-parsing worker) from ``/proc``.
* :func:`spawn_fake_engine`: ``python -m sim.emulator.hostile`` — a fake engine process whose
  behaviour is switched at run time (``POST /fake/mode``): ``ok`` (a short answer, JSON or SSE),
  ``reject`` (400 to every generation request, as an engine refuses a prompt over its context),
  ``sse_no_newline`` (a streamed answer that is one endless SSE line without a newline) and
  ``wedged`` (``/health`` answers, generation requests never do). It reads a body without parsing
  it, so that a 32 MB prompt costs it no more than the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from sim.emulator.testing import Proc, _spawn

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_PROBE = r"""
import http.client, json, sys, time
host, port, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = None
out = sys.stdout
print("probing", flush=True)
nxt = time.monotonic()
import select
while True:
    if select.select([sys.stdin], [], [], max(0.0, nxt - time.monotonic()))[0]:
        break  # the parent wrote (or closed stdin): stop
    nxt += interval
    t0 = time.monotonic()
    try:
        if conn is None:
            conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        status = r.status
    except Exception as e:
        status = -1
        conn = None
    out.write(json.dumps([round(t0, 4), round(time.monotonic() - t0, 5), status]) + "\n")
    out.flush()
    if nxt < time.monotonic():  # a late probe: the next one goes at once, not in a burst
        nxt = time.monotonic()
"""


@dataclass
class ProbeResult:
    """Latencies (seconds) and statuses of the probes, in order."""

    times_s: list[float]
    latencies_s: list[float]
    statuses: list[int]

    def p99_s(self) -> float:
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    def max_s(self) -> float:
        return max(self.latencies_s, default=float("nan"))

    def errors(self) -> int:
        return sum(s != 200 for s in self.statuses)


class Probe:
    """``GET /health`` every ``interval_s`` from a child process until :meth:`stop`."""

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        self.popen = subprocess.Popen([sys.executable, "-c", _PROBE, host, port, str(interval_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.popen.stdout is not None
        self.popen.stdout.readline()  # "probing"

    def stop(self) -> ProbeResult:
        out, _ = self.popen.communicate("stop\n", timeout=30)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("[")]
        return ProbeResult([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (bytes; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (one level)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


def tree_rss_bytes(pid: int, depth: int = 3) -> int:
    """Resident memory of ``pid`` and its descendants (``depth`` levels; bytes)."""
    total = rss_bytes(pid)
    if depth > 0:
        for c in children(pid):
            total += tree_rss_bytes(c, depth - 1)
    return total


def wait_until(pred, timeout_s: float, step_s: float = 0.1) -> bool:  # noqa: ANN001
    """Poll ``pred()`` until it is true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step_s)


# ---------------------------------------------------------------------- the fake engine
def _fake_app():  # noqa: ANN202
    from aiohttp import web

    state = {"mode": "ok", "sse_bytes": 8 * 1024 * 1024, "requests": 0}

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.read()  # never parsed: a large prompt costs the engine only its bytes
        state["requests"] += 1
        mode = state["mode"]
        if mode == "reject":
            return web.json_response({"error": {"message": "prompt too long", "type": "invalid_request_error",
                                                "code": 400}}, status=400)
        if mode == "wedged":
            await asyncio.sleep(3600)
        stream = b'"stream": true' in body or b'"stream":true' in body
        if mode == "sse_no_newline" and stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = b"data: " + b"x" * (64 * 1024 - 6)
            await resp.write(chunk)
            sent = len(chunk)
            piece = b"x" * (64 * 1024)
            while sent < state["sse_bytes"]:
                await resp.write(piece)
                sent += len(piece)
            await resp.write_eof()
            return resp
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b'data: {"choices": [{"text": "t%d", "index": 0}]}\n\n' % i)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"id": "x", "object": "text_completion", "kv_transfer_params": {},
                                  "choices": [{"text": "ok", "index": 0, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def set_mode(request: web.Request) -> web.Response:
        body = await request.json()
        state.update(body)
        return web.json_response(state)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "requests": state["requests"]})

    app = web.Application(client_max_size=1 << 30)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, generate)
    app.router.add_post("/fake/mode", set_mode)
    app.router.add_post("/abort_request", lambda r: _ok())
    app.router.add_get("/health", health)
    return app


async def _ok():  # noqa: ANN202
    from aiohttp import web

    return web.json_response({})


async def _serve_fake(port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(_fake_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    print(f"fake engine ready on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def spawn_fake_engine() -> Proc:
    """Start a fake engine process (module docstring) on 127.0.0.1, port 0. Always ``stop()`` it."""
    cmd = [sys.executable, "-m", "sim.emulator.hostile", "--port", "0"]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    return _spawn(cmd, popen=popen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a fake engine whose misbehaviour is set with POST /fake/mode")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    try:
        asyncio.run(_serve_fake(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

