#!/usr/bin/env python3
"""Issue 26's whole table in one run inside a time budget: pdlb vs smg, sglang-router, vllm-router; route decisions.

pdlb against smg, sglang-router and vllm-router in regular, SGLang-PD and vLLM-PD modes, then the
route-decision table.

Made for one call of at most 600 s on the 16-core GPU host (``.dev/device/bin/b6.sh`` runs it
there; see docs/serving.md), and usable anywhere::

    .venv/bin/python bench/issue26_table.py --out results/issue26 --budget-s 520 --router-cpus 0-7 \\
        --smg 'smg launch' --sglang-router 'sglang-router launch' --vllm-router vllm-router
    .venv/bin/python bench/issue26_table.py --out /tmp/i26 --budget-s 240 --duration-s 1 \\
        --pdlb-processes 1,2 --route-args '--policies ep_aware,round_robin --replicas 64 --requests 200'

What it does, in order:

1. starts every mode's processes at once, as ``bench/router_overhead.py`` does for one mode
   (:func:`router_overhead.start_mode`): each mode its own zero-delay engines and direct engine,
   pdlb at each ``--pdlb-processes`` count (default 1 and 8), and the peers that speak the mode
   (smg and sglang-router: regular and SGLang PD; vllm-router: regular and vLLM PD), all pinned
   to ``--router-cpus`` with engines and load on the other CPUs. A router waiting for its turn is
   idle; only the one measured gets requests.
2. measures the repeats interleaved across modes: repeat 1 of every mode, then repeat 2, ...
   (``--repeat``, default 3); one repeat of a mode measures the direct engine, every pdlb row and
   every peer in turn (:func:`router_overhead.measure_repeat`: latency at ``--concurrency``, then
   max req/s at ``--max-concurrency`` from ``--load-processes`` client processes with the router's
   CPU time per request). Repeat 1 always runs; a later repeat starts only if it fits before the
   measurement deadline (``--budget-s`` less ``--route-s``), each mode's block estimated by
   :func:`block_estimate_s`, so a slower host gets fewer repeats, never a mode left out. After
   every block the raw results are rewritten to ``OUT/overhead.json``, so a run cut short keeps
   what it measured.
3. prints ``router_overhead``'s summary (medians, per-repeat ratios, its issue-26 table and goal
   verdicts), then the issue's own layout (:func:`issue_table`: pdlb at the most processes / each
   peer, req/s, CPU per request, added p99) and the absolute figures (:func:`absolute_lines`: CPU
   per request and req/s of every row, the most processes vs one).
4. runs ``bench/route_latency.py ROUTE_ARGS`` (default: every policy, 64 and 512 ranks, 32k-token
   prompts, KV events applied concurrently at 2,000/s, 256 requests in flight, CPU clock) as a child
   with the time left (at least ``--route-s``), its output printed and kept in ``OUT/route.txt``.
   ``--route-args`` is checked by route_latency.py's own parser before anything starts (a bad one
   stops the run at once, naming ``--route-args``). One sample per row by default; add
   ``--repeat N`` to it for N rounds, configurations interleaved, per row the median and min-max
   range (N times the table's time: give ``--route-s`` room for it).

Ratios are taken per repeat, then the median (pdlb and a peer measured in the same repeat); on a
busy host absolute figures are pessimistic for every router. Added p99 is a ratio only where the
peer adds over 0.1 ms (below that, noise): otherwise the cell gives both added p99s in ms.
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
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402
from pdlb_cli.args import ArgumentParser  # noqa: E402

#: the issue's names for the modes
MODE_LABELS = {"regular": "regular", "pd": "PD, SGLang bootstrap", "vllm-pd": "PD, vLLM protocol"}
#: route_latency.py's arguments for the issue's decision goal (p99 <= 100 us at 64 ranks, <= 200 us at 512)
ROUTE_ARGS = ("--replicas 64,512 --prompts 32768 --requests 2000 --clock cpu --in-flight 256 "
              "--kv-events-per-s 2000")
#: seconds one measured row costs besides its two runs of --duration-s: the 1 s connection warm-up,
#: the 1.5 s the client processes wait to start together, and their start-up and report (~0.5 s)
ROW_OVERHEAD_S = 3.0


def block_estimate_s(rows: int, duration_s: float, taken_s: list[float]) -> float:
    """Seconds one repeat of one mode will take: the longest it took before (``taken_s``), else
    ``rows`` x (2 x ``duration_s`` + :data:`ROW_OVERHEAD_S`) (each row: a latency and a throughput
    run)."""
    if taken_s:
        return max(taken_s)
    return rows * (2 * duration_s + ROW_OVERHEAD_S)


def repeat_fits(now_s: float, deadline_s: float, estimates_s: list[float]) -> bool:
    """Whether a whole repeat (every mode's block, ``estimates_s``) ends by ``deadline_s``."""
    return now_s + sum(estimates_s) <= deadline_s


def most_processes_row(res: dict[str, Any]) -> str | None:
    """The pdlb row with the most processes that has results (``pdlb xN``; ``pdlb`` = one process)."""
    def count(name: str) -> int:
        return 1 if name == "pdlb" else int(name.split()[1][1:])
    rows = [k for k in res if (k == "pdlb" or (k.startswith("pdlb x") and "," not in k and "default" not in k))
            and res[k]]
    return max(rows, key=count) if rows else None


def _median_added_ms(res: dict[str, Any], name: str, q: str) -> float:
    return statistics.median(ro._added_ms(r, d, q) for r, d in zip(res[name], res["direct"]))


def issue_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's table: per mode, pdlb at the most processes / each peer that ran: req/s, CPU per
    request, added p99 (medians of per-repeat ratios; the added p99 cell gives both routers' added
    p99 in ms where the peer adds under 0.1 ms, as :func:`router_overhead._ratios` leaves it out)."""
    lines = ["| mode | pdlb row | pdlb / peer: req/s | CPU per request | added p99 |", "|---|---|---|---|---|"]
    for mode, res in results.items():
        row = most_processes_row(res)
        peers = [p for p in res.get("peers", []) if res.get(p)]
        if row is None or not peers:
            continue
        cells = {p: ro._ratios(res, row, p) for p in peers}

        def ratio(p: str, key: str) -> str:
            xs = cells[p][key]
            return f"{p} {statistics.median(xs):.2f}x" if xs else ""

        a99 = []
        for p in peers:
            a99.append(ratio(p, "a99") or (f"{p} n/a ({_median_added_ms(res, row, 'p99'):+.2f} vs "
                                          f"{_median_added_ms(res, p, 'p99'):+.2f} ms)"))
        lines.append(f"| {MODE_LABELS.get(mode, mode)} | {row} | {', '.join(ratio(p, 'rps') for p in peers)} | "
                     f"{', '.join(ratio(p, 'cpu') for p in peers)} | {', '.join(a99)} |")
    if len(lines) == 2:  # no mode had both a pdlb row and a peer that ran: say so, not an empty table
        return ["(no peer ran in any mode (--peers none, or every peer failed to start): nothing to compare; "
                "the absolute figures follow)"]
    return lines


def absolute_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Per mode, the medians over repeats of every row: CPU us per request and req/s; the most
    processes' CPU per request against one process's (the issue's <= 1.3x goal)."""
    lines = []
    for mode, res in results.items():
        names = [k for k in res if k.startswith("pdlb") and res[k]] + [p for p in res.get("peers", []) if res.get(p)]
        if not names:
            continue
        cpu = {k: statistics.median(r["cpu_us"] for r in res[k]) for k in names}
        rps = {k: statistics.median(r["rps"] for r in res[k]) for k in names}
        row = most_processes_row(res)
        own = (f"; {row} / pdlb CPU per request {cpu[row] / cpu['pdlb']:.2f}x"
               if row not in (None, "pdlb") and "pdlb" in cpu else "")
        lines.append(f"{MODE_LABELS.get(mode, mode)}: CPU us per request " + ", ".join(f"{k} {cpu[k]:.0f}" for k in names)
                     + "; req/s " + ", ".join(f"{k} {rps[k]:.0f}" for k in names) + own
                     + f" ({len(res.get('direct', []))} repeats)")
    return lines


def write_json(path: Path | None, results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "results": {mode: {row: [per repeat {p50, p99 (s), rps, n, cpu_us}], "peers": [...]}}}``,
    written whole to a side file first, then renamed (a reader never sees half a file)."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    tmp.replace(path)


async def measure_all(args: argparse.Namespace, peer_cmds: dict[str, list[str]], deadline_s: float,
                      json_path: Path | None, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Steps 1 and 2 of the module's doc: every mode started, then the repeats interleaved across
    modes until ``--repeat`` or the deadline (``time.monotonic()`` seconds); the results per mode."""
    runs: dict[str, ro.ModeRun] = {}
    results: dict[str, dict[str, Any]] = {}
    taken: dict[str, list[float]] = {}
    broken: set[str] = set()
    try:
        for mode in args.modes:
            t0 = time.monotonic()
            try:
                runs[mode] = await ro.start_mode(mode, args, peer_cmds)
            except Exception as e:  # e.g. a pdlb row that did not start: the other modes still run
                print(f"{mode}: not started ({e}); the other modes go on", flush=True)
                continue
            results[mode] = runs[mode].out
            taken[mode] = []
            print(f"{mode}: started in {time.monotonic() - t0:.1f} s (pdlb rows {', '.join(runs[mode].pdlbs)}; "
                  f"peers {', '.join(runs[mode].out['peers']) or 'none'})", flush=True)
        for k in range(1, args.repeat + 1):
            live = {m: r for m, r in runs.items() if m not in broken}
            est = [block_estimate_s(1 + len(r.pdlbs) + len(r.out["peers"]), args.duration_s, taken[m])
                   for m, r in live.items()]
            if not live:
                break
            if k > 1 and not repeat_fits(time.monotonic(), deadline_s, est):
                print(f"\nrepeat {k} not started: it needs ~{sum(est):.0f} s, {deadline_s - time.monotonic():.0f} s "
                      f"are left before the route table's share ({args.repeat} asked, {k - 1} measured)", flush=True)
                break
            for mode, run in live.items():
                print(run.header(args) + f" (repeat {k} of {args.repeat})", flush=True)
                t0 = time.monotonic()
                try:
                    await ro.measure_repeat(run, args, k)
                except Exception as e:  # a router that died mid-run: keep what was measured, leave the mode out
                    print(f"{mode}: repeat {k} failed ({e!r}); this mode is left out of later repeats", flush=True)
                    broken.add(mode)
                taken[mode].append(time.monotonic() - t0)
                meta["block_s"] = taken
                write_json(json_path, results, meta)
    finally:
        for run in runs.values():
            ro.stop_mode(run)
    return results


ROUTE_SCRIPT = Path(__file__).resolve().parent / "route_latency.py"


def run_route(route_args: list[str], timeout_s: float, out_path: Path | None, script: Path = ROUTE_SCRIPT) -> int:
    """``bench/route_latency.py ROUTE_ARGS`` (``script``) in a child for at most ``timeout_s``, its
    lines printed as they come and written to ``out_path``; its exit status (124 when stopped at the
    limit: the lines it printed until then are kept)."""
    cmd = [sys.executable, "-u", str(script), *route_args]
    print(f"\n== route decisions: {' '.join(shlex.quote(a) for a in cmd[2:])} (limit {timeout_s:.0f} s)", flush=True)
    sink = out_path.open("w") if out_path else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:  # until the child's output closes (it exits or is killed)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if sink:
                sink.write(line)
                sink.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = 124
    reader.join(10)
    if rc == 124:
        note = f"route_latency.py stopped at its limit of {timeout_s:.0f} s; the lines above are what it finished\n"
        print(note, end="")
        if sink:
            sink.write(note)
    if sink:
        sink.close()
    return rc


def check_route_args(ap: argparse.ArgumentParser, route_args: list[str]) -> None:
    """``--route-args`` read by bench/route_latency.py's parser and its option checks (lists,
    ``--repeat``), nothing measured: a bad value stops ``ap`` (exit status 2) with route_latency's
    message, naming ``--route-args``, before the fleet's minutes rather than after them."""
    import contextlib
    import io

    import route_latency as rl

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rap = rl.build_parser()
            rargs = rap.parse_args(route_args)
            rl.list_options(rap, rargs)
            rl.check_repeat(rap, rargs)
    except SystemExit as e:
        if e.code:
            lines = err.getvalue().strip().splitlines() or [f"exit status {e.code}"]
            ap.error(f"--route-args: {lines[-1].split('error: ', 1)[-1]}")


def build_parser() -> argparse.ArgumentParser:
    """The command line (also read by the test that checks .dev/device/bin/b6.sh's options)."""
    from pdlb_cli.arg_types import nonnegative_float, positive_float
    ap = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--out", type=Path, metavar="DIR", help="write overhead.json and route.txt there (default: none)")
    ap.add_argument("--budget-s", type=positive_float, default=520.0,
                    help="seconds for the whole run, route table included (default 520)")
    ap.add_argument("--route-s", type=nonnegative_float, default=150.0,
                    help="seconds kept for the route table out of the budget (default 150; 0: no route table)")
    ap.add_argument("--route-args", default=ROUTE_ARGS,
                    help=f"bench/route_latency.py's arguments (default: every policy, {ROUTE_ARGS})")
    ro.add_fleet_args(ap, duration_s=3.0, max_concurrency=256, pdlb_processes="1,8", engines=4, pd_engines=2,
                      load_processes=4, repeat_help="interleaved repeats, as many as fit (default 3)")
    ro.add_variant_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    if not (math.isfinite(args.budget_s) and args.budget_s > 0 and math.isfinite(args.route_s) and args.route_s >= 0):
        ap.error("--budget-s must be a finite number > 0 and --route-s a finite number >= 0")
    ro.check_fleet_args(ap, args, min_processes=1)
    # what router_overhead's helpers read and this run does not vary
    args.baseline, args.paired_rounds = None, 0
    args.variant = ro.parse_variants(ap, args.variant)
    wanted = args.peer_names
    route_args = shlex.split(args.route_args)
    if args.route_s > 0:
        check_route_args(ap, route_args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    peer_cmds = {}
    for name in wanted:
        if any(m in ro.PEERS[name].modes for m in args.modes):
            cmd = ro.peer_command(ro.PEERS[name], getattr(args, f"cmd_{name}"), None)
            if cmd is not None:
                peer_cmds[name] = cmd
    meta = {"argv": sys.argv[1:] if argv is None else argv, "cpus": os.cpu_count(),
            "router_cpus": sorted(args.router_cpus or []), "peers": {n: ro.PEERS[n].version for n in peer_cmds}}
    print(f"host: {os.cpu_count()} CPUs; routers on {sorted(args.router_cpus) if args.router_cpus else 'any CPU'}; "
          f"budget {args.budget_s:.0f} s ({args.route_s:.0f} s kept for the route table); peers "
          + (", ".join(f"{n} {ro.PEERS[n].version}" for n in peer_cmds) or "none"), flush=True)
    deadline = t_start + args.budget_s - args.route_s
    results = asyncio.run(measure_all(args, peer_cmds, deadline, args.out / "overhead.json" if args.out else None,
                                      meta))
    ro._summary(results)
    print("\nissue 26, the issue's layout (medians of per-repeat ratios; pdlb at the most processes / peer):")
    print("\n".join(issue_table(results)))
    print("\n".join(absolute_lines(results)))
    print(f"measurements took {time.monotonic() - t_start:.0f} s", flush=True)
    if args.route_s > 0:
        left = t_start + args.budget_s - time.monotonic()
        run_route(route_args, max(left, args.route_s), args.out / "route.txt" if args.out else None)
    print(f"issue26_table.py took {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
