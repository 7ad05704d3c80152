"""Why several pdlb processes cost more CPU per request than one: controls that separate the
host's scaling from pdlb's shared state, in one run.

Run by hand (on a host with at least 4 CPUs; ``--router-cpus`` as in ``router_overhead.py``)::

    .venv/bin/python bench/router_scaling.py --router-cpus 0-7 --engines 4 --pd-engines 2
    .venv/bin/python bench/router_scaling.py --router-cpus 0-1 --duration-s 1 --rounds 1   # dry run

Phases (engines and client processes on the CPUs outside ``--router-cpus``, routers inside):

* **probe**: a fixed pure-Python loop timed on one router CPU alone, next to one spinner on each
  other CPU in turn (a CPU whose spinner slows it is a sibling of the same physical core, or
  shares its clock), on all router CPUs at once and on every CPU; CPU MHz from ``/proc/cpuinfo``
  and ``cpufreq`` where readable; steal time from ``/proc/stat`` throughout;
* **regular** (mixed engines, ``--max-concurrency`` connections from ``--load-processes``
  clients): CPU per request of one pdlb process; of one process given only its share of the
  connections; of one process pinned to one CPU with spinners on the other router CPUs (and on
  its sibling, if the probe found one); of ``pdlb serve`` with one process per router CPU (shared
  load block and decision rings), with asyncio and with uvloop; of as many *independent*
  one-process ``pdlb serve`` (own port, nothing shared), each driven by its share of the clients;
  of sglang-router with one CPU (one tokio worker) and with all router CPUs; py-spy profiles
  (``--py-spy PATH``) of the single process and of one of the several, collapsed to a table of
  functions and to code areas in microseconds per request;
* **pd** (SGLang PD protocol): latency at ``--concurrency`` of the direct engine, one process per
  router CPU, the independent processes, one process given two connections, uvloop and
  sglang-router, with the tail described (p90/p99/p99.9, how many of the slowest 1% fell within
  the same 10 ms as another, which connection they came from);
* **ablate** (not in the default phases): regular mode, one process and one per router CPU
  as shipped (both profiled), then with the peer-load read, the decision rings, or both switched
  off by bench-only patches (``bench/ablate/sitecustomize.py``), and as many independent routers.

Everything is printed; ``--out DIR`` also writes ``scaling.json`` and the raw py-spy files.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402

from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None
"""Whether ``pdlb serve --event-loop uvloop`` can run here (the uvloop rows are left out, with a
note, where it cannot: the optional package is not installed)."""

# ---------------------------------------------------------------------- host readings
_PROBE = r"""
import os, sys, time
cpu, start_at, dur, kind = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
os.sched_setaffinity(0, {cpu})
if kind == "mem":
    import random
    data = list(range(400_000)); order = list(range(400_000)); random.Random(cpu).shuffle(order)
def chunk():
    if kind == "mem":
        s = 0
        for i in order[:20000]:
            s += data[i]
        return s
    d = {}
    for i in range(2000):
        d[i & 63] = d.get(i & 63, 0) + i * 3 // 7
    return d
time.sleep(max(0.0, start_at - time.time()))
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < dur:
    chunk(); n += 1
print(n / (time.perf_counter() - t0))
"""

_SPIN = "import os,sys\nos.sched_setaffinity(0,{int(sys.argv[1])})\nwhile True: pass\n"


def _proc_stat() -> dict[int, list[int]]:
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = line.split()
            out[int(f[0][3:])] = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
    return out


def _stat_delta(a: dict[int, list[int]], b: dict[int, list[int]], cpus: set[int]) -> dict[str, float]:
    """Mean busy and steal fraction over ``cpus`` between two /proc/stat readings."""
    busy, steal, n = 0.0, 0.0, 0
    for c in cpus:
        if c not in a or c not in b:
            continue
        d = [y - x for x, y in zip(a[c], b[c])]
        tot = sum(d) or 1
        busy += (tot - d[3] - d[4] - d[7]) / tot
        steal += d[7] / tot
        n += 1
    return {"busy": busy / max(1, n), "steal": steal / max(1, n)}


def _mhz() -> dict[int, float]:
    out: dict[int, float] = {}
    for c in range(os.cpu_count() or 1):
        try:
            out[c] = int(Path(f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq").read_text()) / 1e3
        except (OSError, ValueError):
            pass
    if out:
        return out
    try:
        cpu = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("processor"):
                cpu = int(line.split(":")[1])
            elif line.startswith("cpu MHz") and cpu is not None:
                out[cpu] = float(line.split(":")[1])
    except OSError:
        pass
    return out


class HostWindow:
    """/proc/stat and MHz over a phase: ``with HostWindow(args) as w: ...``; ``w.result``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.mhz, self._stop = args, [], threading.Event()

    def __enter__(self) -> "HostWindow":
        self.s0 = _proc_stat()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.mhz.append(_mhz())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        s1 = _proc_stat()
        rc, oc = self.args.router_cpus, self.args.other_cpus
        self.result = {"router_cpus": _stat_delta(self.s0, s1, rc), "other_cpus": _stat_delta(self.s0, s1, oc)}
        for name, cpus in (("router_mhz", rc), ("other_mhz", oc)):
            vals = [m[c] for m in self.mhz for c in cpus if c in m]
            self.result[name] = round(statistics.mean(vals)) if vals else None


def _fmt_host(h: dict) -> str:
    r, o = h["router_cpus"], h["other_cpus"]
    mhz = f", MHz {h['router_mhz']}/{h['other_mhz']}" if h.get("router_mhz") else ""
    return (f"busy router CPUs {r['busy']:.0%} (steal {r['steal']:.1%}), other CPUs {o['busy']:.0%} "
            f"(steal {o['steal']:.1%}){mhz}")


async def _probe_rates(cpus_kinds: list[tuple[int, str]], dur: float) -> list[float]:
    start_at = time.time() + 0.8
    kids = [await asyncio.create_subprocess_exec(sys.executable, "-c", _PROBE, str(c), str(start_at), str(dur), k,
                                                 stdout=subprocess.PIPE) for c, k in cpus_kinds]
    return [float((await k.communicate())[0]) for k in kids]


async def probe(args: argparse.Namespace) -> dict:
    """Fixed-work loop rates: alone, beside each other CPU, on all router CPUs, on all CPUs."""
    rc = sorted(args.router_cpus)
    allc = sorted(args.router_cpus | args.other_cpus)
    c0, dur = rc[0], args.probe_s
    out: dict = {"cpu": c0}
    for kind in ("alu", "mem"):
        alone = statistics.median([(await _probe_rates([(c0, kind)], dur))[0] for _ in range(3)])
        res = {"alone": alone}
        if kind == "alu":
            beside = {}
            for c in allc:
                if c != c0:
                    beside[c] = (await _probe_rates([(c0, kind), (c, kind)], dur))[0] / alone
            res["beside"] = beside
        res["all_router"] = statistics.mean(await _probe_rates([(c, kind) for c in rc], dur)) / alone
        res["all"] = statistics.mean(await _probe_rates([(c, kind) for c in allc], dur)) / alone
        out[kind] = res
    beside = out["alu"]["beside"]
    out["sibling"] = min(beside, key=beside.get) if beside and min(beside.values()) < 0.85 else None
    print(f"\n== probe: fixed pure-Python loop on CPU {c0} ({dur:g} s each) ==")
    print("  rate beside one spinner on CPU j (1.00 = alone): "
          + " ".join(f"{c}:{v:.2f}" for c, v in beside.items()))
    for kind in ("alu", "mem"):
        print(f"  {kind}: all router CPUs busy {out[kind]['all_router']:.2f}x, all CPUs busy {out[kind]['all']:.2f}x "
              "of one alone (per copy)")
    print(f"  sibling of CPU {c0}: {out['sibling']}; MHz now: {sorted(set(round(v) for v in _mhz().values()))[:8]}")
    topo = Path(f"/sys/devices/system/cpu/cpu{c0}/topology/thread_siblings_list")
    out["topology_siblings"] = topo.read_text().strip() if topo.exists() else None
    print(f"  kernel's thread_siblings_list of CPU {c0}: {out['topology_siblings']}")
    return out


# ---------------------------------------------------------------------- load
_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
urls, per_url, start_at, duration_s, body, keep = (sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]),
                                                  float(sys.argv[4]), sys.argv[5], sys.argv[6] == "1")
async def main():
    done, errors, lat = {u: 0 for u in urls}, 0, []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(u, w):
            nonlocal errors
            while time.time() < stop_at:
                t0 = time.perf_counter(); w0 = time.time()
                try:
                    async with s.post(u + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    done[u] += 1
                    if keep and w0 >= start_at:
                        lat.append((round(w0 - start_at, 6), round(time.perf_counter() - t0, 7), w))
                else:
                    errors += 1
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = start_at + duration_s
        await asyncio.gather(*(worker(u, i * per_url + k) for i, u in enumerate(urls) for k in range(per_url)))
    print(json.dumps({"done": done, "errors": errors, "lat": lat}))
asyncio.run(main())
"""


async def drive(urls: list[str], total: int, args: argparse.Namespace, procs: int, duration_s: float,
                watch: dict[str, list[int]], keep_latency: bool = False, warm_s: float = 1.0,
                profile: tuple[int, Path] | None = None) -> dict:
    """``total`` closed-loop connections spread evenly over ``urls`` from ``procs`` client
    processes; the first ``warm_s`` are not measured. CPU of each ``watch`` group (pids, with
    their descendants) over the measured window only, requests per url, host readings; with
    ``profile=(pid, path)`` py-spy records that pid during the window."""
    per_url_total = max(1, total // len(urls))
    procs = max(1, min(procs, per_url_total))
    per = [per_url_total // procs + (1 if k < per_url_total % procs else 0) for k in range(procs)]
    lead = 1.5
    start_at = time.time() + lead
    kids = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLIENT, ",".join(urls), str(c), str(start_at + warm_s), str(duration_s), ro._BODY_JSON,
        "1" if keep_latency else "0", stdout=subprocess.PIPE,
        preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus)) if args.other_cpus else None)
        for c in per if c > 0]
    # the clients' window is [start_at + warm_s, + duration_s]; read CPU at its edges
    await asyncio.sleep(max(0.0, start_at + warm_s - time.time()))
    spy, spy_idle = None, True
    if profile is not None and args.py_spy:
        for flags in (["--idle"], []):  # with --idle every sample counts (wall time); without, py-spy guesses idle
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(profile[0]), "--duration", str(int(duration_s)),
                                    "--rate", "200", "--nonblocking", *flags, "--format", "raw", "-o", str(profile[1])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, {max(args.other_cpus)}))
                                   if args.other_cpus else None)
            await asyncio.sleep(0.3)
            if spy.poll() is None or spy.returncode == 0:
                break
            print(f"  py-spy {' '.join(flags)} failed: {spy.stderr.read().decode(errors='replace')[:200]}")
            spy_idle = False
    cpu0 = {name: sum(_cpu(p) for p in pids) for name, pids in watch.items()}
    with HostWindow(args) as hw:
        await asyncio.sleep(max(0.0, start_at + warm_s + duration_s - time.time()))
        cpu1 = {name: sum(_cpu(p) for p in pids) for name, pids in watch.items()}
    outs = [json.loads((await k.communicate())[0]) for k in kids]
    if spy is not None:
        try:
            _, err = spy.communicate(timeout=20)
            if spy.returncode:
                print(f"  py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-300:]}")
        except subprocess.TimeoutExpired:
            spy.kill()
    done = {u: sum(o["done"][u] for o in outs) for u in urls}
    n = sum(done.values())
    res = {"n": n, "rps": n / duration_s, "errors": sum(o["errors"] for o in outs), "host": hw.result,
           "cpu_s": {k: cpu1[k] - cpu0[k] for k in watch}, "done": done, "connections": total,
           "spy_idle": spy_idle}
    res["cpu_us"] = sum(res["cpu_s"].values()) / max(1, n) * 1e6
    if keep_latency:
        res["lat"] = [x for o in outs for x in o["lat"]]
    if res["errors"]:
        print(f"  warning: {res['errors']} failed requests")
    return res


# ---------------------------------------------------------------------- routers
def _own_cpu_s(pid: int) -> float:
    f = ro._stat(pid)
    return (int(f[11]) + int(f[12])) / ro._TICKS_PER_S if f else float("nan")


def _cpu(pid: int) -> float:
    """CPU seconds of ``pid`` with its descendants; a negative ``pid``: of ``-pid`` alone."""
    return _own_cpu_s(-pid) if pid < 0 else ro._cpu_s(pid)


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and (f := ro._stat(int(d.name))) is not None and int(f[1]) == pid:
                out.append(int(d.name))
        return out


def _router_children(pid: int) -> list[int]:
    """The router processes of a ``pdlb serve`` parent (its children but multiprocessing's
    resource tracker)."""
    out = []
    for c in _children(pid):
        try:
            if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


_ABLATE_DIR = Path(__file__).resolve().parent / "ablate"


def start_pdlb(mode: str, engines: list[Proc], processes: int | None, cpus: set[int], *extra: str,
               ablate: str = "") -> Proc:
    """``pdlb serve`` on ``cpus`` with ``processes`` processes (None: one per CPU of ``cpus``, the
    count the bench compares with as many independent routers; ``pdlb serve``'s own default would
    take one in ``LOCAL_ENGINE_CORE_SHARE`` of them, since the bench's engines are on this host,
    issue 30); ``ablate``: a ``PDLB_BENCH_ABLATE`` list (``bench/ablate/sitecustomize.py``) for it
    and its processes."""
    a = ro._pdlb_args(mode, engines, processes or len(cpus))
    if not ablate:
        with ro._affinity(cpus):
            return _spawn([*a, *extra])
    env = os.environ.copy()
    env["PDLB_BENCH_ABLATE"] = ablate
    env["PYTHONPATH"] = os.pathsep.join([str(_ABLATE_DIR), str(ro.ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))", *a, *extra]
    with ro._affinity(cpus):
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    return _spawn([*a, *extra], popen=popen)


def start_independent(mode: str, engines: list[Proc], k: int, cpus: set[int], pin: bool = False) -> list[Proc]:
    """``k`` one-process ``pdlb serve`` on their own ports, allowed ``cpus`` (``pin``: the i-th
    only the i-th of them)."""
    from sim.emulator.testing import _start

    arglists = [ro._pdlb_args(mode, engines, 1) for _ in range(k)]
    ps = []
    for i, a in enumerate(arglists):
        with ro._affinity({sorted(cpus)[i % len(cpus)]} if pin else cpus):
            ps.append(_start(a))
    return [_spawn(a, popen=p) for a, p in zip(arglists, ps)]


async def start_sglang(mode: str, engines: list[Proc], cmd: list[str], cpus: set[int]) -> tuple[subprocess.Popen, str]:
    with ro._affinity(cpus):
        p, url = ro._start_sglang(mode, engines, cmd)
    try:
        await ro._wait_ready(url, p)
    except BaseException:
        _stop_all([p])
        raise
    return p, url


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _stop_all(procs: list) -> None:
    for p in procs:
        if isinstance(p, Proc):
            p.stop()
        elif p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# ---------------------------------------------------------------------- py-spy tables
def _area(frame: str) -> str:
    """The code area of a py-spy frame ``func (path:line)`` (py-spy shortens site-packages paths)."""
    f = "/" + frame.rsplit("(", 1)[-1]
    for key, name in (("/selectors.py", "epoll wait"), ("/asyncio/selector_events.py", "asyncio transports"),
                      ("/asyncio/", "asyncio loop"), ("/uvloop/", "asyncio loop"),
                      ("/aiohttp/web_", "aiohttp server"), ("/aiohttp/http_", "aiohttp parse/write"),
                      ("/aiohttp/_http", "aiohttp parse/write"), ("/aiohttp/client", "aiohttp client"),
                      ("/aiohttp/connector", "aiohttp client"), ("/aiohttp/", "aiohttp other"),
                      ("/balancer/service/processes/shared_", "pdlb shared"), ("/balancer/service/upstream", "pdlb lean client"),
                      ("/balancer/service/", "pdlb service"),
                      ("/balancer/", "pdlb core"), ("/prometheus_client/", "prometheus"),
                      ("/yarl/", "yarl/multidict"), ("/multidict/", "yarl/multidict"), ("/json/", "json"),
                      ("/socket.py", "socket")):
        if key in f:
            return name
    return "other"


def collapse(raw: Path) -> dict:
    """Samples of a py-spy ``--format raw`` file by leaf function (self) and by code area (of the
    leaf frame); ``{"samples", "self": [(function, n)...], "areas": {area: n}}``."""
    self_n: Counter = Counter()
    areas: Counter = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        # drop the line number: "func (path:123)" -> "func (path)"
        head, _, tail = leaf.rpartition(":")
        fn = head + ")" if tail.rstrip(")").isdigit() else leaf
        fn = fn.replace(str(ro.ROOT) + "/", "")
        for marker in ("site-packages/", "/lib/python3"):
            if marker in fn:
                fn = fn.split("(", 1)[0] + "(" + fn.split(marker, 1)[1]
        self_n[fn] += int(n)
        areas[_area(leaf)] += int(n)
        total += int(n)
    return {"samples": total, "self": self_n.most_common(30), "areas": dict(areas)}


def print_profiles(profiles: dict[str, tuple[dict, float, float]]) -> None:
    """Top 30 per profile and code areas in us of CPU per request: samples in the epoll wait
    (where an idle loop sits; py-spy records idle threads too, ``--idle``) are left out and the
    rest scaled to the process's measured CPU per request (the wait's own CPU, a few us, is
    counted in the rest)."""
    for name, (col, cpu_us, _) in profiles.items():
        busy = col["samples"] - col["areas"].get("epoll wait", 0)
        if busy <= 0:
            print(f"\n  profile {name}: no samples")
            continue
        print(f"\n  profile {name}: {col['samples']} samples, {busy} outside the epoll wait, CPU {cpu_us:.0f} us/request; "
              "top 30 by self samples (share of those outside the wait, us of CPU per request):")
        for fn, n in col["self"]:
            if not fn.startswith("EpollSelector.select"):
                print(f"    {n / busy:6.1%} {n / busy * cpu_us:7.1f} us  {fn[:110]}")
    names = list(profiles)
    areas = sorted({a for c, _, _ in profiles.values() for a in c["areas"]} - {"epoll wait"})
    print("\n  code areas, us of CPU per request (samples outside the epoll wait, scaled to the measured CPU):")
    print("    " + f"{'area':20}" + "".join(f"{n[:18]:>20}" for n in names))
    for a in [*areas, "(measured CPU)", "(epoll wait, share)"]:
        row = []
        for n in names:
            col, cpu_us, _ = profiles[n]
            busy = max(1, col["samples"] - col["areas"].get("epoll wait", 0))
            row.append(cpu_us if a == "(measured CPU)" else col["areas"].get("epoll wait", 0) / max(1, col["samples"])
                       if a.startswith("(epoll") else col["areas"].get(a, 0) / busy * cpu_us)
        print("    " + f"{a:20}" + "".join(f"{x:20.2f}" if a.startswith("(epoll") else f"{x:20.1f}" for x in row))


# ---------------------------------------------------------------------- latency tails
def tail_report(lat: list, label: str, direct: dict | None) -> dict:
    """p50/p90/p99/p99.9 (ms), added to the direct engine's when given, and where the slowest 1%
    sit: how many came within 10 ms of another slow one (a stall of one loop delays all its
    connections), and how many different connections they came from."""
    if not lat:
        return {}
    t = np.array([x[0] for x in lat])
    v = np.array([x[1] for x in lat]) * 1e3
    conn = np.array([x[2] for x in lat])
    q = {k: float(np.percentile(v, p)) for k, p in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9))}
    q["max"] = float(v.max())
    cut = np.percentile(v, 99)
    slow = np.sort(t[v >= cut] + v[v >= cut] / 1e3)  # end times of the slowest 1%
    near = np.zeros(len(slow), dtype=bool)
    if len(slow) > 1:
        close = np.diff(slow) < 0.010
        near[:-1] |= close
        near[1:] |= close
    clustered = int(near.sum())
    q.update({"n": len(v), "slow": int(len(slow)), "slow_clustered": clustered,
              "slow_connections": int(len(set(conn[v >= cut].tolist())))})
    # how slow requests fall in a 1-second cycle and in 20 ms (the rings' idle timer) cycles
    ends = t + v / 1e3
    q["slow_by_100ms_of_second"] = np.bincount(((ends[v >= cut] % 1.0) * 10).astype(int), minlength=10).tolist()
    add = ""
    if direct:
        add = "  added " + " ".join(f"{k} {q[k] - direct[k]:+.2f}" for k in ("p50", "p90", "p99", "p999"))
    print(f"    {label:30} p50 {q['p50']:.2f} p90 {q['p90']:.2f} p99 {q['p99']:.2f} p99.9 {q['p999']:.2f} "
          f"max {q['max']:.1f} ms{add}; slowest 1%: {q['slow']} from {q['slow_connections']} connections, "
          f"{q['slow_clustered']} within 10 ms of another")
    return q


# ---------------------------------------------------------------------- phases
async def regular(args: argparse.Namespace, sglang_cmd: list[str] | None, sibling: int | None, out: dict) -> None:
    rc = args.router_cpus
    n_proc = args.many or len(rc)
    c0 = min(rc)
    with ro._affinity(args.other_cpus):
        engines = spawn_engines([("mixed", "--zero-delay")] * args.engines)
    res: dict = defaultdict(list)
    profiles: dict[str, tuple[dict, float, float]] = {}
    d, conc, lp = args.duration_s, args.max_concurrency, args.load_processes
    pyspy_dir = args.out / "pyspy" if args.out else Path("/tmp/pdlb-scaling-pyspy")
    pyspy_dir.mkdir(parents=True, exist_ok=True)

    def show(name: str, r: dict, extra: str = "") -> None:
        per = ", ".join(f"{k} {v:.2f} s" for k, v in r["cpu_s"].items()) if len(r["cpu_s"]) > 1 else ""
        print(f"    {name:44} {r['rps']:8.0f} req/s {r['cpu_us']:6.0f} us/req  {_fmt_host(r['host'])}"
              + (f"  [{per}]" if per and args.verbose else "") + extra)
        res[name].append({k: v for k, v in r.items() if k != "lat"})

    print(f"\n== regular ({args.engines} mixed engines), {conc} connections from {lp} client processes, {d:g} s "
          f"windows; routers on CPUs {sorted(rc)} ==")
    try:
        for rnd in range(1, args.rounds + 1):
            print(f"  round {rnd}:")
            one = start_pdlb("regular", engines, 1, rc)
            try:
                prof = (one.popen.pid, pyspy_dir / f"regular_x1_r{rnd}.txt") if rnd == 1 else None
                r = await drive([one.url], conc, args, lp, d, {"pdlb": [one.popen.pid]}, profile=prof)
                show("pdlb, 1 process", r)
                if prof and prof[1].exists():
                    profiles["1 process"] = (collapse(prof[1]), r["cpu_us"],
                                                 d / max(1, r["n"]) * 1e6 if r["spy_idle"] else r["cpu_us"])
                if rnd == 1:
                    share = max(1, conc // n_proc)
                    r = await drive([one.url], share, args, 1, d, {"pdlb": [one.popen.pid]})
                    show(f"pdlb, 1 process, {share} connections (its share)", r)
            finally:
                one.stop()
            if rnd == 1:
                pinned = start_pdlb("regular", engines, 1, {c0})
                spin: list[subprocess.Popen] = []
                try:
                    r = await drive([pinned.url], conc, args, lp, d, {"pdlb": [pinned.popen.pid]})
                    show(f"pdlb, 1 process on CPU {c0}", r)
                    spin = [subprocess.Popen([sys.executable, "-c", _SPIN, str(c)]) for c in sorted(rc - {c0})]
                    await asyncio.sleep(0.5)
                    r = await drive([pinned.url], conc, args, lp, d, {"pdlb": [pinned.popen.pid]})
                    show(f"  + spinners on the other {len(spin)} router CPUs", r)
                    if sibling is not None and sibling not in rc:
                        spin.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(sibling)]))
                        await asyncio.sleep(0.5)
                        r = await drive([pinned.url], conc, args, lp, d, {"pdlb": [pinned.popen.pid]})
                        show(f"  + spinner on its sibling CPU {sibling} too", r)
                finally:
                    for s in spin:
                        s.kill()
                        s.wait()
                    pinned.stop()
            for loop in ("asyncio", "uvloop") if rnd == 1 and HAS_UVLOOP else ("asyncio",):
                many = start_pdlb("regular", engines, args.many, rc, *(["--event-loop", loop] if loop != "asyncio" else []))
                try:
                    await drive([many.url], conc, args, lp, 1.0, {})  # spread the connections, warm up
                    kids = _router_children(many.popen.pid)
                    prof = None
                    if rnd == 1 and loop == "asyncio":
                        prof = (kids[0], pyspy_dir / f"regular_x{n_proc}_child_r{rnd}.txt")
                    r = await drive([many.url], conc, args, lp, d,
                                    {"parent": [-many.popen.pid], **{f"p{k}": [c] for k, c in enumerate(kids)}},
                                    profile=prof)
                    per_child = [r["cpu_s"].get(f"p{k}", 0.0) for k in range(len(kids))]
                    show(f"pdlb x{n_proc} (shared state), {loop}", r,
                         f"  CPU s per child {' '.join(f'{x:.2f}' for x in sorted(per_child))}, parent "
                         f"{r['cpu_s']['parent']:.2f}")
                    if prof and prof[1].exists():
                        # the profiled process's own CPU per request: its CPU over its share of requests
                        pc = r["cpu_s"].get(f"p{kids.index(prof[0])}", 0.0) if prof[0] in kids else 0.0
                        share = r["n"] * pc / max(1e-9, sum(per_child))  # its requests, if CPU/request is even
                        profiles[f"one of {n_proc} processes"] = (
                            collapse(prof[1]), pc / max(1, share) * 1e6,
                            d / max(1, share) * 1e6 if r["spy_idle"] else pc / max(1, share) * 1e6)
                finally:
                    many.stop()
            for pin in (False, True) if rnd == 1 else (False,):
                indep = start_independent("regular", engines, n_proc, rc, pin)
                try:
                    r = await drive([p.url for p in indep], conc, args, lp, d,
                                    {f"i{k}": [p.popen.pid] for k, p in enumerate(indep)})
                    spread = sorted(r["done"].values())
                    show(f"{n_proc} independent pdlb (1 process each){', pinned' if pin else ''}", r,
                         f"  req per router {spread[0]}-{spread[-1]}")
                finally:
                    _stop_all(indep)
            if sglang_cmd is not None:
                for cpus, label in (({c0}, "1 CPU"), (rc, f"{n_proc} CPUs")) if rnd == 1 else ((rc, f"{n_proc} CPUs"),):
                    try:
                        p, url = await start_sglang("regular", engines, sglang_cmd, cpus)
                    except (RuntimeError, OSError) as e:
                        print(f"    sglang-router unavailable: {e}")
                        break
                    try:
                        await drive([url], conc, args, lp, 1.0, {})
                        r = await drive([url], conc, args, lp, d, {"sglang": [p.pid]})
                        show(f"sglang-router, {label} ({_threads(p.pid)} threads)", r)
                    finally:
                        _stop_all([p])
    finally:
        _stop_all(engines)
    print_profiles(profiles)
    out["regular"] = dict(res)
    out["profiles"] = {k: {"cpu_us": v[1], "wall_us": v[2], **v[0]} for k, v in profiles.items()}


async def pd(args: argparse.Namespace, sglang_cmd: list[str] | None, out: dict) -> None:
    rc = args.router_cpus
    n_proc = args.many or len(rc)
    n = args.pd_engines
    with ro._affinity(args.other_cpus):
        engines = spawn_engines([("prefill", "--zero-delay")] * n + [("decode", "--zero-delay")] * n
                                + [("mixed", "--zero-delay")])
    direct, engines = engines[-1], engines[:-1]
    d, c = args.duration_s, args.concurrency
    res: dict = defaultdict(list)
    print(f"\n== pd ({n} prefill + {n} decode, SGLang PD): latency at {c} connections from one client process, "
          f"{d:g} s; ms ==")

    async def lat(label: str, urls: list[str], total: int, base: dict | None) -> dict:
        r = await drive(urls, total, args, 1, d, {}, keep_latency=True)
        q = tail_report(r["lat"], label, base)
        q["host"] = r["host"]
        res[label].append(q)
        return q

    try:
        for rnd in range(1, args.rounds + 1):
            print(f"  round {rnd}:")
            base = await lat("direct engine", [direct.url], c, None)
            many = start_pdlb("pd", engines, args.many, rc)
            try:
                await drive([many.url], c, args, 1, 1.0, {})
                await lat(f"pdlb x{n_proc}", [many.url], c, base)
                if rnd == 1:
                    r = await drive([many.url], args.max_concurrency, args, args.load_processes, d, {"pdlb": [many.popen.pid]})
                    print(f"    {'  throughput':30} {r['rps']:.0f} req/s, {r['cpu_us']:.0f} us/req; {_fmt_host(r['host'])}")
            finally:
                many.stop()
            indep = start_independent("pd", engines, n_proc, rc)
            try:
                await lat(f"{n_proc} independent pdlb", [p.url for p in indep], c, base)
                if rnd == 1:
                    r = await drive([p.url for p in indep], args.max_concurrency, args, args.load_processes, d,
                                    {f"i{k}": [p.popen.pid] for k, p in enumerate(indep)})
                    print(f"    {'  throughput':30} {r['rps']:.0f} req/s, {r['cpu_us']:.0f} us/req; {_fmt_host(r['host'])}")
            finally:
                _stop_all(indep)
            if rnd == 1:
                one = start_pdlb("pd", engines, 1, rc)
                try:
                    share = max(1, c // n_proc)
                    await lat(f"pdlb, 1 process, {share} connections", [one.url], share, base)
                finally:
                    one.stop()
                if HAS_UVLOOP:
                    uv = start_pdlb("pd", engines, args.many, rc, "--event-loop", "uvloop")
                    try:
                        await drive([uv.url], c, args, 1, 1.0, {})
                        await lat(f"pdlb x{n_proc}, uvloop", [uv.url], c, base)
                    finally:
                        uv.stop()
            if sglang_cmd is not None:
                try:
                    p, url = await start_sglang("pd", engines, sglang_cmd, rc)
                except (RuntimeError, OSError) as e:
                    print(f"    sglang-router unavailable: {e}")
                    continue
                try:
                    await drive([url], c, args, 1, 1.0, {})
                    await lat("sglang-router", [url], c, base)
                finally:
                    _stop_all([p])
    finally:
        _stop_all([direct, *engines])
    out["pd"] = dict(res)


async def ablate(args: argparse.Namespace, out: dict) -> None:
    """Regular mode, several processes: CPU per request with the shared state's parts switched
    off in turn (bench-only, ``bench/ablate``), against independent one-process routers."""
    rc = args.router_cpus
    n_proc = args.many or len(rc)
    with ro._affinity(args.other_cpus):
        engines = spawn_engines([("mixed", "--zero-delay")] * args.engines)
    d, conc, lp = args.duration_s, args.max_concurrency, args.load_processes
    res: dict = defaultdict(list)
    extra = args.pdlb_extra.split() if args.pdlb_extra else []
    profiles: dict[str, tuple[dict, float, float]] = {}
    pyspy_dir = args.out / "pyspy" if args.out else Path("/tmp/pdlb-scaling-pyspy")
    pyspy_dir.mkdir(parents=True, exist_ok=True)
    print(f"\n== ablate: regular, {conc} connections, pdlb x{n_proc} with parts of its shared state off "
          f"(bench-only switches), {d:g} s windows ==")
    try:
        for rnd in range(1, args.rounds + 1):
            print(f"  round {rnd}:")
            if rnd == 1:
                one = start_pdlb("regular", engines, 1, rc, *extra)
                try:
                    prof = (one.popen.pid, pyspy_dir / "ablate_x1.txt")
                    r = await drive([one.url], conc, args, lp, d, {"pdlb": [one.popen.pid]}, profile=prof)
                finally:
                    one.stop()
                print(f"    {'pdlb, 1 process':44} {r['rps']:8.0f} req/s {r['cpu_us']:6.0f} us/req  {_fmt_host(r['host'])}")
                res["pdlb, 1 process"].append({k: v for k, v in r.items() if k != "lat"})
                if prof[1].exists():
                    profiles["1 process"] = (collapse(prof[1]), r["cpu_us"], r["cpu_us"])
            for what in ("", "peer_refresh", "prefix_share", "peer_refresh,prefix_share"):
                many = start_pdlb("regular", engines, args.many, rc, *extra, ablate=what)
                try:
                    await drive([many.url], conc, args, lp, 1.0, {})
                    kids = _router_children(many.popen.pid)
                    prof = (kids[0], pyspy_dir / f"ablate_x{n_proc}_child.txt") if rnd == 1 and not what and kids else None
                    r = await drive([many.url], conc, args, lp, d,
                                    {"parent": [-many.popen.pid], **{f"p{k}": [c] for k, c in enumerate(kids)}},
                                    profile=prof)
                finally:
                    many.stop()
                if prof and prof[1].exists():
                    per_child = [r["cpu_s"].get(f"p{k}", 0.0) for k in range(len(kids))]
                    pc = r["cpu_s"].get("p0", 0.0)
                    share = r["n"] * pc / max(1e-9, sum(per_child))
                    profiles[f"one of {n_proc} processes"] = (collapse(prof[1]), pc / max(1, share) * 1e6,
                                                              pc / max(1, share) * 1e6)
                label = f"pdlb x{n_proc}" + (f", no {what.replace(',', ', no ')}" if what else ", as shipped")
                print(f"    {label:44} {r['rps']:8.0f} req/s {r['cpu_us']:6.0f} us/req  {_fmt_host(r['host'])}")
                res[label].append({k: v for k, v in r.items() if k != "lat"})
            indep = start_independent("regular", engines, n_proc, rc)
            try:
                r = await drive([p.url for p in indep], conc, args, lp, d,
                                {f"i{k}": [p.popen.pid] for k, p in enumerate(indep)})
            finally:
                _stop_all(indep)
            print(f"    {f'{n_proc} independent pdlb':44} {r['rps']:8.0f} req/s {r['cpu_us']:6.0f} us/req  "
                  f"{_fmt_host(r['host'])}")
            res[f"{n_proc} independent pdlb"].append({k: v for k, v in r.items() if k != "lat"})
    finally:
        _stop_all(engines)
    print_profiles(profiles)
    out["ablate"] = dict(res)
    out["ablate_profiles"] = {k: {"cpu_us": v[1], **v[0]} for k, v in profiles.items()}


def main() -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import positive_float, positive_int

    ap = ArgumentParser(description=__doc__.splitlines()[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--duration-s", type=positive_float, default=4.0, help="seconds per measured window (default 4)")
    ap.add_argument("--probe-s", type=positive_float, default=0.3, help="seconds per probe reading (default 0.3)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="rounds of the main comparisons (default 2)")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="connections for the PD latency runs (default 16)")
    ap.add_argument("--max-concurrency", type=positive_int, default=256, help="connections for throughput (default 256)")
    ap.add_argument("--load-processes", type=positive_int, default=4, help="client processes for throughput (default 4)")
    ap.add_argument("--engines", type=positive_int, default=4, help="mixed engines, regular mode (default 4)")
    ap.add_argument("--pd-engines", type=positive_int, default=2, help="prefill and decode engines each, pd mode (default 2)")
    ap.add_argument("--router-cpus", required=True, metavar="LIST", help="CPUs for the routers, e.g. 0-7")
    ap.add_argument("--phases", default="probe,regular,pd", help="comma list of probe, regular, pd, ablate")
    ap.add_argument("--pdlb-extra", default="", metavar="ARGS", help="more 'pdlb serve' arguments for the ablate phase")
    ap.add_argument("--sglang-router", default=f"bash {ro.PEER}", metavar="CMD",
                    help="command that runs 'sglang-router launch' with the args appended ('' to skip)")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), metavar="PATH", help="py-spy binary (default: on PATH)")
    ap.add_argument("--out", type=Path, help="folder for scaling.json and the py-spy raw files (pyspy.tar.gz)")
    ap.add_argument("--many", type=positive_int, metavar="N",
                    help="the several-process rows run --processes N (default: pdlb's default, one per router CPU)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    all_cpus = os.sched_getaffinity(0)
    args.router_cpus = ro._cpu_list(args.router_cpus, ap)
    if not args.router_cpus < all_cpus:
        ap.error(f"--router-cpus must be a proper subset of {sorted(all_cpus)}")
    args.other_cpus = all_cpus - args.router_cpus
    from pdlb_cli.comma_lists import list_arg, one_of

    phases = list_arg(ap, "--phases", args.phases, "phases of probe, regular, pd, ablate",
                      one_of(("probe", "regular", "pd", "ablate")))
    sglang_cmd = __import__("shlex").split(args.sglang_router) if args.sglang_router else None
    if sglang_cmd and sglang_cmd[0] == "bash" and len(sglang_cmd) > 1 and not Path(sglang_cmd[1]).is_file():
        print(f"note: {sglang_cmd[1]} not found; no sglang-router rows")
        sglang_cmd = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print(f"host: {os.cpu_count()} CPUs; routers on {sorted(args.router_cpus)}, engines and clients on "
          f"{sorted(args.other_cpus)}; py-spy: {args.py_spy}")
    if not HAS_UVLOOP:
        print("note: uvloop is not installed; no uvloop rows")
    out: dict = {"args": {k: (sorted(v) if isinstance(v, set) else str(v)) for k, v in vars(args).items()}}
    sibling = None
    t0 = time.monotonic()
    if "probe" in phases:
        out["probe"] = asyncio.run(probe(args))
        sibling = out["probe"]["sibling"]
    os.sched_setaffinity(0, args.other_cpus)
    if "regular" in phases:
        asyncio.run(regular(args, sglang_cmd, sibling, out))
    if "pd" in phases:
        asyncio.run(pd(args, sglang_cmd, out))
    if "ablate" in phases:
        asyncio.run(ablate(args, out))
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    if args.out:
        (args.out / "scaling.json").write_text(json.dumps(out, indent=1, default=str))
        spy = args.out / "pyspy"
        if spy.exists():
            with tarfile.open(args.out / "pyspy.tar.gz", "w:gz") as tf:
                tf.add(spy, arcname="pyspy")
            shutil.rmtree(spy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
