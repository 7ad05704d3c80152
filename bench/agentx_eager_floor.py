"""AgentX 440246's 24 rows and step classes with and without the eager-step floor (run by hand;
issue 23 part 1, session 16).

The point's launcher captures CUDA graphs for uniform decode batches only (``cudagraph_mode
FULL_DECODE_ONLY``, compilation ``mode 0``), so every step with a prefill chunk runs eagerly on every
DP rank and lasts at least the host's launch time (:class:`sim.perf.step_class.StepClassPerf`
``eager_floor_s``; values read from the capture's minima, :data:`sim.validation.agentx.EAGER_STEP_FLOOR_S`).
For each floor setting, aiperf warm-up variant and workload seed this runs ``pdlb sim validate
--agentx-440246``'s simulation (:func:`sim.validation.agentx.simulate_440246`, the API server's
tokenization on, the committed deratings) and prints

* every row's error against the published figure and the rows within +-15%;
* the per-rank step records by class against the capture's (count, min, p50, p90, p95, seconds
  per rank) and the share of a rank's prefill-bearing records in which it had no decoding sequence.

The warm-up variants are the pinned aiperf's two unpublished facts (docs/validate.md, "aiperf's
code at the pin"): ``defaults`` (10 think-paced requests per lane, recorded outputs), ``once`` (a
``max_tokens=1`` primer per lane, all at t = 0, then 10 pressure requests without idle delays),
``oncecap`` (the same, pressure requests capped at one output token), ``spread`` / ``spreadcap``
(primers spread by the public corpus' leads, aiperf's later default); ``defaultsbar`` /
``oncecapbar``: the same with a barrier between the warm-up and the measured phase (no lane sends a
measured request before every lane's warm-up has finished: ``warmup_barrier``).

    python bench/agentx_eager_floor.py --floor on,off --variants defaults,oncecap --seeds 42,1,2,3 --jobs 2

About 15 s of CPU per run (one variant at one seed).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdlb_cli.comma_lists import list_arg, one_of  # noqa: E402

#: the pinned aiperf's warm-up as AgenticWorkloadConfig fields (None: the corpus' primer leads,
#: :func:`sim.workload.agentic.weka_primer_lead_quantiles`, filled in at run time)
WARMUPS: dict[str, dict] = {
    "defaults": {},
    "once": dict(warmup_primer=True, warmup_think_s=0.0),
    "oncecap": dict(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1),
    "spread": dict(warmup_primer=True, warmup_think_s=0.0, primer_lead_quantiles_s=None),
    "spreadcap": dict(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1, primer_lead_quantiles_s=None),
    "defaultsbar": dict(warmup_barrier=True),
    "oncecapbar": dict(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1, warmup_barrier=True),
}
FLOORS = {"on": True, "off": False}
STEP_CLASSES = ("prefill_only", "decode_only", "mixed")
#: ranks of the point (records are per rank)
RANKS = 8


def workload_fields(name: str) -> dict:
    """The :class:`sim.workload.agentic.AgenticWorkloadConfig` fields of warm-up variant ``name``."""
    fields = dict(WARMUPS[name])
    if "primer_lead_quantiles_s" in fields:
        from sim.workload.agentic import weka_primer_lead_quantiles
        fields["primer_lead_quantiles_s"] = weka_primer_lead_quantiles()
    return fields


def class_stats(iterations: dict[str, np.ndarray], ranks: int = RANKS) -> dict[str, dict[str, float]]:
    """Per step class (records in seconds, one per rank per step): count, min / p50 / p90 / p95 in
    ms and seconds per rank (sum / ranks); plus ``no_decode_share``: prefill-only records over all
    records with prefill (the share of a rank's prefill-bearing steps in which it decoded nothing)."""
    out: dict[str, dict[str, float]] = {}
    for c in STEP_CLASSES:
        v = np.asarray(iterations.get(c, np.zeros(0)), dtype=np.float64)
        if len(v):
            q = np.percentile(v, [50, 90, 95]) * 1e3
            out[c] = dict(count=float(len(v)), min=float(v.min() * 1e3), p50=float(q[0]), p90=float(q[1]),
                          p95=float(q[2]), s_per_rank=float(v.sum() / ranks))
        else:
            out[c] = dict(count=0.0, min=float("nan"), p50=float("nan"), p90=float("nan"), p95=float("nan"),
                          s_per_rank=0.0)
    with_prefill = out["prefill_only"]["count"] + out["mixed"]["count"]
    out["no_decode_share"] = {"value": out["prefill_only"]["count"] / with_prefill if with_prefill else float("nan")}
    return out


def published_class_stats() -> dict[str, dict[str, float]]:
    """:func:`class_stats`' figures for the capture (``sim/data/measured/agentx_440246.json``)."""
    from sim.validation.agentx import load_published
    it = load_published()["iteration_times_ms"]
    out = {c: dict(count=float(it[c]["count"]), min=float(it[c]["min"]), p50=float(it[c]["p50"]),
                   p90=float(it[c]["p90"]), p95=float(it[c]["p95"]),
                   s_per_rank=float(it[c]["count"] * it[c]["mean"] / 1e3 / RANKS)) for c in STEP_CLASSES}
    out["no_decode_share"] = {"value": out["prefill_only"]["count"] / (out["prefill_only"]["count"] + out["mixed"]["count"])}
    return out


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def run(floor: str, warmup: str, seed: int) -> tuple[str, str, int, dict[str, float], dict]:
    from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, rows_from_metrics, simulate_440246
    from sim.workload.agentic import AgenticWorkloadConfig
    res = simulate_440246(AgenticWorkloadConfig(**workload_fields(warmup), seed=seed),
                          frontend_s_per_token=FRONTEND_S_PER_TOKEN_MEASURED, eager_floor=FLOORS[floor])
    rows = {r.key: r.error for r in rows_from_metrics(res.metrics())}
    return floor, warmup, seed, rows, class_stats(res.iterations)


def print_rows(tasks: list, label: dict, rows: dict) -> None:
    """The 440246 rows as CSV, one column per run: each row's relative error in percent
    (``rows[task][row]`` a fraction), then how many rows of each run lie within +-15%."""
    print("row," + ",".join(label[t] for t in tasks))
    for k in rows[tasks[0]]:
        print(k + "," + ",".join(f"{100 * rows[t][k]:+.1f}" for t in tasks))
    print("rows within 15%," + ",".join(str(sum(abs(v) <= 0.15 for v in rows[t].values())) for t in tasks))


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import int_between
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floor", default="on,off", help="comma list of on, off (the eager-step floor)")
    ap.add_argument("--variants", default="defaults", help=f"comma list of warm-ups: {', '.join(WARMUPS)}")
    ap.add_argument("--seeds", default="42,1,2,3", help="comma list of workload seeds (integers >= 0)")
    ap.add_argument("--jobs", type=int_between(1, 64), default=1, help="parallel runs (processes, 1..64)")
    args = ap.parse_args(argv)
    floors = list_arg(ap, "--floor", args.floor, "on or off", one_of(FLOORS))
    names = list_arg(ap, "--variants", args.variants, "warm-up names", one_of(WARMUPS))
    seeds = list_arg(ap, "--seeds", args.seeds, "integers >= 0", _seed)
    if not 1 <= args.jobs <= 64:
        ap.error("--jobs must be in 1..64")
    tasks = [(f, n, s) for f in floors for n in names for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, *zip(*tasks)))
    label = {t: f"floor {t[0]} {t[1]} s{t[2]}" for t in tasks}
    rows = {(f, n, s): r for f, n, s, r, _ in results}
    stats = {(f, n, s): c for f, n, s, _, c in results}
    print_rows(tasks, label, rows)
    print()
    pub = published_class_stats()
    print("step records,published," + ",".join(label[t] for t in tasks))
    for c in STEP_CLASSES:
        for f in ("count", "min", "p50", "p90", "p95", "s_per_rank"):
            print(f"{c} {f},{pub[c][f]:.1f}," + ",".join(f"{stats[t][c][f]:.1f}" for t in tasks))
    print("no-decode share of prefill records,"
          f"{pub['no_decode_share']['value']:.3f}," + ",".join(f"{stats[t]['no_decode_share']['value']:.3f}" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
