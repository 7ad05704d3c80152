"""AgentX 440246 per DP rank: which mechanism puts a rank in prefill with nothing decoding (run by
hand; issue 23 part 1, session 17).

The capture counts per rank its prefill-only records and its 1 s heartbeats (idle seconds;
:mod:`sim.validation.agentx_ranks` reads the FPM patch). For each variant and workload seed this
runs ``pdlb sim validate --agentx-440246``'s simulation (:func:`sim.validation.agentx.simulate_440246`,
the API server's tokenization on, the committed deratings and eager floor) and prints

* every row's error against the published figure and the rows within +-15%;
* across the 8 ranks, prefill-only records against idle seconds (correlation, slope in records per
  idle second, max / min of the prefill-only records, the no-decode share of prefill-bearing
  records), over the whole run and over the warm-up alone, against the capture's;
* the requests per rank (max / min) and the warm-up's length (the measured window's start).

Variants (:data:`VARIANTS`): ``defaults``; ``lane`` (vllm-router's key stays on the lane for the
whole run, as the corpus' long traces make it, ``AgenticWorkloadConfig.routing_key``); ``oncecap``
/ ``oncecapbar`` (aiperf's primer at once, no-delay pressure requests capped at one token, without
/ with the barrier of ``--warmup-grace-period``); ``oncebar`` (the pressure requests keep their
recorded outputs); ``spreadbar`` / ``spreadcapbar`` (primers spread by the public corpus' leads,
aiperf's later default); ``oncecapbar-x1.75`` / ``-x2.6`` and ``spreadcapbar-x1.75`` / ``-x2.6``
(primers 1.75 / 2.6 times longer,
``primer_context_scale``: the primers' length is not published, and aiperf's structure fitted to the
same statistics makes them 1.6-2.8 times the defaults'); ``oncecapbarlane``, ``defaultsbar``.

    python bench/agentx_rank_spread.py --variants defaults,lane,oncecapbar,oncecapbarlane --seeds 42,1,2,3 --jobs 2

About 15 s of CPU per run (one variant at one seed).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentx_eager_floor import print_rows  # noqa: E402  (this folder, on sys.path when run as a script)
from pdlb_cli.comma_lists import list_arg, one_of  # noqa: E402

_WARM = dict(warmup_primer=True, warmup_think_s=0.0, warmup_max_output_tokens=1)
#: the variants as :class:`sim.workload.agentic.AgenticWorkloadConfig` fields
VARIANTS: dict[str, dict] = {
    "defaults": {},
    "lane": dict(routing_key="lane"),
    "oncecap": dict(_WARM),
    "oncecapbar": dict(_WARM, warmup_barrier=True),
    "oncecapbarlane": dict(_WARM, warmup_barrier=True, routing_key="lane"),
    "defaultsbar": dict(warmup_barrier=True),
    "oncebar": dict(warmup_primer=True, warmup_think_s=0.0, warmup_barrier=True),
    "spreadbar": dict(warmup_primer=True, warmup_think_s=0.0, warmup_barrier=True, primer_lead_quantiles_s=None),
    "spreadcapbar": dict(_WARM, warmup_barrier=True, primer_lead_quantiles_s=None),
    # the primers' length, unpublished: aiperf's structure fitted to the same statistics gives 1.6-2.8x
    "oncecapbar-x1.75": dict(_WARM, warmup_barrier=True, primer_context_scale=1.75),
    "oncecapbar-x2.6": dict(_WARM, warmup_barrier=True, primer_context_scale=2.6),
    "spreadcapbar-x1.75": dict(_WARM, warmup_barrier=True, primer_lead_quantiles_s=None, primer_context_scale=1.75),
    "spreadcapbar-x2.6": dict(_WARM, warmup_barrier=True, primer_lead_quantiles_s=None, primer_context_scale=2.6),
}
#: the per-rank statistics printed (keys of :func:`sim.validation.agentx_ranks.rank_spread`)
SPREAD_KEYS = ("corr", "slope", "max_min", "no_decode_share")


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def summarize(result) -> dict[str, float]:  # noqa: ANN001
    """The per-rank figures of one closed-loop run: ``rank_spread`` over the whole run (``all_*``)
    and the warm-up (``warm_*``), ``mixed_max_min`` (the ranks' mixed records, largest over
    smallest), ``requests_max_min``, ``warmup_s``, and the per-rank
    prefill-only records and idle seconds of the whole run (``po_r`` / ``idle_r``, r = 0..7)."""
    from sim.validation.agentx_ranks import rank_spread, simulated_rank_records
    out: dict[str, float] = {}
    for tag, warm in (("all", False), ("warm", True)):
        r = simulated_rank_records(result, warmup_only=warm)
        for k, v in rank_spread(r["prefill_only"], r["idle_s"], r["mixed"]).items():
            out[f"{tag}_{k}"] = v
    mixed = result.rank_class_steps[:, 2].astype(np.float64)
    out["mixed_max_min"] = float(mixed.max() / mixed.min()) if mixed.min() > 0 else float("inf")
    req = np.asarray(result.rank_requests, dtype=np.float64)
    out["requests_max_min"] = float(req.max() / req.min()) if req.min() > 0 else float("inf")
    out["warmup_s"] = float(result.measure_start_s)
    r = simulated_rank_records(result)
    for i, (p, s) in enumerate(zip(r["prefill_only"], r["idle_s"])):
        out[f"po_{i}"], out[f"idle_{i}"] = float(p), float(s)
    return out


def workload_fields(name: str) -> dict:
    """The :class:`sim.workload.agentic.AgenticWorkloadConfig` fields of variant ``name`` (a None
    ``primer_lead_quantiles_s`` is filled with the public corpus' primer leads, aiperf's spread)."""
    fields = dict(VARIANTS[name])
    if "primer_lead_quantiles_s" in fields:
        from sim.workload.agentic import weka_primer_lead_quantiles
        fields["primer_lead_quantiles_s"] = weka_primer_lead_quantiles()
    return fields


def run(variant: str, seed: int) -> tuple[str, int, dict[str, float], dict[str, float]]:
    from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, rows_from_metrics, simulate_440246
    from sim.workload.agentic import AgenticWorkloadConfig
    res = simulate_440246(AgenticWorkloadConfig(**workload_fields(variant), seed=seed),
                          frontend_s_per_token=FRONTEND_S_PER_TOKEN_MEASURED)
    rows = {r.key: r.error for r in rows_from_metrics(res.metrics())}
    return variant, seed, rows, summarize(res)


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import int_between
    from sim.validation.agentx_ranks import capture_rank_records, capture_rank_spread
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="About 15 s of CPU per run (one variant at one seed); the defaults make 12 runs.")
    ap.add_argument("--variants", default="defaults,lane,oncecapbar",
                    help=f"comma list of: {', '.join(VARIANTS)} (default: defaults,lane,oncecapbar)")
    ap.add_argument("--seeds", default="42,1,2,3", help="comma list of workload seeds (integers >= 0; default: 42,1,2,3)")
    ap.add_argument("--jobs", type=int_between(1, 64), default=1, help="parallel runs (processes, 1..64; default: 1)")
    args = ap.parse_args(argv)
    names = list_arg(ap, "--variants", args.variants, "variant names", one_of(VARIANTS))
    seeds = list_arg(ap, "--seeds", args.seeds, "integers >= 0", _seed)
    tasks = [(n, s) for n in names for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, *zip(*tasks)))
    label = {t: f"{t[0]} s{t[1]}" for t in tasks}
    rows = {(n, s): r for n, s, r, _ in results}
    spread = {(n, s): x for n, s, _, x in results}
    print_rows(tasks, label, rows)
    print()
    cap = capture_rank_spread()
    rec = capture_rank_records()
    print("per rank,capture," + ",".join(label[t] for t in tasks))
    for tag in ("all", "warm"):
        for k in SPREAD_KEYS:
            ref = f"{cap[k]:.3f}" if tag == "all" else ""
            print(f"{tag} {k},{ref}," + ",".join(f"{spread[t][f'{tag}_{k}']:.3f}" for t in tasks))
    mx = rec["mixed"]
    print(f"mixed records max/min,{mx.max() / mx.min():.2f},"
          + ",".join(f"{spread[t]['mixed_max_min']:.2f}" for t in tasks))
    print("requests max/min,," + ",".join(f"{spread[t]['requests_max_min']:.2f}" for t in tasks))
    print("warm-up s,," + ",".join(f"{spread[t]['warmup_s']:.0f}" for t in tasks))
    for i in range(len(rec["prefill_only"])):
        print(f"rank {i} prefill-only / idle s,{rec['prefill_only'][i]} / {rec['no_requests'][i]},"
              + ",".join(f"{spread[t][f'po_{i}']:.0f} / {spread[t][f'idle_{i}']:.0f}" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
