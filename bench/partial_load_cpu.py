"""Where ONE router process's CPU per request goes as its load falls (issue 26: the partly idle
process).

One ``pdlb serve --processes 1`` in front of zero-delay emulated engines is driven at each of
``--rates`` in turn (open loop, ``bench/router_processes_rate.py``'s client: request k is sent at
``k / rate`` s over ``--connections`` keep-alive connections), ``--rounds`` times with the order of
the rates alternating, and per rate it prints, per answered request (medians over rounds):

* CPU (user + system of the router's process tree, ``/proc``), and its **user / system** split;
* **wake-ups**: voluntary context switches (the loop blocking in ``epoll_wait`` and being woken)
  and involuntary ones (preempted);
* a least-squares line through every window: CPU = a + b x wake-ups, for the total, user and
  system time apart: ``b`` is what one wake-up costs the process (``a``: a request's cost when the
  loop is never woken);
* ``--strace``: system calls per request by name (``strace -c -f``; the tracer slows the router,
  so it runs in windows of its own, after the timed ones);
* ``--loop-counts``: what the request path asks of the event loop per request, from a router run
  with ``--event-loop asyncio`` and counting wrappers installed before ``pdlb serve`` starts:
  loop passes, passes that may block (``select`` with a timeout) and events returned, Tasks,
  futures, ``call_soon`` / ``call_at`` (TimerHandles), ``call_soon_threadsafe``, and garbage
  collections; uvloop (the default loop) is C code but pdlb's code makes the same calls;
* ``--perf``: ``perf record -e cpu-clock`` samples of the router by shared object (the Python
  interpreter, the kernel, uvloop, numpy, httptools, libc...), scaled to us of CPU per request:
  which part grows when the load falls (``perf`` on PATH; runs in windows of its own);
* ``--calibrate``: the host's own price of a wake-up for any Python program, no pdlb: a process on
  the router's CPU sleeps until each tick of the same rates and then does a fixed piece of work,
  once a small warm loop (``tight``) and once a walk over 300 objects of a 200,000-object heap
  (``heap``, a working set like a request's), against the same work back to back: the extra CPU
  per wake-up is the kernel's switch plus the caches the process finds cold;
* ``--spin-us LIST``, an experiment (not in pdlb): routers whose loop keeps polling that many us
  after bytes arrive before it blocks (injected before ``pdlb serve`` starts), driven in the same
  rounds as the plain one: CPU per request against it, per rate.

Run by hand::

    .venv/bin/python bench/partial_load_cpu.py                                 # regular, 300,800,1500,6000 req/s
    .venv/bin/python bench/partial_load_cpu.py --modes regular,pd --rounds 3 --calibrate
    .venv/bin/python bench/partial_load_cpu.py --rates 300,1500 --strace --loop-counts --perf
    .venv/bin/python bench/partial_load_cpu.py --rates 300,800,1500,6000 --rounds 3 --spin-us 50
    .venv/bin/python bench/partial_load_cpu.py --tree /path/to/other/checkout  # another checkout's pdlb

The router runs on ``--router-cpus`` (default CPU 0), the engines and the clients on the other
CPUs. A rate above what the process serves gives its saturated figure (the client then falls
behind and says so). Before/after comparisons of two trees at equal load belong to
``bench/router_processes_rate.py --baseline`` (paired rounds); this bench says where the CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
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

#: installed before ``pdlb serve`` runs (``--loop-counts``): counting wrappers on the standard
#: event loop's methods, the selector and the collector; SIGUSR1 writes the counts to $PDLB_BENCH_COUNTS
COUNTING = r"""
import asyncio.base_events as _be, collections as _co, gc as _gc, os as _os, selectors as _sel, signal as _sig
_C = _co.Counter()
def _wrap(name):
    orig = getattr(_be.BaseEventLoop, name)
    def f(self, *a, **k):
        _C[name] += 1
        return orig(self, *a, **k)
    setattr(_be.BaseEventLoop, name, f)
for _n in ("_run_once", "call_soon", "call_at", "create_task", "create_future", "call_soon_threadsafe"):
    _wrap(_n)
_osel = _sel.EpollSelector.select
def _select(self, timeout=None):
    _C["select may block" if timeout is None or timeout > 0 else "select no wait"] += 1
    r = _osel(self, timeout)
    _C["events"] += len(r)
    return r
_sel.EpollSelector.select = _select
_gc.callbacks.append(lambda phase, info: _C.__setitem__(f"gc{info['generation']}", _C[f"gc{info['generation']}"] + (phase == "stop")))
def _dump(*_):
    with open(_os.environ["PDLB_BENCH_COUNTS"] + ".tmp", "w") as fh:
        fh.write("\n".join(f"{k}\t{v}" for k, v in sorted(_C.items())))
    _os.replace(_os.environ["PDLB_BENCH_COUNTS"] + ".tmp", _os.environ["PDLB_BENCH_COUNTS"])
_sig.signal(_sig.SIGUSR1, _dump)
"""
_COUNTER = COUNTING + "import sys\nfrom pdlb_cli.main import main\nsys.exit(main(sys.argv[1:]))\n"

#: ``--spin-us``, an experiment (not in pdlb; tried as ``pdlb serve --loop-poll-us`` in session 17 and
#: removed: no win on the 2-core host, docs/serving.md "The partly idle process"): the router's loop keeps polling (a callback that
#: re-queues itself, so each pass polls with a zero timeout) for $PDLB_BENCH_SPIN_US microseconds
#: after any bytes arrive from a client or an engine before it lets itself block: a wake-up that
#: comes within the window finds the loop running (no switch, caches warm); the spinning is CPU
#: the process pays. Does a wake-up cost more than the wait it replaces?
SPINNING = r"""
import os as _os, time as _time
_S = float(_os.environ["PDLB_BENCH_SPIN_US"]) * 1e-6
_pc = _time.perf_counter
_st = [0.0, False, None]  # last bytes in, spinning, loop
def _spin():
    if _pc() - _st[0] < _S:
        _st[2].call_soon(_spin)
    else:
        _st[1] = False
def _kick():
    _st[0] = _pc()
    if not _st[1]:
        _st[1] = True
        if _st[2] is None:
            import asyncio
            _st[2] = asyncio.get_running_loop()
        _st[2].call_soon(_spin)
def _kicking(cls):
    orig = cls.data_received
    def data_received(self, data):
        _kick()
        return orig(self, data)
    cls.data_received = data_received
import balancer.service.lean_front as _lf, balancer.service.upstream as _up
_kicking(_lf.LeanProtocol)
_kicking(_up._Connection)
"""
_RUN_PDLB = "import sys\nfrom pdlb_cli.main import main\nsys.exit(main(sys.argv[1:]))\n"

#: the loop counters in print order, with their labels
LOOP_KEYS = (("_run_once", "loop passes"), ("select may block", "passes that may block"), ("events", "I/O events"),
             ("create_task", "Tasks"), ("create_future", "futures"), ("call_soon", "call_soon"),
             ("call_at", "call_at (timers)"), ("call_soon_threadsafe", "call_soon_threadsafe"),
             ("gc0", "gc gen 0"), ("gc1", "gc gen 1"), ("gc2", "gc gen 2"))

#: the calibration process: sleeps until each tick of RATE (0: back to back) and does WORK, N times;
#: prints CPU us per iteration
_CALIBRATE = r"""
import os, sys, time
rate, work, n = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
heap = [{"k": i, "v": str(i)} for i in range(200_000)] if work == "heap" else None
idx = [(i * 7919) % 200_000 for i in range(300)]
def tight():
    s = 0
    for i in range(300):
        s += i * i
    return s
def walk():
    s = 0
    for i in idx:
        s += heap[i]["k"]
    return s
fn = walk if work == "heap" else tight
for _ in range(200):
    fn()
c0, t0 = time.process_time(), time.monotonic()
for k in range(n):
    if rate:
        w = t0 + k / rate - time.monotonic()
        if w > 0:
            time.sleep(w)
    fn()
print((time.process_time() - c0) / n * 1e6)
"""


def tree_times(pid: int) -> tuple[int, int, int, int]:
    """``(user ticks, system ticks, voluntary, involuntary context switches)`` summed over ``pid``'s
    process tree (every thread of each process; ticks of ``os.sysconf('SC_CLK_TCK')``)."""
    ut = st = vol = nonvol = 0
    for p in rpr._tree(pid):
        f = ro._stat(p)
        if f is None:
            continue
        ut, st = ut + int(f[11]), st + int(f[12])  # stat fields 14, 15 (utime, stime), counted after the name
        for text in rpr.task_status_texts(p):
            v, n = switches(text)
            vol, nonvol = vol + v, nonvol + n
    return ut, st, vol, nonvol


def switches(status_text: str) -> tuple[int, int]:
    """``(voluntary, involuntary)`` context switches from a ``/proc/.../status`` text."""
    vol = nonvol = 0
    for line in status_text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            nonvol = int(line.split()[1])
    return vol, nonvol


def per_request(before: tuple[int, int, int, int], after: tuple[int, int, int, int], done: int,
                hz: float) -> dict[str, float]:
    """The window's figures per answered request: ``cpu_us``, ``user_us``, ``sys_us`` (ticks of
    ``1/hz`` s), ``wakeups`` (voluntary switches), ``preempted`` (involuntary); nan when none
    was answered."""
    if done <= 0:
        return {k: math.nan for k in ("cpu_us", "user_us", "sys_us", "wakeups", "preempted")}
    d = [a - b for a, b in zip(after, before)]
    user_us, sys_us = d[0] / hz / done * 1e6, d[1] / hz / done * 1e6
    return {"cpu_us": user_us + sys_us, "user_us": user_us, "sys_us": sys_us, "wakeups": d[2] / done,
            "preempted": d[3] / done}


def parse_strace_c(text: str) -> dict[str, int]:
    """System calls by name from ``strace -c`` output (its ``calls`` column; the total row left out)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        f = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(f) >= 5 and f[-1] != "total" and f[3].isdigit():
            try:
                float(f[0])
            except ValueError:
                continue
            out[f[-1]] = out.get(f[-1], 0) + int(f[3])
    return out


def dso_group(dso: str) -> str:
    """A shared object's part of the process (``perf report --sort dso`` names)."""
    if "kernel" in dso or dso.startswith("[k"):
        return "kernel"
    for frag, name in (("libpython", "Python interpreter"), ("python3", "Python interpreter"),
                       ("uvloop", "event loop (uvloop)"), ("loop.cpython", "event loop (uvloop)"),
                       ("_asyncio", "asyncio (C)"), ("multiarray", "numpy"), ("numpy", "numpy"),
                       ("parser.cpython", "httptools"), ("httptools", "httptools"), ("_multidict", "multidict"),
                       ("_json", "json"), ("libc.so", "libc"), ("ld-linux", "libc")):
        if frag in dso:
            return name
    return "other"


def parse_perf_dso(text: str) -> dict[str, float]:
    """Percent of samples by :func:`dso_group` from ``perf report --sort dso --stdio`` output."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        f = line.split(None, 1)
        if len(f) == 2 and f[0].endswith("%") and not line.lstrip().startswith("#"):
            try:
                pct = float(f[0][:-1])
            except ValueError:
                continue
            g = dso_group(f[1].strip())
            out[g] = out.get(g, 0.0) + pct
    return out


def parse_counts(text: str) -> Counter:
    """The counter file ``_COUNTER`` writes: ``name<TAB>count`` lines."""
    c: Counter = Counter()
    for line in text.splitlines():
        if "\t" in line:
            k, v = line.rsplit("\t", 1)
            c[k] = int(v)
    return c


def _start_router(mode: str, engines: list[Proc], args: argparse.Namespace, counts_file: str | None = None,
                  spin_us: float | None = None) -> Proc:
    a = ro._pdlb_args(mode, engines, 1)
    tree = args.tree or Path(__file__).resolve().parents[1]
    if spin_us is not None:
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        env["PDLB_BENCH_SPIN_US"] = str(spin_us)
        with ro._affinity(args.router_cpus):
            popen = subprocess.Popen([sys.executable, "-c", SPINNING + _RUN_PDLB, *a], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, cwd=str(tree))
            return _spawn(a, popen=popen)
    if counts_file is None and args.tree is None:
        with ro._affinity(args.router_cpus):
            return _spawn(a, timeout_s=120)
    if counts_file is None:
        with ro._affinity(args.router_cpus):
            return ro._spawn_pdlb_from(args.tree, a)
    a = [*a, "--event-loop", "asyncio"]
    tree = args.tree or Path(__file__).resolve().parents[1]
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    env["PDLB_BENCH_COUNTS"] = counts_file
    with ro._affinity(args.router_cpus):
        popen = subprocess.Popen([sys.executable, "-c", _COUNTER, *a], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, cwd=str(tree))
        return _spawn(a, popen=popen)


def _read_counts(pid: int, path: str) -> Counter:
    if os.path.exists(path):
        os.unlink(path)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("the router did not write its loop counts")
        time.sleep(0.02)
    return parse_counts(Path(path).read_text())


def _drive_args(args: argparse.Namespace, rate: float) -> argparse.Namespace:
    return argparse.Namespace(rate=rate, load_processes=args.load_processes, connections=args.connections,
                              duration_s=args.duration_s, other_cpus=args.other_cpus)


async def _window(p: Proc, args: argparse.Namespace, rate: float) -> dict[str, float]:
    hz = os.sysconf("SC_CLK_TCK")
    before = tree_times(p.popen.pid)
    res = await rpr._drive(p, _drive_args(args, rate))
    return {**per_request(before, tree_times(p.popen.pid), res["done"], hz), "done": res["done"]}


async def run_mode(mode: str, args: argparse.Namespace) -> dict:
    n_eng = args.engines if mode == "regular" else args.pd_engines
    specs = [("mixed", "--zero-delay")] * n_eng if mode == "regular" else \
        [("prefill", "--zero-delay")] * n_eng + [("decode", "--zero-delay")] * n_eng
    procs: list[Proc] = []
    out: dict = {"rows": {str(r): [] for r in args.rates}}
    try:
        with ro._affinity(args.other_cpus):
            engines = spawn_engines(specs)
        procs += engines
        p = _start_router(mode, engines, args)
        procs.append(p)
        spinners: dict[str, Proc] = {}
        for us in args.spin_us:
            spinners[f"spin {us:g} us"] = q = _start_router(mode, engines, args, spin_us=us)
            procs.append(q)
            out[f"spin {us:g} us"] = {str(r): [] for r in args.rates}
        if args.other_cpus:
            os.sched_setaffinity(0, args.other_cpus)
        for q in (p, *spinners.values()):
            await ro._wait_ready(q.url, q.popen)
        print(f"\n== {mode}: one process, {args.connections} connections, {args.duration_s:g} s windows, "
              f"{args.rounds} round(s) ==")
        for q in (p, *spinners.values()):
            await rpr._drive(q, _drive_args(args, min(args.rates)))  # warm-up (connections, first-use costs)
        for r in range(args.rounds):
            order = args.rates if r % 2 == 0 else args.rates[::-1]
            for rate in order:
                routers = [("plain", p), *spinners.items()]
                for name, q in (routers if r % 2 == 0 else routers[::-1]):
                    row = await _window(q, args, rate)
                    (out["rows"] if name == "plain" else out[name])[str(rate)].append(row)
                    print(f"  round {r + 1}, {rate:g} req/s{'' if name == 'plain' else ', ' + name}: {row['cpu_us']:.0f} "
                          f"us/req (user {row['user_us']:.0f}, system {row['sys_us']:.0f}), {row['wakeups']:.2f} "
                          f"wake-ups/req, {row['done']} answered", flush=True)
        ro.stop_all([q.popen for q in spinners.values()])
        if args.strace:
            out["strace"] = await _strace_windows(p, args)
        if args.perf:
            out["perf"] = await _perf_windows(p, args)
        ro.stop_all([p.popen])
        if args.loop_counts:
            out["loop"] = await _loop_windows(mode, engines, args)
        return out
    finally:
        ro.stop_all([q.popen for q in procs])


async def _strace_windows(p: Proc, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for rate in args.rates:
            f = os.path.join(d, f"strace_{rate:g}.txt")
            tracer = subprocess.Popen(["strace", "-f", "-c", "-p", str(p.popen.pid), "-o", f], stderr=subprocess.DEVNULL,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus)) if args.other_cpus else None)
            time.sleep(0.5)  # attached
            res = await rpr._drive(p, _drive_args(args, rate))
            tracer.send_signal(signal.SIGINT)
            tracer.wait(10)
            calls = parse_strace_c(Path(f).read_text()) if os.path.exists(f) else {}
            n = max(1, res["done"])
            out[str(rate)] = {k: v / n for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}
    return out


async def _perf_windows(p: Proc, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    hz = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory() as d:
        for rate in args.rates:
            f = os.path.join(d, f"perf_{rate:g}.data")
            rec = subprocess.Popen([args.perf_bin, "record", "-e", "cpu-clock", "-F", "10000", "-p", str(p.popen.pid),
                                    "-o", f], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus)) if args.other_cpus else None)
            time.sleep(0.5)
            before = tree_times(p.popen.pid)
            res = await rpr._drive(p, _drive_args(args, rate))
            after = tree_times(p.popen.pid)
            rec.send_signal(signal.SIGINT)
            rec.wait(20)
            rep = subprocess.run([args.perf_bin, "report", "-i", f, "--no-children", "--sort", "dso", "--stdio"],
                                 capture_output=True, text=True, timeout=120)
            cpu_us = per_request(before, after, res["done"], hz)["cpu_us"]
            shares = parse_perf_dso(rep.stdout)
            out[str(rate)] = {"cpu_us": cpu_us, **{k: v / 100 * cpu_us for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}}
    return out


async def _loop_windows(mode: str, engines: list[Proc], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "counts.txt")
        p = _start_router(mode, engines, args, counts_file=path)
        try:
            await ro._wait_ready(p.url, p.popen)
            await rpr._drive(p, _drive_args(args, min(args.rates)))  # warm-up: connections opened
            for rate in args.rates:
                c0 = _read_counts(p.popen.pid, path)
                res = await rpr._drive(p, _drive_args(args, rate))
                c1 = _read_counts(p.popen.pid, path)
                n = max(1, res["done"] + args.connections)  # the client's warm-up requests count too
                out[str(rate)] = {k: (c1[k] - c0[k]) / n for k, _ in LOOP_KEYS}
            c0 = _read_counts(p.popen.pid, path)
            time.sleep(args.idle_s)
            c1 = _read_counts(p.popen.pid, path)
            out["idle per s"] = {k: (c1[k] - c0[k]) / args.idle_s for k, _ in LOOP_KEYS}
        finally:
            ro.stop_all([p.popen])
    return out


def calibrate(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """CPU us per iteration of the calibration process, per work kind and rate (0: back to back)."""
    out: dict[str, dict[str, float]] = {}
    for work in ("tight", "heap"):
        out[work] = {}
        for rate in [*args.rates, 0.0]:
            n = int(min(3000, max(300, rate * min(2.0, args.duration_s)))) if rate else 20_000
            with ro._affinity(args.router_cpus):
                r = subprocess.run([sys.executable, "-c", _CALIBRATE, str(rate), work, str(n)], capture_output=True,
                                   text=True, timeout=120)
            out[work][str(rate)] = float(r.stdout.strip()) if r.returncode == 0 else math.nan
    return out


def _summary(mode: str, res: dict, args: argparse.Namespace) -> None:
    rows = res["rows"]
    print(f"\n{mode}: {'offered req/s':>13} {'CPU us/req':>10} {'user':>6} {'system':>7} {'wake-ups':>9} "
          f"{'preempted':>9}   CPU per round")
    pts: dict[str, list[tuple[float, float]]] = {"cpu_us": [], "user_us": [], "sys_us": []}
    for rate in args.rates:
        rs = [r for r in rows[str(rate)] if r["done"] > 0]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("cpu_us", "user_us", "sys_us", "wakeups", "preempted")}
        print(f"{'':<{len(mode) + 1}} {rate:>13g} {med['cpu_us']:>10.0f} {med['user_us']:>6.0f} {med['sys_us']:>7.0f} "
              f"{med['wakeups']:>9.2f} {med['preempted']:>9.2f}   " + ", ".join(f"{r['cpu_us']:.0f}" for r in rs))
        for k in pts:
            pts[k] += [(r["wakeups"], r[k]) for r in rs]
    for k, label in (("cpu_us", "CPU"), ("user_us", "user"), ("sys_us", "system")):
        fit = rpr.wakeup_fit(pts[k])
        if fit is not None:
            print(f"{'':<{len(mode) + 1}} {label} us/req = {fit[0]:.0f} + {fit[1]:.0f} x wake-ups/req "
                  f"(least squares over {len(pts[k])} windows, r = {fit[2]:.2f})")
        elif k == "cpu_us":  # review5 U5: the line the help promises was left out without a word
            print(f"{'':<{len(mode) + 1}} no CPU = a + b x wake-ups line: it needs 3 or more answered windows with "
                  f"different wake-ups (here {len(pts[k])}; more --rates or --rounds)")
    for name in (k for k in res if k.startswith("spin ")):
        print(f"{'':<{len(mode) + 1}} {name} (experiment, not in pdlb): CPU us/req / the plain router's in the same round")
        for rate in args.rates:
            pairs = [(a["cpu_us"], b["cpu_us"]) for a, b in zip(res[name][str(rate)], rows[str(rate)])
                     if a["done"] > 0 and b["done"] > 0]
            if pairs:
                ratios = [a / b for a, b in pairs]
                print(f"{'':<{len(mode) + 3}} {rate:>11g} req/s: {statistics.median(a for a, _ in pairs):.0f} vs "
                      f"{statistics.median(b for _, b in pairs):.0f} us/req, {statistics.median(ratios):.2f}x ("
                      + ", ".join(f"{x:.2f}" for x in ratios) + "), wake-ups/req "
                      f"{statistics.median(r['wakeups'] for r in res[name][str(rate)]):.2f}")
    if "strace" in res:
        print(f"{'':<{len(mode) + 1}} system calls per request (strace -c -f, windows of their own):")
        for rate, calls in res["strace"].items():
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(calls.items())[:8])
            print(f"{'':<{len(mode) + 3}} {float(rate):g} req/s: total {sum(calls.values()):.2f}: {top}")
    if "perf" in res:
        print(f"{'':<{len(mode) + 1}} us of CPU per request by part (perf cpu-clock samples, windows of their own):")
        for rate, parts in res["perf"].items():
            top = ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if k != "cpu_us")
            print(f"{'':<{len(mode) + 3}} {float(rate):g} req/s ({parts['cpu_us']:.0f} us/req): {top}")
    if "loop" in res:
        print(f"{'':<{len(mode) + 1}} event-loop work per request (router on --event-loop asyncio, counting wrappers):")
        cols = list(res["loop"])
        print(f"{'':<{len(mode) + 3}} {'':<24}" + "".join(f"{(c if c.startswith('idle') else f'{float(c):g} req/s'):>14}"
                                                          for c in cols))
        for key, label in LOOP_KEYS:
            print(f"{'':<{len(mode) + 3}} {label:<24}" + "".join(f"{res['loop'][c][key]:>14.2f}" for c in cols))


def main() -> int:
    from pdlb_cli.arg_types import positive_float, positive_int
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.comma_lists import list_arg, one_of

    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--modes", default="regular", help="comma list of regular, pd, vllm-pd (default regular)")
    ap.add_argument("--rates", default="300,800,1500,6000",
                    help="comma list of offered requests/s (default 300,800,1500,6000; the last saturates one process here)")
    ap.add_argument("--connections", type=positive_int, default=32, help="client connections, all client processes together (default 32)")
    ap.add_argument("--duration-s", type=positive_float, default=3.0, help="seconds per window (default 3)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="rounds over the rates, order alternating (default 2)")
    ap.add_argument("--idle-s", type=positive_float, default=2.0, help="seconds of no load for --loop-counts' idle column (default 2)")
    ap.add_argument("--load-processes", type=positive_int, default=1, help="client processes sharing each rate (default 1)")
    ap.add_argument("--engines", type=positive_int, default=1, help="mixed engines in regular mode (default 1)")
    ap.add_argument("--pd-engines", type=positive_int, default=1, help="prefill and decode engines (N each) in PD modes (default 1)")
    ap.add_argument("--router-cpus", default="0", metavar="LIST", help="the router's CPUs (default 0)")
    ap.add_argument("--tree", type=Path, help="measure this checkout's pdlb instead of this one")
    ap.add_argument("--strace", action="store_true", help="also count system calls per request (strace on PATH)")
    ap.add_argument("--loop-counts", action="store_true", help="also count the event-loop work per request (standard loop)")
    ap.add_argument("--perf", action="store_true", help="also split the CPU by shared object (perf on PATH)")
    ap.add_argument("--calibrate", action="store_true", help="also measure the host's price of a wake-up for a bare Python process")
    ap.add_argument("--spin-us", default="", metavar="LIST",
                    help="experiment: also drive a router that polls this many us after bytes arrive before it blocks "
                         "(comma list, e.g. 50,200; default none)")
    ap.add_argument("--out", type=Path, help="write the raw figures as JSON here")
    # a timeout's SIGTERM ends the run through the finally blocks: the engines and routers stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = ap.parse_args()
    modes = list_arg(ap, "--modes", args.modes, "modes of regular, pd, vllm-pd", one_of(("regular", "pd", "vllm-pd")))
    args.rates = list_arg(ap, "--rates", args.rates, "offered rates > 0", positive_float)
    args.spin_us = list_arg(ap, "--spin-us", args.spin_us, "spin windows > 0 (us)", positive_float, empty_ok=True)
    if args.tree is not None and not ro.is_pdlb_checkout(args.tree):
        ap.error(f"--tree {args.tree}: not a pdlb checkout")
    for tool, flag in (("strace", args.strace), ("perf", args.perf)):
        if flag and shutil.which(tool) is None:
            ap.error(f"--{tool}: {tool} is not on PATH")
    args.perf_bin = shutil.which("perf")
    cpus = os.sched_getaffinity(0)
    args.router_cpus = ro._cpu_list(args.router_cpus, ap)
    args.other_cpus = (cpus - args.router_cpus) or None
    print(f"host: {os.cpu_count()} CPUs; router on {sorted(args.router_cpus)}; load and engines on "
          f"{sorted(args.other_cpus) if args.other_cpus else 'the same'}; Python {sys.version.split()[0]}")
    results: dict = {}
    for m in modes:  # each mode's summary as soon as it is measured (a run cut short keeps what it printed)
        results[m] = asyncio.run(run_mode(m, args))
        print("\n== summary (medians over rounds; per answered request) ==")
        _summary(m, results[m], args)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    if args.calibrate:
        results["calibrate"] = calibrate(args)
        cal = results["calibrate"]
        print("\nthe host's price of a wake-up, no pdlb (a Python process on the router's CPU: CPU us per iteration "
              "woken at each rate, and back to back; the difference is what the wake-up costs it):")
        for work, by_rate in cal.items():
            warm = by_rate["0.0"]
            print(f"  {work:<6} back to back {warm:.1f} us; " + ", ".join(
                f"{float(r):g}/s {v:.1f} (+{v - warm:.1f})" for r, v in by_rate.items() if r != "0.0"))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
