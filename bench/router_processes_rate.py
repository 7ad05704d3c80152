"""What each extra router process costs per request at the SAME offered load (issue 26).

``bench/router_overhead.py`` measures CPU per request at each router's closed-loop maximum: with
``--processes 8`` in front of engines that top out near 4,000 requests/s (PD on the 16-core
host), each process is half idle and its CPU per request doubles (1,092 vs 501-555 us for one
process, /work/notes/device_s14/b8). This bench separates that from the cost of sharing state:
every ``pdlb serve --processes N`` of ``--processes`` runs at once (routers on ``--router-cpus``,
engines and the load generator on the other CPUs), and each is driven in turn, round after
round, at the same fixed offered rate (open loop: request k is sent at ``k / --rate`` s whether
or not earlier ones have been answered, over ``--connections`` keep-alive connections), so the
load, not the router's capacity, decides the work. Per N and mode it prints:

* CPU per request (user + system of the router's processes, the parent included, from
  ``/proc``), the median over rounds and each round's figure;
* wake-ups per request: the router processes' voluntary context switches (a thread that blocks,
  here the event loop waiting in ``epoll_wait``, then runs again), summed over their threads;
* CPU per second of being up with no requests (``--idle-s``, before the rounds): timers, polls;
* the ratio of each N's CPU per request to N = 1's in the same round (median over rounds);
* a least-squares line through every window of a tree: CPU per request against wake-ups per
  request, whose slope is what one wake-up of an event loop costs (an idle process's loop woken
  for one event pays the caches and the loop's own pass again; a saturated one is not woken).

``--baseline DIR`` adds the same process counts from another checkout (rows ``N@base``), driven
in the same rounds: before / after at equal load.

Run by hand::

    .venv/bin/python bench/router_processes_rate.py                       # regular, pd, vllm-pd; N = 1,2,4,8
    .venv/bin/python bench/router_processes_rate.py --modes pd --rate 400 --rounds 3
    .venv/bin/python bench/router_processes_rate.py --baseline /work/wt/base --processes 1,8
    .venv/bin/python bench/router_processes_rate.py --router-cpus 0-7 --rate 2000 --load-processes 4  # 16-core host

On a 2-core host every router process shares CPU 0 (``--router-cpus 0``, the default there): the
count of processes still changes how many event loops split the same requests, which is what
the ratio measures; the absolute figures are the host's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402

from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402

_RATE_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
url, rate, start_at, duration_s, conns, body = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
async def main():
    ok = errors = late = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as s:
        async def one():
            nonlocal ok, errors
            try:
                async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status == 200:
                        ok += 1
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1
        # warm the connections (not counted)
        await asyncio.gather(*(one() for _ in range(conns)))
        ok = errors = 0
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0, n, tasks = time.monotonic(), int(rate * duration_s), []
        for k in range(n):
            wait = t0 + k / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -0.05:
                late += 1
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    print(json.dumps({"ok": ok, "errors": errors, "late": late}))
asyncio.run(main())
"""


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (f := ro._stat(int(d.name))) is not None:
            children.setdefault(int(f[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def task_status_texts(p: int):
    """The ``/proc/<p>/task/<tid>/status`` text of each thread of process ``p`` (threads that end
    while they are read, or a process that is gone, are skipped)."""
    try:
        tasks = os.listdir(f"/proc/{p}/task")
    except OSError:
        return
    for t in tasks:
        try:
            yield Path(f"/proc/{p}/task/{t}/status").read_text()
        except OSError:
            continue


def _wakeups(pid: int) -> int:
    """Voluntary context switches of ``pid``'s process tree, all threads."""
    total = 0
    for p in _tree(pid):
        for text in task_status_texts(p):
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


async def _drive(proc: Proc, args: argparse.Namespace) -> dict[str, float]:
    """One window at ``--rate`` against ``proc``: CPU us and wake-ups per answered request."""
    start_at = time.time() + 2.0  # the clients' start-up and connection warm-up come before
    per = [args.rate / args.load_processes] * args.load_processes
    conns = max(1, args.connections // args.load_processes)
    kids = [await asyncio.create_subprocess_exec(sys.executable, "-c", _RATE_CLIENT, proc.url, str(r), str(start_at),
                                                 str(args.duration_s), str(conns), ro._BODY_JSON, stdout=subprocess.PIPE,
                                                 preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus))
                                                 if args.other_cpus else None)
            for r in per]
    await asyncio.sleep(max(0.0, start_at - time.time() - 0.05))
    cpu0, wk0 = ro._cpu_s(proc.popen.pid), _wakeups(proc.popen.pid)
    outs = [json.loads((await k.communicate())[0]) for k in kids]
    cpu1, wk1 = ro._cpu_s(proc.popen.pid), _wakeups(proc.popen.pid)
    done = sum(o["ok"] for o in outs)
    errors, late = sum(o["errors"] for o in outs), sum(o["late"] for o in outs)
    if errors or late > 0.01 * args.rate * args.duration_s:
        print(f"  note: {proc.url}: {errors} errors, {late} requests sent > 50 ms late (the client fell behind)")
    return {"cpu_us": (cpu1 - cpu0) / max(1, done) * 1e6, "wakeups": (wk1 - wk0) / max(1, done), "done": done}


def _idle(procs: dict[str, Proc], seconds: float) -> dict[str, float]:
    """CPU ms per second of each router with no requests."""
    c0 = {k: ro._cpu_s(p.popen.pid) for k, p in procs.items()}
    time.sleep(seconds)
    return {k: (ro._cpu_s(p.popen.pid) - c0[k]) / seconds * 1e3 for k, p in procs.items()}


async def run_mode(mode: str, args: argparse.Namespace) -> dict:
    n_eng = args.engines if mode == "regular" else args.pd_engines
    specs = [("mixed", "--zero-delay")] * n_eng if mode == "regular" else \
        [("prefill", "--zero-delay")] * n_eng + [("decode", "--zero-delay")] * n_eng
    procs: list[Proc] = []
    routers: dict[str, Proc] = {}
    try:
        with ro._affinity(args.other_cpus):
            engines = spawn_engines(specs)
        procs += engines
        with ro._affinity(args.router_cpus):
            for tree, tag in [(None, ""), *[(Path(b), "@base" if k == 0 else f"@base{k + 1}") for k, b in enumerate(args.baseline)]]:
                for n in args.processes:
                    a = ro._pdlb_args(mode, engines, n)
                    p = _spawn(a, timeout_s=120) if tree is None else ro._spawn_pdlb_from(tree, a)
                    procs.append(p)
                    routers[f"x{n}{tag}"] = p
        if args.other_cpus:
            os.sched_setaffinity(0, args.other_cpus)
        for p in routers.values():
            await ro._wait_ready(p.url, p.popen)
        time.sleep(1.0)
        idle = _idle(routers, args.idle_s)
        rows: dict[str, list[dict[str, float]]] = {k: [] for k in routers}
        print(f"\n== {mode}: {args.rate:g} requests/s offered, {args.connections} connections, "
              f"{args.duration_s:g} s windows, {args.rounds} round(s) ==")
        for r in range(args.rounds):
            order = list(routers) if r % 2 == 0 else list(routers)[::-1]  # alternate the order per round
            for k in order:
                rows[k].append(await _drive(routers[k], args))
            print(f"  round {r + 1}: " + ", ".join(f"{k} {rows[k][-1]['cpu_us']:.0f} us/req "
                                                    f"{rows[k][-1]['wakeups']:.2f} wake-ups/req" for k in routers))
        return {"idle_ms_per_s": idle, "rows": rows}
    finally:
        ro.stop_all([p.popen for p in procs])


def _summary(mode: str, res: dict, args: argparse.Namespace) -> None:
    rows, idle = res["rows"], res["idle_ms_per_s"]
    print(f"\n{mode}: {'router':<10} {'CPU us/req':>10} {'/ x1 same round':>16} {'wake-ups/req':>13} {'idle CPU ms/s':>14}   per round")
    for k, rs in rows.items():
        tag = k[k.index("@"):] if "@" in k else ""
        first = f"x{args.processes[0]}{tag}"
        ratios = [r["cpu_us"] / f["cpu_us"] for r, f in zip(rs, rows[first])] if first in rows else [math.nan]
        print(f"{'':<9}{k:<10} {statistics.median(r['cpu_us'] for r in rs):>10.0f} "
              f"{statistics.median(ratios):>15.2f}x {statistics.median(r['wakeups'] for r in rs):>13.2f} "
              f"{idle[k]:>14.1f}   " + ", ".join(f"{r['cpu_us']:.0f}" for r in rs))
    for tag in sorted({k[k.index("@"):] if "@" in k else "" for k in rows}):
        pts = [(r["wakeups"], r["cpu_us"]) for k, rs in rows.items() if (k[k.index("@"):] if "@" in k else "") == tag
               for r in rs]
        fit = wakeup_fit(pts)
        if fit is not None:
            print(f"{'':<9}{'this tree' if not tag else tag}: CPU us/req = {fit[0]:.0f} + {fit[1]:.0f} x wake-ups/req "
                  f"(least squares over {len(pts)} windows, r = {fit[2]:.2f}): what one wake-up of an event loop costs")


def wakeup_fit(points: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """Least-squares line ``cpu = a + b * wakeups`` through ``(wakeups, cpu)`` points: ``(a, b, r)``
    (r: Pearson's correlation), or None with fewer than 3 points or no spread in wake-ups."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    return my - b * mx, b, sxy / math.sqrt(sxx * syy)


def main() -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.comma_lists import list_arg, one_of

    from pdlb_cli.arg_types import positive_float, positive_int
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--modes", default="regular,pd,vllm-pd", help="comma list of regular, pd, vllm-pd (default all)")
    ap.add_argument("--processes", default="1,2,4,8", help="comma list of 'pdlb serve --processes' values (default 1,2,4,8)")
    ap.add_argument("--rate", type=positive_float, default=300.0, help="offered requests/s, every router alike (default 300)")
    ap.add_argument("--connections", type=positive_int, default=32, help="client connections, all client processes together (default 32)")
    ap.add_argument("--duration-s", type=positive_float, default=4.0, help="seconds per window (default 4)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="rounds; each drives every router once (default 2)")
    ap.add_argument("--idle-s", type=positive_float, default=3.0, help="seconds of no load measured first (default 3)")
    ap.add_argument("--load-processes", type=positive_int, default=1, help="client processes sharing the rate (default 1)")
    ap.add_argument("--engines", type=positive_int, default=1, help="mixed engines in regular mode (default 1)")
    ap.add_argument("--pd-engines", type=positive_int, default=1, help="prefill and decode engines (N each) in PD modes (default 1)")
    ap.add_argument("--router-cpus", default=None, help="routers' CPUs, e.g. 0-7 (default: CPU 0 when the host has 2+)")
    ap.add_argument("--baseline", action="append", default=[], help="also run these process counts from this checkout (repeatable)")
    ap.add_argument("--out", default=None, help="write the raw results as JSON to this file")
    # a timeout's SIGTERM ends the run through the finally blocks: the engines and routers stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = ap.parse_args()
    args.processes = list_arg(ap, "--processes", args.processes, "process counts >= 1", positive_int)
    modes = list_arg(ap, "--modes", args.modes, "modes of regular, pd, vllm-pd", one_of(("regular", "pd", "vllm-pd")))
    for name in ("rate", "duration_s", "idle_s"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number")
    if args.rounds < 1 or args.connections < 1 or args.load_processes < 1:
        ap.error("--rounds, --connections and --load-processes must be >= 1")
    for b in args.baseline:
        if not ro.is_pdlb_checkout(Path(b)):
            ap.error(f"--baseline {b}: not a pdlb checkout")
    cpus = os.sched_getaffinity(0)
    if args.router_cpus is None:
        args.router_cpus = {min(cpus)} if len(cpus) >= 2 else None
    else:
        args.router_cpus = ro._cpu_list(args.router_cpus, ap)
    args.other_cpus = (cpus - args.router_cpus) if args.router_cpus else None
    print(f"host: {os.cpu_count()} CPUs; routers on {sorted(args.router_cpus) if args.router_cpus else 'any'}; "
          f"load and engines on {sorted(args.other_cpus) if args.other_cpus else 'any'}")
    results = {m: asyncio.run(run_mode(m, args)) for m in modes}
    print("\n== summary (medians over rounds; the ratio to the first process count is taken per round) ==")
    for m, res in results.items():
        _summary(m, res, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
