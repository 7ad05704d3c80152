#!/usr/bin/env python3
"""Benchmark: ``ep_aware`` with and without the sequence cap in its cost model, on every scenario
issue 23 names (before / after of pricing ``max_num_seqs`` and the slot wait).

``ep_aware:seq_cap=true`` (a decode or mixed rank that already holds its pool's ``max_num_seqs``
requests costs the slot wait, :func:`balancer.cost_model.slot_wait_s`) against ``ep_aware`` (the
default, which prices no cap), each run once per rate scale and seed on:

- ``mooncake:default``: the embedded Mooncake conversation trace on dsv3-pd-h200 (6 prefill
  engines of EP8, 1 decode engine of EP8; decode ranks hold up to 256 sequences);
- ``mooncake_synthetic:default``: Mooncake's FAST25 synthetic trace (``--traces-dir``) on the same;
- ``shared_prefix:default``: SGLang's generated-shared-prefix layout (256 groups x 16 prompts,
  4 req/s) on the same;
- ``mooncake:agg``: the embedded trace on llama8b-agg-h100 (aggregated, mixed ranks);

judged at ``bench/policy_goodput.py``'s base SLO (90% of requests with TTFT <= 2 s + 0.1 s per 1k
prompt tokens and TPOT <= 50 ms; the router is given the TTFT budget). Printed per row, rate and
seed: attainment, goodput (SLO-meeting requests/s), TTFT p99 and TPOT p99 before and after, and
whether every figure is identical (the cap changes a decision only when some rank holds
``max_num_seqs`` requests). Point 440246 (vLLM, 16 sequences per rank) is in
``bench/agentx_policies.py``.

``--before`` / ``--after`` compare any two policy specs the same way (e.g. ``--before ep_aware
--after ep_aware:parallel_chunks=true``: the parallel-chunk group terms, which act only
where a pool's cost model sets vLLM's per-request chunk limit; issue 23), on any rows of
``bench/policy_goodput.py`` (``mooncake:longsplit``, ``mooncake:dense_dbound``, ...).

    .venv/bin/python bench/seq_cap_before_after.py --traces-dir /path/with/mooncake_synthetic_trace.jsonl
    .venv/bin/python bench/seq_cap_before_after.py --rows mooncake:default --scales 1,4 --seeds 1
    .venv/bin/python bench/seq_cap_before_after.py --before ep_aware --after ep_aware:parallel_chunks=true \
        --rows mooncake:default,mooncake:longsplit,mooncake:dense_dbound --scales 1
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from policy_goodput import scenario_of, workload_of  # noqa: E402

ROWS = ("mooncake:default", "mooncake_synthetic:default", "shared_prefix:default", "mooncake:agg")
BEFORE, AFTER = "ep_aware", "ep_aware:seq_cap=true"


def main(argv: list[str] | None = None) -> int:
    from sim.search.point import SLO, Point, evaluate_point, parse_policy

    from pdlb_cli.args import ArgumentParser  # one usage line, then the error
    from pdlb_cli.arg_types import fraction, nonnegative_float, positive_float, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="workload:scenario,... (default: %(default)s)")
    ap.add_argument("--scales", default="1,2,4", help="rate scales of each trace (default: %(default)s)")
    ap.add_argument("--seeds", type=positive_int, default=1, help="seeds per point (default 1)")
    ap.add_argument("--traces-dir", type=Path, default=None, help="folder with mooncake_synthetic_trace.jsonl")
    ap.add_argument("--slo-ttft-s", type=positive_float, default=2.0)
    ap.add_argument("--slo-ttft-per-1k-s", type=nonnegative_float, default=0.1,
                    help="TTFT budget per 1k prompt tokens, s (default 0.1; 0: none)")
    ap.add_argument("--slo-tpot-s", type=positive_float, default=0.05)
    ap.add_argument("--slo-attainment", type=fraction, default=0.9)
    ap.add_argument("--before", default=BEFORE, help="policy spec of the 'before' runs (default: %(default)s)")
    ap.add_argument("--after", default=AFTER, help="policy spec of the 'after' runs (default: %(default)s)")
    a = ap.parse_args(argv)
    from pdlb_cli.args import positive_float
    from pdlb_cli.comma_lists import list_arg

    rows = list_arg(ap, "--rows", a.rows, "rows workload:scenario")
    scales = list_arg(ap, "--scales", a.scales, "rate scales > 0", positive_float)
    if not rows or not scales or a.seeds < 1:
        ap.error("need at least one row, one scale and one seed")
    for spec in (a.before, a.after):
        try:
            parse_policy(spec)
        except ValueError as e:
            ap.error(f"bad policy spec {spec!r}: {e}")
    before, after = a.before, a.after
    slo = SLO(ttft_s=a.slo_ttft_s, tpot_s=a.slo_tpot_s, attainment=a.slo_attainment,
              ttft_per_1k_prompt_tokens_s=a.slo_ttft_per_1k_s)
    print(f"SLO: {a.slo_attainment:.0%} of requests with TTFT <= {a.slo_ttft_s:g} s + {a.slo_ttft_per_1k_s:g} s/1k "
          f"and TPOT <= {a.slo_tpot_s * 1e3:g} ms; router given the TTFT budget; before = {before}, after = {after}")
    print("| row | rate scale | seed | attainment before / after | goodput req/s before / after | "
          "TTFT p99 s before / after | TPOT p99 ms before / after | identical | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    same_all = True
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            wl_name, sc_name = row.split(":")
            sc = scenario_of(sc_name)
            for seed in range(a.seeds):
                wl = workload_of(wl_name, seed, a.traces_dir, Path(tmp))
                for scale in scales:
                    t0 = time.process_time()
                    got = {p: evaluate_point(Point(scenario=sc, workload=wl, policy=parse_policy(p), rate_scale=scale,
                                                   slo=slo, seed=seed)) for p in (before, after)}
                    b, f = got[before], got[after]
                    for r in (b, f):
                        if r.error:
                            raise SystemExit(f"{row} x{scale:g} seed {seed}: {r.error}")
                    figs = ("attainment", "goodput_rps", "ttft_p99_s", "tpot_p99_s")
                    same = all(getattr(b, k) == getattr(f, k) or (math.isnan(getattr(b, k)) and math.isnan(getattr(f, k)))
                               for k in figs)
                    same_all &= same
                    print(f"| {row} | {scale:g} | {seed} | {b.attainment:.1%} / {f.attainment:.1%} | "
                          f"{b.goodput_rps:.3f} / {f.goodput_rps:.3f} | {b.ttft_p99_s:.2f} / {f.ttft_p99_s:.2f} | "
                          f"{b.tpot_p99_s * 1e3:.1f} / {f.tpot_p99_s * 1e3:.1f} | {'yes' if same else 'NO'} | "
                          f"{time.process_time() - t0:.0f} |", flush=True)
    print("every point identical" if same_all else "some points differ (see the rows marked NO)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
