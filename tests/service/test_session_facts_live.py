"""The live router feeds ``ep_aware``'s session facts from what it relays (issue 23 part 3): the
same :class:`balancer.router.Router` and policy object as the simulator
(tests/balancer/test_session_facts.py has the facts by hand; tests/sim/run/test_session_facts_sim.py the
simulator's side)."""

from __future__ import annotations

import aiohttp

from balancer.policies.ep_aware import EpAware
from balancer.service.app import SERVICE
from balancer.session_forecast import SessionFacts
from balancer.types import ReplicaId
from sim.emulator.testing import inprocess_cluster

FAST = {"speed": 20.0}


async def _served_by(session: aiohttp.ClientSession, servers) -> list[int]:
    out = []
    for s in servers:
        async with session.get(f"http://127.0.0.1:{s.port}/emulator/requests") as r:
            out.append(len(await r.json()))
    return out


async def test_the_live_router_records_finished_sessions_where_they_ran_and_forgets_them_when_they_return():
    spec = "ep_aware:session_forecast=true,prefill_at_once=true"
    async with inprocess_cluster("none", num_decode=2, engine=FAST, router={"decode_policy": spec}) as c, \
            aiohttp.ClientSession() as s:
        router = c.router.app[SERVICE].router
        assert isinstance(router.decode_policy, EpAware) and router.decode_policy.session_forecast
        facts = router.session_facts
        assert isinstance(facts, SessionFacts)
        before = await _served_by(s, c.decode)
        r = await s.post(c.url + "/v1/completions", json={"prompt": "turn 0 " * 40, "max_tokens": 3},
                         headers={"X-Session-Id": "agent-1"})
        assert r.status == 200
        await r.read()
        after = await _served_by(s, c.decode)
        served = [i for i in range(2) if after[i] > before[i]]
        assert len(served) == 1
        slot = router.load.slot(ReplicaId(f"http://127.0.0.1:{c.decode[served[0]].port}", 0))
        idle = facts.sessions._idle
        assert list(idle) == ["agent-1"]
        rec_slot, finished_s, context = idle["agent-1"]
        assert rec_slot == slot and context > 3  # prompt + the 3 output tokens
        # while it ran, the router counted its prompt in prefill; now nothing is in prefill anywhere
        assert int(router.load.prefill_inflight.sum()) == 0
        # a request without a session leaves no record
        r = await s.post(c.url + "/v1/completions", json={"prompt": "other " * 30, "max_tokens": 2})
        assert r.status == 200
        await r.read()
        assert list(idle) == ["agent-1"]
        # the session's next, longer turn: its record is replaced (a longer context, a later finish)
        r = await s.post(c.url + "/v1/completions", json={"prompt": "turn 0 " * 40 + "turn 1 " * 40, "max_tokens": 3},
                         headers={"X-Session-Id": "agent-1"})
        assert r.status == 200
        await r.read()
        _, finished2_s, context2 = idle["agent-1"]
        assert finished2_s >= finished_s and context2 > context
        # the forecast the policy is given: weight 1 - age / 60 s for the one idle session
        req, kv = facts.forecast(router.registry.pools()["decode"].slots, router._now_s)
        # (the forecast sums count x (1 - now / H) + sum(t) / H: at the live clock's magnitude the two
        # terms cancel to within ~1e-13 relative; 143.0000000000291 for 143 was seen)
        assert 0.9 < req.sum() <= 1.0 + 1e-9 and kv.sum() <= context2 * (1 + 1e-9)
