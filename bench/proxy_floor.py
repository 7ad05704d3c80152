"""How far below one pdlb process's CPU per request a Python proxy can go: the floor under pdlb's
HTTP layer and its own per-request work (issue 26: "where pure Python cannot reach a goal, measure
why").

Run by hand (a host with at least 2 CPUs; routers on ``--router-cpus``, engines and load on the
others)::

    .venv/bin/python bench/proxy_floor.py --router-cpus 0
    .venv/bin/python bench/proxy_floor.py --router-cpus 0-7 --engines 4 --load-processes 4 --max-concurrency 256

Three routers in front of the same zero-delay emulated mixed engines (round robin, the
``router_overhead.py`` regular mode and request), one process each, measured in the same run:

* ``pdlb``: ``pdlb serve --processes 1 --decode-policy round_robin`` as shipped;
* ``aiohttp + lean client``: an aiohttp server whose one handler reads the body and forwards it
  with pdlb's lean upstream client (:class:`balancer.service.upstream.UpstreamClient`) to the
  next engine, then answers with the engine's body: pdlb's two HTTP layers and nothing else
  (no routing, prompt hashing, checks, metrics, retries or timeouts);
* ``httptools + lean client``: the same with the server side an ``asyncio.Protocol`` parsing
  requests with ``httptools`` (the parser the lean client already uses) instead of aiohttp's
  server: what replacing aiohttp's server could reach.

``--ablate 'route;timeouts,route,hash,checks,metrics'`` adds a ``pdlb`` row per ``;``-separated
list with those parts of its per-request work taken away by bench-only patches
(``bench/ablate/sitecustomize.py``): what each part costs inside the running service, where
caches are shared with everything else (a part's in-process microbenchmark understates that).
``--ablate 'proxy;service'`` bisects the rest: ``proxy`` keeps pdlb's server, request handler,
metrics and JSON parse but forwards like the minimal proxies (no ``Proxy.handle``); ``service``
also drops pdlb's handler (what is left: its aiohttp server as configured, and its background
tasks). The 2-core host's run is in docs/serving.md ("How far one process is from a bare Python proxy").

For each: CPU per request (user + system of the router process, ``/proc``) at
``--max-concurrency`` connections, in ``--rounds`` paired rounds (all three driven at once by the
same client processes, so the host's load weighs on them alike), then the ratios to ``pdlb``:
what pdlb's own per-request work costs (pdlb - aiohttp) and what aiohttp's server costs over a
bare parser (aiohttp - httptools).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import router_overhead as ro  # noqa: E402

from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402

_MINIMAL = r'''
import asyncio, itertools, sys
from balancer.service.upstream import UpstreamClient
kind, engines = sys.argv[1], sys.argv[2].split(",")
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
HEADERS = {"Content-Type": "application/json"}

async def main():
    client = UpstreamClient()
    urls = itertools.cycle([e + "/v1/completions" for e in engines])

    async def forward(body):
        resp = await client.post(next(urls), body, HEADERS)
        return await resp.read()

    if kind == "aiohttp":
        from aiohttp import web

        async def handle(request):
            return web.Response(body=await forward(await request.read()), content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
    else:
        import httptools

        class Conn(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport, self.parts = transport, []
                self.parser = httptools.HttpRequestParser(self)

            def data_received(self, data):
                self.parser.feed_data(data)

            def on_body(self, body):
                self.parts.append(body)

            def on_message_complete(self):
                body, self.parts = b"".join(self.parts), []
                asyncio.ensure_future(self.answer(body))

            async def answer(self, body):
                data = await forward(body)
                self.transport.write(HEAD % len(data) + data)

        server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    print(f"ready on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
'''


def spawn_minimal(kind: str, engines: list[Proc]) -> Proc:
    """The minimal proxy of ``kind`` (``aiohttp`` or ``httptools``) in front of ``engines``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    popen = subprocess.Popen([sys.executable, "-c", _MINIMAL, kind, ",".join(e.url for e in engines)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return _spawn([kind], popen=popen)


def spawn_ablated(what: str, engines: list[Proc]) -> Proc:
    """``pdlb serve`` (one process, regular mode) with the bench-only switches ``what`` (a comma list
    of ``bench/ablate/sitecustomize.py``'s) on."""
    a = ro._pdlb_args("regular", engines, 1)
    env = {**os.environ, "PDLB_BENCH_ABLATE": what,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "ablate"), str(ROOT),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))", *a]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return _spawn(a, popen=popen)


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    with ro._affinity(args.other_cpus):
        engines = spawn_engines([("mixed", "--zero-delay")] * args.engines)
    routers: dict[str, Proc] = {}
    try:
        with ro._affinity(args.router_cpus):
            routers["pdlb"] = _spawn(ro._pdlb_args("regular", engines, 1))
            for what in args.ablate:
                routers[f"pdlb, no {what.replace(',', ', no ')}"] = spawn_ablated(what, engines)
            routers["aiohttp + lean client"] = spawn_minimal("aiohttp", engines)
            routers["httptools + lean client"] = spawn_minimal("httptools", engines)
        if args.other_cpus:
            os.sched_setaffinity(0, args.other_cpus)
        for p in routers.values():  # each answers (and opens its engine connections) before measuring
            await ro._closed_loop(p.url, 8, 0.5)
        got: dict[str, list[float]] = {k: [] for k in routers}
        load = SimpleNamespace(load_processes=args.load_processes, concurrency=args.max_concurrency,
                               duration_s=args.duration_s, other_cpus=args.other_cpus)
        for k in range(1, args.rounds + 1):
            cpu = await ro._paired_cpu(routers, load)
            for name, us in cpu.items():
                got[name].append(us)
            print(f"  round {k}: " + ", ".join(f"{name} {us:.0f} us" for name, us in cpu.items()), flush=True)
        return got
    finally:
        for p in [*routers.values(), *engines]:
            p.stop()


def main() -> int:
    from pdlb_cli.arg_types import positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-cpus", required=True, metavar="LIST", help="CPUs for the routers, e.g. 0 or 0-7")
    ap.add_argument("--engines", type=positive_int, default=2, help="mixed zero-delay engines (default 2)")
    ap.add_argument("--load-processes", type=positive_int, default=1, help="client processes (default 1)")
    ap.add_argument("--max-concurrency", type=positive_int, default=48,
                    help="connections per router, from all client processes (default 48)")
    ap.add_argument("--duration-s", type=positive_float, default=4.0, help="seconds per round (default 4)")
    ap.add_argument("--rounds", type=positive_int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--ablate", default="", metavar="LISTS",
                    help="';'-separated comma lists of bench/ablate switches (route, timeouts, hash, checks, metrics, proxy, service, candidates, index, load): "
                         "a pdlb row each with those parts taken away")
    args = ap.parse_args()
    args.ablate = [w.strip() for w in args.ablate.split(";") if w.strip()]
    known = {"route", "timeouts", "hash", "checks", "metrics", "proxy", "service", "candidates", "index", "load"}
    if bad := {x.strip() for w in args.ablate for x in w.split(",")} - known:
        ap.error(f"unknown --ablate switches {sorted(bad)}; known: {', '.join(sorted(known))}")
    args.router_cpus = ro._cpu_list(args.router_cpus, ap)
    all_cpus = os.sched_getaffinity(0)
    if not args.router_cpus < all_cpus:
        ap.error(f"--router-cpus must be a proper subset of this bench's CPUs ({sorted(all_cpus)})")
    args.other_cpus = all_cpus - args.router_cpus
    print(f"routers on {sorted(args.router_cpus)}, engines and {args.load_processes} client process(es) on "
          f"{sorted(args.other_cpus)}; {args.max_concurrency} connections per router, {args.duration_s:g} s rounds")
    got = asyncio.run(run(args))
    med = {k: statistics.median(v) for k, v in got.items()}
    base = got["pdlb"]
    print("\nrouter CPU per request, median of the rounds (ratio to pdlb: median of per-round ratios):")
    for name, us in med.items():
        r = statistics.median(x / b for x, b in zip(got[name], base))
        print(f"  {name:62} {us:7.0f} us   {r:.2f}x pdlb")
    a, h, p = med["aiohttp + lean client"], med["httptools + lean client"], med["pdlb"]
    print(f"pdlb's own per-request work (pdlb - aiohttp + lean client): {p - a:.0f} us ({(p - a) / p:.0%} of pdlb's); "
          f"aiohttp's server over a bare httptools protocol: {a - h:.0f} us ({(a - h) / p:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
