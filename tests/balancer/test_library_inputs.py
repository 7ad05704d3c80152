"""Bad input to the routing library (``balancer.types``, ``balancer.router``) gets a clear error
naming the value, and leaves the router as it was; tested by class (every bad value of a field).

Expected values are worked out by hand in the comments (block counts are ``ceil(tokens / B)``).
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from balancer.router import Router
from balancer.types import ReplicaId, Request, Role
from balancer_factories import blocks, req

NOT_FINITE = [math.nan, math.inf, -math.inf, np.float64("nan"), True, "1.0", None]


# ------------------------------------------------------------------------------ Request / ReplicaId
@pytest.mark.parametrize("t", NOT_FINITE, ids=repr)
def test_request_arrival_time_must_be_a_finite_number(t) -> None:
    with pytest.raises(ValueError, match=r"request r1: arrival_time_s must be a finite number of seconds, got "):
        Request("r1", t, 10)


@pytest.mark.parametrize("t", [0, 0.0, -2.5, 1e9, np.float64(3.25), np.int64(7)], ids=repr)
def test_request_arrival_time_accepts_finite_numbers(t) -> None:
    assert Request("r1", t, 10).arrival_time_s == t


@pytest.mark.parametrize("dp_rank", [-1, -100, np.int64(-2)], ids=repr)
def test_replica_id_refuses_a_negative_dp_rank(dp_rank) -> None:
    with pytest.raises(ValueError, match=rf"dp_rank must be >= 0, got {int(dp_rank)} for engine 'p'"):
        ReplicaId("p", dp_rank)


@pytest.mark.parametrize("engine, dp_rank, field", [
    ("p", True, "dp_rank"), ("p", 1.0, "dp_rank"), ("p", "1", "dp_rank"), ("p", None, "dp_rank"),
    (3, 0, "engine"), (None, 0, "engine"), (b"p", 0, "engine"),
], ids=repr)
def test_replica_id_refuses_wrong_types(engine, dp_rank, field) -> None:
    with pytest.raises(TypeError, match=f"ReplicaId {field} must be"):
        ReplicaId(engine, dp_rank)


def test_replica_id_stays_a_plain_tuple_and_checks_replace() -> None:
    r = ReplicaId("p", np.int64(3))
    assert type(r.dp_rank) is int and r == ("p", 3) and hash(r) == hash(("p", 3)) and str(r) == "p/dp3"
    assert pickle.loads(pickle.dumps(r)) == r and ReplicaId("p") == ("p", 0)
    assert r._replace(dp_rank=5) == ReplicaId("p", 5)
    with pytest.raises(ValueError, match="dp_rank must be >= 0, got -1"):
        r._replace(dp_rank=-1)


# ------------------------------------------------------------------------------ now_s
def _router(**kw) -> Router:
    kw.setdefault("block_size", 16)
    r = Router(**kw)
    r.add_replica(ReplicaId("d", 0), Role.DECODE)
    return r


@pytest.mark.parametrize("t", NOT_FINITE, ids=repr)
def test_route_refuses_a_non_finite_now_and_counts_nothing(t) -> None:
    r = _router()
    with pytest.raises(ValueError, match=r"now_s must be a finite number of seconds, got "):
        r.route(req("a", 32, [1, 2]), t)
    m = r.metrics()
    assert m["in_flight"] == 0 and m["decisions"] == {"prefill": {}, "decode": {}} and m["index_blocks"] == 0
    r.route(req("a", 32, [1, 2]), 1.0)  # the same request is then routed normally
    assert r.metrics()["in_flight"] == 1


@pytest.mark.parametrize("hook", ["on_prefill_done", "on_first_token", "on_finished"])
@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf], ids=repr)
def test_hooks_refuse_a_non_finite_now_and_release_nothing(hook: str, t: float) -> None:
    r = _router()
    r.route(req("a", 32, [1, 2]), 1.0)
    before = r.load.get(ReplicaId("d", 0))
    with pytest.raises(ValueError, match="now_s must be a finite number"):
        getattr(r, hook)("a", t)
    assert r.load.get(ReplicaId("d", 0)) == before and r.metrics()["in_flight"] == 1


@pytest.mark.parametrize("call", ["record_routed", "on_kv_event", "on_load_report"])
def test_other_timed_entry_points_refuse_nan(call: str) -> None:
    from balancer.kv_events import BlockStored
    from balancer.load import LoadReport

    r = _router()
    d = ReplicaId("d", 0)
    args = {"record_routed": ([d], blocks([1]), math.nan),
            "on_kv_event": (d, BlockStored(blocks([1])), math.nan),
            "on_load_report": (d, LoadReport(1, 0, 0.1), math.nan)}[call]
    with pytest.raises(ValueError, match="now_s must be a finite number"):
        getattr(r, call)(*args)
    assert r.metrics()["index_blocks"] == 0


def test_time_going_backwards_is_clamped_and_counted() -> None:
    # TTL 5 s: a prompt routed at "4" after one at 10 counts as recorded at 10 (the latest time),
    # so it survives until now - 10 > 5, i.e. it is in the index at 15 and gone at 15.5
    r = _router(index_ttl_s=5.0)
    d = ReplicaId("d", 0)
    a, b = blocks([1, 2]), blocks([7, 8])
    r.route(req("a", 32, block_hashes=a), 10.0)
    r.route(req("b", 32, block_hashes=b), 4.0)
    m = r.metrics()
    assert (m["clock_regressions"], m["clock_regression_max_s"]) == (1, 6.0)
    r.on_finished("b", 9.0)  # 1 s back: counted, max stays 6
    m = r.metrics()
    assert (m["clock_regressions"], m["clock_regression_max_s"]) == (2, 6.0)
    r.route(req("c", 16, block_hashes=(99,)), 15.0)
    assert r.index.match(b) == {d: 2}
    r.route(req("e", 16, block_hashes=(98,)), 15.5)
    assert r.index.match(b) == {} and r.index.match(a) == {}
    assert r.metrics()["clock_regressions"] == 2  # forward steps are not counted


def test_clock_counters_survive_a_snapshot_and_old_snapshots_restore() -> None:
    r = _router()
    r.route(req("a", 16), 3.0)
    r.route(req("b", 16), 1.0)
    assert Router.restore(r.snapshot()).metrics()["clock_regressions"] == 1
    state = r.__getstate__()
    del state["_clock_regressions"], state["_clock_regression_max_s"]  # as written before the counters
    old = Router.__new__(Router)
    old.__setstate__(state)
    assert (old.metrics()["clock_regressions"], old.metrics()["clock_regression_max_s"]) == (0, 0.0)


def test_negative_clocks_work() -> None:
    # a caller's clock may start below 0: nothing is clamped while it moves forward
    r = _router()
    r.route(req("a", 16), -50.0)
    r.on_finished("a", -49.0)
    assert r.metrics()["clock_regressions"] == 0


# ------------------------------------------------------------------------------ on_finished
@pytest.mark.parametrize("n", [-3, -1, 1.5, True, "3", np.float64(2.0)], ids=repr)
def test_on_finished_refuses_a_bad_output_count_and_releases_nothing(n) -> None:
    r = _router()
    r.route(req("a", 32, [1, 2]), 1.0)
    with pytest.raises(ValueError, match=rf"request 'a': num_output_tokens must be an integer >= 0 or None, got "):
        r.on_finished("a", 2.0, n)
    assert r.metrics()["in_flight"] == 1
    r.on_finished("a", 2.0, 4)
    assert r.metrics()["in_flight"] == 0


@pytest.mark.parametrize("n", [None, 0, 1, 1000, np.int64(5)], ids=repr)
def test_on_finished_accepts_counts_from_zero(n) -> None:
    r = _router(learn_cost_model=True)
    r.route(req("a", 32, [1, 2]), 1.0)
    r.on_finished("a", 2.0, n)
    assert r.metrics()["in_flight"] == 0


# ------------------------------------------------------------------------------ block hashes
@pytest.mark.parametrize("prompt_tokens, hashes, most", [
    (10, 100, 1),   # 10 tokens at B = 16 are 1 block
    (10, 2, 1),
    (16, 2, 1),     # exactly one full block
    (32, 3, 2),
    (33, 4, 3),     # ceil(33 / 16) = 3 (a partial last block)
])
def test_route_refuses_more_block_hashes_than_prompt_blocks(prompt_tokens: int, hashes: int, most: int) -> None:
    r = _router()
    with pytest.raises(ValueError) as e:
        r.route(req("a", prompt_tokens, list(range(hashes))), 1.0)
    assert str(e.value) == (f"request 'a' carries {hashes} block hashes, but its prompt of {prompt_tokens} tokens "
                            f"has at most {most} blocks of 16 tokens (block hashes made at another block size, or "
                            f"a wrong prompt_tokens?)")
    m = r.metrics()
    assert m["in_flight"] == 0 and m["index_blocks"] == 0


@pytest.mark.parametrize("prompt_tokens, hashes", [(10, 0), (10, 1), (16, 1), (32, 2), (33, 2), (33, 3)])
def test_route_accepts_full_or_partial_last_block(prompt_tokens: int, hashes: int) -> None:
    r = _router()
    r.route(req("a", prompt_tokens, list(range(hashes)) or None), 1.0)
    assert r.metrics()["index_blocks"] == hashes  # approximate mode records every hash on the replica


# ------------------------------------------------------------------------------ add_replica again
def test_add_replica_again_with_the_same_role_updates_capacity_and_health_and_keeps_state() -> None:
    r = Router(block_size=16)
    d, e = ReplicaId("d", 0), ReplicaId("e", 0)
    r.add_replica(d, Role.DECODE, kv_capacity_tokens=1000)
    r.add_replica(e, Role.DECODE, kv_capacity_tokens=1000)
    h = blocks([1, 2, 3])
    first = r.route(req("a", 48, block_hashes=h), 1.0).decode
    load = r.load.get(first)
    r.set_healthy(first, False)
    r.add_replica(first, "decode", kv_capacity_tokens=5000)  # same role: an update
    info = {i.replica: i for i in r.replicas()}[first]
    assert (info.kv_capacity_tokens, info.healthy) == (5000, True)
    assert r.load.get(first) == load and r.metrics()["in_flight"] == 1  # in-flight load kept
    assert r.index.match(h) == {first: 3}  # cached blocks kept
    # a request of 2000 + 1 tokens now fits only the re-registered replica (hand: 2001 > 1000)
    assert r.route(req("big", 2000), 2.0).decode == first
    r.add_replica(first, Role.DECODE)  # again without a capacity: unknown (0) again
    assert {i.replica: i for i in r.replicas()}[first].kv_capacity_tokens == 0


def test_add_replica_with_another_role_is_refused_and_changes_nothing() -> None:
    r = Router(block_size=16)
    d = ReplicaId("d", 0)
    r.add_replica(d, Role.DECODE, kv_capacity_tokens=1000)
    r.route(req("a", 32), 1.0)
    for role in (Role.PREFILL, "mixed"):
        with pytest.raises(ValueError) as e:
            r.add_replica(d, role, kv_capacity_tokens=99)
        assert str(e.value) == (f"d/dp0 is already registered as decode, not {Role(role).value} "
                                f"(remove_replica it first to change its role)")
    [info] = r.replicas()
    assert (info.role, info.kv_capacity_tokens) == (Role.DECODE, 1000) and r.metrics()["in_flight"] == 1
    r.remove_replica(d)  # the documented way to change a role
    r.add_replica(d, Role.MIXED)
    assert [i.role for i in r.replicas()] == [Role.MIXED]


# ------------------------------------------------------------------------------ kv_cost parameters
@pytest.mark.parametrize("spec, name, value", [
    ("kv_cost:temperature=-1", "temperature", "-1.0"), ("kv_cost:overlap_weight=-0.5", "overlap_weight", "-0.5"),
    ("kv_cost:overlap_weight=-2,temperature=3", "overlap_weight", "-2.0"),
])
def test_kv_cost_names_the_bad_parameter_and_its_value(spec: str, name: str, value: str) -> None:
    from balancer.policies.kv_cost import KvCost
    from balancer.policies.spec import build_policy

    with pytest.raises(ValueError) as e:
        build_policy(spec)
    assert str(e.value) == f"policy 'kv_cost': {name} must be >= 0, got {value}"
    with pytest.raises(ValueError, match=f"^kv_cost: {name} must be >= 0, got {value}$"):  # built directly
        KvCost(**{name: float(value)})
