"""Router overhead: pdlb vs the newest Rust routers in front of the same zero-delay emulated engines.

Run by hand::

    .venv/bin/python bench/router_overhead.py                 # all modes, all peers, 3 interleaved repeats
    .venv/bin/python bench/router_overhead.py --peers none    # pdlb vs the direct engine only
    .venv/bin/python bench/router_overhead.py --modes regular --repeat 2 --duration-s 5
    .venv/bin/python bench/router_overhead.py --pdlb-processes 1,0   # also pdlb serve's default process count
    .venv/bin/python bench/router_overhead.py --smg '/opt/smg/bin/smg launch' --vllm-router /opt/vr/bin/vllm-router

Peers (``--peers``, default all three; each pinned to the version in :data:`PEERS`): ``smg``
(SGLang's model gateway, ``smg launch``), ``sglang-router`` (``sglang-router launch``) and
``vllm-router``. Each runs from ``--smg CMD`` / ``--sglang-router CMD`` / ``--vllm-router CMD`` when
given, else from its own virtual environment under ``~/.cache/pdlb-peers/NAME-VERSION``, made on
first use with ``pip install NAME==VERSION`` (``--peer-wheels DIR``: pip also looks in DIR, e.g.
downloaded wheels). A peer that cannot be installed or does not start is skipped with a note, and
the others are still measured. smg and sglang-router take both the same worker list (regular) and
SGLang's PD protocol; vllm-router the worker list and vLLM's PD protocol
(``--vllm-pd-disaggregation``: prefill with ``kv_transfer_params``, then decode).

Modes (``--modes``, default all): ``regular`` (``--engines`` mixed engines, every peer), ``pd``
(``--pd-engines`` prefill + as many decode engines, SGLang PD protocol with a bootstrap room:
pdlb ``--pd-protocol sglang``, smg and sglang-router ``--pd-disaggregation``) and ``vllm-pd`` (the
same engines, vLLM's PD protocol: pdlb ``--pd-protocol vllm``, vllm-router). For each mode it starts the
engines (``pdlb engine --zero-delay``), a separate direct engine, pdlb and the mode's peers once,
then for each repeat measures, in turn, the direct engine, pdlb and every peer with
non-streaming ``/v1/completions`` (8 output tokens, model ``pdlb-emulated``: the name the
emulated engines serve):

* latency at ``--concurrency`` (closed loop); *added* latency = router percentile - the same
  percentile sending directly to one engine, measured in the same repeat;
* max requests/s (closed loop at ``--max-concurrency``);
* router CPU time per request (user + system, all threads of the router process and its child
  processes, from ``/proc/PID/stat``) during the throughput run: the least contention-sensitive
  number on a shared host;
* with ``--baseline``, after the repeats: ``--paired-rounds`` rounds in which one pdlb process and
  every baseline are driven at the same time by the same client processes (``--concurrency``
  connections each), CPU per request of each: what else the host does meanwhile weighs on all of
  them alike, so the per-round ratio is steadier than that of runs taken in turn.

``--pdlb-processes 1,4`` measures ``pdlb serve`` once per listed process count (rows ``pdlb``,
``pdlb x4``); ``0`` is pdlb's default (row ``pdlb xN (default)``): one process per core the router
may use, of which it takes one in ``LOCAL_ENGINE_CORE_SHARE`` (4) since this bench's engines run on
the same host (issue 30), i.e. 2 with ``--router-cpus 0-7``: list the counts to compare at equal
cores (``--pdlb-processes 1,2,4,8``); several processes add throughput, not CPU efficiency.

``--router-cpus 0-7`` pins every router to those CPUs (they are started with that affinity, so
pdlb's default process count and the peers' worker threads follow it) and the engines
and load generators to the others: the routers compete for the same cores, not with the load.
``--load-processes K`` drives the throughput run from K client processes (one Python client
process tops out near 10,000 requests/s); ``--engines N`` / ``--pd-engines N`` start N mixed engines
(regular) or N prefill + N decode engines (pd, vllm-pd).
``--variant 'NAME=ARGS'`` adds a row ``pdlb xN, NAME``: the default process count with ARGS added
(N: ARGS' own ``--processes`` if given)
(e.g. ``--variant 'aiohttp client=--upstream-client aiohttp'``).
``--baseline DIR`` also measures ``pdlb serve`` (one process) from another checkout, e.g. the
main branch's (row ``pdlb@base``), in the same repeats: CPU per request before / after. Given
twice or more, every checkout gets a row (``pdlb@base``, ``pdlb@base2``, ...; the goal is checked
against the first).

It prints every repeat and a summary: the medians over repeats; per pdlb row and peer the
ratios pdlb / peer per repeat (median); the issue-26 table (the default-process row, or the last
pdlb row, against each peer: req/s, CPU per request, added p99) and its goals: req/s >= 1.0x the
best peer's, added p99 <= the best peer's, CPU per request <= 1.5x the best peer's and <= 1.3x
pdlb's own one-process figure (when both rows were measured); and issue 13's: one process's CPU
per request <= 2/3 of the baseline's (``--baseline``).
The load generator shares the host with routers and engines, so on a small or busy host absolute
numbers are pessimistic for every router; the ratios from the same repeat are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sim.emulator.config import EmulatorConfig  # noqa: E402
from sim.emulator.testing import Proc, _spawn, spawn_engines  # noqa: E402
from balancer.service.launch import default_processes  # noqa: E402
from pdlb_cli.arg_types import nonnegative_int, positive_float, positive_int  # noqa: E402
from pdlb_cli.args import ArgumentParser  # noqa: E402
from pdlb_cli.comma_lists import CommaListError, comma_list, one_of  # noqa: E402

PEER = ROOT.parent / "shared" / "peers" / "sglang_router.sh"  # the older peer script (router_scaling.py)
#: the model name pdlb's emulated engines serve (sim.emulator.config); smg checks it (model_not_found)
MODEL = EmulatorConfig.model_fields["served_model_name"].default
LOCAL_URL = "http://127.0.0.1"
"""Where this bench's engines listen (this host: ``pdlb serve``'s default process count counts it)."""
BODY = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 8}
_BODY_JSON = __import__("json").dumps(BODY)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Peer:
    """A peer router: its package (pinned), the command its package installs, its modes."""

    name: str
    package: str
    version: str
    argv: tuple[str, ...]  # the console script and subcommand, inside its environment's bin/
    modes: tuple[str, ...]
    log_level: str  # its spelling of "warnings and worse"

    def pd_args(self, prefill: list[Proc], decode: list[Proc]) -> list[str]:
        if "vllm-pd" in self.modes:
            return ["--vllm-pd-disaggregation", *[a for e in prefill for a in ("--prefill", e.url)],
                    *[a for e in decode for a in ("--decode", e.url)]]
        return ["--pd-disaggregation", *[a for e in prefill for a in ("--prefill", e.url, str(e.port))],
                *[a for e in decode for a in ("--decode", e.url)]]


#: The peers, newest on the registry when pinned (2026-12): smg and sglang-router speak SGLang's
#: PD protocol (the prefill's bootstrap port after its URL), vllm-router vLLM's.
PEERS = {p.name: p for p in (
    Peer("smg", "smg", "1.13.0", ("smg", "launch"), ("regular", "pd"), "warn"),
    Peer("sglang-router", "sglang-router", "0.3.2", ("sglang-router", "launch"), ("regular", "pd"), "warn"),
    Peer("vllm-router", "vllm-router", "0.1.17", ("vllm-router",), ("regular", "vllm-pd"), "warning"),
)}
MODES = ("regular", "pd", "vllm-pd")


def peer_command(peer: Peer, given: str | None, wheels: Path | None) -> list[str] | None:
    """The command that starts ``peer`` (arguments appended): ``given`` (split like a shell), else
    its pinned package in ``~/.cache/pdlb-peers/NAME-VERSION`` (installed now if missing); None
    with a printed note when it cannot be had."""
    if given:
        return shlex.split(given)
    venv = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdlb-peers" / f"{peer.name}-{peer.version}"
    exe = venv / "bin" / peer.argv[0]
    if not exe.is_file():
        print(f"installing {peer.package}=={peer.version} into {venv} ...", flush=True)
        extra = ["--find-links", str(wheels)] if wheels else []
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *extra, f"{peer.package}=={peer.version}"],
                           check=True)
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"note: could not install {peer.package}=={peer.version} ({e}); skipping {peer.name}")
            return None
    return [str(exe), *peer.argv[1:]]


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (all threads), or nan
    if unknown."""
    if pid is None or (root := _stat(pid)) is None:
        return float("nan")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {pid: root}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != pid and (f := _stat(int(d.name))) is not None:
            stats[int(d.name)] = f
            children.setdefault(int(f[1]), []).append(int(d.name))  # f[1]: parent pid
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += int(stats[p][11]) + int(stats[p][12])  # utime + stime, clock ticks
        todo += children.get(p, [])
    return total / _TICKS_PER_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with status {proc.returncode}")
            try:
                async with s.post(url + "/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} never answered within {timeout_s:.0f} s")


async def _closed_loop(url: str, concurrency: int, duration_s: float) -> tuple[np.ndarray, float, int]:
    """Latencies (s) of the 200 answers completed in ``duration_s``, achieved requests/s, errors."""
    lat: list[float] = []
    errors = 0
    stop_at = time.monotonic() + duration_s
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", json=BODY) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if not ok:
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    return np.array(lat), len(lat) / elapsed, errors


_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
url, concurrency, start_at, duration_s, body = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
bin_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0  # > 0: also count answers per bin_s since start_at
async def main():
    lat, errors = [], 0
    bins = [0] * (int(duration_s / bin_s) + 2) if bin_s > 0 else []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker():
            nonlocal errors
            while time.time() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                    if bins:
                        bins[min(len(bins) - 1, int((time.time() - start_at) / bin_s))] += 1
                else:
                    errors += 1
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = start_at + duration_s
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    print(json.dumps({"lat": lat, "errors": errors, "bins": bins}))
asyncio.run(main())
"""


async def _closed_loop_procs(url: str, concurrency: int, duration_s: float, procs: int,
                             cpus: set[int] | None) -> tuple[np.ndarray, float, int]:
    """:func:`_closed_loop` from ``procs`` client processes (``concurrency`` split over them),
    started together one second after they are spawned."""
    import json

    start_at = time.time() + 1.5
    per = [concurrency // procs + (1 if k < concurrency % procs else 0) for k in range(procs)]
    kids = [await asyncio.create_subprocess_exec(sys.executable, "-c", _CLIENT, url, str(c), str(start_at),
                                                 str(duration_s), _BODY_JSON, stdout=subprocess.PIPE,
                                                 preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            for c in per if c > 0]
    outs = [json.loads((await k.communicate())[0]) for k in kids]
    lat = np.array([x for o in outs for x in o["lat"]])
    return lat, len(lat) / duration_s, sum(o["errors"] for o in outs)


_PAIRED_CLIENT = r"""
import asyncio, json, sys, time
import aiohttp
urls, concurrency, start_at, duration_s, body = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
async def main():
    done, errors = {u: 0 for u in urls}, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(u):
            nonlocal errors
            while time.time() < stop_at:
                try:
                    async with s.post(u + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    done[u] += 1
                else:
                    errors += 1
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = start_at + duration_s
        await asyncio.gather(*(worker(u) for u in urls for _ in range(concurrency)))
    print(json.dumps({"done": done, "errors": errors}))
asyncio.run(main())
"""


async def _paired_cpu(routers: dict[str, Proc], args: argparse.Namespace) -> dict[str, float]:
    """One paired round: every router in ``routers`` driven at the same time by the same
    ``--load-processes`` client processes (``--concurrency`` connections per router in all), for
    ``--duration-s``; CPU us per request of each. Routers measured at once share whatever else
    the host runs, so their ratio is steadier than that of turns taken one after another."""
    import json

    urls = ",".join(p.url for p in routers.values())
    procs = max(1, min(args.load_processes, args.concurrency))
    per = [args.concurrency // procs + (1 if k < args.concurrency % procs else 0) for k in range(procs)]
    start_at = time.time() + 1.5
    cpu0 = {name: _cpu_s(p.popen.pid) for name, p in routers.items()}
    kids = [await asyncio.create_subprocess_exec(sys.executable, "-c", _PAIRED_CLIENT, urls, str(c), str(start_at),
                                                 str(args.duration_s), _BODY_JSON, stdout=subprocess.PIPE,
                                                 preexec_fn=(lambda: os.sched_setaffinity(0, args.other_cpus))
                                                 if args.other_cpus else None)
            for c in per if c > 0]
    outs = [json.loads((await k.communicate())[0]) for k in kids]
    errors = sum(o["errors"] for o in outs)
    if errors:
        print(f"  warning: {errors} failed requests in a paired round")
    # the 1.5 s before the start is idle for every router (its CPU then is noise, not requests)
    return {name: (_cpu_s(p.popen.pid) - cpu0[name]) / max(1, sum(o["done"][p.url] for o in outs)) * 1e6
            for name, p in routers.items()}


async def _measure(url: str, args: argparse.Namespace, pid: int | None = None) -> dict[str, float]:
    await _closed_loop(url, args.concurrency, 1.0)  # warm up connections
    lat, _, e1 = await _closed_loop(url, args.concurrency, args.duration_s)
    cpu0 = _cpu_s(pid)
    if args.load_processes > 1:
        lat_max, rps, e2 = await _closed_loop_procs(url, args.max_concurrency, args.duration_s, args.load_processes,
                                                    args.other_cpus)
    else:
        lat_max, rps, e2 = await _closed_loop(url, args.max_concurrency, args.duration_s)
    cpu_us = (_cpu_s(pid) - cpu0) / max(1, len(lat_max)) * 1e6
    if e1 + e2:
        print(f"  warning: {e1 + e2} failed requests to {url}")
    return {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "rps": rps, "n": len(lat),
            "cpu_us": cpu_us}


def _start_peer(peer: Peer, mode: str, engines: list[Proc], cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """Start ``peer`` (``cmd``) in front of ``engines`` (regular: all mixed; PD: the first half
    prefill, the rest decode), round robin; returns the process and its URL. Its output goes to
    ``/tmp/pdlb-bench-NAME-MODE.log``."""
    port = _free_port()
    args = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port()),
            "--policy", "round_robin", "--log-level", peer.log_level]
    if mode == "regular":
        args += ["--worker-urls", *[e.url for e in engines]]
    else:
        half = len(engines) // 2
        args += peer.pd_args(engines[:half], engines[half:])
    log = open(f"/tmp/pdlb-bench-{peer.name}-{mode}.log", "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _start_sglang(mode: str, engines: list[Proc], cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """sglang-router (``cmd``) in ``mode`` (``regular`` or ``pd``), as :func:`_start_peer`."""
    return _start_peer(PEERS["sglang-router"], mode, engines, cmd)


def _added_ms(r: dict[str, float], direct: dict[str, float], q: str) -> float:
    return (r[q] - direct[q]) * 1e3


def _print_repeat(k: int, rows: list[tuple[str, dict[str, float]]], direct: dict[str, float]) -> None:
    print(f"  repeat {k}: {'':12}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'max req/s':>11}"
          f"{'CPU us/req':>12}")
    for name, r in rows:
        print(f"    {name:22}{r['p50'] * 1e3:9.2f}{r['p99'] * 1e3:9.2f}{_added_ms(r, direct, 'p50'):11.2f}"
              f"{_added_ms(r, direct, 'p99'):11.2f}{r['rps']:11.0f}{r['cpu_us']:12.0f}")


@contextlib.contextmanager
def _affinity(cpus: set[int] | None):
    """Children started inside inherit ``cpus`` as their CPU set (the bench's own is restored)."""
    if not cpus:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def pdlb_default_processes(router_cpus: set[int] | None) -> int:
    """The router processes ``pdlb serve`` starts without ``--processes`` on ``router_cpus`` (None:
    this bench's CPUs) in front of this bench's engines: on this host, so one in
    ``LOCAL_ENGINE_CORE_SHARE`` of the CPUs (issue 30; ``balancer.service.launch.default_processes``)."""
    with _affinity(router_cpus):
        return default_processes([LOCAL_URL])


def is_pdlb_checkout(path: Path) -> bool:
    """Whether ``path`` holds a pdlb tree that :func:`_spawn_pdlb_from` can run (``pdlb_cli/main.py``;
    it used to look for ``sim/cli.py``, gone since the CLI package, so every ``--baseline`` was refused)."""
    return (path / "pdlb_cli" / "main.py").is_file() and (path / "balancer" / "router.py").is_file()


def _spawn_pdlb_from(checkout: Path, args: list[str]) -> Proc:
    """``pdlb serve ARGS`` from another checkout (its code first on ``PYTHONPATH``)."""
    from sim.emulator.testing import _spawn

    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))", *args]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(checkout))
    return _spawn(args, popen=popen)


def _pdlb_args(mode: str, engines: list[Proc], processes: int) -> list[str]:
    half = len(engines) // 2
    if mode == "regular":
        return ["serve", "--port", "0", "--pd-protocol", "none", "--mixed", *[e.url for e in engines],
                "--decode-policy", "round_robin", "--processes", str(processes)]
    if mode == "vllm-pd":
        return ["serve", "--port", "0", "--pd-protocol", "vllm",
                "--prefill", *[e.url for e in engines[:half]], "--decode", *[e.url for e in engines[half:]],
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--processes", str(processes)]
    return ["serve", "--port", "0", "--pd-protocol", "sglang",
            "--prefill", *[f"{e.url},bootstrap={e.port}" for e in engines[:half]], "--decode", *[e.url for e in engines[half:]],
            "--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--processes", str(processes)]


@dataclass
class ModeRun:
    """One mode's processes, started by :func:`start_mode` and kept for its repeats: the engines (the
    last one the direct engine), pdlb's rows, the peers that started, and the per-repeat results
    ``out`` (``{"direct": [...], ROW: [...], "peers": [...]}``, as :func:`run_mode` returns)."""

    mode: str
    out: dict[str, Any]
    direct_engine: Proc
    pdlbs: dict[str, Proc]
    started: dict[str, tuple[subprocess.Popen, str]]
    bases: dict[str, Path]
    procs: list[Proc]

    def header(self, args: argparse.Namespace) -> str:
        n = args.engines if self.mode == "regular" else args.pd_engines
        desc = {"regular": f"{n} mixed engines", "pd": f"{n} prefill + {n} decode, SGLang PD",
                "vllm-pd": f"{n} prefill + {n} decode, vLLM PD"}[self.mode]
        return (f"\n== {self.mode} ({desc}), zero-delay engines, latency at concurrency {args.concurrency}, "
                f"throughput at {args.max_concurrency} from {args.load_processes} client process(es), "
                f"{args.duration_s:g} s each ==")


async def start_mode(mode: str, args: argparse.Namespace, peer_cmds: dict[str, list[str]]) -> ModeRun:
    """Start one mode's engines, pdlb rows and peers (``peer_cmds``: the peers to run, those of them
    that speak ``mode``; one that does not start is left out with a note); on an error, what was
    started is stopped again. Afterwards this process (the load generator) runs on the other CPUs."""
    n = args.engines if mode == "regular" else args.pd_engines
    specs = [("mixed", "--zero-delay")] * n if mode == "regular" else \
        [("prefill", "--zero-delay")] * n + [("decode", "--zero-delay")] * n
    procs: list[Proc] = []
    peers = {name: cmd for name, cmd in peer_cmds.items() if mode in PEERS[name].modes}
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    bases = {_base_name(k): d for k, d in enumerate(args.baseline or [])}
    variants = {_variant_name(name, extra, args): extra for name, extra in args.variant}
    names = [*bases] + [_pdlb_name(k, args) for k in args.pdlb_processes] + [*variants]
    out: dict[str, Any] = {"direct": [], **{k: [] for k in names}, **{k: [] for k in peers}}
    pdlbs: dict[str, Proc] = {}
    try:
        with _affinity(args.other_cpus):
            engines = spawn_engines([*specs, ("mixed", "--zero-delay")])
        procs += engines
        direct_engine, engines = engines[-1], engines[:-1]
        with _affinity(args.router_cpus):
            for name, checkout in bases.items():
                pdlbs[name] = _spawn_pdlb_from(checkout, _pdlb_args(mode, engines, 1))
                procs.append(pdlbs[name])
            for k in args.pdlb_processes:
                a = _pdlb_args(mode, engines, k if k > 0 else args.default_processes)
                if k == 0:  # pdlb's own default: no --processes at all
                    i = a.index("--processes")
                    del a[i:i + 2]
                pdlb = _spawn(a)
                procs.append(pdlb)
                pdlbs[_pdlb_name(k, args)] = pdlb
            for name, extra in variants.items():  # the default process count with more arguments
                a = _pdlb_args(mode, engines, args.default_processes)
                i = a.index("--processes")
                del a[i:i + 2]
                pdlbs[name] = _spawn([*a, *extra])
                procs.append(pdlbs[name])
            for name, cmd in peers.items():
                try:
                    started[name] = _start_peer(PEERS[name], mode, engines, cmd)
                    await _wait_ready(started[name][1], started[name][0])
                except (RuntimeError, OSError) as e:
                    print(f"  {name} unavailable: {e} (see /tmp/pdlb-bench-{name}-{mode}.log); skipping it")
    except BaseException:
        _stop(started, procs)
        raise
    for name in [k for k in peers if k not in started or started[k][0].poll() is not None]:
        del out[name]
    if args.other_cpus:
        os.sched_setaffinity(0, args.other_cpus)  # the load generator too
    out["peers"] = [k for k in peers if k in out]
    return ModeRun(mode, out, direct_engine, pdlbs, started, bases, procs)


async def measure_repeat(run: ModeRun, args: argparse.Namespace, k: int) -> None:
    """Repeat ``k``: the direct engine, every pdlb row, then every peer, in turn; appended to
    ``run.out`` and printed."""
    out = run.out
    direct = await _measure(run.direct_engine.url, args, run.direct_engine.popen.pid)
    rows = [("direct engine", direct)]
    out["direct"].append(direct)
    for name, pdlb in run.pdlbs.items():
        ours = await _measure(pdlb.url, args, pdlb.popen.pid)
        rows.append((name, ours))
        out[name].append(ours)
    for name in out["peers"]:
        popen, url = run.started[name]
        theirs = await _measure(url, args, popen.pid)
        rows.append((name, theirs))
        out[name].append(theirs)
    _print_repeat(k, rows, direct)


async def measure_paired(run: ModeRun, args: argparse.Namespace) -> None:
    """With ``--baseline``: ``--paired-rounds`` rounds of one pdlb process and every baseline driven at once."""
    paired = {name: p for name, p in run.pdlbs.items() if name in run.bases or name == "pdlb"}
    if args.paired_rounds and "pdlb" in paired and len(paired) > 1:
        print(f"  paired CPU/req (one process each, driven at once, {args.concurrency} connections each):")
        for k in range(1, args.paired_rounds + 1):
            got = await _paired_cpu(paired, args)
            run.out.setdefault("paired", []).append(got)
            print(f"    round {k}: " + ", ".join(f"{name} {us:.0f} us" for name, us in got.items())
                  + "; pdlb / " + ", pdlb / ".join(f"{b} {got['pdlb'] / (got[b] or float('nan')):.2f}x"
                                                   for b in run.bases))


def stop_all(popens: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM to each of ``popens`` still running, then wait for each up to ``timeout_s`` and
    SIGKILL it after: all of them stop at once, not one after another."""
    for p in popens:
        if p.poll() is None:
            p.terminate()
    for p in popens:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()


def _stop(started: dict[str, tuple[subprocess.Popen, str]], procs: list[Proc]) -> None:
    for popen, _ in started.values():
        if popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                popen.kill()
    for p in procs:
        p.stop()


def stop_mode(run: ModeRun) -> None:
    """Stop the peers (SIGTERM, then SIGKILL after 10 s), then pdlb and the engines."""
    _stop(run.started, run.procs)


async def run_mode(mode: str, args: argparse.Namespace, peer_cmds: dict[str, list[str]]) -> dict:
    """Measure one mode; returns per-repeat results ``{"direct": [...], "pdlb": [...], PEER: [...]}``
    (``peer_cmds``: the peers to run, those of them that speak ``mode``), and ``"peers"``: the
    names of the peers that started."""
    run = await start_mode(mode, args, peer_cmds)
    try:
        print(run.header(args))
        for k in range(1, args.repeat + 1):
            await measure_repeat(run, args, k)
        await measure_paired(run, args)
    finally:
        stop_mode(run)
    return run.out


def _base_name(k: int) -> str:
    return "pdlb@base" if k == 0 else f"pdlb@base{k + 1}"


def _pdlb_name(processes: int, args: argparse.Namespace) -> str:
    if processes == 0:
        return f"pdlb x{args.default_processes} (default)"
    return "pdlb" if processes == 1 else f"pdlb x{processes}"


def add_variant_arg(ap: argparse.ArgumentParser) -> None:
    """``--variant NAME=ARGS`` (repeatable): a row ``pdlb xN, NAME`` (:func:`parse_variants`)."""
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also measure pdlb serve with the default process count and ARGS added, as row "
                         "'pdlb xN, NAME' (repeatable), e.g. 'aiohttp client=--upstream-client aiohttp'")


def parse_variants(ap: argparse.ArgumentParser, given: list[str]) -> list[tuple[str, list[str]]]:
    """``--variant`` values as ``(NAME, ARGS split as a shell would)``; a value without ``=``, with
    an empty NAME, or a NAME given twice stops ``ap`` (exit status 2)."""
    variants: list[tuple[str, list[str]]] = []
    for v in given:
        name, sep, extra = v.partition("=")
        if not sep or not name.strip():
            ap.error(f"--variant must be NAME=ARGS, got {v!r}")
        if name.strip() in (n for n, _ in variants):
            ap.error(f"--variant: the name {name.strip()!r} is given twice")
        try:
            variants.append((name.strip(), shlex.split(extra)))
        except ValueError as e:
            ap.error(f"--variant {v!r}: {e}")
    return variants


def _variant_name(name: str, extra: list[str], args: argparse.Namespace) -> str:
    """``pdlb xN, NAME``: N the ``--processes`` given in the variant's arguments, else the default."""
    n = args.default_processes
    if "--processes" in extra[:-1]:
        n = extra[extra.index("--processes") + 1]
    return f"pdlb x{n}, {name}"


def _ratios(res: dict, name: str, peer: str) -> dict[str, list[float]]:
    """Per repeat, ``name`` / ``peer``: req/s, CPU per request, added p50 and p99 (added-latency
    ratios only where the peer's added latency is over 0.1 ms: below that it is noise)."""
    out: dict[str, list[float]] = {"rps": [], "cpu": [], "a50": [], "a99": []}
    for o, t, d in zip(res[name], res[peer], res["direct"]):
        out["rps"].append(o["rps"] / t["rps"])
        out["cpu"].append(o["cpu_us"] / t["cpu_us"])
        for q, key in (("p50", "a50"), ("p99", "a99")):
            if _added_ms(t, d, q) > 0.1:
                out[key].append(_added_ms(o, d, q) / _added_ms(t, d, q))
    return out


def _med(xs: list[float], width: int = 10) -> str:
    return f"{statistics.median(xs):{width}.2f}x" if xs else f"{'n/a':>{width + 1}}"


def _summary(results: dict[str, dict]) -> None:
    print("\n== summary (medians over repeats; ratios taken per repeat, then the median) ==")
    print(f"{'mode':9}{'router':24}{'added p50 ms':>13}{'added p99 ms':>13}{'max req/s':>11}{'CPU us/req':>12}")
    verdicts = []
    table = []
    for mode, res in results.items():
        paired = res.get("paired", [])
        peers = res.get("peers", [])
        pdlb_names = [k for k in res if k.startswith("pdlb")]
        med = {}
        for name in [*pdlb_names, *peers]:
            runs = res[name]
            if not runs:
                continue
            a50 = statistics.median(_added_ms(r, d, "p50") for r, d in zip(runs, res["direct"]))
            a99 = statistics.median(_added_ms(r, d, "p99") for r, d in zip(runs, res["direct"]))
            rps = statistics.median(r["rps"] for r in runs)
            cpu = statistics.median(r["cpu_us"] for r in runs)
            med[name] = (a50, a99, rps, cpu)
            print(f"{mode:9}{name:24}{a50:13.2f}{a99:13.2f}{rps:11.0f}{cpu:12.0f}")
        for base in [k for k in pdlb_names if k.startswith("pdlb@base")] if "pdlb" in res else ():
            r_cpu = [o["cpu_us"] / b["cpu_us"] for o, b in zip(res["pdlb"], res[base])]
            r_rps = [o["rps"] / b["rps"] for o, b in zip(res["pdlb"], res[base])]
            rc = statistics.median(r_cpu)
            print(f"{mode:9}{'pdlb / ' + base:24}{'':26}{statistics.median(r_rps):10.2f}x{rc:11.2f}x"
                  f"   (per repeat: CPU/req {', '.join(f'{x:.2f}' for x in r_cpu)})")
            if paired:
                r_pair = [r["pdlb"] / (r[base] or float("nan")) for r in paired]
                rp = statistics.median(r_pair)
                print(f"{mode:9}{'pdlb / ' + base + ' paired':24}{'':37}{rp:11.2f}x"
                      f"   (per round: {', '.join(f'{x:.2f}' for x in r_pair)})")
            if base == "pdlb@base":
                verdicts.append(f"{mode}: one process's CPU per request {rc:.2f}x the baseline's "
                                f"({'meets' if rc <= 2 / 3 else 'misses'} <= 0.67x)"
                                + (f", paired {rp:.2f}x ({'meets' if rp <= 2 / 3 else 'misses'})" if paired else ""))
        ours = [k for k in pdlb_names if not k.startswith("pdlb@base") and res[k]]
        for name in ours:
            for peer in peers:
                r = _ratios(res, name, peer)
                print(f"{mode:9}{(name + ' / ' + peer)[:23]:24}{_med(r['a50'], 12)}{_med(r['a99'], 12)}"
                      f"{_med(r['rps'])}{_med(r['cpu'], 11)}"
                      f"   (per repeat: req/s {', '.join(f'{x:.2f}' for x in r['rps'])}; "
                      f"CPU/req {', '.join(f'{x:.2f}' for x in r['cpu'])})")
        # the issue-26 table and goals: the default process count (else the last pdlb row) vs each peer
        # (else the last --pdlb-processes row, the most processes; variants are not the main row)
        plain = [k for k in ours if "," not in k] or ours
        main_row = next((k for k in ours if "default" in k), plain[-1] if plain else None)
        if main_row is None or not peers:
            verdicts.append(f"{mode}: no peer comparison" if main_row else f"{mode}: no pdlb row")
            continue
        cells = {p: _ratios(res, main_row, p) for p in peers}
        table.append((mode, main_row, cells))
        best_rps = max(med[p][2] for p in peers)
        best_a99 = min(med[p][1] for p in peers)
        best_cpu = min(med[p][3] for p in peers)
        a50, a99, rps, cpu = med[main_row]
        goal = [f"req/s {rps / best_rps:.2f}x the best peer's ({'meets' if rps >= best_rps else 'misses'} >= 1.0x)",
                f"added p99 {a99:.2f} ms vs the best peer's {best_a99:.2f} ({'meets' if a99 <= best_a99 else 'misses'})",
                f"CPU/req {cpu / best_cpu:.2f}x the best peer's ({'meets' if cpu <= 1.5 * best_cpu else 'misses'} <= 1.5x)"]
        if main_row != "pdlb" and "pdlb" in med:
            own = cpu / med["pdlb"][3]
            goal.append(f"{own:.2f}x one pdlb process's ({'meets' if own <= 1.3 else 'misses'} <= 1.3x)")
        verdicts.append(f"{mode} {main_row}: " + ", ".join(goal))
    if table:
        print("\nissue 26 table (medians of per-repeat ratios, pdlb row / peer; added p99 'n/a' where the peer"
              " adds under 0.1 ms):")
        print("| mode | pdlb row | peer | req/s | CPU per request | added p99 |")
        print("|---|---|---|---|---|---|")
        for mode, row, cells in table:
            for peer, r in cells.items():
                print(f"| {mode} | {row} | {peer} | {_med(r['rps'], 0).strip()} | {_med(r['cpu'], 0).strip()} | "
                      f"{_med(r['a99'], 0).strip()} |")
    print("goals: " + "; ".join(verdicts))
    print("(added p99 from closed-loop runs on a shared host is dominated by CPU contention; compare ratios)")


def _cpu_range(text: str) -> frozenset[int]:
    """``"0-3"`` -> {0, 1, 2, 3}; ``"8"`` -> {8} (CPU numbers >= 0, low to high)."""
    lo, _, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        first, last = -1, -1
    if first < 0 or last < first:
        raise ValueError(f"{text!r} is not N or LOW-HIGH with 0 <= LOW <= HIGH")
    return frozenset(range(first, last + 1))


def _cpu_list(text: str, ap: argparse.ArgumentParser) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8}."""
    try:
        return set().union(*comma_list(text, _cpu_range, "CPU numbers or ranges like 0-7 or 0,2,4"))
    except CommaListError as e:
        ap.error(f"--router-cpus: {e}")


def add_fleet_args(ap: argparse.ArgumentParser, *, duration_s: float, max_concurrency: int, pdlb_processes: str,
                   engines: int, pd_engines: int, load_processes: int, repeat_help: str) -> None:
    """The options this bench shares with ``bench/issue26_table.py`` (one declaration, each
    script's defaults): run length, clients, repeats, modes, peers, pdlb process counts, engine and
    client counts, router CPUs. :func:`check_fleet_args` validates what they parse to."""
    ap.add_argument("--duration-s", type=positive_float, default=duration_s,
                    help=f"seconds per latency and per throughput run (default {duration_s:g})")
    ap.add_argument("--concurrency", type=positive_int, default=16, help="closed-loop clients for latency (default 16)")
    ap.add_argument("--max-concurrency", type=positive_int, default=max_concurrency,
                    help=f"closed-loop clients for max req/s (default {max_concurrency})")
    ap.add_argument("--repeat", type=positive_int, default=3, help=repeat_help)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default all)")
    ap.add_argument("--peers", default=",".join(PEERS), metavar="LIST",
                    help=f"comma list of peers to measure, of {', '.join(PEERS)}; 'none': pdlb alone (default all)")
    ap.add_argument("--pdlb-processes", default=pdlb_processes, metavar="LIST",
                    help=f"comma list of 'pdlb serve --processes' values to measure (default {pdlb_processes})")
    ap.add_argument("--engines", type=positive_int, default=engines, metavar="N",
                    help=f"mixed engines in regular mode (default {engines})")
    ap.add_argument("--pd-engines", type=positive_int, default=pd_engines, metavar="N",
                    help=f"prefill engines and decode engines (N each) in the PD modes (default {pd_engines})")
    ap.add_argument("--load-processes", type=positive_int, default=load_processes, metavar="K",
                    help=f"client processes for the throughput run (default {load_processes})")
    ap.add_argument("--router-cpus", metavar="LIST",
                    help="pin the routers to these CPUs (e.g. 0-7), engines and clients to the others (default: no pinning)")
    for peer in PEERS.values():
        ap.add_argument(f"--{peer.name}", metavar="CMD", dest=f"cmd_{peer.name}",
                        help=f"command that runs '{' '.join(peer.argv)}' with the args appended (default: "
                             f"{peer.package}=={peer.version} in its own environment, installed on first use)")


def check_fleet_args(ap: argparse.ArgumentParser, args: argparse.Namespace, *, min_processes: int) -> None:
    """Validate and convert :func:`add_fleet_args`' options in place (``ap.error``, exit status 2,
    on bad input; lists by :func:`pdlb_cli.comma_lists.comma_list`: no empty item, no item twice):
    ``modes`` a list; ``peer_names`` the peers to measure (``--peers``, less ``none``);
    ``pdlb_processes`` a sorted list of counts >= ``min_processes`` (0 = pdlb's default, sorted last); ``router_cpus`` / ``other_cpus`` CPU sets or None (the
    router CPUs a proper subset of this process's affinity); ``default_processes`` what ``pdlb
    serve`` starts on the router CPUs without --processes."""
    try:
        args.modes = comma_list(args.modes, one_of(MODES), f"modes of {', '.join(MODES)}")
    except CommaListError as e:
        ap.error(f"--modes: {e}")
    try:  # peer_names: the peers to measure ("none": pdlb alone)
        peers = comma_list(args.peers, one_of([*PEERS, "none"]), f"peers of {', '.join(PEERS)} or none")
    except CommaListError as e:
        ap.error(f"--peers: {e}")
    args.peer_names = [p for p in peers if p != "none"]
    if args.repeat < 1 or not (math.isfinite(args.duration_s) and args.duration_s > 0):
        ap.error("--repeat must be >= 1 and --duration-s a finite number > 0")
    if min(args.engines, args.pd_engines, args.load_processes, args.concurrency, args.max_concurrency) < 1:
        ap.error("--engines, --pd-engines, --load-processes, --concurrency and --max-concurrency must be >= 1")
    default = " (0: pdlb's default)" if min_processes == 0 else ""
    counts = f"integers >= {min_processes}{default}"

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < min_processes:
            raise ValueError(f"expected an integer >= {min_processes}{default}, got {text!r}")
        return value
    try:
        args.pdlb_processes = sorted(comma_list(args.pdlb_processes, count, counts), key=lambda k: k or 1e9)
    except CommaListError as e:
        ap.error(f"--pdlb-processes: {e}")
    all_cpus = os.sched_getaffinity(0)
    args.router_cpus = _cpu_list(args.router_cpus, ap) if args.router_cpus else None
    if args.router_cpus and not args.router_cpus < all_cpus:
        ap.error(f"--router-cpus must be a proper subset of the CPUs this bench may use ({sorted(all_cpus)})")
    args.other_cpus = (all_cpus - args.router_cpus) if args.router_cpus else None
    # what `pdlb serve` starts without --processes: its CPUs (the router CPUs), one in LOCAL_ENGINE_CORE_SHARE of
    # them since this bench's engines are on this host (issue 30); the rows are named with that count
    args.default_processes = pdlb_default_processes(args.router_cpus)


def main() -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(__doc__.splitlines()[1:]))
    add_fleet_args(ap, duration_s=5.0, max_concurrency=64, pdlb_processes="1", engines=2, pd_engines=1,
                   load_processes=1, repeat_help="interleaved repeats per mode (default 3)")
    ap.add_argument("--baseline", metavar="DIR", type=Path, action="append",
                    help="also measure pdlb serve (one process) from this checkout, e.g. the main branch's (repeatable)")
    ap.add_argument("--paired-rounds", type=nonnegative_int, default=5, metavar="N",
                    help="with --baseline: after the repeats, N rounds driving one pdlb process and every baseline at "
                         "the same time for CPU per request (0: none; default 5)")
    add_variant_arg(ap)
    ap.add_argument("--peer-wheels", type=Path, metavar="DIR",
                    help="a folder of wheels pip may use when it installs a peer (default: the registry only)")
    args = ap.parse_args()
    check_fleet_args(ap, args, min_processes=0)
    modes = args.modes
    for checkout in args.baseline or []:
        if not is_pdlb_checkout(checkout):
            ap.error(f"--baseline {checkout}: not a pdlb checkout (no pdlb_cli/main.py)")
    args.variant = parse_variants(ap, args.variant)
    wanted = args.peer_names
    peer_cmds = {}
    for name in wanted:
        if any(m in PEERS[name].modes for m in modes):
            cmd = peer_command(PEERS[name], getattr(args, f"cmd_{name}"), args.peer_wheels)
            if cmd is not None:
                peer_cmds[name] = cmd
    print(f"host: {os.cpu_count()} CPUs shared by the load generator, routers and engines")
    results = {mode: asyncio.run(run_mode(mode, args, peer_cmds)) for mode in modes}
    _summary(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
