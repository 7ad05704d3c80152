"""Why 8 router processes cost more CPU per request than one (issue 26): the host's share, pdlb's share, placement, pinning.

On the 16-core GPU host (session 16, call 1) ``pdlb serve --processes 8`` costs 1.5-2.1x one process's CPU per request
in ``bench/router_overhead.py``'s closed loop (regular 370 vs 226 us, SGLang PD 768 vs 361, vLLM PD 667 vs 440). This
bench splits that, per mode, in ONE run, every figure a ratio of windows taken in the same run:

1. **the host** (``host`` phase): one pdlb process pinned to the first router CPU, CPU per request with the other router
   CPUs idle vs each running a busy loop (``--burner spin``: a pure-Python loop, the frequency / hypervisor share;
   ``mem``: a loop copying 8 MiB, also the shared L3 and memory bandwidth), at a fixed offered rate (open loop,
   ``--rate``) and in the closed loop at ``--max-concurrency`` (as router_overhead's throughput run); the same for
   vllm-router (``--vllm-router CMD``; regular and vLLM PD) at the fixed rate. If one process's figure rises by as much
   under burners as x8's over x1, the ratio is the host's, not pdlb's.
2. **pdlb's own** (fixed rate): x8 against x1 at the SAME offered rate (each x8 process gets 1/8 of the requests, so
   less work per event-loop wake-up), and in the closed loop (x8 saturated or engine-bound).
3. **placement** (``--connection-placement follow_load``, the default, vs ``round_robin``): in every closed-loop window
   of x8 a sampler records, every ``--sample-s``, each router process's CPU (``/proc``, so independent of pdlb's own
   accounting) and ``pdlb_router_processes_active`` (scraped from ``/metrics``); it prints the time line (processes
   above 10% of a core, the metric's k) and the CPU per request of the window's first and second half, and with
   ``--long-s`` one long window at ``--max-concurrency`` and one at ``--concurrency`` clients: does the placement settle
   inside a 2.5 s run, and what does it cost then?
4. **per-process pinning** (row ``x8 pin``): ``pdlb serve --processes 8 --pin-processes`` (each router process on its
   own CPU of the router set) when the tree has the option, else the bench pins each process's threads itself after
   start-up (printed which).

``--rows`` picks the optional rows (``rr``, ``pin``, ``burn``); ``--variant 'NAME=ARGS'`` adds a multi-process row
``x8 NAME`` with more ``pdlb serve`` arguments (e.g. ``'t0.9=--placement-target-util 0.9'``), measured in the closed
loop and the long windows beside ``x8``.

Routers on ``--router-cpus`` (0-7), engines and clients on the rest (as router_overhead). Each mode starts with a 1 s
warm-up of every router at once (upstream pools, the placement out of its start-up state); an x8 window then starts
with the placement where that router's previous window left it (b6's throughput run follows a 16-client latency run). A global ``--budget-s`` skips
windows that would not fit (printed). Run by hand::

    .venv/bin/python bench/router_cores.py --router-cpus 0 --engines 1 --pd-engines 1 --load-processes 1 \
        --rate 200 --duration-s 1 --repeat 1          # 2-core dry run (no burner CPUs: the host phase is skipped)
    python3 bench/router_cores.py --vllm-router /tmp/peers/vllm_router/bin/vllm-router   # 16-core host (bench/device/cores_b11.sh)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402
import router_processes_rate as rpr  # noqa: E402

from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402

_BURN = {
    "spin": "while True: pass",
    "mem": "a = bytearray(8 << 20)\nb = bytearray(8 << 20)\nwhile True: b[:] = a",
}

def _children(pid: int) -> list[int]:
    """The router processes of a ``pdlb serve`` parent (its spawned children, not multiprocessing's
    resource tracker), oldest first; [] for one process (it serves itself)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (f := ro._stat(int(d.name))) is not None and int(f[1]) == pid:
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"resource_tracker" not in cmd:
                out.append(int(d.name))
    return sorted(out)


def _own_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s threads from ``/proc/PID/task/*/schedstat`` (ns: finer than the
    100 Hz ticks of ``stat`` for 0.1 s samples); nan when it is gone."""
    total = 0
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        return float("nan")
    return total / 1e9


def _pin_threads(pid: int, cpu: int) -> None:
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(t), {cpu})
        except OSError:
            pass


def _scrape(url: str) -> tuple[float, float]:
    """``pdlb_router_processes_active`` and the sum of ``pdlb_connections_given_back_total`` over
    its reasons from ``url``'s ``/metrics`` (nan for what is not there)."""
    k, given = float("nan"), float("nan")
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=0.5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("pdlb_router_processes_active"):
                    k = float(line.split()[-1])
                elif line.startswith("pdlb_connections_given_back_total"):
                    given = (0.0 if math.isnan(given) else given) + float(line.split()[-1])
    except (OSError, ValueError):
        pass
    return k, given


def _pinned(cpu: int):  # noqa: ANN202
    return lambda: os.sched_setaffinity(0, {cpu})


class Burners:
    """Busy loops pinned one per CPU of ``cpus`` (``kind``: a key of :data:`_BURN`), while inside."""

    def __init__(self, cpus: list[int], kind: str) -> None:
        self.cpus, self.kind = cpus, kind
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Burners":
        for c in self.cpus:
            self.procs.append(subprocess.Popen([sys.executable, "-c", _BURN[self.kind]],
                                               preexec_fn=_pinned(c)))
        time.sleep(0.3)  # running before the window starts
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


async def _sampler(pid: int, url: str | None, every_s: float, stop: asyncio.Event, line: list, given: list) -> None:
    """Appends (t, [CPU s of each router process], active k) to ``line`` and the connections given
    back so far to ``given`` every ``every_s`` until ``stop``."""
    kids = _children(pid) or [pid]
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        k, g = await loop.run_in_executor(None, _scrape, url) if url else (float("nan"), float("nan"))
        line.append((time.monotonic() - t0, [_own_cpu_s(p) for p in kids], k))
        given.append(g)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def _closed(proc: Proc, args: argparse.Namespace, clients: int, duration_s: float, sample: bool) -> dict:
    """One closed-loop window: req/s, CPU us/req (whole tree, from just before the clients start),
    p50/p99, per-half CPU us/req and the sampler's time line."""
    start_at = time.time() + 1.5
    procs = max(1, min(args.load_processes, clients))
    per = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    kids = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", ro._CLIENT, proc.url, str(c), str(start_at), str(duration_s), ro._BODY_JSON,
        str(args.sample_s), stdout=subprocess.PIPE,
        preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus)) if args.other_cpus else None)
        for c in per if c > 0]
    await asyncio.sleep(max(0.0, start_at - time.time() - 0.05))
    line: list = []
    given: list = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(_sampler(proc.popen.pid, proc.url, args.sample_s, stop, line, given)) if sample else None
    cpu0 = ro._cpu_s(proc.popen.pid)
    outs = [json.loads((await k.communicate())[0]) for k in kids]
    cpu1 = ro._cpu_s(proc.popen.pid)
    stop.set()
    if task:
        await task
    lat = sorted(x for o in outs for x in o["lat"])
    bins = [sum(o["bins"][i] for o in outs) for i in range(len(outs[0]["bins"]))]
    errors = sum(o["errors"] for o in outs)
    if errors:
        print(f"  warning: {errors} failed requests to {proc.url}")
    n = max(1, len(lat))
    res = {"rps": len(lat) / duration_s, "cpu_us": (cpu1 - cpu0) / n * 1e6,
           "p50_ms": lat[len(lat) // 2] * 1e3 if lat else math.nan,
           "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else math.nan,
           "bins": bins, "line": line,
           # connections given back (follow_load) per 1,000 answered requests during the window
           "given_back_per_1k": (given[-1] - given[0]) / n * 1e3 if len(given) > 1 else math.nan}
    if line and len(line) > 2:
        res.update(_halves(line, bins, args.sample_s, duration_s))
        # the router processes' own CPU over the sampled span; the rest of cpu_us is the parent's
        # (accepting and handing on connections, the supervision pass) and the resource tracker's
        res["children_cpu_us"] = sum(y - x for x, y in zip(line[0][1], line[-1][1])) / n * 1e6
    return res


def _halves(line: list, bins: list[int], bin_s: float, duration_s: float) -> dict:
    """CPU us/req of the routers' processes (parent excluded) in the first and second half of the
    window, k over time (processes above 10% of a core per sample; the metric's value)."""
    half = duration_s / 2
    def at(t: float) -> tuple[float, list[float]]:
        return min(line, key=lambda x: abs(x[0] - t))[:2]
    def cpu(a: float, b: float) -> float:
        (ta, ca), (tb, cb) = at(a), at(b)
        return sum(y - x for x, y in zip(ca, cb))
    n1 = sum(bins[:int(half / bin_s)])
    n2 = sum(bins[int(half / bin_s):int(duration_s / bin_s)])
    busy = []
    for (t0, c0, _), (t1, c1, k) in zip(line, line[1:]):
        dt = max(1e-9, t1 - t0)
        busy.append((round(t1, 2), sum(1 for x, y in zip(c0, c1) if (y - x) / dt > 0.10), k,
                     [round((y - x) / dt, 2) for x, y in zip(c0, c1)]))
    return {"cpu_us_first_half": cpu(0, half) / max(1, n1) * 1e6, "cpu_us_second_half": cpu(half, duration_s) / max(1, n2) * 1e6,
            "busy": busy}


async def _fixed(proc: Proc, args: argparse.Namespace) -> dict:
    r = await rpr._drive(proc, argparse.Namespace(rate=args.rate, load_processes=args.load_processes,
                                                  connections=args.connections, duration_s=args.duration_s,
                                                  other_cpus=args.other_cpus))
    return r


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def fits(self, need_s: float, what: str) -> bool:
        if time.monotonic() + need_s <= self.end:
            return True
        print(f"  skipped (budget): {what}")
        return False


def _has_pin_option() -> bool:
    from balancer.service.config import ServiceConfig
    return "pin_processes" in ServiceConfig.model_fields


async def run_mode(mode: str, args: argparse.Namespace, budget: Budget) -> dict:
    n_eng = args.engines if mode == "regular" else args.pd_engines
    specs = [("mixed", "--zero-delay")] * n_eng if mode == "regular" else \
        [("prefill", "--zero-delay")] * n_eng + [("decode", "--zero-delay")] * n_eng
    procs: list[Proc] = []
    peer_procs: list[subprocess.Popen] = []
    routers: dict[str, Proc] = {}
    first = {min(args.router_cpus)} if args.router_cpus else None
    n = args.processes
    res: dict = {"host": {}, "closed": {}, "long": {}}
    try:
        with ro._affinity(args.other_cpus):
            engines = spawn_engines(specs)
        procs += engines
        with ro._affinity(first):
            routers["x1@0"] = _spawn(ro._pdlb_args(mode, engines, 1), timeout_s=120)
            if args.vllm_router and mode in ("regular", "vllm-pd") and mode in args.host_modes:  # only measured there
                try:
                    p, url = ro._start_peer(ro.PEERS["vllm-router"], mode, engines, args.vllm_router)
                except OSError as e:
                    print(f"  vllm-router@0 unavailable: {e}; skipping it")
                else:
                    peer_procs.append(p)
                    routers["vllm-router@0"] = Proc(p, int(url.rsplit(":", 1)[1]))
        with ro._affinity(args.router_cpus):
            base = ro._pdlb_args(mode, engines, n)
            routers[f"x{n}"] = _spawn(base, timeout_s=120)
            if "rr" in args.rows:
                routers[f"x{n} rr"] = _spawn([*base, "--connection-placement", "round_robin"], timeout_s=120)
            if "pin" in args.rows:
                routers[f"x{n} pin"] = _spawn([*base, "--pin-processes"] if args.pin_option else base, timeout_s=120)
            for vname, vargs in args.variant:
                routers[f"x{n} {vname}"] = _spawn([*base, *vargs], timeout_s=120)
        procs += [p for k, p in routers.items() if not k.startswith("vllm")]
        if args.other_cpus:
            os.sched_setaffinity(0, args.other_cpus)
        for name, rp in list(routers.items()):
            try:
                await ro._wait_ready(rp.url, rp.popen, timeout_s=60 if name.startswith("vllm") else 180)
            except RuntimeError as e:
                if not name.startswith("vllm"):
                    raise
                print(f"  {name} unavailable: {e} (see /tmp/pdlb-bench-vllm-router-{mode}.log); skipping it")
                del routers[name]
        if f"x{n} pin" in routers:
            if not args.pin_option and args.router_cpus:
                cpus = sorted(args.router_cpus)
                for i, kid in enumerate(_children(routers[f"x{n} pin"].popen.pid)):
                    _pin_threads(kid, cpus[i % len(cpus)])
            pin_kids = _children(routers[f"x{n} pin"].popen.pid)
            print(f"  x{n} pin: the router processes' CPU sets (main thread): "
                  + " ".join(str(sorted(os.sched_getaffinity(k))) for k in pin_kids), flush=True)
        multi = [k for k in routers if k.startswith(f"x{n}")]  # the multi-process rows, x{n} first
        # warm-up, every router at once (1 s closed loop at --max-concurrency): upstream pools open, the
        # placement out of its start-up state, so that no row's first window pays for that alone
        await asyncio.gather(*(_closed(rp, args, args.max_concurrency, 1.0, False) for rp in routers.values()))
        print(f"\n== {mode}: routers {', '.join(routers)} ==", flush=True)
        burn_cpus = sorted(args.router_cpus - first) if args.router_cpus and len(args.router_cpus) > 1 else []
        host_rows = [k for k in routers if k.endswith("@0")]
        conds = ["none", *([b for b in args.burner] if burn_cpus and "burn" in args.rows else [])]
        win_fixed = args.duration_s + 2.6
        win_closed = args.duration_s + 2.0
        async def windows(phase: str, items: list[tuple[str, str]], r: int, win_s: float, drive) -> None:  # noqa: ANN001
            """Each (row, condition) of ``items`` once (reversed on odd repeats), appended to ``res[phase]``;
            condition "none", a burner kind (on every burner CPU) or "KIND@CPU" (one burner)."""
            for k, c in (items[::-1] if r % 2 else items):
                key = f"{k} {c}" if c != "none" else k
                if not budget.fits(win_s, f"{mode} {phase} {key} repeat {r + 1}"):
                    continue
                if c == "none":
                    out = await drive(k, True)
                else:
                    kind, _, at = c.partition("@")
                    with Burners([int(at)] if at else burn_cpus, kind):
                        out = await drive(k, False)
                res[phase].setdefault(key, []).append(out)

        async def fixed(k: str, _: bool) -> dict:
            return await _fixed(routers[k], args)

        async def closed(k: str, plain: bool) -> dict:  # the sampler on the multi-process rows' plain windows
            return await _closed(routers[k], args, args.max_concurrency, args.duration_s, plain and k in multi)

        for r in range(args.repeat):
            # 1. fixed rate: x1@0 / vllm-router@0 without and with burners; x8 and its variants at the same rate;
            # the topology probe (x1@0 with ONE busy loop, on each CPU of --probe-cpus in turn)
            if mode in args.host_modes:
                await windows("host", [(k, c) for k in host_rows for c in conds] + [(k, "none") for k in multi
                                                                                    if k == f"x{n}" or k[len(f"x{n} "):]
                                                                                    in dict(args.variant)]
                              + [("x1@0", f"spin@{j}") for j in args.probe_cpus], r, win_fixed, fixed)
                print(f"  repeat {r + 1} fixed {args.rate:g} req/s: " + ", ".join(
                    f"{k} {v[-1]['cpu_us']:.0f}" for k, v in res["host"].items() if len(v) == r + 1) + " us/req", flush=True)
            # 2. closed loop at --max-concurrency: x1@0 (+ burners), the multi-process rows
            await windows("closed", [("x1@0", "none"), *([("x1@0", args.burner[0])] if burn_cpus and "burn" in args.rows
                                                         else []), *[(k, "none") for k in multi]], r, win_closed, closed)
            print(f"  repeat {r + 1} closed {args.max_concurrency}: " + ", ".join(
                f"{k} {v[-1]['rps']:.0f} req/s {v[-1]['cpu_us']:.0f} us/req" for k, v in res["closed"].items()
                if len(v) == r + 1), flush=True)
        # 3. long windows: does follow_load settle?
        if args.long_s > 0 and mode in args.long_modes:
            for clients in (args.max_concurrency, args.concurrency):
                for k in [f"x{n}", *[f"x{n} {v}" for v, _ in args.variant]]:
                    if budget.fits(args.long_s + 2.0, f"{mode} long {k} at {clients}"):
                        res["long"][f"{k} c{clients}"] = await _closed(routers[k], args, clients, args.long_s, True)
        return res
    finally:
        ro.stop_all([*peer_procs, *(q.popen for q in procs)])


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def _ratio_line(rows: dict, a: str, b: str, field: str = "cpu_us") -> str:
    if a not in rows or b not in rows:
        return "n/a"
    per = [x[field] / y[field] for x, y in zip(rows[a], rows[b]) if y[field] > 0]
    return f"{_med(per):.2f}x (per repeat {', '.join(f'{p:.2f}' for p in per)})" if per else "n/a"


def summary(mode: str, res: dict, args: argparse.Namespace) -> None:
    n = args.processes
    print(f"\n{mode}:")
    if res["host"]:
        h = res["host"]
        print(f"  fixed {args.rate:g} req/s, CPU us/req (median): " + ", ".join(f"{k} {_med([x['cpu_us'] for x in v]):.0f}"
                                                                          for k, v in h.items()))
        print(f"    wake-ups/req: " + ", ".join(f"{k} {_med([x['wakeups'] for x in v]):.2f}" for k, v in h.items()))
        for b in args.burner:
            print(f"    HOST x1@0 with {b} burners / without: {_ratio_line(h, f'x1@0 {b}', 'x1@0')}")
            print(f"    HOST vllm-router@0 with {b} burners / without: {_ratio_line(h, f'vllm-router@0 {b}', 'vllm-router@0')}")
        print(f"    PDLB x{n} / x1@0 at equal load: {_ratio_line(h, f'x{n}', 'x1@0')}")
        for v, _ in args.variant:
            print(f"    x{n} {v} / x1@0 at equal load: {_ratio_line(h, f'x{n} {v}', 'x1@0')}; "
                  f"/ x{n}: {_ratio_line(h, f'x{n} {v}', f'x{n}')}")
        for j in args.probe_cpus:
            print(f"    PROBE x1@0 with one busy loop on CPU {j} / without: {_ratio_line(h, f'x1@0 spin@{j}', 'x1@0')}")
    c = res["closed"]
    if c:
        print(f"  closed loop at {args.max_concurrency}: " + ", ".join(
            f"{k} {_med([x['rps'] for x in v]):.0f} req/s {_med([x['cpu_us'] for x in v]):.0f} us/req p99 {_med([x['p99_ms'] for x in v]):.1f} ms"
            for k, v in c.items()))
        b = args.burner[0]
        print(f"    HOST x1@0 with {b} burners / without (closed): {_ratio_line(c, f'x1@0 {b}', 'x1@0')}")
        multi = [k for k in c if k.startswith(f"x{n}")]
        for k in multi:
            print(f"    {k} / x1@0 CPU/req: {_ratio_line(c, k, 'x1@0')}; req/s: {_ratio_line(c, k, 'x1@0', 'rps')}")
        for k in multi[1:]:
            print(f"    {k} / x{n} CPU/req: {_ratio_line(c, k, f'x{n}')}; req/s: {_ratio_line(c, k, f'x{n}', 'rps')}; "
                  f"p99: {_ratio_line(c, k, f'x{n}', 'p99_ms')}")
        for k, v in c.items():
            if v and "cpu_us_first_half" in v[0]:
                print(f"    {k}: children's CPU us/req first half {_med([x['cpu_us_first_half'] for x in v]):.0f}, "
                      f"second half {_med([x['cpu_us_second_half'] for x in v]):.0f}; the rest (parent) "
                      f"{_med([x['cpu_us'] - x['children_cpu_us'] for x in v]):.0f}; connections given back per 1k "
                      f"requests {_med([x['given_back_per_1k'] for x in v]):.1f}; busy processes (>10% core) / "
                      f"k over time (repeat 1): " + " ".join(f"{t:g}s:{nb}/{kk:g}" for t, nb, kk, _ in v[0]["busy"][::2]))
    for k, v in res["long"].items():
        print(f"  long {args.long_s:g} s {k}: {v['rps']:.0f} req/s, {v['cpu_us']:.0f} us/req, p99 {v['p99_ms']:.1f} ms; "
              f"children's CPU us/req first half {v.get('cpu_us_first_half', math.nan):.0f}, second "
              f"{v.get('cpu_us_second_half', math.nan):.0f}; connections given back per 1k requests "
              f"{v.get('given_back_per_1k', math.nan):.1f}")
        print("    busy/k, per-process cores: " + " | ".join(f"{t:g}s {nb}/{kk:g} {cs}" for t, nb, kk, cs in v.get("busy", [])[::4]))


def main() -> int:
    from pdlb_cli.args import ArgumentParser
    from pdlb_cli.comma_lists import list_arg, one_of

    from pdlb_cli.arg_types import nonnegative_float, positive_float, positive_int
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--modes", default="pd,regular,vllm-pd", help="comma list of regular, pd, vllm-pd (default all, PD first)")
    ap.add_argument("--host-modes", default="regular,pd", help="modes with the fixed-rate host phase (default regular,pd)")
    ap.add_argument("--long-modes", default="pd,regular", help="modes with the long windows (default pd,regular)")
    ap.add_argument("--processes", type=positive_int, default=8, help="router processes of the multi-process rows (default 8)")
    ap.add_argument("--rate", type=positive_float, default=1500.0, help="offered req/s in the fixed-rate windows (default 1500)")
    ap.add_argument("--connections", type=positive_int, default=128, help="client connections in the fixed-rate windows (default 128)")
    ap.add_argument("--duration-s", type=positive_float, default=2.5, help="seconds per window (default 2.5, as b6)")
    ap.add_argument("--long-s", type=nonnegative_float, default=8.0, help="seconds of the long windows; 0: none (default 8)")
    ap.add_argument("--sample-s", type=positive_float, default=0.1, help="sampler interval (default 0.1)")
    ap.add_argument("--repeat", type=positive_int, default=2, help="interleaved repeats (default 2)")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="clients of the low-load long window (default 16)")
    ap.add_argument("--max-concurrency", type=positive_int, default=256, help="closed-loop clients (default 256)")
    ap.add_argument("--load-processes", type=positive_int, default=4, help="client processes (default 4)")
    ap.add_argument("--engines", type=positive_int, default=4, help="mixed engines, regular mode (default 4)")
    ap.add_argument("--pd-engines", type=positive_int, default=2, help="prefill and decode engines each, PD modes (default 2)")
    ap.add_argument("--router-cpus", default="0-7", help="routers' CPUs (default 0-7); the first one holds the @0 rows")
    ap.add_argument("--burner", default="spin", help="comma list of spin, mem (default spin; the first is used closed-loop)")
    ap.add_argument("--probe-cpus", default="", help="CPUs for the topology probe: x1@0 at the fixed rate with one busy "
                    "loop on each in turn (host modes; default none), e.g. 1-15: which CPUs share CPU 0's core")
    ap.add_argument("--rows", default="rr,pin,burn", help="optional rows: rr (x8 round_robin placement), pin (x8 pinned), "
                    "burn (x1@0 with busy loops, fixed rate and closed loop) (default all; '' none)")
    ro.add_variant_arg(ap)  # here: a row "x8 NAME", the multi-process row with ARGS added
    ap.add_argument("--vllm-router", default=None, metavar="CMD", help="vllm-router's command (default or 'none': no peer row)")
    ap.add_argument("--budget-s", type=positive_float, default=1e9, help="skip windows that would end after this (default none)")
    ap.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = ap.parse_args()
    modes = list_arg(ap, "--modes", args.modes, "modes", one_of(("regular", "pd", "vllm-pd")))
    args.host_modes = list_arg(ap, "--host-modes", args.host_modes, "modes", one_of(("regular", "pd", "vllm-pd")))
    args.long_modes = list_arg(ap, "--long-modes", args.long_modes, "modes", one_of(("regular", "pd", "vllm-pd")))
    args.burner = list_arg(ap, "--burner", args.burner, "burners", one_of(tuple(_BURN)))
    args.rows = list_arg(ap, "--rows", args.rows, "rows", one_of(("rr", "pin", "burn"))) if args.rows else []
    args.variant = ro.parse_variants(ap, args.variant)
    args.vllm_router = shlex.split(args.vllm_router) if args.vllm_router and args.vllm_router != "none" else None
    for name in ("rate", "duration_s", "sample_s", "budget_s"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number")
    if args.processes < 2 or args.repeat < 1 or args.long_s < 0:
        ap.error("--processes must be >= 2, --repeat >= 1, --long-s >= 0")
    cpus = os.sched_getaffinity(0)
    args.router_cpus = ro._cpu_list(args.router_cpus, ap)
    args.probe_cpus = sorted(ro._cpu_list(args.probe_cpus, ap) - {min(args.router_cpus)}) if args.probe_cpus else []
    args.other_cpus = (cpus - args.router_cpus) or None
    args.pin_option = _has_pin_option()
    budget = Budget(args.budget_s)
    print(f"host: {os.cpu_count()} CPUs; routers on {sorted(args.router_cpus)}, @0 rows on CPU {min(args.router_cpus)}; "
          f"load and engines on {sorted(args.other_cpus) if args.other_cpus else 'any'}; x{args.processes} pin: "
          f"{'pdlb serve --pin-processes' if args.pin_option else 'pinned by this bench (no --pin-processes in this tree)'}",
          flush=True)
    results = {}
    for m in modes:
        if budget.fits(15, f"mode {m}"):
            results[m] = asyncio.run(run_mode(m, args, budget))
    print("\n== summary (medians over repeats; ratios per repeat, then their median) ==")
    for m, res in results.items():
        summary(m, res, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
