"""Router overhead: pdlb vs sglang-router in front of the same zero-delay emulated engines.

Run by hand (needs network to PyPI once, for /work/shared/peers/sglang_router.sh)::

    .venv/bin/python bench/router_overhead.py [--duration-s 5] [--concurrency 16] [--max-concurrency 64]

For each mode (``regular``: 2 mixed engines; ``pd``: 1 prefill + 1 decode engine, SGLang PD
protocol) and each router it measures, with non-streaming ``/v1/completions`` (8 output tokens):

* latency at fixed concurrency (closed loop); *added* latency = router percentile - the same
  percentile sending directly to one engine;
* max requests/s (closed loop at ``--max-concurrency``).

Prints both routers and the ratios pdlb / sglang-router. Goal (issue 3): added p99 <= 2 ms and
throughput >= 0.5x sglang-router. The load generator shares the host with routers and engines,
so on a small host absolute numbers are pessimistic for both; the ratios are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sim.emulator.testing import Proc, spawn_engines, spawn_router  # noqa: E402

PEER = "/work/shared/peers/sglang_router.sh"
BODY = {"model": "emu", "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.post(url + "/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} never answered")


async def _closed_loop(url: str, concurrency: int, duration_s: float) -> tuple[np.ndarray, float]:
    """Latencies (s) of requests completed in ``duration_s`` and the achieved requests/s."""
    lat: list[float] = []
    errors = 0
    stop_at = time.monotonic() + duration_s
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                lat.append(time.perf_counter() - t0)
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    if errors:
        print(f"  warning: {errors} non-200 answers from {url}")
    return np.array(lat), len(lat) / elapsed


def _start_sglang(mode: str, engines: list[Proc]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    args = ["bash", PEER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port()),
            "--policy", "round_robin", "--log-level", "warn"]
    if mode == "regular":
        args += ["--worker-urls", *[e.url for e in engines]]
    else:
        args += ["--pd-disaggregation", "--prefill", engines[0].url, str(engines[0].port), "--decode", engines[1].url]
    log = open(f"/tmp/pdlb-bench-sglang-{mode}.log", "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


async def _measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    await _closed_loop(url, args.concurrency, 1.0)  # warm up connections
    lat, _ = await _closed_loop(url, args.concurrency, args.duration_s)
    _, rps = await _closed_loop(url, args.max_concurrency, args.duration_s)
    return {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "rps": rps, "n": len(lat)}


async def run_mode(mode: str, args: argparse.Namespace) -> None:
    specs = [("mixed", "--zero-delay"), ("mixed", "--zero-delay")] if mode == "regular" else \
        [("prefill", "--zero-delay"), ("decode", "--zero-delay")]
    engines = spawn_engines(specs)
    procs: list[Proc] = list(engines)
    sgl = None
    try:
        direct_engine = engines[0] if mode == "regular" else spawn_engines([("mixed", "--zero-delay")])[0]
        if direct_engine not in procs:
            procs.append(direct_engine)
        direct = await _measure(direct_engine.url, args)
        if mode == "regular":
            pdlb = spawn_router("none", [], [], "--decode-policy", "round_robin", mixed=engines)
        else:
            pdlb = spawn_router("sglang", engines[:1], engines[1:], "--prefill-policy", "round_robin",
                                "--decode-policy", "round_robin")
        procs.append(pdlb)
        ours = await _measure(pdlb.url, args)
        pdlb.stop()
        sgl_res = None
        try:
            sgl, sgl_url = _start_sglang(mode, engines)
            await _wait_ready(sgl_url)
            sgl_res = await _measure(sgl_url, args)
        except (RuntimeError, OSError) as e:
            print(f"  sglang-router unavailable: {e} (see /tmp/pdlb-bench-sglang-{mode}.log)")
        print(f"\n== {mode} ({'2 mixed engines' if mode == 'regular' else '1 prefill + 1 decode, SGLang PD'}), "
              f"zero-delay engines, concurrency {args.concurrency}, throughput at {args.max_concurrency} ==")
        print(f"{'':16}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'max req/s':>11}")
        rows = [("direct engine", direct), ("pdlb", ours)] + ([("sglang-router", sgl_res)] if sgl_res else [])
        for name, r in rows:
            add50 = (r["p50"] - direct["p50"]) * 1e3
            add99 = (r["p99"] - direct["p99"]) * 1e3
            print(f"{name:16}{r['p50'] * 1e3:9.2f}{r['p99'] * 1e3:9.2f}{add50:11.2f}{add99:11.2f}{r['rps']:11.0f}")
        if sgl_res:
            a_ours = max(ours["p99"] - direct["p99"], 1e-6)
            a_sgl = max(sgl_res["p99"] - direct["p99"], 1e-6)
            print(f"ratios pdlb/sglang-router: added p50 "
                  f"{(ours['p50'] - direct['p50']) / max(sgl_res['p50'] - direct['p50'], 1e-6):.2f}x, "
                  f"added p99 {a_ours / a_sgl:.2f}x, max req/s {ours['rps'] / sgl_res['rps']:.2f}x")
    finally:
        if sgl is not None and sgl.poll() is None:
            sgl.terminate()
            try:
                sgl.wait(10)
            except subprocess.TimeoutExpired:
                sgl.kill()
        for p in procs:
            p.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--modes", default="regular,pd")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs; load generator, routers and engines share it")
    for mode in args.modes.split(","):
        asyncio.run(run_mode(mode.strip(), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
