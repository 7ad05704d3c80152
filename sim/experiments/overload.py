"""Overload and fairness with deadline admission (issue 28 item 4), in the simulator.

Three tenants (``A``, ``B``, ``C``) send Poisson arrivals of prompts drawn uniformly from
``[prompt_min, prompt_max]`` tokens with short outputs (the prefill pool is the bottleneck: the
TTFT SLO is what admission protects) to a small PD cluster (Llama-3.1-8B on H100: 2 prefill and 2
decode engines by default, :func:`small_pd_scenario`). :func:`burst_table` measures, with and
without admission (:mod:`sim.run.deadline_gate`):

* **burst**: tenant ``B`` sends ``burst_x`` (10) times its rate for the middle third of the run;
  the other tenants' SLO attainment is compared with a run without the burst;
* **overload**: every tenant at a rate that offers ``overload_x`` (2) times the prefill pool's
  capacity (:func:`capacity_rps`); goodput (requests meeting the SLO per second of arrivals) with
  admission vs without;
* **answers**: every request ends with a first token or a shed (``answered == requests``).

Run: ``python -m sim.experiments.overload`` (or ``bench/admission_overload.py`` for the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer.deadline_admission import AdmissionConfig, prefill_rate_tokens_per_s
from balancer.types import Request, TtftSlo
from sim.run.cluster import simulate
from sim.run.router_cost import cost_model_for
from sim.run.metrics import summarize
from sim.scenario import PoolConfig, Scenario

TENANTS = ("A", "B", "C")


def small_pd_scenario(num_prefill: int = 2, num_decode: int = 2) -> Scenario:
    """Llama-3.1-8B on H100, ``num_prefill`` prefill and ``num_decode`` decode engines of one GPU."""
    return Scenario(name="admission-pd", model="llama-3.1-8b", hardware="h100",
                    prefill=PoolConfig(num_engines=num_prefill), decode=PoolConfig(num_engines=num_decode))


def capacity_rps(scenario: Scenario, mean_prompt_tokens: float) -> float:
    """Requests/s the prefill pool sustains: the cost model's per-replica prefill rate
    (:func:`balancer.deadline_admission.prefill_rate_tokens_per_s`) times the prefill replicas,
    over the mean prompt."""
    pool = scenario.prefill if scenario.disaggregated else scenario.mixed
    rate = prefill_rate_tokens_per_s(cost_model_for(scenario), scenario.disaggregated)
    return rate * pool.num_engines * pool.dp_ranks / mean_prompt_tokens


def tenant_workload(rates_rps: dict[str, float], duration_s: float, *, seed: int = 0, prompt_min: int = 1000,
                    prompt_max: int = 3000, output_tokens: int = 16,
                    burst: tuple[str, float, float, float] | None = None) -> list[Request]:
    """Poisson arrivals per tenant (``traffic_class`` = the tenant's name), sorted by arrival.

    ``burst = (tenant, factor, start_s, end_s)``: that tenant's rate times ``factor`` in
    ``[start_s, end_s)`` (arrivals of the extra rate are added over the window)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, str]] = []

    def poisson(tenant: str, rate: float, t0: float, t1: float) -> None:
        if rate <= 0:
            return
        n = rng.poisson(rate * (t1 - t0))
        rows.extend((float(t), tenant) for t in rng.uniform(t0, t1, n))

    for tenant, rate in rates_rps.items():
        poisson(tenant, rate, 0.0, duration_s)
    if burst is not None:
        tenant, factor, b0, b1 = burst
        poisson(tenant, rates_rps[tenant] * (factor - 1.0), b0, b1)
    rows.sort()
    prompts = rng.integers(prompt_min, prompt_max + 1, len(rows))
    return [Request(f"r{i}", t, int(p), max_output_tokens=output_tokens, traffic_class=tenant)
            for i, ((t, tenant), p) in enumerate(zip(rows, prompts))]


def _run(scenario: Scenario, reqs: Sequence[Request], adm: AdmissionConfig | None, slo: TtftSlo,
         policy: str) -> dict[str, Any]:
    res = simulate(scenario, reqs, policy, "least_load", admission=adm)
    s = summarize(res, slo_ttft_s=slo.ttft_s, slo_tpot_s=10.0)
    ttft = res.records.first_token_s - res.records.arrival_s
    ok = ttft <= slo.ttft_s
    tenants = np.array([r.traffic_class for r in reqs], dtype=object)
    out = {"requests": len(reqs), "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
           "ttft_p50_s": s["ttft_s"].get("p50", float("nan")), "ttft_p99_s": s["ttft_s"].get("p99", float("nan")),
           "num_shed": res.records.num_shed,
           "answered": int(np.count_nonzero(~np.isnan(res.records.first_token_s))) + res.records.num_shed,
           "by_tenant": {t: float(ok[tenants == t].mean()) for t in sorted(set(tenants))}}
    return out


def burst_table(*, duration_s: float = 60.0, base_rps: float | None = None, burst_x: float = 10.0,
                overload_x: float = 2.0, ttft_slo_s: float = 1.0, seed: int = 0, policy: str = "least_load",
                scenario: Scenario | None = None, wait_model: str = "backlog") -> dict[str, Any]:
    """The three measurements of the module docstring; returns a JSON-friendly dict of runs.

    ``base_rps``: each tenant's rate without the burst (default: a tenth of the capacity, so the
    three tenants load the prefill pool to 30% and B's burst adds 10 x 10% = 100%: 1.2x capacity
    during the burst). ``policy``: the prefill policy (decode: ``least_load``); ``wait_model``: the
    gate's (:data:`balancer.deadline_admission.WAIT_MODELS`)."""
    sc = scenario or small_pd_scenario()
    cap = capacity_rps(sc, 2000.0)
    base = base_rps if base_rps is not None else cap / 10.0
    slo = TtftSlo(ttft_slo_s)
    adm = AdmissionConfig(slo, wait_model=wait_model)
    calm = tenant_workload({t: base for t in TENANTS}, duration_s, seed=seed)
    burst = tenant_workload({t: base for t in TENANTS}, duration_s, seed=seed,
                            burst=("B", burst_x, duration_s / 3, 2 * duration_s / 3))
    over = tenant_workload({t: overload_x * cap / len(TENANTS) for t in TENANTS}, duration_s, seed=seed + 1)
    runs: dict[str, Any] = {"capacity_rps": cap, "base_rps_per_tenant": base, "ttft_slo_s": ttft_slo_s}
    for name, reqs in (("calm", calm), ("burst", burst), ("overload", over)):
        for label, cfg in (("off", None), ("on", adm)):
            runs[f"{name}/{label}"] = _run(sc, reqs, cfg, slo, policy)
    return runs


def wait_model_table(wait_models: Sequence[str] = ("backlog", "policy", "max"), *, policy: str = "ep_aware",
                     scenario: str = "dsv3-pd-h200", limit: int = 1500, rate_scale: float = 3.0,
                     ttft_slo_s: float = 2.0, seed: int = 0) -> dict[str, Any]:
    """Deadline admission's wait models (:data:`balancer.deadline_admission.WAIT_MODELS`) on the
    embedded Mooncake trace (what ``pdlb sim compare --limit 1500 --rate-scale 3 --admission
    --slo-ttft-s 2 --policies ep_aware --admission-wait-model M`` runs): per model, the SLO
    attainment and goodput (a shed request misses), the admitted requests, how many of them met
    the flat SLO and how many met the deadline the gate gave them (a prompt longer than its budget
    gets its own prefill on top), and the admitted requests' TTFT p50/p99; with a prediction
    (``policy``, ``max``), ``prefill_error_s``: percentiles 1, 50, 99 of the simulated prefill end
    minus dispatch less the policy's predicted prefill time at dispatch (> 0: the prediction was
    short)."""
    from sim.scenario import load_scenario
    from sim.workload.loader import read_trace_cut

    reqs, _ = read_trace_cut(None, "auto", limit=limit, spread_s=3.0, seed=seed, rate_scale=rate_scale,
                             duration_s=None)
    sc = load_scenario(scenario)
    slo = TtftSlo(ttft_slo_s)
    out: dict[str, Any] = {"requests": len(reqs), "routing_policy": policy, "scenario": scenario}
    for wm in wait_models:
        res = simulate(sc, reqs, policy, policy, seed=seed, admission=AdmissionConfig(slo, wait_model=wm))
        s = summarize(res, slo_ttft_s=ttft_slo_s, slo_tpot_s=10.0)
        adm = res.extra["admission"]
        ttft = res.records.first_token_s - res.records.arrival_s
        disp = ~np.isnan(adm.dispatch_s)
        met_deadline = res.records.first_token_s <= adm.deadline_s
        out[wm] = {"slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
                   "admitted": int(disp.sum()), "admitted_met_slo": int(np.sum(ttft[disp] <= ttft_slo_s)),
                   "admitted_met_deadline": int(np.sum(met_deadline[disp])),
                   "ttft_p50_s": float(np.nanpercentile(ttft[disp], 50)) if disp.any() else float("nan"),
                   "ttft_p99_s": float(np.nanpercentile(ttft[disp], 99)) if disp.any() else float("nan")}
        pred = adm.predicted_prefill_s
        have = disp & ~np.isnan(pred)
        if have.any():  # the policy's prediction at dispatch against the simulated prefill end
            err = (res.records.prefill_end_s[have] - adm.dispatch_s[have]) - pred[have]
            out[wm]["prefill_error_s"] = {f"p{q}": float(np.percentile(err, q)) for q in (1, 50, 99)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--ttft-slo-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    json.dump(burst_table(duration_s=a.duration_s, ttft_slo_s=a.ttft_slo_s, seed=a.seed), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
