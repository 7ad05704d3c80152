"""Soak of ``pdlb serve`` under mixed hostile traffic (issue 25): RSS and ``/health`` latency.

A real ``pdlb serve`` (one process) in front of three fake engines (1 prefill, 2 decode; SGLang
protocol; :func:`sim.emulator.hostile.spawn_hostile_cluster`). First an idle phase (the anchor:
the same router, probed with no other traffic), then ``--duration-s`` of mixed hostile traffic:
the actions of :data:`sim.emulator.hostile.ACTIONS` (32 MB token-id prompts the engines refuse,
20 MB ``logit_bias`` maps, 900k-message chats, gzip bombs, malformed bearer tokens, admin adds of
1,024 DP ranks with ``/metrics`` scrapes, endless SSE lines, ``Content-Length: -5`` floods, a
wedged engine) chosen at random, one after another, while a child process probes ``GET /health``
every 50 ms and the router's RSS (and its body-parsing worker's) is sampled every second.

Prints, for the idle phase and the hostile phase: probe p50/p99/max, the router's own event-loop
lag (``pdlb_event_loop_lag_seconds``: share over 100 ms, count over 250 ms) and its CPU lag
(``pdlb_event_loop_cpu_lag_seconds``, :mod:`balancer.service.loop_watch`: the part of the lag the
router's CPU time explains; a busy host stretches the lag, not this), the CPUs other work on the
host took meanwhile (:class:`sim.emulator.hostile.HostCpu`), RSS at the start, the peak and the
end, anonymous memory (RSS without mapped files) at the start and the end, the ratios
hostile/idle, and per action the statuses and the probe's worst.

Run (from the repository root)::

    .venv/bin/python bench/hostile_soak.py --duration-s 600
    .venv/bin/python bench/hostile_soak.py --duration-s 120 --seed 3   # a shorter run
    .venv/bin/python bench/hostile_soak.py --duration-s 120 --memory-report [--tracemalloc 12]

``--memory-report`` starts the router with ``PDLB_DEBUG_MEMORY=1`` and reads its
``GET /debug/memory`` (:mod:`balancer.service.memory_debug`) after the warm-up and at the end, then
again after a full garbage collection and after ``malloc_trim``: the RSS each step gives back tells
cyclic garbage (collection) from free heap kept by malloc (trim) from live objects (neither), and
the growth of object counts per type (and, with ``--tracemalloc N``, of allocations per traceback
of N frames) says what lives. ``--actions a,b`` runs only those actions.

Exit status 1 if an action got an unexpected status (a 5xx) or the router died.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim.emulator.hostile import (ACTIONS, CPU_LAG, EXPECTED, HostCpu, LoopLag, Probe,  # noqa: E402
                                  loop_lag_counts, spawn_hostile_cluster, warm_up)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _line(label: str, lat: list[float], lag: LoopLag, cpu_lag: LoopLag, foreign_cores: float) -> str:
    return (f"{label:8s} probes {len(lat):6d}  p50 {_pct(lat, 0.5) * 1e3:7.1f} ms  p99 {_pct(lat, 0.99) * 1e3:7.1f} ms  "
            f"max {max(lat, default=float('nan')) * 1e3:7.1f} ms | loop lag samples {lag.samples:6d}  "
            f">100 ms {100 * lag.over_100ms / max(1, lag.samples):5.2f}%  >250 ms {lag.over_250ms} | CPU lag "
            f">100 ms {100 * cpu_lag.over_100ms / max(1, cpu_lag.samples):5.2f}%  >250 ms {cpu_lag.over_250ms} | "
            f"other work on the host {foreign_cores:.2f} CPUs")


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import nonnegative_int, positive_float, seed_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=positive_float, default=600.0, help="hostile phase length (default 600)")
    p.add_argument("--idle-s", type=positive_float, default=20.0, help="idle (anchor) phase length (default 20)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--memory-report", action="store_true", help="read GET /debug/memory before and after (docstring)")
    p.add_argument("--tracemalloc", type=nonnegative_int, default=0, metavar="FRAMES",
                   help="with --memory-report: trace the router's allocations from the warm-up on, FRAMES frames deep (default 0: off)")
    p.add_argument("--actions", help="comma-separated subset of the actions (default: all)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    names = list(ACTIONS)
    if args.actions:
        from pdlb_cli.comma_lists import list_arg, one_of

        names = list_arg(p, "--actions", args.actions, f"actions of {', '.join(ACTIONS)}", one_of(ACTIONS))
    if args.memory_report:
        os.environ["PDLB_DEBUG_MEMORY"] = "1"
    reports: list[tuple[str, dict]] = []
    c = spawn_hostile_cluster(tempfile.mkdtemp(prefix="pdlb-soak-"))
    rss: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss.append((time.monotonic(), *c.rss()))
            stop.wait(1.0)

    try:
        warm_up(c)
        time.sleep(1.0)
        if args.memory_report:
            reports.append(("after warm-up", memory_report(c, f"trace={args.tracemalloc}" if args.tracemalloc else "")))
        base_main, base_children = c.rss()
        base_anon = c.anon()[0]
        # idle anchor
        lag0, host0 = loop_lag_counts(c.router.url), HostCpu.now()
        probe = Probe(c.router.url)
        time.sleep(args.idle_s)
        idle = probe.stop()
        idle_foreign = host0.foreign_cores(HostCpu.now())
        lag0b = loop_lag_counts(c.router.url)
        idle_lag, idle_cpu_lag = LoopLag.between(lag0, lag0b), LoopLag.between(lag0, lag0b, CPU_LAG)
        # hostile phase
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        lag1, host1 = loop_lag_counts(c.router.url), HostCpu.now()
        probe = Probe(c.router.url)
        t0 = time.monotonic()
        per_action: dict[str, list[tuple[float, float, list[int]]]] = {}
        bad = 0
        while time.monotonic() - t0 < args.duration_s:
            name = rng.choice(names)
            a0 = time.monotonic()
            statuses = ACTIONS[name](c)
            per_action.setdefault(name, []).append((a0, time.monotonic(), statuses))
            if not set(statuses) <= EXPECTED[name] or not c.router.alive():
                bad += 1
                print(f"unexpected: {name} -> {statuses}", flush=True)
                if not c.router.alive():
                    break
        hostile = probe.stop()
        hostile_foreign = host1.foreign_cores(HostCpu.now())
        lag1b = loop_lag_counts(c.router.url)
        hostile_lag, hostile_cpu_lag = LoopLag.between(lag1, lag1b), LoopLag.between(lag1, lag1b, CPU_LAG)
        took = time.monotonic() - t0
        time.sleep(5.0)  # memory settles
        stop.set()
        sampler.join()
        end_main, end_children = c.rss()
        end_anon = c.anon()[0]
        if args.memory_report:
            reports.append(("end", memory_report(c)))
            reports.append(("after gc.collect()", memory_report(c, "collect=1&garbage=1")))
            reports.append(("after malloc_trim", memory_report(c, "trim=1")))
    finally:
        stop.set()
        c.stop()

    print(f"pdlb serve (1 process) + 3 fake engines; idle {args.idle_s:.0f} s, then {took:.0f} s of hostile traffic "
          f"({sum(len(v) for v in per_action.values())} actions, seed {args.seed}); machine: {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(_line("idle", idle.latencies_s, idle_lag, idle_cpu_lag, idle_foreign))
    print(_line("hostile", hostile.latencies_s, hostile_lag, hostile_cpu_lag, hostile_foreign))
    print(f"ratio hostile/idle: probe p99 {_pct(hostile.latencies_s, 0.99) / _pct(idle.latencies_s, 0.99):.2f}x, "
          f"max {hostile.max_s() / idle.max_s():.2f}x; probes that failed: {hostile.errors()}")
    peak_main = max((r[1] for r in rss), default=0)
    peak_children = max((r[2] for r in rss), default=0)
    print(f"RSS router: baseline {base_main / 1e6:.0f} MB, peak {peak_main / 1e6:.0f} MB, end {end_main / 1e6:.0f} MB "
          f"({end_main / base_main:.2f}x baseline); body worker + fork server: baseline {base_children / 1e6:.0f} MB, "
          f"peak {peak_children / 1e6:.0f} MB, end {end_children / 1e6:.0f} MB ({end_children / max(1, base_children):.2f}x)")
    print(f"router anonymous memory (heap, without mapped library code): baseline {base_anon / 1e6:.1f} MB, "
          f"end {end_anon / 1e6:.1f} MB ({end_anon / max(1, base_anon):.3f}x)")
    if rss:
        tail = [r[1] for r in rss if r[0] > rss[-1][0] - 60]
        print(f"RSS router over the last 60 s: median {statistics.median(tail) / 1e6:.0f} MB")
    print("per action: runs, statuses seen, worst probe latency during it")
    times, lats = hostile.times_s, hostile.latencies_s
    for name, runs in sorted(per_action.items()):
        worst = max((lat for t, lat in zip(times, lats) if any(a <= t <= b for a, b, _ in runs)), default=float("nan"))
        seen = sorted({s for _, _, st in runs for s in st})
        print(f"  {name:32s} {len(runs):4d}  {seen}  {worst * 1e3:7.1f} ms")
    if reports:
        print_memory_reports(reports)
    return 1 if bad else 0


def memory_report(c, query: str = "") -> dict:  # noqa: ANN001
    """The router's ``GET /debug/memory`` (JSON)."""
    import json

    from sim.emulator.hostile import ADMIN_KEY, http_request

    status, body = http_request(c.router.url, "GET", "/debug/memory" + (f"?{query}" if query else ""),
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout_s=300)
    if status != 200:
        raise RuntimeError(f"/debug/memory answered {status}: {body[:200]!r}")
    return json.loads(body)


def print_memory_reports(reports: list[tuple[str, dict]]) -> None:
    """RSS, Python and malloc figures of each report, object-type growth and allocation growth."""
    print("router memory (GET /debug/memory):")
    for label, r in reports:
        m, py, pm, sm = r.get("malloc") or {}, r["python"], r.get("pymalloc") or {}, r.get("smaps") or {}
        print(f"  {label:20s} RSS {r['rss_bytes'] / 1e6:6.1f} MB (anonymous {sm.get('Anonymous', 0) / 1e6:6.1f})  "
              f"pymalloc: arenas {pm.get('arena_bytes', 0) / 1e6:6.1f} MB (high-water {pm.get('arenas_highwater', 0)}), blocks in use "
              f"{pm.get('allocated_bytes', 0) / 1e6:6.1f} MB | malloc: in use {m.get('uordblks', 0) / 1e6:6.1f} MB, "
              f"free kept {m.get('fordblks', 0) / 1e6:5.1f} MB, mmapped {m.get('hblkhd', 0) / 1e6:5.1f} MB, "
              f"arenas {m.get('arenas', '?')} | gc objects {py['gc_objects']}"
              + f" | prefix index {r.get('prefix_index_blocks', '?')} blocks"
              + (f", collected {r['collected']}" if "collected" in r else "")
              + (f" (RSS before trim {r['rss_before_trim_bytes'] / 1e6:.1f} MB)" if "rss_before_trim_bytes" in r else ""))
    first, last = reports[0][1]["python"]["types"], reports[1][1]["python"]["types"]
    growth = sorted(((last.get(k, 0) - first.get(k, 0), k) for k in set(first) | set(last)), reverse=True)
    print("  object types, end minus after warm-up: " + ", ".join(f"{k} {d:+d}" for d, k in growth if d)[:1500])
    for label, r in reports:
        if "garbage_types" in r:
            print(f"  cyclic garbage at the end ({label}): types " + ", ".join(f"{k} {v}" for k, v in r["garbage_types"].items()))
            print("    frames: " + ", ".join(f"{k} {v}" for k, v in r["garbage_frames"].items()))
            print("    exceptions: " + ", ".join(f"{k} {v}" for k, v in r["garbage_exceptions"].items()))
    tm = reports[1][1].get("tracemalloc")
    if tm and tm.get("growth"):
        print(f"  tracemalloc: traced {tm['traced_bytes'] / 1e6:.1f} MB; growth by traceback since the warm-up:")
        for g in tm["growth"][:12]:
            print(f"    {g['size_diff_bytes'] / 1e3:+9.1f} kB {g['count_diff']:+7d} blocks  {' <- '.join(reversed(g['traceback']))}")


if __name__ == "__main__":
    sys.exit(main())
