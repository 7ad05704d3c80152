"""Paired CPU per request of ``pdlb serve`` variants (one process each), driven at the same time.

Each variant is ``TREE::ARGS``: a pdlb checkout (its code first on ``PYTHONPATH``) and extra
``pdlb serve`` arguments, e.g. the session start's tree against this one with ``--http-front lean``
and with ``--event-loop uvloop``. Every round drives all variants at once from the same client
processes (``bench/router_overhead.py``'s paired client: what else the host does weighs on all of
them alike), in front of the same zero-delay emulated engines; the first variant is the baseline
of the printed ratios (per round, then the median and range over rounds).

Usage (from the repository root)::

    python bench/front_paired.py --mode regular --rounds 8 --router-cpus 0 \\
        '/path/to/base::' '.::--http-front aiohttp' '.::--http-front lean' \\
        '.::--http-front lean --event-loop uvloop'

``--mode``: ``regular`` (two mixed engines), ``pd`` (SGLang PD: one prefill + one decode) or
``vllm-pd``. ``--router-cpus``: the routers' CPU set (the engines and clients get the others).
Prints one line per round and a summary line per variant; CPU time is each router process's
(user + system, from ``/proc``), divided by the requests it answered in the round.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import router_overhead as ro  # noqa: E402

from sim.emulator.testing import spawn_engines  # noqa: E402


def _spawn_from(checkout: Path, serve_args: list[str], timeout_s: float):  # noqa: ANN202
    """``pdlb serve`` from ``checkout`` (its code first on ``PYTHONPATH``), waited for at most
    ``timeout_s`` (a fresh checkout compiles its numba kernels at the first start)."""
    import os
    import subprocess

    from sim.emulator.testing import _spawn

    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", "import sys; from pdlb_cli.main import main; sys.exit(main(sys.argv[1:]))",
           *serve_args]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(checkout))
    return _spawn(serve_args, timeout_s=timeout_s, popen=popen)


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    engines_spec = ([("mixed", "--zero-delay")] * 2 if args.mode == "regular"
                    else [("prefill", "--zero-delay"), ("decode", "--zero-delay")])
    import os

    all_cpus = os.sched_getaffinity(0)
    router_cpus = args.router_cpus
    other = (all_cpus - router_cpus) if router_cpus and all_cpus - router_cpus else None
    with ro._affinity(other):
        engines = spawn_engines(engines_spec)
    routers = {}
    got: dict[str, list[float]] = {}
    try:
        with ro._affinity(router_cpus):
            for spec in args.variants:
                tree, _, extra = spec.partition("::")
                routers[spec] = _spawn_from(Path(tree).resolve(), ro._pdlb_args(args.mode, engines, 1)
                                            + shlex.split(extra), args.start_timeout_s)
        for p in routers.values():
            await ro._closed_loop(p.url, 8, 0.5)  # warm up
        got = {k: [] for k in routers}
        load = SimpleNamespace(load_processes=args.load_processes, concurrency=args.concurrency,
                               duration_s=args.duration_s, other_cpus=other)
        base = args.variants[0]
        for k in range(args.rounds):
            cpu = await ro._paired_cpu(routers, load)
            for name, us in cpu.items():
                got[name].append(us)
            print(f"round {k + 1}: " + ", ".join(f"[{n}] {us:.0f} us ({us / cpu[base]:.3f}x)"
                                                 for n, us in cpu.items()), flush=True)
        b = got[base]
        for name, v in got.items():
            r = [x / y for x, y in zip(v, b)]
            print(f"{args.mode} [{name}]: median {statistics.median(v):.0f} us/request, median per-round ratio "
                  f"{statistics.median(r):.3f}x (rounds {min(r):.3f}-{max(r):.3f})", flush=True)
    finally:
        for p in [*routers.values(), *engines]:
            p.stop()
    return got


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked (``--router-cpus`` as a CPU set or None: ``router_overhead``'s reading,
    :mod:`pdlb_cli.comma_lists`); a bad value exits with status 2 naming the option."""
    from pdlb_cli.arg_types import positive_float, positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", metavar="TREE::ARGS", help="a pdlb checkout and extra serve arguments")
    ap.add_argument("--mode", choices=["regular", "pd", "vllm-pd"], default="regular",
                    help="regular (two mixed engines), pd (SGLang PD) or vllm-pd (default: regular)")
    ap.add_argument("--rounds", type=positive_int, default=6, help="paired rounds (default: 6)")
    ap.add_argument("--duration-s", type=positive_float, default=3.0, help="seconds of load per round (default: 3)")
    ap.add_argument("--concurrency", type=positive_int, default=32, help="client connections per router (default: 32)")
    ap.add_argument("--load-processes", type=positive_int, default=1, help="client processes (default: 1)")
    ap.add_argument("--start-timeout-s", type=positive_float, default=120.0, help="wait for each router's start (default: 120)")
    ap.add_argument("--router-cpus", default="", help="CPU set of the routers, e.g. 0 or 0-7 (default: any)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or not (0 < args.duration_s < 600) or args.concurrency < 1 or args.load_processes < 1:
        ap.error("--rounds, --concurrency and --load-processes must be >= 1 and --duration-s in (0, 600)")
    for spec in args.variants:
        tree = spec.partition("::")[0]
        if not ro.is_pdlb_checkout(Path(tree)):
            ap.error(f"{tree!r} is not a pdlb checkout")
    args.router_cpus = ro._cpu_list(args.router_cpus, ap) if args.router_cpus else None
    return args


def main(argv: list[str] | None = None) -> int:
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
