"""The engine-leg HTTP client alone: pdlb's lean client vs aiohttp's, against the same raw server.

Run by hand::

    .venv/bin/python bench/upstream_client.py                     # 5 interleaved rounds, both clients
    .venv/bin/python bench/upstream_client.py --rounds 9 --requests 20000 --concurrency 16 --stream

A raw asyncio server (a separate process, ``asyncio.Protocol``, no HTTP library: it splits
requests at the blank line and ``Content-Length`` and answers a fixed 200 JSON body of about 300
bytes, or with ``--stream`` a chunked SSE body of ``--events`` events) stands in for an engine.
In each round, each client in turn (order alternating between rounds) sends ``--requests`` POSTs of
the proxy's shape (JSON body, ``Content-Type`` and ``X-Request-Id`` headers) from
``--concurrency`` tasks over keep-alive connections and reads each answer whole (or, with
``--stream``, chunk by chunk as the SSE relay does). The aiohttp session is configured as
``pdlb serve`` configures it (``balancer.service.app.make_client_session``), the lean client as
``make_upstream_client``. Reported per client: requests/s and the client process's CPU time per
request (user + system, ``time.process_time``), median over rounds, and the ratio lean / aiohttp
per round (median and range): only ratios from the same run mean anything on a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BODY = json.dumps({"model": "emu", "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
                   "max_tokens": 8, "rid": "pdlb-0123456789ab-1"}).encode()
ANSWER = json.dumps({"id": "cmpl-pdlb-0123456789ab-1", "object": "text_completion", "created": 1764633600,
                     "model": "emu", "choices": [{"index": 0, "text": " a b c d e f g h", "finish_reason": "length",
                                                  "logprobs": None}],
                     "usage": {"prompt_tokens": 90, "completion_tokens": 8, "total_tokens": 98}}).encode()


def _server_main(port_fd: int, stream: bool, events: int) -> None:
    """The raw server: answer each request on a connection in turn (keep-alive)."""
    if stream:
        ev = b"data: " + ANSWER + b"\n\n"
        one = b"%x\r\n%s\r\n" % (len(ev), ev)
        done = b"data: [DONE]\n\n"
        resp = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                + one * events + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    else:
        resp = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER)
                + ANSWER)

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):  # noqa: ANN001
            self.t = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            buf = self.buf + data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buf[:end].lower()
                i = head.find(b"content-length:")
                n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
                if len(buf) < end + 4 + n:
                    break
                buf = buf[end + 4 + n:]
                self.t.write(resp)
            self.buf = buf

    async def run() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Proto, "127.0.0.1", 0, backlog=1024)
        os.write(port_fd, str(srv.sockets[0].getsockname()[1]).encode() + b"\n")
        await asyncio.Event().wait()

    asyncio.run(run())


async def _drive(post, url: str, n: int, concurrency: int, stream: bool) -> tuple[float, float]:
    """``(seconds, CPU seconds)`` of ``n`` requests from ``concurrency`` tasks."""
    left = n

    async def worker(k: int) -> None:
        nonlocal left
        headers = {"Content-Type": "application/json", "X-Request-Id": f"pdlb-0123456789ab-{k}"}
        while left > 0:
            left -= 1
            resp = await post(url, data=BODY, headers=headers)
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status}")
            if stream:
                async for _ in resp.content.iter_any():
                    pass
            else:
                await resp.read()
            resp.release()

    await asyncio.gather(*(worker(k) for k in range(concurrency)))  # warm the connections
    left = n
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return time.perf_counter() - t0, time.process_time() - c0


async def main_async(args: argparse.Namespace, url: str) -> dict[str, list[tuple[float, float]]]:
    from balancer.service.app import make_client_session, make_upstream_client
    from balancer.service.config import ServiceConfig

    cfg = ServiceConfig()
    lean = make_upstream_client(cfg)
    assert lean is not None
    session = make_client_session(cfg)
    clients = {"lean": lean.post, "aiohttp": session.post}
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
    try:
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(clients)[::-1]
            for name in order:
                wall, cpu = await _drive(clients[name], url, args.requests, args.concurrency, args.stream)
                out[name].append((wall, cpu))
                print(f"round {r + 1} {name:8s} {args.requests / wall:9.0f} req/s  "
                      f"{cpu / args.requests * 1e6:7.1f} CPU µs/request", flush=True)
    finally:
        await session.close()
        await lean.close()
    return out


def main() -> int:
    from pdlb_cli.arg_types import positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--requests", type=positive_int, default=10_000, help="requests per client per round (default 10000)")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="concurrent requests (default 16)")
    ap.add_argument("--stream", action="store_true", help="chunked SSE answers read chunk by chunk")
    ap.add_argument("--events", type=positive_int, default=9, help="SSE events per streamed answer (default 9)")
    ap.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                    help="the client's event loop (default asyncio)")
    args = ap.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1 or args.events < 1:
        ap.error("--rounds, --requests, --concurrency and --events must be >= 1")
    r_fd, w_fd = os.pipe()
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import upstream_client as u; "
            f"u._server_main({w_fd}, {args.stream}, {args.events})")
    server = subprocess.Popen([sys.executable, "-c", code], pass_fds=(w_fd,))
    os.close(w_fd)
    try:
        with os.fdopen(r_fd) as f:
            line = f.readline()
        if not line:
            print("the raw server did not start", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{int(line)}/v1/completions"
        if args.event_loop == "uvloop":
            import uvloop

            out = uvloop.run(main_async(args, url))
        else:
            out = asyncio.run(main_async(args, url))
    finally:
        server.terminate()
        server.wait(10)
    n = args.requests
    print(f"\n{args.rounds} rounds x {n} requests, concurrency {args.concurrency}, "
          f"{'streamed SSE (' + str(args.events) + ' events)' if args.stream else 'whole JSON answers'}; medians:")
    med = {}
    for name, runs in out.items():
        rps = statistics.median(n / w for w, _ in runs)
        cpu = statistics.median(c / n * 1e6 for _, c in runs)
        med[name] = (rps, cpu)
        print(f"  {name:8s} {rps:9.0f} req/s  {cpu:7.1f} CPU µs/request")
    cpu_ratio = [lc / ac for (_, lc), (_, ac) in zip(out["lean"], out["aiohttp"])]
    rps_ratio = [aw / lw for (lw, _), (aw, _) in zip(out["lean"], out["aiohttp"])]
    print(f"  lean / aiohttp: CPU per request {statistics.median(cpu_ratio):.2f}x "
          f"(rounds {min(cpu_ratio):.2f}-{max(cpu_ratio):.2f}), requests/s {statistics.median(rps_ratio):.2f}x "
          f"(rounds {min(rps_ratio):.2f}-{max(rps_ratio):.2f})")
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    sys.exit(main())
