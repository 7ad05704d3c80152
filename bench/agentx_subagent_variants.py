"""AgentX 440246's 24 rows under subagent-tree workloads, per seed (run by hand; issue 23 part 1).

Runs ``pdlb sim validate --agentx-440246``'s simulation (:func:`sim.validation.agentx.simulate_440246`,
the API server's tokenization on) for each named workload variant and workload seed, and prints every
row's error against the published figure and the rows within +-15%. The variants are the ones
docs/validate.md reports ("Subagents at once inside a lane"): each is a set of
:class:`sim.workload.agentic.AgenticWorkloadConfig` fields plus its two roofline deratings; how each
was fitted is written beside it below.

    python bench/agentx_subagent_variants.py --variants defaults,VB --seeds 42,1,2,3 --jobs 2

About 15 s of CPU per run (one variant at one seed).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdlb_cli.comma_lists import list_arg, one_of  # noqa: E402

#: the public corpus' spawns (bench/weka_subagent_shapes.py): 21 of one sibling, 9 of two, 8 of three;
#: 3 of 63 subagents in the background (aiperf's join rule); p = 0.0422 gives 45% of requests in
#: subagents (the 062126 corpus: 42%, aiperf's AgentX FAQ) with session 13's subagent laws
TREE = dict(subagent_spawn_probability=0.0422, subagent_fanout_weights=(21, 9, 8),
            subagent_background_probability=0.0476, subagent_turns_median=8)
#: session 13's F2: aiperf's structure (turn-0 recycling, primer, no-delay pressure requests, primers
#: at once), sequential subagents (p 0.07), parents fitted to the 4 published statistics + 2 strata
F2 = dict(recycle_from_turn0=True, warmup_primer=True, warmup_think_s=0, initial_context_median_tokens=22300,
          subagent_spawn_probability=0.07, subagent_turns_median=8, turns_median=80, new_tokens_median=550,
          new_tokens_trajectory_sigma=0.9)
#: the parents refitted (``fit_to_published``, aiperf's rule) with the tree at once: 10k / 80 / 260 / 0.9
VA = dict(TREE, subagent_at_once=True, initial_context_median_tokens=10000, turns_median=80, new_tokens_median=260,
          new_tokens_trajectory_sigma=0.9)
#: VA with heavier subagent turns: new tokens per subagent turn median 600, log-sigma 1.55 (the public
#: corpus' subagents: 2,259 and 1.55); parents refitted (10k / 60 / 260 / 1.2; fit error 0.21)
VB = dict(VA, subagent_new_tokens_median=600.0, subagent_new_tokens_sigma=1.55, turns_median=60,
          new_tokens_trajectory_sigma=1.2)
#: subagent turns at median 1,200; parents refitted (10k / 60 / 200 / 1.2; fit error 0.48)
VC = dict(VB, subagent_new_tokens_median=1200.0, new_tokens_median=200)
#: VB with the warm-up that fitted best in session 13 (primer, no-delay pressure requests capped at one
#: output token, all at once): the pinned aiperf's cap and spread are not published
VD = dict(VB, warmup_primer=True, warmup_think_s=0, warmup_max_output_tokens=1)

#: name -> (workload fields, decode derating, prefill derating). Think times fitted to the published
#: 6,608 requests by Little's law on the seed-42 hour (two rounds: think' = (L + think) * ratio - L);
#: deratings fitted to the decode-only and mixed p50 on the same hour (two or three proportional rounds,
#: the API server's tokenization on). "cal": own deratings; otherwise the committed 0.73 / 0.64
VARIANTS: dict[str, tuple[dict, float, float]] = {
    "defaults": ({}, 0.73, 0.64),
    "F2": (F2, 0.73, 0.64),
    "F2tree": (dict(F2, **TREE), 0.73, 0.64),  # F2's workload as a tree, siblings one after another
    "F2once": (dict(F2, **TREE, subagent_at_once=True), 0.73, 0.64),  # the same tree at once, same think
    "F2oc": (dict(F2, **TREE, subagent_at_once=True, think_s=20.22), 0.719, 0.5217),
    "VA": (dict(VA, think_s=19.35), 0.73, 0.64),
    "VAseq": (dict(VA, subagent_at_once=False), 0.73, 0.64),  # VA's tree one after another, think 9.67
    "VAseqcal": (dict(VA, subagent_at_once=False, think_s=15.27), 0.7171, 0.4739),  # VAcal's deratings
    "VAcal": (dict(VA, think_s=19.35), 0.7171, 0.4739),
    "VB": (dict(VB, think_s=17.42), 0.7228, 0.5447),
    "VC": (dict(VC, think_s=17.18), 0.7235, 0.5484),
    "VD": (dict(VD, think_s=17.61), 0.7226, 0.5570),
}


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def run(name: str, seed: int) -> tuple[str, int, dict[str, float]]:
    from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, rows_from_metrics, simulate_440246
    from sim.workload.agentic import AgenticWorkloadConfig
    fields, ds, ps = VARIANTS[name]
    res = simulate_440246(AgenticWorkloadConfig(**fields, seed=seed), decode_scale=ds, prefill_scale=ps,
                          frontend_s_per_token=FRONTEND_S_PER_TOKEN_MEASURED)
    return name, seed, {r.key: r.error for r in rows_from_metrics(res.metrics())}


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="defaults,VB", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default="42,1,2,3", help="comma list of workload seeds")
    ap.add_argument("--jobs", type=positive_int, default=1, help="parallel runs (processes)")
    args = ap.parse_args(argv)
    names = list_arg(ap, "--variants", args.variants, "variant names", one_of(VARIANTS))
    seeds = list_arg(ap, "--seeds", args.seeds, "integers >= 0", _seed)
    if not 1 <= args.jobs <= 64:
        ap.error("--jobs must be in 1..64")
    tasks = [(n, s) for n in names for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, *zip(*tasks)))
    by = {(n, s): rows for n, s, rows in results}
    keys = list(results[0][2])
    print("row," + ",".join(f"{n} s{s}" for n, s in tasks))
    for k in keys:
        print(k + "," + ",".join(f"{100 * by[t][k]:+.1f}" for t in tasks))
    print("rows within 15%," + ",".join(str(sum(abs(v) <= 0.15 for v in by[t].values())) for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
