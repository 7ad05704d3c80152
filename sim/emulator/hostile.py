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


def anon_bytes(pid: int) -> int:
    """Anonymous resident memory of process ``pid`` (``RssAnon`` of ``/proc/PID/status``, bytes; 0
    if it is gone): its heap and stacks, without the mapped files (the interpreter's and the
    libraries' code, numba's included) that its RSS also counts and no client can grow."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
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


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used by process ``pid``, its descendants, and the descendants
    they have reaped (``/proc/PID/stat`` ``utime stime cutime cstime``); 0 for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    own = sum(int(x) for x in fields[11:15]) / CLOCK_TICKS_PER_S  # utime stime cutime cstime
    return own + sum(tree_cpu_s(c) for c in children(pid))


@dataclass(frozen=True)
class HostCpu:
    """A reading of the host's busy CPU time and of one process tree's (seconds), to tell how much
    CPU other work on the host took between two readings (:meth:`foreign_cores`)."""

    wall_s: float
    busy_s: float  # all CPUs: user + nice + system + irq + softirq + steal (/proc/stat)
    own_s: float  # the tree of ``root``: tree_cpu_s(root)

    @classmethod
    def now(cls, root: int | None = None) -> HostCpu:
        """Read now; ``root``: the process whose tree is this test's own (default: this process)."""
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        return cls(time.monotonic(), busy / CLOCK_TICKS_PER_S, tree_cpu_s(os.getpid() if root is None else root))

    def foreign_cores(self, later: HostCpu) -> float:
        """Average CPUs busy with work outside the tree between this reading and ``later``
        (other processes, the hypervisor's steal); 0 where ``/proc`` says nothing."""
        wall = later.wall_s - self.wall_s
        return max(0.0, (later.busy_s - self.busy_s) - (later.own_s - self.own_s)) / wall if wall > 0 else 0.0


QUIET_FOREIGN_CORES = 0.25
"""A host is quiet while other work takes at most this many CPUs on average (:meth:`HostCpu.foreign_cores`)."""


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
    app.router.add_post("/abort_request", _empty_answer)
    app.router.add_get("/health", health)
    return app


async def _empty_answer(request):  # noqa: ANN001, ANN202
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



# ---------------------------------------------------------------------- hostile actions
def raw_exchange(url: str, data: bytes, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """Send ``data`` (a whole HTTP request, as bytes) on a new connection and return the status of
    the answer and its bytes (until the router closes, or ``timeout_s``)."""
    import socket

    host, port = url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.") else -1
    return status, out


def http_request(url: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 120.0) -> tuple[int, bytes]:
    """One HTTP request on a new connection (http.client); ``(status, body)``."""
    import http.client

    host, port = url.removeprefix("http://").rstrip("/").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        h = {"Content-Type": "application/json", **(headers or {})}
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def set_mode(engine: Proc, **state: object) -> None:
    """Switch a fake engine's behaviour (``mode=...``, ``sse_bytes=...``)."""
    status, _ = http_request(engine.url, "POST", "/fake/mode", json.dumps(state).encode())
    assert status == 200


def token_id_prompt(n_tokens: int = 3_700_000) -> bytes:
    """A ``/v1/completions`` body whose prompt is ``n_tokens`` token ids (8-9 bytes each: 3.7M
    is about 32 MB, just under the default ``max_body_bytes``)."""
    ids = str(list(range(100_000, 100_000 + n_tokens))).encode()  # a list's repr is its JSON
    return b'{"max_tokens": 4, "prompt": ' + ids + b"}"


def logit_bias_body(n_entries: int = 1_400_000) -> bytes:
    """A short prompt with a ``logit_bias`` map of ``n_entries`` token ids (about 20 MB)."""
    entries = b", ".join(b'"%d": 1' % i for i in range(100_000, 100_000 + n_entries))
    return b'{"prompt": "hello", "max_tokens": 4, "logit_bias": {' + entries + b"}}"


def many_messages_body(n_messages: int = 900_000) -> bytes:
    """A chat body of ``n_messages`` one-character messages (about 34 bytes each: 30 MB)."""
    msgs = b", ".join([b'{"role": "user", "content": "x"}'] * n_messages)
    return b'{"max_tokens": 4, "messages": [' + msgs + b"]}"


def gzip_bomb(inflated_bytes: int = 30 * 1024 * 1024) -> bytes:
    """A gzip of a JSON body that inflates to about ``inflated_bytes`` (about 30 KB compressed)."""
    import gzip

    return gzip.compress(b'{"prompt": "' + b"a" * inflated_bytes + b'", "max_tokens": 4}', 9)


ADMIN_KEY = "s3cret"
"""The router's ``admin_api_key`` in :func:`spawn_hostile_cluster`."""


class LogTap:
    """Reads a child process's output (its stdout pipe, stderr merged) in a daemon thread, so that
    the child never blocks on a full pipe, and counts it: :attr:`bytes` so far, the last
    :data:`KEEP_BYTES` in :meth:`tail`. (The router logs one short line per kind of client error
    per 10 s: issue 25 item 7.)"""

    KEEP_BYTES = 16 * 1024

    def __init__(self, popen: subprocess.Popen) -> None:
        import threading

        assert popen.stdout is not None
        self.bytes = 0
        self._fd = popen.stdout.fileno()
        self._tail = b""
        self._thread = threading.Thread(target=self._run, daemon=True, name="log-tap")
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.bytes += len(chunk)
            self._tail = (self._tail + chunk)[-self.KEEP_BYTES:]

    def tail(self, n_bytes: int = 2000) -> str:
        """The last ``n_bytes`` of the output, as text."""
        return self._tail[-n_bytes:].decode(errors="replace")


@dataclass
class HostileCluster:
    """A ``pdlb serve`` process in front of one prefill and two decode fake engines; ``log``:
    the router's output (:class:`LogTap`)."""

    router: Proc
    prefill: Proc
    decode: list[Proc]
    log: LogTap | None = None

    @property
    def engines(self) -> list[Proc]:
        return [self.prefill, *self.decode]

    def stop(self) -> None:
        for p in (self.router, *self.engines):
            p.stop()

    def worker_pids(self) -> list[int]:
        """The router's child processes (its body-parsing worker and fork server)."""
        return children(self.router.popen.pid)

    def rss(self) -> tuple[int, int]:
        """``(router process RSS, RSS of its children)`` in bytes."""
        main = rss_bytes(self.router.popen.pid)
        return main, tree_rss_bytes(self.router.popen.pid) - main

    def anon(self) -> tuple[int, int]:
        """``(router process anonymous RSS, that of its children)`` in bytes (:func:`anon_bytes`)."""
        pid = self.router.popen.pid
        return anon_bytes(pid), sum(anon_bytes(c) + sum(anon_bytes(g) for g in children(c)) for c in children(pid))


def spawn_hostile_cluster(config_dir: str, prelude: str = "", **router: object) -> HostileCluster:
    """Fake engines (1 prefill, 2 decode, SGLang protocol) and a ``pdlb serve`` in front of them
    with ``admin_api_key`` :data:`ADMIN_KEY`, non-streamed and prefill legs bounded at 2 s, and
    ``router`` settings on top (a config file written to ``config_dir``); ``prelude``: Python
    statements the router process runs before ``pdlb serve`` (a test's patch)."""
    from sim.emulator.testing import spawn_router

    engines: list[Proc] = []
    try:
        for _ in range(3):
            engines.append(spawn_fake_engine())
        cfg = {"admin_api_key": ADMIN_KEY, "nonstream_timeout_s": 2.0, "nonstream_timeout_per_token_s": 0.0,
               "prefill_timeout_s": 2.0, "stream_first_chunk_timeout_s": 2.0,
               "circuit_breaker": {"failure_threshold": 3, "open_duration_s": 2.0}, **router}
        path = os.path.join(config_dir, "hostile-router.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        r = spawn_router("sglang", engines[:1], engines[1:], "--config", path, prelude=prelude)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return HostileCluster(r, engines[0], engines[1:], LogTap(r.popen))


def _act_token_ids_rejected(c: HostileCluster) -> list[int]:
    """A 32 MB token-id prompt that the engines refuse (400, relayed)."""
    for e in c.engines:
        set_mode(e, mode="reject")
    try:
        return [http_request(c.router.url, "POST", "/v1/completions", token_id_prompt())[0]]
    finally:
        for e in c.engines:
            set_mode(e, mode="ok")


def _act_logit_bias(c: HostileCluster) -> list[int]:
    """A 20 MB ``logit_bias`` map, served."""
    return [http_request(c.router.url, "POST", "/v1/completions", logit_bias_body())[0]]


def _act_many_messages(c: HostileCluster) -> list[int]:
    """A 30 MB chat of 900k messages, served."""
    return [http_request(c.router.url, "POST", "/v1/chat/completions", many_messages_body())[0]]


def _act_gzip(c: HostileCluster) -> list[int]:
    """A 30 KB gzip that inflates to 30 MiB, and an invalid gzip body (both 415, never inflated)."""
    h = {"Content-Encoding": "gzip"}
    return [http_request(c.router.url, "POST", "/v1/completions", gzip_bomb(), h)[0],
            http_request(c.router.url, "POST", "/v1/completions", b"\x1f\x8bnot gzip at all", h)[0]]


def _act_bad_bearer(c: HostileCluster) -> list[int]:
    """``Authorization: Bearer s3cret\\xff`` (and other malformed credentials) on the admin API (401)."""
    out = []
    for cred in (b"Bearer " + ADMIN_KEY.encode() + b"\xff", b"Bearer \xc3\x28", b"Basic \xff\xfe", b"Bearer"):
        req = (b"GET /workers HTTP/1.1\r\nHost: x\r\nAuthorization: " + cred + b"\r\nConnection: close\r\n\r\n")
        out.append(raw_exchange(c.router.url, req, 10.0)[0])
    return out


def _act_admin_scale(c: HostileCluster) -> list[int]:
    """Four workers of 1,024 DP ranks added, ``/metrics`` scraped five times, the workers removed."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    out = []
    urls = [f"http://10.255.0.{i}:9" for i in range(4)]
    for u in urls:
        body = json.dumps({"url": u, "role": "decode", "dp_size": 1024}).encode()
        out.append(http_request(c.router.url, "POST", "/workers", body, auth)[0])
    for _ in range(5):
        out.append(http_request(c.router.url, "GET", "/metrics")[0])
    for u in urls:
        out.append(http_request(c.router.url, "DELETE", f"/workers?url={u}", None, auth)[0])
    return out


def _act_sse_no_newline(c: HostileCluster) -> list[int]:
    """A streamed answer that is one 60 MB SSE line without a newline, while the client set ``rid``
    (the router swaps ids line by line): the stream ends with an error event, status 200."""
    for e in c.decode:
        set_mode(e, mode="sse_no_newline", sse_bytes=60 * 1024 * 1024)
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True, "rid": "client-7"}).encode()
        status, data = http_request(c.router.url, "POST", "/v1/completions", body)
        return [status if b'"error"' in data[-400:] else 599]  # the error event must end the stream
    finally:
        for e in c.decode:
            set_mode(e, mode="ok")


def _act_bad_content_length(c: HostileCluster, n: int = 300) -> list[int]:
    """``n`` requests with ``Content-Length: -5`` (400 each, one log line per 10 s)."""
    req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\nConnection: close\r\n\r\n{}"
    return [raw_exchange(c.router.url, req, 10.0)[0] for _ in range(n)]


def _act_wedged_engine(c: HostileCluster) -> list[int]:
    """One decode engine passes health checks and never answers: non-streamed requests are retried
    on the other within ``nonstream_timeout_s`` (2 s here) and served."""
    set_mode(c.decode[0], mode="wedged")
    try:
        body = json.dumps({"prompt": "hello there", "max_tokens": 4}).encode()
        return [http_request(c.router.url, "POST", "/v1/completions", body)[0] for _ in range(4)]
    finally:
        set_mode(c.decode[0], mode="ok")


ACTIONS = {
    "token_ids_32mb_rejected": _act_token_ids_rejected,
    "logit_bias_20mb": _act_logit_bias,
    "chat_900k_messages": _act_many_messages,
    "gzip_bomb_and_invalid_gzip": _act_gzip,
    "malformed_bearer": _act_bad_bearer,
    "admin_1024_ranks_and_metrics": _act_admin_scale,
    "sse_line_60mb_without_newline": _act_sse_no_newline,
    "content_length_minus_5": _act_bad_content_length,
    "wedged_decode_engine": _act_wedged_engine,
}
"""Issue 25's hostile requests, admin calls and engine misbehaviours: name -> action(cluster) ->
the HTTP statuses it got."""

EXPECTED = {
    "token_ids_32mb_rejected": {400}, "logit_bias_20mb": {200}, "chat_900k_messages": {200},
    "gzip_bomb_and_invalid_gzip": {415}, "malformed_bearer": {401},
    "admin_1024_ranks_and_metrics": {200, 201}, "sse_line_60mb_without_newline": {200},
    "content_length_minus_5": {400}, "wedged_decode_engine": {200},
}
"""The statuses each action must get (never a 5xx)."""


def warm_up(c: HostileCluster) -> None:
    """Large bodies through the router (one of 32 MB: it starts its body-parsing worker, its
    threads and their buffers), one admin cycle, two wedged-engine rounds and a few small
    requests, so that a baseline RSS taken afterwards includes the one-time growth of a router that
    has seen each kind of work (repeating any of them adds nothing): the tests then check that no
    hostile action leaves memory behind."""
    body = json.dumps({"prompt": "warm " * 100_000, "max_tokens": 2}).encode()
    for _ in range(2):
        assert http_request(c.router.url, "POST", "/v1/completions", body)[0] == 200
    assert http_request(c.router.url, "POST", "/v1/completions", token_id_prompt())[0] == 200
    # and one admin cycle: the router's tables (dicts sized for 4k more ranks) keep their size after
    # the workers leave; a second cycle adds 0.66 MB (tracemalloc), so this is a plateau, not a leak
    assert set(_act_admin_scale(c)) <= {200, 201}
    # and one wedged-engine round (timeouts, aborts, a breaker opening): +3.7 MB the first time or
    # second time, nothing after (three rounds in a row: 82.7, 86.4, 86.4 MB)
    for _ in range(2):
        assert set(_act_wedged_engine(c)) == {200}
    small = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    for _ in range(20):
        http_request(c.router.url, "POST", "/v1/completions", small)


LAG = "pdlb_event_loop_lag_seconds"
CPU_LAG = "pdlb_event_loop_cpu_lag_seconds"
"""The router's event-loop lag histograms (:mod:`balancer.service.loop_watch`)."""


def loop_lag_counts(url: str) -> dict[str, dict[float, float]]:
    """The router's :data:`LAG` and :data:`CPU_LAG` histograms now: name -> upper bound ->
    cumulative count."""
    status, text = http_request(url, "GET", "/metrics")
    assert status == 200
    out: dict[str, dict[float, float]] = {LAG: {}, CPU_LAG: {}}
    for line in text.decode().splitlines():
        name = line.split("_bucket{", 1)[0]
        if name in out:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[name][float(le)] = float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class LoopLag:
    """Event-loop lag samples between two :func:`loop_lag_counts` readings."""

    samples: int
    over_100ms: int
    over_250ms: int
    over_500ms: int

    @classmethod
    def between(cls, before: dict[str, dict[float, float]], after: dict[str, dict[float, float]],
                name: str = LAG) -> LoopLag:
        """The samples of histogram ``name`` (:data:`LAG` or :data:`CPU_LAG`) between two
        :func:`loop_lag_counts` readings."""
        b, a = before[name], after[name]
        d = {k: a[k] - b.get(k, 0.0) for k in a}
        total = d[float("inf")]
        return cls(int(total), int(total - d[0.1]), int(total - d[0.25]), int(total - d[0.5]))

    def p99_under_100ms(self, allowed: int = 0) -> bool:
        """At most 1% of the samples (or ``allowed``, if more) over 100 ms."""
        return self.over_100ms <= max(allowed, 0.01 * self.samples)


ISSUE_P99_S = 0.100
ISSUE_MAX_S = 0.250
"""Issue 25's latency bounds: p99 under 100 ms, never over 250 ms."""


LOG_BYTES_MAX = 4096
"""What the router may log during one hostile action (bytes): a few short lines, however many bad
requests the action sends (issue 25 item 7: 1,000 bad requests logged 578 KB of tracebacks)."""


def verdict(name: str, statuses: list[int], seen: ProbeResult, lag: LoopLag, cpu_lag: LoopLag,
            foreign_cores: float, logged_bytes: int = 0) -> list[str]:
    """What went wrong during hostile action ``name`` (empty: nothing), by issue 25's "Done when"
    (``tests/service/test_service_hostile.py``'s docstring): its ``statuses``; the probe's latencies
    ``seen``; the router's wall-clock and CPU event-loop lag (:class:`LoopLag` of :data:`LAG` and
    :data:`CPU_LAG`); the CPUs other work on the host took meanwhile
    (:meth:`HostCpu.foreign_cores`: above :data:`QUIET_FOREIGN_CORES` the wall-clock figures
    measure the host as much as the router, and are not held to the bounds); ``logged_bytes``:
    what the router wrote to its log meanwhile (at most :data:`LOG_BYTES_MAX`)."""
    problems = []
    if logged_bytes > LOG_BYTES_MAX:
        problems.append(f"the router logged {logged_bytes} bytes (at most {LOG_BYTES_MAX})")
    if not set(statuses) <= EXPECTED[name]:
        problems.append(f"statuses {statuses}, expected {EXPECTED[name]}")
    if seen.errors() or not seen.latencies_s:
        problems.append(f"{seen.errors()} probes failed")
    # the router's own work on its loop: the issue's bounds, in CPU terms (held on any host)
    if cpu_lag.over_100ms > 0.01 * cpu_lag.samples or cpu_lag.over_250ms:
        problems.append(f"event loop CPU lag {cpu_lag}: p99 must stay under {ISSUE_P99_S * 1e3:.0f} ms and no "
                        f"sample over {ISSUE_MAX_S * 1e3:.0f} ms")
    if foreign_cores <= QUIET_FOREIGN_CORES:  # a quiet host: the issue's bounds in wall-clock time too
        if seen.p99_s() >= ISSUE_P99_S or seen.max_s() > ISSUE_MAX_S:
            problems.append(f"probe p99 {seen.p99_s() * 1e3:.0f} ms, max {seen.max_s() * 1e3:.0f} ms on a quiet host "
                            f"(other work: {foreign_cores:.2f} CPUs): the bounds are {ISSUE_P99_S * 1e3:.0f} and "
                            f"{ISSUE_MAX_S * 1e3:.0f} ms")
        if lag.over_100ms > 0.01 * lag.samples or lag.over_250ms:
            problems.append(f"event loop lag {lag} on a quiet host (other work: {foreign_cores:.2f} CPUs)")
    return problems
