"""The router as a library for gateways: top-level imports, thread safety, snapshot/restore,
replica copies, reaping, metrics, engine load reports, hybrid index mode.

Expected values are hand-computed from the hooks' documented arithmetic (stated per test).
"""

from __future__ import annotations

import pickle
import random
import sys
import threading
from pathlib import Path

import pytest

import balancer
from balancer.parts import LoadSources
from balancer import (AllBlocksCleared, BlockRemoved, BlockStored, LoadReport, ReplicaId, Request, Role, Router,
                      hash_token_blocks)


def _prompt(seed: int, n_tokens: int = 640, block: int = 64, shared: list[int] | None = None) -> Request:
    rng = random.Random(seed)
    toks = (shared or []) + [rng.randrange(30_000) for _ in range(n_tokens - len(shared or []))]
    return Request(f"r{seed}", 0.0, len(toks), tuple(hash_token_blocks(toks, block)))


def _router(n: int = 4, **kw) -> tuple[Router, list[ReplicaId]]:  # noqa: ANN003
    r = Router("cache_aware", "cache_aware", block_size=64, **kw)
    reps = [ReplicaId(f"e{i}", 0) for i in range(n)]
    for rep in reps:
        r.add_replica(rep, Role.MIXED, kv_capacity_tokens=10_000)
    return r, reps


def test_top_level_imports_and_py_typed():
    for name in balancer.__all__:
        assert getattr(balancer, name) is not None
    assert (Path(balancer.__file__).parent / "py.typed").is_file()


def test_replicas_returns_copies():
    r, reps = _router(2)
    infos = r.replicas()
    infos[0].healthy = False  # changing the copy changes nothing
    infos[0].kv_capacity_tokens = 1
    assert all(i.healthy for i in r.replicas()) and r.replicas()[0].kv_capacity_tokens == 10_000
    assert r.route(_prompt(1), 0.0).decode in reps


def test_thread_safety_kv_events_while_routing():
    """One thread routes (and finishes) requests while another applies KV events for the same
    replicas: no exception, and the load returns exactly to zero (the lock serialises them)."""
    r, reps = _router(4, index_mode="events")
    errors: list[BaseException] = []
    stop = threading.Event()
    prompts = [_prompt(i) for i in range(50)]

    def events() -> None:
        k = 0
        try:
            while not stop.is_set():
                p = prompts[k % 50]
                rep = reps[k % 4]
                r.on_kv_event(rep, BlockStored(p.block_hashes))
                if k % 3 == 0:
                    r.on_kv_event(rep, BlockRemoved(p.block_hashes[5:]))
                if k % 17 == 0:
                    r.on_kv_event(rep, AllBlocksCleared())
                if k % 11 == 0:
                    r.on_load_report(rep, LoadReport(k % 5, 1, 0.5))
                k += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=events)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads as often as possible
    try:
        t.start()
        for i in range(3000):
            p = prompts[i % 50]
            req = Request(f"q{i}", 0.0, p.prompt_tokens, p.block_hashes)
            r.route(req, float(i))
            r.on_finished(req.request_id, float(i))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors
    assert r.load.num_in_flight == 0 and int(r.load.num_requests.sum()) == 0


def test_snapshot_restore_deep_index_and_identical_decisions():
    """100 prompts each extending the previous (a 100-deep prefix chain: pickle's recursion limit
    was hit at ~70 before) plus siblings; the restored router has the same index and makes the
    same decisions, RNG included, as the original from then on."""
    r, reps = _router(4, index_capacity_blocks=500)
    rng = random.Random(1)
    toks: list[int] = []
    for i in range(100):
        toks = toks + [rng.randrange(30_000) for _ in range(64)]
        req = Request(f"a{i}", float(i), len(toks), tuple(hash_token_blocks(toks, 64)))
        r.route(req, float(i))
        if i % 2:
            r.on_finished(req.request_id, float(i))
    for i in range(30):
        r.route(_prompt(100 + i), 100.0 + i)
    data = r.snapshot()
    r2 = Router.restore(data)
    assert pickle.loads(pickle.dumps(r2)).index.num_blocks() == r.index.num_blocks()
    for rep in reps:
        assert r2.index.lru_order(rep) == r.index.lru_order(rep)
        assert r2.load.get(rep) == r.load.get(rep)
    assert r2.metrics() == r.metrics()
    for i in range(200):
        p = _prompt(1000 + i % 40)
        a = r.route(Request(f"z{i}", 200.0 + i, p.prompt_tokens, p.block_hashes), 200.0 + i)
        b = r2.route(Request(f"z{i}", 200.0 + i, p.prompt_tokens, p.block_hashes), 200.0 + i)
        assert (a.decode, a.decode_matched_tokens) == (b.decode, b.decode_matched_tokens)
    with pytest.raises(TypeError, match="not a Router snapshot"):
        Router.restore(pickle.dumps({"x": 1}))
    for junk in (b"", b"not a pickle", pickle.dumps({"x": 1})[:5]):  # empty, foreign, truncated
        with pytest.raises(TypeError, match="not a Router snapshot"):
            Router.restore(junk)


def test_requests_never_finished_are_reaped():
    r, reps = _router(2, inflight_timeout_s=10.0)
    r.route(_prompt(1), 0.0)
    r.route(_prompt(2), 5.0)
    assert r.load.num_in_flight == 2
    r.route(_prompt(3), 12.0)  # request 1 is 12 s old (> 10): reaped; request 2 (7 s) stays
    assert r.load.num_in_flight == 2 and r.metrics()["reaped_requests"] == 1
    assert not r.load.is_in_flight("r1") and r.load.is_in_flight("r2")
    r.on_finished("r1", 13.0)  # a late callback for a reaped request releases nothing twice
    assert int(r.load.num_requests.sum()) == 2


def test_metrics_count_decisions_matched_tokens_and_events():
    r, reps = _router(2, index_mode="events")
    p = _prompt(7)
    r.on_kv_event(reps[1], BlockStored(p.block_hashes[:4]))
    r.on_kv_event(ReplicaId("ghost", 0), BlockStored(p.block_hashes[:4]))
    route = r.route(p, 1.0)
    m = r.metrics()
    assert route.decode == reps[1]
    # 4 of the prompt's 10 blocks of 64 tokens held on e1: 256 matched tokens
    assert m["matched_tokens"]["decode"] == 256 and m["decisions"]["decode"] == {"cache_hit": 1}
    assert m["kv_events"] == {"applied": 1, "ignored": 1} and m["index_blocks"] == 4 and m["in_flight"] == 1


def test_load_reports_add_what_other_routers_sent():
    """Replica e0 reports 5 running + 3 waiting while this router has 1 request there: 7 external
    requests (8 - 1); with capacity 10,000 tokens and usage 0.5, 5,000 - 640 own = 4,360 external KV
    tokens. least_load then avoids e0; an old report stops counting after load_report_max_age_s."""
    r = Router("least_load", "least_load", block_size=64, load_report_max_age_s=5.0)
    reps = [ReplicaId(f"e{i}", 0) for i in range(2)]
    for rep in reps:
        r.add_replica(rep, "mixed", kv_capacity_tokens=10_000)
    busy = r.route(_prompt(1), 0.0).decode
    other = reps[1] if busy == reps[0] else reps[0]
    r.on_load_report(busy, LoadReport(5, 3, 0.5), 1.0)
    s = r.load.slot(busy)
    assert int(r.load.external_requests[s]) == 7 and int(r.load.external_kv_tokens[s]) == 10_000 // 2 - 640
    for i in range(3):
        assert r.route(_prompt(10 + i), 2.0).decode == other  # 0..2 own vs 1 own + 7 external
    cands = r.candidates(_prompt(20), "decode")
    assert dict(zip(cands.replicas, cands.num_requests.tolist())) == {busy: 8, other: 3}
    r.route(_prompt(30), 7.0)  # the report (t=1) is 6 s old > 5: no longer counted
    assert int(r.load.external_requests[s]) == 0 and not r.load.has_external
    with pytest.raises(ValueError, match="kv_usage"):
        LoadReport(1, 1, 1.5)
    with pytest.raises(TypeError):
        r.on_load_report(reps[0], {"running": 1})  # type: ignore[arg-type]


def test_hybrid_mode_speculative_entries_expire():
    """hybrid: a routed prompt counts on its replica for speculative_ttl_s (2 s here), then only
    the engines' events count."""
    r, reps = _router(3, index_mode="hybrid", speculative_ttl_s=2.0)
    shared = [random.Random(3).randrange(30_000) for _ in range(512)]
    a = r.route(_prompt(1, shared=shared), 0.0)
    b = r.route(_prompt(2, shared=shared), 1.0)
    assert b.decode == a.decode and b.decode_matched_tokens == 512  # the sibling follows (8 shared blocks)
    r.on_finished("r1", 1.0)
    r.on_finished("r2", 1.0)
    c = r.route(_prompt(3, shared=shared), 5.0)  # entries from t=0, 1 expired at 5 (> 2 s)
    assert c.decode_matched_tokens == 0
    r.on_finished("r3", 5.5)
    engine = next(rep for rep in reps if rep != c.decode)  # not where c's own entry points
    r.on_kv_event(engine, BlockStored(_prompt(4, shared=shared).block_hashes[:8]), 8.0)
    d = r.route(_prompt(5, shared=shared), 8.0)  # c's entry (t=5) expired at 7
    assert d.decode == engine and d.decode_matched_tokens == 512
    with pytest.raises(ValueError, match="speculative_ttl_s"):
        Router(index_mode="hybrid", speculative_ttl_s=0)


def test_processes_share_in_flight_load_through_shared_memory():
    """Two routers (two processes' views, two rows of one block): A routes 3 requests to e0;
    B, before its own decision, reads A's row: e0 carries 3 requests there, so least_load sends
    B's request to e1; when A's requests finish, B sees 0 again. Closing A zeroes its row."""
    from balancer.service.processes.shared_load import SharedLoad, create_shared_load_block

    reps = [ReplicaId("e0", 0), ReplicaId("e1", 0)]
    shm = create_shared_load_block(2, 2)
    try:
        views = [SharedLoad(shm.name, 2, i, columns=2) for i in range(2)]  # given to the routers as they are built
        routers = []
        for view in views:
            r = Router("least_load", "least_load", block_size=64, load_sources=LoadSources(peer=view))
            for rep in reversed(reps):  # slots in another order than the shared columns
                r.add_replica(rep, "mixed")
            view.add(reps)
            routers.append(r)
        a, b = routers
        va, vb = views
        a.set_healthy(reps[1], False)  # A's own least_load would spread: keep it on e0
        for i in range(3):
            assert a.route(_prompt(10 + i), 1.0).decode == reps[0]
        assert b.route(_prompt(20), 1.0).decode == reps[1]
        s0 = b.load.slot(reps[0])
        assert int(b.load.peer_requests[s0]) == 3
        cands = b.candidates(_prompt(21), "decode")
        assert dict(zip(cands.replicas, cands.num_requests.tolist())) == {reps[0]: 3, reps[1]: 1}
        for i in range(3):
            a.on_finished(f"r{10 + i}", 2.0)
        b.on_finished("r20", 2.0)
        b.route(_prompt(22), 3.0)
        assert int(b.load.peer_requests[s0]) == 0
        a.route(_prompt(30), 4.0)
        va.close()
        b.route(_prompt(31), 5.0)
        assert int(b.load.peer_requests.sum()) == 0  # A's row zeroed on close
        vb.close()
    finally:
        shm.close()
        shm.unlink()


from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "report", "route"]), st.integers(0, 3),
                          st.integers(0, 7), st.integers(0, 9)), min_size=1, max_size=40))
# a 2-block hit of 10 is a cache_aware miss: the routers' RNGs break the all-idle load tie differently
@example([("store", 0, 0, 1), ("route", 0, 0, 0)])
def test_property_routers_fed_the_same_events_and_loads_decide_alike(ops):
    """Three independent routers (different seeds, as router replicas or processes have) that
    consume the same KV events and load reports route every probe request to the same replica
    (events mode: the prefix view comes from the events only; probes finish at once, so the
    routers' own load stays equal). Policies: cache_aware prefill over kv_cost decode, whose
    choices depend on the prefix match and load but on the RNG only for exact ties."""
    routers = []
    for seed in range(3):
        r = Router("cache_aware", "kv_cost", block_size=64, index_mode="events", seed=seed)
        for i in range(4):
            r.add_replica(ReplicaId(f"p{i}", 0), "prefill", 64_000)
            r.add_replica(ReplicaId(f"d{i}", 0), "decode", 64_000)
        routers.append(r)
    prompts = [_prompt(100 + k) for k in range(8)]
    for n, (op, rep_i, k, x) in enumerate(ops):
        rep = ReplicaId(("p" if x % 2 else "d") + str(rep_i), 0)
        p = prompts[k]
        for r in routers:
            if op == "store":
                r.on_kv_event(rep, BlockStored(p.block_hashes[: 1 + x]))
            elif op == "remove":
                r.on_kv_event(rep, BlockRemoved(p.block_hashes[x:]))
            elif op == "clear":
                r.on_kv_event(rep, AllBlocksCleared())
            elif op == "report":
                r.on_load_report(rep, LoadReport(x, k, x / 10), float(n))
        if op == "route":
            req = Request(f"q{n}", float(n), p.prompt_tokens, p.block_hashes)
            load = {pool: dict(zip((c := routers[0].candidates(req, pool)).replicas, c.num_requests.tolist()))
                    for pool in ("prefill", "decode")}
            routes = [r.route(req, float(n)) for r in routers]
            for r in routers:
                r.on_finished(f"q{n}", float(n))
            assert len({(rt.prefill, rt.decode) for rt in routes}) == 1 or _tied(routes, load)


#: cache_aware reasons decided by the in-flight count alone (its reported scores are the matches)
_BY_LOAD = ("imbalanced", "cache_miss")


def _tied(routes, load) -> bool:  # noqa: ANN001
    """True when the routers disagree only between replicas their policies rated equal: equal
    scores, or, for cache_aware's load-decided reasons, equal in-flight counts (``load``, the
    candidates' ``num_requests`` per pool before routing)."""
    for attr, pool in (("prefill_choice", "prefill"), ("decode_choice", "decode")):
        choices = [getattr(rt, attr) for rt in routes]
        chosen = {ch.replica for ch in choices}
        if len(chosen) > 1:
            if {ch.reason for ch in choices} <= set(_BY_LOAD) and len({ch.reason for ch in choices}) == 1:
                if len({load[pool][c] for c in chosen}) != 1:
                    return False
                continue
            scores = choices[0].scores
            if len({scores[c] for c in chosen}) != 1:
                return False
    return True


@pytest.mark.parametrize("args, field", [((True,), "ttft_s"), ((2.0, True), "per_1k"), (("2",), "ttft_s"),
                                         ((float("inf"),), "ttft_s"), ((2.0, float("nan")), "per_1k")])
def test_ttft_slo_refuses_what_is_not_a_number_of_seconds(args, field) -> None:
    from balancer.types import TtftSlo

    with pytest.raises(ValueError, match=field):
        TtftSlo(*args)  # a bool is an int to Python, not a budget (True would be a 1 s SLO)
    assert TtftSlo(2, 0).budget_s(1000) == 2.0  # integers are fine


def test_the_prefix_index_saves_and_restores_itself_with_its_bounds():
    # the index pickles itself flat (PrefixIndex.to_flat / from_flat; the router no longer reaches
    # into it); its bounds come back too: the total bound was lost by a restore before (None after)
    from balancer.prefix_index import PrefixIndex
    r, reps = _router(4, index_capacity_blocks=500, index_total_capacity_blocks=1000, index_mode="hybrid")
    for i in range(20):
        r.route(_prompt(i), float(i))
    r2 = Router.restore(r.snapshot())
    for ix, ix2 in ((r.index, r2.index), (r.speculative, r2.speculative)):
        assert (ix2.capacity_blocks, ix2.total_capacity_blocks, ix2.ttl_s) == (ix.capacity_blocks, ix.total_capacity_blocks,
                                                                             ix.ttl_s)
        assert [ix2.lru_order(rep) for rep in reps] == [ix.lru_order(rep) for rep in reps]
    assert (r2.index.total_capacity_blocks, r2.speculative.ttl_s) == (1000, 5.0)
    alone = pickle.loads(pickle.dumps(r.index))
    assert isinstance(alone, PrefixIndex) and alone.to_flat() == r.index.to_flat()
    # a snapshot that stored the flat form itself (written before the index saved itself) restores
    # (the router's state as it was then: its own indexes, tier views and replica dict, no parts)
    old_state = {k: v for k, v in r.__getstate__().items() if k not in ("cache", "registry")}
    old_state["index"] = {k: v for k, v in r.index.to_flat().items() if k != "total_capacity_blocks"}
    old_state["speculative"] = r.speculative.to_flat()
    old_state.update(host_index=None, store_index=None, tier_weights=dict(r.tier_weights),
                     _replicas={i.replica: i for i in r.replicas()})
    r3 = Router.__new__(Router)
    r3.__setstate__(pickle.loads(pickle.dumps(old_state)))  # its own copy of every part
    assert [r3.index.lru_order(rep) for rep in reps] == [r.index.lru_order(rep) for rep in reps]
    assert r3.index.total_capacity_blocks is None  # not in that form: no total bound, as those snapshots restored
    assert [i.replica for i in r3.replicas()] == reps
    assert r3.route(_prompt(99), 30.0).decode == r.route(_prompt(99), 30.0).decode
