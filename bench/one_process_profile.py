"""Where ONE ``pdlb serve`` process spends its CPU per request, by code area and by function, in
each mode (issue 26: one process's CPU per request).

One process (``--processes 1``) in front of zero-delay emulated engines is driven at a fixed
offered rate (open loop, ``bench/router_processes_rate.py``'s client: request k is sent at
``k / --rate`` s over ``--connections`` keep-alive connections), while ``py-spy`` samples it
(``--rate 250``, without ``--idle``). The samples (less those in ``epoll_wait``, which only
``--native`` shows) are scaled to the process's measured CPU per request (``/proc``, user +
system, over the same window), so each row reads as microseconds of CPU per request: exact
shares only when the process is saturated (offer a rate above what it serves): below that
py-spy takes idle samples for busy ones (under the loop's ``run``, and, reading the router's
memory without stopping it, on the stale frames of callbacks that have returned), so the rows
are shares of samples, not of CPU.
``--strace``: system calls per request instead (``strace -c``). The tables:

* **areas**: each sample's leaf frame by code area (the lean front, the proxy, the upstream
  client, the routing core, the metrics, aiohttp, json...); native time (sockets, ``httptools``,
  numpy) counts towards the Python frame that called it; samples whose leaf is the loop's
  ``run`` (uvloop's C loop: epoll, reads, callbacks' dispatch) are ``event loop (C) + idle``:
  py-spy counts some idle waits in ``epoll_wait`` as busy there (the share shrinks towards the
  loop's real work as the process saturates: compare at a rate it cannot keep up with);
* **inclusive**: per pdlb function, the share of samples whose stack holds it (each stack
  counted once per function), in us of CPU per request: what removing the function's whole
  call would save;
* **self**: the top leaf functions.

Run by hand (py-spy on PATH, or ``--py-spy PATH``; it needs ptrace rights over the router)::

    .venv/bin/python bench/one_process_profile.py                          # every mode, 300 requests/s
    .venv/bin/python bench/one_process_profile.py --modes pd --rate 500 --duration-s 8
    .venv/bin/python bench/one_process_profile.py --tree /work/wt/base     # profile another checkout

On a host with more than 2 CPUs the router runs on ``--router-cpus`` (default: CPU 0) and the
engines, clients and py-spy on the others. The figures are one window's: compare trees with
``bench/router_processes_rate.py --baseline`` (paired rounds), not with two runs of this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402
import router_processes_rate as rpr  # noqa: E402

from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402

#: (path fragment of a frame's file, area), first match wins
AREAS = (
    ("/selectors.py", "epoll wait"), ("epoll_pwait (", "epoll wait"), ("epoll_wait (", "epoll wait"),
    ("/balancer/service/lean_front", "pdlb lean front"),
    ("/balancer/service/proxy", "pdlb proxy"),
    ("/balancer/service/upstream", "pdlb upstream client"),
    ("/balancer/service/app", "pdlb app (_generate, _observed)"),
    ("/balancer/service/metrics", "pdlb metrics"),
    ("/balancer/service/prompt", "pdlb prompt/hash"),
    ("/balancer/service/workers", "pdlb workers"),
    ("/balancer/service/processes/", "pdlb shared state"),
    ("/balancer/service/", "pdlb service other"),
    ("/balancer/", "pdlb core (routing)"),
    ("/asyncio/runners.py", "event loop (C) + idle"),  # LOOP
    ("/asyncio/", "asyncio (Python)"), ("/uvloop/", "asyncio (Python)"),
    ("/aiohttp/", "aiohttp"), ("/prometheus_client/", "prometheus"),
    ("/yarl/", "yarl/multidict"), ("/multidict/", "yarl/multidict"),
    ("/json/", "json"), ("/orjson", "json"), ("/socket.py", "socket"), ("/httptools/", "httptools"),
)


def area(frame: str) -> str:
    """The code area of a py-spy frame ``func (path:line)``."""
    f = "/" + frame.rsplit("(", 1)[-1]
    for key, name in AREAS:
        if key in f or (key.endswith("(") and frame.startswith(key)):
            return name
    return "other"


def _fn(frame: str) -> str:
    """``func (path:line)`` -> ``func (short path)``."""
    head, _, tail = frame.rpartition(":")
    fn = head + ")" if tail.rstrip(")").isdigit() else frame
    fn = fn.replace(str(ro.ROOT) + "/", "")
    for marker in ("site-packages/", "/lib/python3"):
        if marker in fn:
            fn = fn.split("(", 1)[0] + "(" + fn.split(marker, 1)[1]
    return fn


def collapse(raw: Path) -> dict:
    """py-spy ``--format raw`` lines -> samples by area (leaf), by leaf function, by function
    anywhere in the stack (once per stack); the router's main thread only (other threads: the
    ``other threads`` area)."""
    areas: Counter = Counter()
    self_n: Counter = Counter()
    incl: Counter = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n_s = line.rpartition(" ")
        if not stack or not n_s.isdigit():
            continue
        n = int(n_s)
        frames = stack.split(";")
        total += n
        leaf = frames[-1]
        areas[area(leaf)] += n
        self_n[_fn(leaf)] += n
        for fn in {_fn(f) for f in frames}:
            incl[fn] += n
    return {"samples": total, "areas": areas, "self": self_n, "incl": incl}


LOOP = "event loop (C) + idle"
SAMPLE_RATE_HZ = 250
"""py-spy's sampling rate here (samples per second of the router's main thread)."""


def report(mode: str, col: dict, cpu_us: float, top: int, done: float | None = None) -> dict:
    """Print the tables; returns them in microseconds of CPU per request: every sample outside the
    epoll wait scaled to ``cpu_us`` (``done``: the requests in py-spy's window, printed only).

    Exact shares only for a saturated process: py-spy (``--nonblocking``) takes some idle samples
    for busy ones here, and not only under the loop's ``run``: reading a running process's memory
    without stopping it, it also finds the last Python frames of a callback that has returned
    (at a fixed 400 requests/s the Python frames alone summed to 1.4x the measured CPU)."""
    areas = col["areas"]
    busy = col["samples"] - areas.get("epoll wait", 0)
    print(f"\n== {mode}: {cpu_us:.0f} us CPU per request, {col['samples']} samples ({busy} outside the epoll wait)"
          + (f", {done:.0f} requests in it ==" if done else " =="))
    if busy <= 0:
        return {}
    scale = cpu_us / busy
    out_areas = {a: n * scale for a, n in areas.items() if a != "epoll wait"}
    print("  areas (leaf frame), us per request (samples outside the epoll wait scaled to the measured CPU):")
    for a, us in sorted(out_areas.items(), key=lambda kv: -kv[1]):
        print(f"    {us:7.1f} us {us / max(cpu_us, 1e-9):6.1%}  {a}")
    print(f"  inclusive (stack holds it), pdlb and library functions, top {top}:")
    rows = [(fn, n) for fn, n in col["incl"].most_common() if "(" in fn and not fn.startswith(("<module>", "run ("))]
    for fn, n in rows[:top]:
        print(f"    {n * scale:7.1f} us {n / busy:6.1%}  {fn[:120]}")
    print(f"  self (leaf), top {top}:")
    for fn, n in col["self"].most_common(top):
        if not fn.startswith(("EpollSelector.select", "run (")):
            print(f"    {n * scale:7.1f} us {n / busy:6.1%}  {fn[:120]}")
    return {"cpu_us": cpu_us, "samples": col["samples"], "busy": busy, "done": done,
            "areas_us": out_areas, "incl_us": {fn: n * scale for fn, n in rows[:200]}}


async def _start_later(cmd: list[str], args: argparse.Namespace, stderr: int) -> subprocess.Popen:
    """``cmd`` started 2 s from now (when ``router_processes_rate._drive``'s clients begin), on the
    CPUs outside the router's."""
    await asyncio.sleep(2.0)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr,
                            preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus)) if args.other_cpus else None)


async def run_mode(mode: str, args: argparse.Namespace, spy: str) -> dict:
    n_eng = args.engines if mode == "regular" else args.pd_engines
    specs = [("mixed", "--zero-delay")] * n_eng if mode == "regular" else \
        [("prefill", "--zero-delay")] * n_eng + [("decode", "--zero-delay")] * n_eng
    procs: list[Proc] = []
    try:
        with ro._affinity(args.other_cpus):
            engines = spawn_engines(specs)
        procs += engines
        a = ro._pdlb_args(mode, engines, 1) + args.extra.split()
        with ro._affinity(args.router_cpus):
            router = _spawn(a, timeout_s=120) if args.tree is None else ro._spawn_pdlb_from(args.tree, a)
        procs.append(router)
        if args.other_cpus:
            os.sched_setaffinity(0, args.other_cpus)
        await ro._wait_ready(router.url, router.popen)
        await rpr._drive(router, argparse.Namespace(**{**vars(args), "duration_s": 1.0}))  # warm-up, not counted
        pid = router.popen.pid
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.txt"
            # _drive's clients send from 2 s after it is called (connections warmed first) for
            # --duration-s: the tracer starts with them, so both see the same window
            if args.strace:  # system calls per request instead of a profile
                tracer = asyncio.ensure_future(_start_later(["strace", "-c", "-f", "-o", str(raw), "-p", str(pid)],
                                                            args, subprocess.DEVNULL))
                res = await rpr._drive(router, args)
                st = await tracer
                st.terminate()
                st.wait(10)
                print(f"\n== {mode}: system calls over the window, {res['done']} requests ==")
                for line in raw.read_text().splitlines():
                    parts = line.split()
                    if len(parts) >= 5 and parts[3].isdigit():
                        print(f"    {int(parts[3]) / max(1, res['done']):6.2f} per request  {line}")
                return {"cpu_us": res["cpu_us"]}
            how = ["--native"] if args.native else ["--nonblocking"]
            spy_task = asyncio.ensure_future(_start_later(
                [spy, "record", "--pid", str(pid), "--duration", str(int(args.duration_s)),
                 "--rate", str(SAMPLE_RATE_HZ), *how, "--format", "raw", "-o", str(raw)], args, subprocess.PIPE))
            t_send = time.monotonic() + 2.0  # when _drive's clients begin
            res = await rpr._drive(router, args)
            # a client that falls behind (a rate above the router's capacity) sends past the
            # window: the requests within py-spy's window, at the run's mean throughput
            in_window = res["done"] * min(1.0, int(args.duration_s) / max(1e-9, time.monotonic() - t_send))
            spy_p = await spy_task
            try:
                _, err = spy_p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                spy_p.kill()
                err = b"timeout"
            if not raw.exists():
                print(f"  py-spy wrote nothing: {err.decode(errors='replace')[-300:]}")
                return {"cpu_us": res["cpu_us"]}
            col = collapse(raw)
            if args.keep_raw:
                shutil.copy(raw, args.keep_raw / f"{mode}.raw.txt")
        out = report(mode, col, res["cpu_us"], args.top, in_window)
        out["wakeups"] = res["wakeups"]
        return out
    finally:
        ro.stop_all([p.popen for p in procs])


def main() -> int:
    from pdlb_cli.arg_types import positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="regular,pd,vllm-pd", help="comma list of regular, pd, vllm-pd")
    ap.add_argument("--rate", type=positive_float, default=300.0, help="offered requests/s (default 300)")
    ap.add_argument("--duration-s", type=positive_float, default=6.0, help="profiled window, s (default 6)")
    ap.add_argument("--connections", type=positive_int, default=16, help="client keep-alive connections (default 16)")
    ap.add_argument("--load-processes", type=positive_int, default=1, help="client processes (default 1)")
    ap.add_argument("--engines", type=positive_int, default=2, help="mixed engines, regular mode (default 2)")
    ap.add_argument("--pd-engines", type=positive_int, default=1, help="prefill and decode engines each (default 1)")
    ap.add_argument("--router-cpus", default="0", metavar="LIST", help="CPUs of the router (default 0)")
    ap.add_argument("--tree", type=Path, help="profile this checkout's pdlb instead of this one")
    ap.add_argument("--extra", default="", metavar="ARGS", help="more 'pdlb serve' arguments")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH", help="py-spy binary (default: on PATH)")
    ap.add_argument("--native", action="store_true",
                    help="py-spy --native: C frames too (epoll_wait, uvloop, system calls; stops the router per sample)")
    ap.add_argument("--strace", action="store_true", help="count system calls per request (strace -c) instead")
    ap.add_argument("--keep-raw", type=Path, metavar="DIR", help="keep py-spy's raw files here (MODE.raw.txt)")
    ap.add_argument("--top", type=positive_int, default=40, help="rows of the function tables (default 40)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    from pdlb_cli.comma_lists import list_arg, one_of
    modes = list_arg(ap, "--modes", args.modes, "modes", one_of(ro.MODES))
    if args.rate <= 0 or args.duration_s < 1 or args.connections < 1 or args.load_processes < 1:
        ap.error("--rate > 0, --duration-s >= 1, --connections >= 1, --load-processes >= 1")
    if args.strace and not shutil.which("strace"):
        ap.error("--strace: strace not found")
    if not args.strace and not args.py_spy:
        ap.error("py-spy not found: --py-spy PATH")
    all_cpus = os.sched_getaffinity(0)
    args.router_cpus = ro._cpu_list(args.router_cpus, ap) if len(all_cpus) >= 2 else None
    args.other_cpus = (all_cpus - args.router_cpus) if args.router_cpus else None
    out = {m: asyncio.run(run_mode(m, args, args.py_spy)) for m in modes}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
