"""The HTTP server alone: CPU per request of aiohttp's low-level server, pdlb's lean front
(:mod:`balancer.service.lean_front`) and uvicorn's ``httptools`` protocol with a raw ASGI callable,
each answering ``POST /v1/completions`` with the same fixed JSON body (no routing, no upstream), on
the same event loop, driven at once by the same client processes (paired rounds, as
``bench/router_overhead.py``). The question it answers: is a well-kept library's server (uvicorn)
close in cost to pdlb's own lean front, so that the library should be preferred (issue 26)?

Usage: ``python bench/front_floor.py --rounds 8 --duration-s 3 --server-cpus 0 [--loop uvloop]``.
uvicorn is not a pdlb dependency: its row is left out when it is not installed (``pip install uvicorn``).
Prints one line per round and the median per-round ratio of each server against aiohttp's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from pdlb_cli.comma_lists import list_arg  # noqa: E402

import router_overhead as ro  # noqa: E402

ANSWER = (b'{"id": "cmpl-1", "object": "text_completion", "model": "emu", "choices": [{"index": 0, "text": " t0 t1",'
          b' "finish_reason": "length"}], "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}}')

_SERVER = r"""
import asyncio, sys
kind, loop_name, answer = sys.argv[1], sys.argv[2], sys.argv[3].encode()
if loop_name == "uvloop":
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

async def aiohttp_main():
    from aiohttp import web
    async def handler(request):
        await request.read()
        return web.Response(body=answer, content_type="application/json")
    server = web.Server(handler, access_log=None)
    srv = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    print("PORT", srv.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

async def lean_main():
    from aiohttp import web
    from balancer.service.app_server import RouterServer
    from balancer.service.lean_front import LeanProtocol
    async def handler(request, endpoint):
        await request.read()
        return web.Response(body=answer, content_type="application/json")
    async def fallback(request):
        return web.Response(status=404)
    server = RouterServer(fallback, request_factory=lambda *a: web.BaseRequest(*a, loop=asyncio.get_running_loop()),
                          access_log=None)
    server.serve_lean(lambda s: LeanProtocol(s, handler, {b"/v1/completions": "completions"}, max_body_bytes=1 << 18,
                                             idle_timeout_s=30, body_timeout_s=30, body_timeout_answer=None))
    srv = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    print("PORT", srv.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

async def uvicorn_main():
    import uvicorn
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            msg = await receive()
            more = msg.get("more_body", False)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})
    import socket
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(1024)
    print("PORT", sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, http="httptools", loop="none", lifespan="off", access_log=False, log_level="warning")
    await uvicorn.Server(config).serve(sockets=[sock])

asyncio.run({"aiohttp": aiohttp_main, "lean": lean_main, "uvicorn": uvicorn_main}[kind]())
"""


def _start(kind: str, loop: str, cpus: set[int] | None) -> SimpleNamespace:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with ro._affinity(cpus):
        popen = subprocess.Popen([sys.executable, "-c", _SERVER, kind, loop, ANSWER.decode()], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, env=env)
    line = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = popen.stdout.readline()  # type: ignore[union-attr]
        if m := re.match(rb"PORT (\d+)", line):
            return SimpleNamespace(popen=popen, url=f"http://127.0.0.1:{int(m.group(1))}")
        if not line:
            break
    popen.kill()
    raise RuntimeError(f"{kind} server did not start: {line!r}")


async def run(args: argparse.Namespace) -> None:
    kinds = ["aiohttp", "lean"]
    try:
        import uvicorn  # noqa: F401

        kinds.append("uvicorn")
    except ImportError:
        print("uvicorn not installed: its row is left out")
    all_cpus = os.sched_getaffinity(0)
    cpus = args.server_cpus or None
    other = (all_cpus - cpus) if cpus and all_cpus - cpus else None
    servers = {k: _start(k, args.loop, cpus) for k in kinds}
    try:
        for s in servers.values():
            await ro._closed_loop(s.url, 8, 0.5)
        load = SimpleNamespace(load_processes=1, concurrency=args.concurrency, duration_s=args.duration_s,
                               other_cpus=other)
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            cpu = await ro._paired_cpu(servers, load)  # type: ignore[arg-type]
            if not all(us > 0 for us in cpu.values()):  # a server answered nothing this round: left out
                print(f"round {r + 1}: left out ({cpu})", flush=True)
                continue
            for k, us in cpu.items():
                got[k].append(us)
            print(f"round {r + 1}: " + ", ".join(f"{k} {us:.1f} us ({us / cpu['aiohttp']:.3f}x)" for k, us in cpu.items()),
                  flush=True)
        for k, v in got.items():
            if not v:
                continue
            ratios = [x / y for x, y in zip(v, got["aiohttp"])]
            print(f"{k} ({args.loop}): median {statistics.median(v):.1f} us/request, median per-round ratio to aiohttp "
                  f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    finally:
        for s in servers.values():
            s.popen.kill()
            s.popen.wait(5)


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=6, help="paired rounds (default: 6)")
    ap.add_argument("--duration-s", type=positive_float, default=3.0, help="seconds of load per round (default: 3)")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="client connections per server (default: 16)")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                    help="the servers' event loop (default: asyncio)")
    ap.add_argument("--server-cpus", default="", help="comma-separated CPUs of the servers, e.g. 0 (default: any)")
    args = ap.parse_args(argv)
    args.server_cpus = set(list_arg(ap, "--server-cpus", args.server_cpus, "CPU numbers", int, empty_ok=True))
    if any(c < 0 for c in args.server_cpus):
        ap.error("--server-cpus: CPU numbers are >= 0")
    if args.rounds < 1 or args.concurrency < 1 or not (0 < args.duration_s < 600):
        ap.error("--rounds and --concurrency must be >= 1 and --duration-s in (0, 600)")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
