"""``ep_aware``'s TTFT budget acts only on pools with a dense engine unless ``slo_wide_ep`` (issue 23
part 3): through the simulator's own router and cost model (each engine's ``ep_synchronous`` from
its pool), on the embedded trace's first requests under a tight budget."""

from __future__ import annotations

import numpy as np

from balancer.policies.ep_aware import EpAware
from balancer.types import TtftSlo
from sim.run.cluster import simulate
from sim.scenario import PRESETS
from sim.search.point import WorkloadSpec, load_workload


def _prefill_ranks(scenario: str, policy: EpAware, slo: TtftSlo | None) -> np.ndarray:
    reqs = load_workload(WorkloadSpec(seed=0))[:400]
    res = simulate(PRESETS[scenario], reqs, policy, policy, ttft_slo=slo, seed=0)
    return np.asarray(res.records.prefill_rank)


def test_wide_ep_pools_route_blind_by_default_and_dense_pools_keep_the_budget():
    slo = TtftSlo(0.5, 0.02)  # tight: queued ranks miss it, so SLO-aware placement has choices to change
    for scenario, wide in (("dsv3-pd-h200", True), ("llama70b-pd-h100", False)):
        blind = _prefill_ranks(scenario, EpAware(slo_aware=False), None)
        default = _prefill_ranks(scenario, EpAware(), slo)
        forced = _prefill_ranks(scenario, EpAware(slo_wide_ep=True), slo)
        # the budget changes placements when it acts (measured when written: on both presets)
        assert not np.array_equal(forced, blind), scenario
        if wide:  # wide EP (6 engines of EP8): the default ignores the budget, decision for decision
            assert np.array_equal(default, blind)
        else:  # dense ranks: the default routes against it, as before slo_wide_ep existed
            assert np.array_equal(default, forced)
