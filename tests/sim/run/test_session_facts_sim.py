"""The simulator routes with the same :class:`balancer.router.Router` and ``ep_aware`` object as the
live service and feeds it the same session facts from its own hooks (issue 23 part 3; the live side:
tests/service/test_session_facts_live.py). A short AgentX 440246 closed-loop run."""

from __future__ import annotations

from balancer.policies.ep_aware import EpAware
from balancer.router import Router
from balancer.session_forecast import SessionFacts
from sim.run.closed_loop import simulate_closed_loop
from sim.validation.agentx import perf_factory_440246, scenario_440246
from sim.workload.agentic import AgenticWorkloadConfig


def test_a_closed_loop_run_feeds_the_router_the_session_facts():
    seen = {}

    def hook(cluster) -> None:  # noqa: ANN001
        seen["router"] = cluster.router

    wl = AgenticWorkloadConfig(lanes=6, duration_s=120.0)
    r = simulate_closed_loop(scenario_440246(), wl, "ep_aware:session_forecast=true,prefill_at_once=true",
                             perf_factory=perf_factory_440246(), seed=3, cluster_hook=hook)
    router = seen["router"]
    assert type(router) is Router and isinstance(router.decode_policy, EpAware)
    facts = router.session_facts
    assert isinstance(facts, SessionFacts)
    n = len(r.records.output_tokens)
    assert n > 6
    # every request of a session was routed with its session id and released on finish: after the drain
    # no prompt is in prefill, and the idle sessions (at most one per lane's recent trajectories) sit on the
    # engine's mixed ranks' slots
    assert int(router.load.prefill_inflight.sum()) == 0
    slots = set(int(x) for x in router.registry.pools()["decode"].slots)
    idle = facts.sessions._idle
    assert 1 <= len(idle) <= n and all(rec[0] in slots for rec in idle.values())
    assert all(rec[2] > 0 for rec in idle.values())  # contexts: prompt + output tokens
