#!/usr/bin/env python3
"""Why ``ep_aware`` places requests where it does on the reproduced AgentX 440246 deployment: each
candidate rank's predicted cost terms against what then happened (issue 23, part 3).

One closed-loop run of point 440246 (``sim.validation.agentx.simulate_440246``, as
``bench/agentx_policies.py`` runs it: the router given the SLO's 10 s TTFT budget, the API server's
tokenization on) per ``ep_aware`` variant. At every routing decision of the mixed pool the script
recomputes, on the same candidates, the terms ``ep_aware`` adds up:

- ``ttft drain``: the predicted TTFT under FIFO draining at the step budget (the prompt starts after
  its rank's queue); ``ttft``: the TTFT as priced (with vLLM's per-request chunk limit and prefill
  cadence: ``ceil(u / 512)`` open steps whatever the queue ahead, plus a slot wait on a full rank);
- ``group drain``: FIFO draining's group terms (externality over the requests queued behind it on
  the other ranks, and the horizon); ``group``: the group terms as priced (by default FIFO
  draining's plus the forced-prefill steps of a full rank; with ``parallel_chunks=true`` the delay
  its group tokens add to every queued request of the engine, plus the forced steps);
- ``decode``: the decode cost; the batch stall (the same on every rank for equal hits) is in ``total``.

Then it prints, over the measured window: where new sessions (a miss on every rank) and returning
ones go (requests above the least-loaded rank; the home rank full), the realised TTFT of misses
per 100k prompt tokens by the queue ahead on their rank against both TTFT predictions, the share of
the EP group's step time spent in steps with prefill, and ``--sample`` decisions of new sessions
placed above the least-loaded rank, candidate by candidate, with the realised TTFT and mean ITL of
the request placed.

    python bench/agentx_decisions.py --lanes 128 --duration-s 600 --seed 1
    python bench/agentx_decisions.py --policies ep_aware:parallel_chunks=true --sample 5

About 10-20 s of CPU per variant at 128 lanes and 600 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.config import PolicySpec  # noqa: E402
from balancer.cost_model import DEFAULT_COST_MODEL, engine_groups  # noqa: E402
from balancer.policies.ep_aware import EpAware  # noqa: E402
from balancer.policies.spec import split_policy_list  # noqa: E402
from balancer.types import Role, TtftSlo  # noqa: E402

#: terms recorded per decision, each ``(n,)`` per candidate rank
TERMS = ("ttft_drain", "group_drain", "ttft", "group", "decode", "total")
#: queue-ahead bins of the TTFT table, tokens
QUEUE_BINS = (0, 1, 100_000, 300_000, 600_000, float("inf"))


def logged(policy: EpAware, log: list[dict]) -> EpAware:
    """A copy of ``policy`` that appends one record per mixed-pool decision to ``log``."""

    @dataclass(frozen=True)
    class Logged(type(policy)):  # type: ignore[misc,valid-type]
        def select(self, request, cands, ctx):  # noqa: ANN001, ANN202
            ch = super().select(request, cands, ctx)
            if cands.role is Role.MIXED:
                log.append(self.terms(request, cands, ctx, cands.replicas.index(ch.replica)))
            return ch

        def terms(self, request, cands, ctx, chosen: int) -> dict:  # noqa: ANN001
            model = ctx.cost_model if ctx.cost_model is not None else DEFAULT_COST_MODEL
            names, idx, rows = engine_groups(cands.replicas)
            cost0, ttft0, own = self.prefill_cost(request, cands, model, names, idx, rows, "mixed", True)
            cost, ttft = cost0, ttft0
            if self.cadence:
                cost, ttft, _ = self._cadence_terms(request, cands, model, names, idx, rows, "mixed", cost0, ttft0, own)
            dec = self.decode_cost(request, cands, model, names, idx, rows, transfer=False)
            stall = self.externality_weight * self._mixed_stall(request, cands, model, names, idx, rows)
            bs = cands.block_size
            if cands.hbm_blocks is not None and cands.host_blocks is not None and cands.store_blocks is not None:
                hit = (cands.hbm_blocks + cands.host_blocks + cands.store_blocks) * bs
            else:
                hit = cands.matched_tokens
            return {"t": ctx.now_s, "prompt": request.prompt_tokens, "chosen": chosen,
                    "b": cands.num_requests.astype(float), "q": cands.prefill_tokens.astype(float),
                    "hit": np.minimum(np.asarray(hit, dtype=float), request.prompt_tokens),
                    "ttft_drain": ttft0, "group_drain": cost0 - ttft0, "ttft": ttft, "group": cost - ttft,
                    "decode": dec, "total": cost + dec + stall}

    return Logged(**{f.name: getattr(policy, f.name) for f in fields(policy)})


def _mean(x: np.ndarray, fmt: str) -> str:
    """The mean of ``x`` formatted with ``fmt``, or ``none measured`` where ``x`` is empty (a short
    run may see no new session in its measured window)."""
    return format(float(np.mean(x)), fmt) if x.size else "none measured"


def run(spec: str, lanes: int, duration_s: float, seed: int, sample: int) -> None:
    from sim.run.closed_loop import simulate_closed_loop
    from sim.validation.agentx import FRONTEND_S_PER_TOKEN_MEASURED, perf_factory_440246, scenario_440246
    from sim.workload.agentic import AgenticWorkloadConfig

    pol = PolicySpec.parse(spec).build()
    assert isinstance(pol, EpAware)  # main checked
    log: list[dict] = []
    groups: list = []
    t0 = time.process_time()
    r = simulate_closed_loop(scenario_440246(), AgenticWorkloadConfig(lanes=lanes, duration_s=duration_s, seed=seed),
                             logged(pol, log), perf_factory=perf_factory_440246(), ttft_slo=TtftSlo(10.0),
                             frontend_s_per_token=FRONTEND_S_PER_TOKEN_MEASURED,
                             cluster_hook=lambda c: groups.extend(c.groups))
    rec = r.records
    n = len(log)
    if n == 0 or not np.array_equal(rec.prompt_tokens[:n], [d["prompt"] for d in log]):
        raise SystemExit("decisions do not line up with the request records")
    ttft_real = rec.first_token_s[:n] - rec.arrival_s[:n]
    itl_real = (rec.finish_s[:n] - rec.first_token_s[:n]) / np.maximum(rec.output_tokens[:n] - 1, 1) * 1e3
    req = r.requests
    tt, itl = req[:, 1], (req[:, 2] - req[:, 1]) / np.maximum(req[:, 4] - 1, 1) * 1e3
    print(f"\n== {spec}: {lanes} lanes, {duration_s:g} s measured, workload seed {seed}: "
          f"{np.mean((tt <= 10) & (itl <= 30)):.1%} meet the SLO (TTFT > 10 s {np.mean(tt > 10):.1%}, mean ITL > 30 ms "
          f"{np.mean(itl > 30):.1%}), GPU hit {r.gpu_hit_rate:.3f}, {n} decisions [{time.process_time() - t0:.0f} s CPU]")
    ar = np.arange(n)
    ch = np.array([d["chosen"] for d in log])
    b = np.array([d["b"] for d in log])
    hit = np.array([d["hit"] for d in log])
    P = np.array([d["prompt"] for d in log], dtype=float)
    meas = np.array([d["t"] for d in log]) >= r.measure_start_s
    above = b[ar, ch] - b.min(axis=1)
    new = hit.max(axis=1) < 0.5 * P  # a miss on every rank: a new session (or one whose prefix is gone)
    home = hit.argmax(axis=1)
    stay = ~new & (hit[ar, ch] >= hit.max(axis=1) - 10_000)
    print(f"new sessions: {_mean(new[meas], '.1%')} of decisions, placed {_mean(above[meas & new], '.2f')} requests "
          f"above the least-loaded rank; returning sessions keep their prefix rank in {_mean(stay[meas & ~new], '.1%')}, "
          f"{_mean(above[meas & ~new], '.2f')} above the least loaded; home rank full (>= 16 requests) "
          f"{_mean(b[ar, home][meas & ~new] >= 16, '.1%')}")
    g = groups[0]
    print(f"EP group (whole run): {g.num_steps} steps, {g.prefill_busy_s / max(g.busy_s, 1e-9):.1%} of its step time in "
          f"steps with prefill on some rank, mean step {1e3 * g.busy_s / max(g.num_steps, 1):.1f} ms")
    q = np.array([d["q"] for d in log])
    qi = q[ar, ch]
    miss = (hit[ar, ch] < 0.5 * P) & np.isfinite(ttft_real) & (b[ar, ch] < 15)  # not waiting for a slot
    print("misses (whole run, rank with a free slot): TTFT per 100k prompt tokens, s, by the queued prefill on their rank")
    print("| queue ahead, k tokens | misses | realised | predicted, FIFO draining | predicted, as priced |")
    print("|---|---|---|---|---|")
    t_drain = np.array([d["ttft_drain"][d["chosen"]] for d in log])
    t_now = np.array([d["ttft"][d["chosen"]] for d in log])
    for lo, hi in zip(QUEUE_BINS[:-1], QUEUE_BINS[1:]):
        m = miss & (qi >= lo) & (qi < hi)
        if m.sum() >= 5:
            top = "" if hi == float("inf") else f"{hi / 1e3:.0f}"
            print(f"| {lo / 1e3:.0f}-{top} | {m.sum()} | {1e5 * np.mean(ttft_real[m] / P[m]):.0f} | "
                  f"{1e5 * np.mean(t_drain[m] / P[m]):.0f} | {1e5 * np.mean(t_now[m] / P[m]):.0f} |")
    picks = np.flatnonzero(meas & new & (above > 0))[:sample]
    for j in picks:
        d = log[j]
        print(f"\nt {d['t']:.0f} s: new session, {d['prompt']:,} prompt tokens -> rank {d['chosen']} "
              f"(realised TTFT {ttft_real[j]:.1f} s, mean ITL {itl_real[j]:.1f} ms)")
        print("| rank | requests | queued k tok | hit k tok | " + " | ".join(TERMS) + " |")
        print("|---" * (4 + len(TERMS)) + "|")
        for i in range(len(d["b"])):
            mark = " *" if i == d["chosen"] else ""
            print(f"| {i}{mark} | {d['b'][i]:.0f} | {d['q'][i] / 1e3:.0f} | {d['hit'][i] / 1e3:.1f} | "
                  + " | ".join(f"{d[k][i]:.1f}" for k in TERMS) + " |")


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.args import ArgumentParser, positive_float

    from pdlb_cli.arg_types import nonnegative_int, positive_int, seed_int
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="ep_aware,ep_aware:parallel_chunks=true",
                    help="comma-separated ep_aware specs (default: %(default)s)")
    ap.add_argument("--lanes", type=positive_int, default=128, help="closed-loop lanes (64 = the measured load; default 128)")
    ap.add_argument("--duration-s", type=positive_float, default=600.0, help="measured seconds (default 600)")
    ap.add_argument("--seed", type=seed_int, default=1, help="workload seed (default 1)")
    ap.add_argument("--sample", type=nonnegative_int, default=3, help="decisions printed candidate by candidate (default 3; 0: none)")
    a = ap.parse_args(argv)
    if not 1 <= a.lanes <= 1024:
        ap.error(f"--lanes must be in [1, 1024], got {a.lanes}")
    if not 0 <= a.sample <= 100:
        ap.error(f"--sample must be in [0, 100], got {a.sample}")
    specs = split_policy_list(a.policies)
    if not specs:
        ap.error("--policies: none given")
    for spec in specs:
        try:
            pol = PolicySpec.parse(spec).build()
        except ValueError as e:
            ap.error(f"--policies: {e}")
        if not isinstance(pol, EpAware):
            ap.error(f"--policies: {spec!r}: only ep_aware variants have these cost terms")
    for spec in specs:
        run(spec, a.lanes, a.duration_s, a.seed, a.sample)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
