"""The router's parts given at construction (balancer/parts.py): route listeners, load sources
(a shared own tracker, a peer source), the cost learner. Expected values are counted by hand from
the requests routed below."""

from __future__ import annotations

import pickle

import pytest

from balancer.config import RouterConfig
from balancer.cost_model import DEFAULT_COST_MODEL, CostLearner
from balancer.load import LoadTracker
from balancer.parts import CostLearnerPart, LoadSources, PeerLoad, RouteListener
from balancer.policies import make_policy
from balancer.router import Router
from balancer.types import ReplicaId, Request

P0, D0, D1 = ReplicaId("p", 0), ReplicaId("d", 0), ReplicaId("d", 1)


def _pd(router: Router) -> Router:
    router.add_replica(P0, "prefill")
    router.add_replica(D0, "decode")
    router.add_replica(D1, "decode")
    return router


def test_listeners_hear_each_recorded_decision_in_order():
    """Two listeners, in the order given, each get (prefill, decode), the hashes and the clock of
    every decision that recorded a prompt; a prompt without block hashes records nothing; in
    events mode the router records no decision, so nobody is called."""
    heard: list[tuple] = []

    def first(replicas, hashes, now_s) -> None:  # noqa: ANN001
        heard.append(("first", tuple(replicas), hashes, now_s))

    def second(replicas, hashes, now_s) -> None:  # noqa: ANN001
        heard.append(("second", tuple(replicas), hashes, now_s))

    r = _pd(Router.from_config(RouterConfig(prefill_policy="round_robin", decode_policy="round_robin", block_size=16),
                               listeners=[first, second]))
    route = r.route(Request("a", 1.0, 32, (7, 8)), 1.0)
    r.route(Request("b", 2.0, 32, ()), 2.0)  # no hashes: no decision recorded
    assert heard == [("first", (P0, route.decode), (7, 8), 1.0), ("second", (P0, route.decode), (7, 8), 1.0)]
    events = _pd(Router.from_config(RouterConfig(prefill_policy="round_robin", decode_policy="round_robin",
                                                 block_size=16, index_mode="events"), listeners=[first]))
    events.route(Request("c", 3.0, 32, (9,)), 3.0)
    assert len(heard) == 2
    assert isinstance(first, RouteListener)
    with pytest.raises(TypeError, match="callable"):
        Router(listeners=[42])


def test_a_shared_own_tracker_is_one_load_view():
    """Two routers given one tracker: a request routed by the first counts on the second's
    candidates (least_load then sends the second router's request to the other decode rank)."""
    shared = LoadTracker()
    a, b = (_pd(Router("round_robin", "least_load", block_size=16, load_sources=LoadSources(own=shared)))
            for _ in range(2))
    assert a.load is b.load is shared
    first = a.route(Request("a", 1.0, 32, (1,), max_output_tokens=4), 1.0)
    cands = b.candidates(Request("x", 1.0, 32, ()), "decode")
    counts = dict(zip(cands.replicas, cands.num_requests.tolist()))
    assert counts[first.decode] == 1 and sum(counts.values()) == 1
    second = b.route(Request("b", 1.0, 32, (2,), max_output_tokens=4), 1.0)
    assert second.decode != first.decode
    a.on_finished("a", 2.0)
    b.on_finished("b", 2.0)
    assert shared.num_in_flight == 0 and int(shared.num_requests.sum()) == 0


class _Peer:
    """A peer source that counts its calls and puts 5 requests on D0 when refreshed."""

    def __init__(self) -> None:
        self.bound: list[LoadTracker] = []
        self.refreshes = self.publishes = 0

    def bind(self, tracker: LoadTracker) -> None:
        self.bound.append(tracker)

    def refresh(self, force: bool = False) -> None:
        self.refreshes += 1
        t = self.bound[0]
        t.peer_requests[:] = 0
        t.peer_requests[t.slot(D0)] = 5

    def publish(self) -> None:
        self.publishes += 1


def test_a_peer_source_is_bound_once_and_read_before_each_decision():
    """The peer source is bound to the router's tracker at construction, refreshed before each
    decision of a load-reading policy and told after each change of the own counts (dispatch,
    prefill done, finish: 3 for one request); its 5 requests on D0 send least_load to D1."""
    peer = _Peer()
    r = _pd(Router("round_robin", "least_load", block_size=16, load_sources=LoadSources(peer=peer)))
    assert peer.bound == [r.load] and r.load.peer is peer and isinstance(peer, PeerLoad)
    assert r.route(Request("a", 1.0, 32, (), max_output_tokens=4), 1.0).decode == D1
    assert peer.refreshes == 1 and peer.publishes == 1
    r.on_prefill_done("a", 1.5)
    r.on_finished("a", 2.0)
    assert peer.publishes == 3
    # pickled: the peer source belongs to its process and is not saved
    restored = pickle.loads(pickle.dumps(r))
    assert restored.load.peer is None and restored.listeners == ()


def test_load_sources_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="not both"):
        LoadSources(own=LoadTracker(), peer=_Peer())
    with pytest.raises(ValueError, match="bind, refresh and publish"):
        LoadSources(peer=object())  # type: ignore[arg-type]


def test_policies_must_be_policy_objects():
    """A policy object's class declares what it reads (uses_load, uses_prefix_index): an object
    that is not a Policy is refused at construction, not probed at each decision."""
    class Duck:
        name = "duck"

        def select(self, request, cands, ctx):  # noqa: ANN001, ANN201
            return None

    with pytest.raises(TypeError, match="balancer.Policy"):
        Router(Duck(), "round_robin")  # type: ignore[arg-type]


class _Learner:
    """A stand-in learner: records the hooks it is fed; its model is what policies read."""

    def __init__(self) -> None:
        self.model = DEFAULT_COST_MODEL
        self.calls: list[tuple] = []

    def on_dispatch(self, request, now_s, decode, decode_pos, prefill, prefill_pos) -> None:  # noqa: ANN001
        self.calls.append(("dispatch", request.request_id, now_s, decode.replicas[decode_pos],
                           None if prefill is None else prefill.replicas[prefill_pos]))

    def on_prefill_done(self, request_id, now_s) -> None:  # noqa: ANN001
        self.calls.append(("prefill_done", request_id, now_s))

    def on_first_token(self, request_id, now_s) -> None:  # noqa: ANN001
        self.calls.append(("first_token", request_id, now_s))

    def on_finished(self, request_id, now_s, num_output_tokens) -> None:  # noqa: ANN001
        self.calls.append(("finished", request_id, now_s, num_output_tokens))

    def stats(self) -> dict:
        return {"calls": len(self.calls)}


def test_a_learner_given_at_construction_is_fed_and_read():
    """The router feeds a given learner its hooks in order (dispatch with the chosen replicas;
    first token also reports prefill done, for aggregated pools) and hands policies its model;
    ``learn_cost_model=False`` without a learner makes none."""
    seen = []

    class Spy(type(make_policy("round_robin"))):  # type: ignore[misc]
        name = "spy_round_robin"

        def select(self, request, cands, ctx):  # noqa: ANN001, ANN201
            seen.append(ctx.cost_model)
            return super().select(request, cands, ctx)

    learner = _Learner()
    r = _pd(Router.from_config(RouterConfig(block_size=16, learn_cost_model=False), prefill_policy=Spy(),
                               decode_policy=Spy(), learner=learner))
    assert r.cost_learner is learner and isinstance(learner, CostLearnerPart)
    route = r.route(Request("a", 1.0, 32, (1,), max_output_tokens=4), 1.0)
    r.on_prefill_done("a", 1.5)
    r.on_first_token("a", 1.6)
    r.on_finished("a", 2.0, 4)
    assert learner.calls == [("dispatch", "a", 1.0, route.decode, P0), ("prefill_done", "a", 1.5),
                             ("prefill_done", "a", 1.6), ("first_token", "a", 1.6), ("finished", "a", 2.0, 4)]
    assert seen == [DEFAULT_COST_MODEL, DEFAULT_COST_MODEL]  # decode, then prefill
    assert r.metrics()["cost_learning"] == {"calls": 5}
    off = Router.from_config(RouterConfig(block_size=16, learn_cost_model=False))
    assert off.cost_learner is None and "cost_learning" not in off.metrics()
    assert isinstance(CostLearner(DEFAULT_COST_MODEL), CostLearnerPart)
