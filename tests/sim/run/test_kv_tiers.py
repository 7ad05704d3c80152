"""KV tiers: bandwidth sharing, fetch-vs-recompute, TTL at the boundary in the engine path, PD
transfer of only the missing blocks, the router's tier-weighted view, and end-to-end
conservation. Expected values are hand calculations stated next to each assertion."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from balancer.config import RouterConfig
from balancer.kv_events import MEDIUM_CPU, MEDIUM_STORE, BlockRemoved, BlockStored, tier_of_medium
from balancer.router import STORE_HOLDER, Router
from balancer.types import ReplicaId, Request, Role
from sim.run.cluster import Cluster, simulate
from sim.run.engine.rank import PrefillJob, Rank
from sim.run.engine.tiers import FairShareLinks, HostTier, RankTiers, SharedStore, TierStats, max_min_share
from sim.run.metrics import summarize, ttft_split
from sim.run.router_config import router_factory
from sim.scenario import HostTierConfig, PoolConfig, Scenario, SharedStoreConfig
from sim.workload import read_trace, spread_batches, take_slice


class LinePerf:
    """Hand-computable perf model: a step takes ``0.01 + 1e-4 * max_r prefill_tokens_r +
    0.002 * max_r decode_seqs_r`` seconds. 1000 KV bytes per token, 10,000 tokens of KV per rank."""

    kv_bytes_per_token = 1000
    kv_capacity_tokens_per_rank = 10_000

    def __init__(self, ep_synchronous: bool = False) -> None:
        self.ep_synchronous = ep_synchronous
        self.wants_prefill_cached_tokens = False
        self.verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
        self.decode_tokens_per_step = 1.0

    def step_time_s(self, prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens):
        t = 1e-4 * np.asarray(prefill_tokens, dtype=float) + 0.002 * np.asarray(decode_seqs, dtype=float)
        return 0.01 + t.max(axis=-1)


BS = 100  # tokens per block in the hand-built cases
BLOCK_BYTES = BS * LinePerf.kv_bytes_per_token  # 1e5


# ---------------------------------------------------------------------- bandwidth sharing
def test_max_min_share_water_fills() -> None:
    # caps 10, 100, 100 sharing 90: the small flow gets its cap, the others split 80 -> 40 each.
    assert max_min_share([10.0, 100.0, 100.0], 90.0) == [10.0, 40.0, 40.0]
    # total above every cap: everyone gets its cap
    assert max_min_share([5.0, 7.0], 100.0) == [5.0, 7.0]


def _run_flows(links: FairShareLinks, env: simpy.Environment, starts: list[tuple[float, object, float]]) -> list[float]:
    done = [float("nan")] * len(starts)

    def starter(k: int, t: float, group: object, nbytes: float):  # noqa: ANN202
        yield env.timeout(t)
        links.start(group, nbytes, lambda now, k=k: done.__setitem__(k, now))

    for k, (t, g, b) in enumerate(starts):
        env.process(starter(k, t, g, b))
    env.run()
    return done


def test_fair_share_links_timing() -> None:
    # One group of 10 B/s. A: 100 B at t=0; B: 20 B at t=5. A alone 0..5 -> 50 B left; both at
    # 5 B/s: B done at 5 + 20/5 = 9, A has 30 B left, alone again at 10 B/s -> done at 12.
    env = simpy.Environment()
    done = _run_flows(FairShareLinks(env, 1000.0, 10.0), env, [(0.0, "e", 100.0), (5.0, "e", 20.0)])
    assert done == pytest.approx([12.0, 9.0], abs=1e-9)
    # Aggregate cap: two groups of 10 B/s each, aggregate 12 B/s; 60 B each -> 6 B/s -> both at 10 s.
    env = simpy.Environment()
    done = _run_flows(FairShareLinks(env, 12.0, 10.0), env, [(0.0, "a", 60.0), (0.0, "b", 60.0)])
    assert done == pytest.approx([10.0, 10.0], abs=1e-9)


def test_rate_estimate_counts_contention() -> None:
    env = simpy.Environment()
    links = FairShareLinks(env, 15.0, 10.0)
    assert links.rate_estimate("a") == 10.0  # alone: the group cap
    links.start("a", 100.0, lambda now: None)
    assert links.rate_estimate("a") == 5.0  # shares group a's 10 B/s with the running flow
    assert links.rate_estimate("b") == 7.5  # group cap 10 each, aggregate 15 split evenly


# ---------------------------------------------------------------------- fetch vs recompute
def _rank_with_tiers(env: simpy.Environment, *, host_bw: float | None = None, store: SharedStore | None = None,
                     rule: str = "faster", max_prefill_tokens: int = 8192) -> tuple[Rank, RankTiers]:
    rank = Rank(ReplicaId("prefill-0", 0), 0, Role.PREFILL, 1000, BS, max_prefill_tokens, 1)
    host = HostTier(env, None, host_bw) if host_bw is not None else None
    tiers = RankTiers(env, 0, "prefill-0", host, store, LinePerf(), group_size=1, position=0, block_size=BS,
                      block_bytes=BLOCK_BYTES, max_prefill_tokens=max_prefill_tokens, fetch_rule=rule,
                      stats=TierStats())
    rank.tiers = tiers
    return rank, tiers


def test_compute_time_saved_is_marginal_and_chunked() -> None:
    env = simpy.Environment()
    _, tiers = _rank_with_tiers(env, host_bw=1e7, max_prefill_tokens=400)
    # 1000 tokens in chunks 400, 400, 200: sum(0.01 + 1e-4 * c) - 3 * 0.01 = 1e-4 * 1000 = 0.1 s
    assert tiers.compute_time_s(1000, 0) == pytest.approx(0.1, abs=1e-12)
    assert tiers.compute_time_s(0, 0) == 0.0


@pytest.mark.parametrize("host_bw, fetched", [(2e7, True), (1e7, False), (5e6, False)])
def test_fetch_iff_faster_than_recompute(host_bw: float, fetched: bool) -> None:
    # Prompt 1100 tokens = 11 blocks; host holds blocks 0..9 (1000 tokens, 1e6 bytes).
    # Compute saved: 1e-4 * 1000 = 0.1 s. Fetch: 1e6 / bw = 0.05 s (fetch), 0.1 s (tie: recompute,
    # the rule is strict), 0.2 s (recompute).
    env = simpy.Environment()
    rank, tiers = _rank_with_tiers(env, host_bw=host_bw)
    hashes = tuple(range(100, 111))
    tiers.host.store.insert(hashes[:10], 0.0)
    job = PrefillJob(0, 1100, 5, hashes)
    rank.enqueue_prefill(job)
    plan = rank.plan()
    if fetched:
        assert (job.cached_tokens, job.host_tokens, job.fetch_pending) == (1000, 1000, 1)
        assert plan.chunks == []  # the job waits for its fetch
        env.run()
        assert job.fetch_end_s == pytest.approx(0.05, abs=1e-12)
        assert rank.plan().chunks == [(job, 100)]  # 1100 - 1000 computed
    else:
        assert (job.cached_tokens, job.host_tokens, job.fetch_pending) == (0, 0, 0)
        assert plan.chunks == [(job, 1100)]
        assert tiers.stats.recompute_blocks == 10


def test_tier_chain_hbm_then_host_then_store_always_rule() -> None:
    # HBM holds blocks 0-1, host 2-4, store 5-7 of a 9-block, 850-token prompt. Rule "always":
    # hbm 200, host 300, store 300 tokens; tokens 800..849 computed. Fetches: host 3 blocks at
    # 1e6 B/s -> 0.3 s; store 3 blocks at min(engine 2e6, aggregate 1e9) -> 0.15 s; ready at 0.3.
    env = simpy.Environment()
    store = SharedStore(env, None, None, {}, 1e9, 1e9, 2e6, 2e6)
    rank, tiers = _rank_with_tiers(env, host_bw=1e6, store=store, rule="always")
    hashes = tuple(range(200, 209))
    rank.cache.insert(hashes[:2])
    tiers.host.store.insert(hashes[2:5], 0.0)
    store.store.insert(hashes[5:8], 0.0)
    job = PrefillJob(0, 850, 5, hashes)
    rank.enqueue_prefill(job)
    rank.plan()
    assert (job.hbm_tokens, job.host_tokens, job.store_tokens, job.cached_tokens) == (200, 300, 300, 800)
    assert job.fetch_pending == 2
    assert tiers.stats.host_fetch_bytes == 3 * BLOCK_BYTES and tiers.stats.store_fetch_bytes == 3 * BLOCK_BYTES
    env.run()
    assert job.fetch_end_s == pytest.approx(0.3, abs=1e-12)
    assert rank.plan().chunks == [(job, 50)]


def test_store_ttl_boundary_in_engine_path() -> None:
    # Store TTL 10 s; blocks written at t=2.5. Admission at t=12.5: now - t = 10 <= 10 -> hit.
    # Admission one step later (12.5 + 2^-20): expired -> miss, the job computes everything.
    env = simpy.Environment()
    store = SharedStore(env, None, 10.0, {}, 1e9, 1e9, 1e9, 1e9)
    rank, _ = _rank_with_tiers(env, store=store, rule="always")
    hashes = tuple(range(300, 304))

    def at(t: float):  # noqa: ANN202
        yield env.timeout(t - env.now)

    env.process(at(2.5))
    env.run()
    store.store.insert(hashes, env.now)
    env.process(at(12.5))
    env.run()
    hit = PrefillJob(0, 400, 5, hashes)
    rank.enqueue_prefill(hit)
    rank.plan()
    assert hit.store_tokens == 399  # 4 blocks, capped at prompt - 1
    rank2, _ = _rank_with_tiers(env, store=SharedStore(env, None, 10.0, {}, 1e9, 1e9, 1e9, 1e9), rule="always")
    rank2.tiers.store.store.insert(hashes, 2.5)
    env.process(at(12.5 + 2.0 ** -20))
    env.run()
    miss = PrefillJob(1, 400, 5, hashes)
    rank2.enqueue_prefill(miss)
    rank2.plan()
    assert (miss.store_tokens, miss.cached_tokens) == (0, 0)


def test_class_ttl_in_engine_path() -> None:
    # agent TTL 3 days, chatbot 7 days (DeepSeek); written at t=0, admitted at t=4 days.
    env = simpy.Environment()
    day = 86_400.0
    store = SharedStore(env, None, 7 * day, {"agent": 3 * day, "chatbot": 7 * day}, 1e12, 1e12, 1e12, 1e12)
    rank, _ = _rank_with_tiers(env, store=store, rule="always")
    store.store.insert((1, 2), 0.0, "agent")
    store.store.insert((5, 6), 0.0, "chatbot")

    def later():  # noqa: ANN202
        yield env.timeout(4 * day)

    env.process(later())
    env.run()
    a, c = PrefillJob(0, 300, 2, (1, 2, 3), "agent"), PrefillJob(1, 300, 2, (5, 6, 7), "chatbot")
    rank.enqueue_prefill(a)
    rank.enqueue_prefill(c)
    rank.plan()
    assert (a.store_tokens, c.store_tokens) == (0, 200)


# ---------------------------------------------------------------------- PD transfer
def _pd_scenario(**kw) -> Scenario:
    return Scenario(name="pd", block_size=BS,
                    prefill=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=8192, max_decode_batch=1),
                    decode=PoolConfig(num_engines=1, dp_ranks=1, max_decode_batch=8),
                    kv_transfer_bandwidth_bytes_per_s=1e8, kv_transfer_latency_s=0.001, **kw)


def test_transfer_moves_only_blocks_missing_on_decode_rank() -> None:
    # A: 1000 tokens (blocks 0..9), 3 output tokens; finishes long before B arrives (t=10).
    # B: 1050 tokens, same 10 blocks + 1. The decode rank cached A's 10 blocks when A finished,
    # so B moves 50 tokens: 50 * 1000 B / 1e8 B/s + 0.001 = 0.0015 s. A moved 1000 tokens: 0.011 s.
    hashes = tuple(range(400, 411))
    reqs = [Request("A", 0.0, 1000, hashes[:10], 3, 3), Request("B", 10.0, 1050, hashes, 3, 3)]
    res = simulate(_pd_scenario(), reqs, "round_robin", perf_factory=lambda sc, pool: LinePerf())
    r = res.records
    assert list(r.transfer_bytes) == [1000 * 1000, 50 * 1000]
    np.testing.assert_allclose(r.transfer_end_s - r.prefill_end_s, [0.011, 0.0015], atol=1e-12)


# ---------------------------------------------------------------------- router view
P = [ReplicaId("prefill-0", 0), ReplicaId("prefill-1", 0)]
D = ReplicaId("decode-0", 0)


def _router(**kw) -> Router:
    r = Router("cache_aware", "least_load", block_size=BS, index_mode="events", host_tier=True, shared_store=True,
               **kw)
    for p in P:
        r.add_replica(p, "prefill")
    r.add_replica(D, "decode")
    return r


def test_router_tier_weighted_match() -> None:
    # 8-block prompt. P0: HBM blocks 0-1, host 2-5 -> eff = 2 + 0.75 * 4 = 5.0 (store holds 0-3,
    # nothing after block 6). P1: nothing in HBM or host; store 0-3 -> eff = 0.5 * 4 = 2.0.
    h = tuple(range(500, 508))
    req = Request("q", 0.0, 800, h)
    r = _router()
    r.on_kv_event(P[0], BlockStored(h[:2]))
    r.on_kv_event(P[0], BlockStored(h[2:6], medium=MEDIUM_CPU))
    r.on_kv_event(P[1], BlockStored(h[:4], medium=MEDIUM_STORE))
    c = r.candidates(req, "prefill")
    assert list(c.hbm_blocks) == [2, 0] and list(c.host_blocks) == [4, 0] and list(c.store_blocks) == [0, 4]
    assert list(c.matched_blocks) == [5.0, 2.0]
    assert list(c.matched_tokens) == [500, 200]
    assert r.route(req, 0.0).prefill == P[0]
    # host 0.25, store 1.0: P0 = 2 + 1 = 3 < P1 = 4
    r2 = _router(tier_weights={"host": 0.25, "store": 1.0})
    r2.on_kv_event(P[0], BlockStored(h[:2]))
    r2.on_kv_event(P[0], BlockStored(h[2:6], medium="cpu"))
    r2.on_kv_event(P[1], BlockStored(h[:4], medium="disk"))
    assert list(r2.candidates(req, "prefill").matched_blocks) == [3.0, 4.0]
    # the store is global: a removal published by any replica removes it for everyone
    r2.on_kv_event(P[0], BlockRemoved(h[:4], medium=MEDIUM_STORE))
    assert r2.store_index.num_blocks(STORE_HOLDER) == 0


def test_router_tiers_approximate_mode() -> None:
    # HBM index bounded at 4 blocks per replica; host view unbounded. Route an 8-block prompt: its
    # prefill replica X keeps blocks 0-3 in the HBM view, 0-7 in the host view; the store view
    # holds 0-7. For the same prompt: X -> 4 + 0.75 * 4 = 7; the other replica -> 0.5 * 8 = 4.
    r = Router("cache_aware", "least_load", block_size=BS, index_capacity_blocks=4, host_tier=True,
               host_index_capacity_blocks=None, shared_store=True)
    for p in P:
        r.add_replica(p, "prefill")
    r.add_replica(D, "decode")
    h = tuple(range(600, 608))
    x = r.route(Request("a", 0.0, 800, h), 0.0).prefill
    c = r.candidates(Request("b", 1.0, 800, h), "prefill")
    k = c.replicas.index(x)
    assert c.matched_blocks[k] == 7.0 and c.matched_blocks[1 - k] == 4.0


def test_router_without_tiers_keeps_int_match_and_rejects_bad_input() -> None:
    r = Router("cache_aware", "least_load", block_size=BS)
    r.add_replica(P[0], "prefill")
    r.add_replica(D, "decode")
    c = r.candidates(Request("q", 0.0, 300, (1, 2, 3)), "prefill")
    assert c.matched_blocks.dtype == np.int64 and c.host_blocks is None
    r.on_kv_event(P[0], BlockStored((1, 2), medium=MEDIUM_CPU))  # host tier not tracked: ignored
    assert r.candidates(Request("q", 0.0, 300, (1, 2, 3)), "prefill").matched_blocks[0] == 0
    with pytest.raises(ValueError, match="unknown KV event medium"):
        r.on_kv_event(P[0], BlockStored((1,), medium="tape"))
    with pytest.raises(ValueError, match="tier_weights"):
        Router(tier_weights={"host": 1.5})
    with pytest.raises(ValueError, match="unknown tier"):
        Router(tier_weights={"ssd": 0.5})
    assert tier_of_medium(None) == "hbm" and tier_of_medium("CPU") == "host" and tier_of_medium("3fs") == "store"


# ---------------------------------------------------------------------- scenario config
def test_scenario_tier_config_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of capacity_bytes or capacity_blocks"):
        HostTierConfig()
    with pytest.raises(ValueError, match="at most one"):
        SharedStoreConfig(capacity_bytes=1e9, capacity_blocks=10)
    with pytest.raises(ValueError, match="must be > 0"):
        SharedStoreConfig(class_ttl_s={"agent": 0})
    with pytest.raises(ValueError, match="decode pool is not modelled"):
        Scenario(prefill=PoolConfig(), decode=PoolConfig(host_tier=HostTierConfig(capacity_blocks=4)))
    assert not _pd_scenario().has_kv_tiers


# ---------------------------------------------------------------------- end to end
def _tiered_scenario() -> Scenario:
    return Scenario(name="tiers", model="deepseek-v3", hardware="h200",
                    prefill=PoolConfig(num_engines=2, dp_ranks=8, kv_capacity_tokens=20_000),
                    decode=PoolConfig(num_engines=1, dp_ranks=8),
                    host_tier=HostTierConfig(capacity_blocks=8 * 200),
                    shared_store=SharedStoreConfig(capacity_blocks=3000, ttl_s=60.0), kv_fetch_rule="always")


@pytest.fixture(scope="module")
def mooncake_300() -> list[Request]:
    return spread_batches(take_slice(read_trace(), 0, 300), 3.0, seed=0)


@pytest.mark.parametrize("mode", ["approximate", "events"])
def test_end_to_end_conservation(mooncake_300: list[Request], mode: str) -> None:
    sc = _tiered_scenario()
    holder: list[Cluster] = []

    def make_router(ranks: object) -> Router:  # an unbounded index: the rank caches are not used
        from sim.run.router_config import router_tier_settings
        kw = router_tier_settings(sc)
        kw.update(host_index_capacity_blocks=None, store_index_capacity_blocks=None, store_ttl_s=None)
        return Router("cache_aware", "least_load", block_size=sc.block_size, index_capacity_blocks=None,
                      index_mode=mode, **kw)

    cl = Cluster(sc, make_router)
    holder.append(cl)
    # prompts over a prefill rank's KV (20,000 tokens, 19,968 in whole blocks) cannot run (the router refuses them, and
    # simulate() rejects them at arrival, sim.run.admission); the rest of the slice runs
    cap = max(r.kv_capacity_blocks * sc.block_size for r in cl.ranks if r.role.value == "prefill")  # 19,968
    reqs = [r for r in mooncake_300 if r.prompt_tokens <= cap]
    assert len(reqs) > 200
    rec = cl.run(reqs)
    n = len(reqs)
    # every request finishes exactly once (a second finish raises inside the cluster)
    assert rec.num_finished == n and not np.isnan(rec.finish_s).any()
    # per request, reused = hbm + host + store; the split of all prompt tokens sums to 1
    np.testing.assert_array_equal(rec.cached_tokens, rec.hbm_hit_tokens + rec.host_hit_tokens + rec.store_hit_tokens)
    assert (rec.cached_tokens <= rec.prompt_tokens - 1).all()
    st = cl.tier_stats
    assert rec.host_hit_tokens.sum() > 0 and rec.store_hit_tokens.sum() > 0
    # fetched tokens fit in the fetched blocks
    assert rec.host_hit_tokens.sum() <= st.host_fetched_blocks * sc.block_size
    assert rec.store_hit_tokens.sum() <= st.store_fetched_blocks * sc.block_size
    # block conservation in every tier: written = inserted = held + evicted + expired
    hosts = [r.tiers.host for r in cl.ranks if r.tiers is not None]
    assert st.host_written_blocks == sum(h.store.inserted_blocks for h in hosts)
    for h in hosts:
        assert h.store.inserted_blocks == len(h.store) + h.store.evicted_blocks + h.store.expired_blocks
        assert not h.pending  # every demotion completed
    s = cl.store.store
    assert st.store_written_blocks == s.inserted_blocks
    assert s.inserted_blocks == len(s) + s.evicted_blocks + s.expired_blocks
    assert st.store_write_bytes == st.store_written_blocks * cl.ranks[0].tiers.block_bytes
    if mode == "events":
        # the router's views equal the simulated caches: every change was published
        for rank in cl.ranks:  # same blocks in the same LRU order (the tree keeps exact block LRU)
            assert cl.router.index.lru_order(rank.replica) == list(rank.cache._lru), rank.replica
            if rank.tiers is not None:
                assert set(cl.router.host_index.lru_order(rank.replica)) == set(rank.tiers.host.store)
        assert set(cl.router.store_index.lru_order(STORE_HOLDER)) == set(s)


def test_events_mode_auto_index_bound_keeps_every_rank_view_exact(mooncake_300: list[Request]) -> None:
    # Prefill ranks hold 20,000 tokens (39 blocks), decode ranks far more. With the default
    # index_capacity_blocks="auto", an events-mode router must not cap its view at the prefill
    # rank's 39 blocks (it would drop blocks decode ranks still hold): expected, from the
    # simulated caches themselves (an independent implementation), view == cache per rank, in
    # LRU order, and the bound is the largest rank's capacity.
    sc = Scenario(name="pd", model="deepseek-v3", hardware="h200",
                  prefill=PoolConfig(num_engines=2, dp_ranks=8, kv_capacity_tokens=20_000),
                  decode=PoolConfig(num_engines=1, dp_ranks=8))
    cfg = RouterConfig(prefill_policy="cache_aware", decode_policy="cache_aware", block_size=sc.block_size,
                       index_mode="events")
    cl = Cluster(sc, router_factory(sc, cfg))  # the simulator's rule for the "auto" bound (sim.run.router_config)
    # prompts over a prefill rank's KV cannot run (the router refuses them, simulate() rejects them)
    cl.run([r for r in mooncake_300 if r.prompt_tokens <= 20_000 // sc.block_size * sc.block_size])
    caps = {rank.role: rank.kv_capacity_blocks for rank in cl.ranks}
    assert caps[Role.PREFILL] == 20_000 // sc.block_size < caps[Role.DECODE]
    assert cl.router.index.capacity_blocks == caps[Role.DECODE]
    decode_held = 0
    for rank in cl.ranks:
        assert cl.router.index.lru_order(rank.replica) == list(rank.cache._lru), rank.replica
        if rank.role is Role.DECODE:
            decode_held = max(decode_held, len(rank.cache._lru))
    assert decode_held > caps[Role.PREFILL]  # the case the old bound got wrong actually occurs


def test_summary_kv_split(mooncake_300: list[Request]) -> None:
    res = simulate(_tiered_scenario(), mooncake_300[:150], "cache_aware", "least_load")
    kv = summarize(res)["kv"]
    h = kv["hit_rate"]
    assert h["hbm"] + h["host"] + h["store"] + h["miss"] == pytest.approx(1.0, abs=1e-12)
    assert h["hbm"] + h["host"] + h["store"] == pytest.approx(summarize(res)["prefix_hit_rate"], abs=1e-12)
    parts = ttft_split(res)
    ttft = res.records.first_token_s - res.records.arrival_s
    np.testing.assert_allclose(sum(parts.values()), ttft, rtol=0, atol=1e-9)
    assert min(float(np.min(v)) for v in parts.values()) >= -1e-9
