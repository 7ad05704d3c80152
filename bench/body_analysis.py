"""What the body worker spends on one large token-id prompt: CPU and peak memory (issue 25).

``balancer.service.body_offload.analyze`` (the work the router's body-parsing worker process does
per large body: parse, check, extract the prompt, hash its blocks) on issue 25's 32 MB prompt of
3.7M token ids, with the prompt read as one integer array (``_compact_ids``, the default) and,
as the baseline in the same run, as a list of Python ints (the path every value took before:
``COMPACT_IDS_MIN_CHARS`` set out of reach). Each measurement runs in a fresh interpreter
(``python -c``), so that its peak resident memory (``ru_maxrss``) is its own; CPU time is the
process's (``time.process_time``: what a loaded host does not change).

Run (from the repository root)::

    .venv/bin/python bench/body_analysis.py [--repeat 3] [--tokens 3700000]

Prints per mode the median CPU seconds and peak-RSS growth (MB) over the repeats, and the ratios
compact / list. Both modes must give the same analysis (checked: token count and block hashes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, resource, sys, time
import balancer.service.body_offload as bo
from balancer.service.prompt import PromptHasher
from sim.emulator.hostile import token_id_prompt
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "list":
    bo.COMPACT_IDS_MIN_CHARS = 1 << 62
hasher = PromptHasher(64, 4.0, None)
bo.analyze(token_id_prompt(1000), "completions", None, 1 << 20, 16, hasher, {})  # imports, first calls
raw = token_id_prompt(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open("/proc/self/statm") as f:
    rss0 = int(f.read().split()[1]) * 4096
t = time.process_time()
a = bo.analyze(raw, "completions", None, 1 << 20, 16, hasher, {})
cpu = time.process_time() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"cpu_s": cpu, "peak_growth_bytes": peak - rss0, "n_tokens": a.n_tokens,
                  "hashes": [len(a.hashes), a.hashes[0], a.hashes[-1]]}))
"""


def measure(mode: str, n_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(n_tokens)], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import positive_int
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per mode, alternating (default 3)")
    p.add_argument("--tokens", type=positive_int, default=3_700_000, help="token ids in the prompt (default 3.7M: 32 MB)")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"list": [], "compact": []}
    for _ in range(args.repeat):
        for mode in runs:
            runs[mode].append(measure(mode, args.tokens))
    same = {json.dumps([r["n_tokens"], r["hashes"]]) for rs in runs.values() for r in rs}
    print(f"analyze() of a prompt of {args.tokens:,} token ids; {args.repeat} runs per mode, each in a fresh process; "
          f"load average {os.getloadavg()[0]:.1f}")
    med = {}
    for mode, rs in runs.items():
        cpu = statistics.median(r["cpu_s"] for r in rs)
        mem = statistics.median(r["peak_growth_bytes"] for r in rs)
        med[mode] = (cpu, mem)
        cpus = ", ".join(f"{r['cpu_s']:.2f}" for r in rs)
        mems = ", ".join(f"{r['peak_growth_bytes'] / 1e6:.0f}" for r in rs)
        print(f"  {mode:8s} CPU {cpu:6.2f} s (runs: {cpus})   peak RSS growth {mem / 1e6:7.1f} MB (runs: {mems})")
    print(f"  compact / list: CPU x{med['compact'][0] / med['list'][0]:.2f}, peak memory x{med['compact'][1] / med['list'][1]:.2f}")
    print(f"  same analysis in every run: {len(same) == 1}")
    return 0 if len(same) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
