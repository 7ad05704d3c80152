"""Simulator tests: a tiny scenario computed by hand, conservation, determinism, and the
equivalence of decode and prefill fast-forward with the exact step-by-step mode."""

from __future__ import annotations

import numpy as np
import pytest

from balancer.types import Request
from sim.run.cluster import simulate
from sim.scenario import PoolConfig, Scenario
from sim.workload import read_trace, spread_batches, take_slice


class LinearPerf:
    """A perf model simple enough to compute by hand.

    Per rank: ``t_r = 0.001 * prefill_tokens + 0.002 * decode_seqs + 1e-6 * decode_ctx_tokens``;
    a step takes ``0.01 + max_r t_r`` seconds. 100 KV bytes per token, 1000 tokens of KV per rank.
    """

    kv_bytes_per_token = 100
    kv_capacity_tokens_per_rank = 1000

    def __init__(self, ep_synchronous: bool = False) -> None:
        self.ep_synchronous = ep_synchronous
        self.wants_prefill_cached_tokens = False
        self.verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
        self.decode_tokens_per_step = 1.0

    def step_time_s(self, prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens):
        t = 0.001 * np.asarray(prefill_tokens) + 0.002 * np.asarray(decode_seqs) + 1e-6 * np.asarray(decode_ctx_tokens)
        return 0.01 + t.max(axis=-1)


def tiny_scenario(fast_forward: bool = True) -> Scenario:
    return Scenario(
        name="tiny", block_size=4,
        prefill=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=16, max_decode_batch=1),
        decode=PoolConfig(num_engines=1, dp_ranks=1, max_decode_batch=8),
        kv_transfer_bandwidth_bytes_per_s=1e5, kv_transfer_latency_s=0.002,
        fast_forward=fast_forward,
    )


@pytest.mark.parametrize("fast_forward", [True, False])
def test_tiny_pd_scenario_matches_hand_calculation(fast_forward: bool) -> None:
    # Hand calculation (LinearPerf above, transfer = 0.002 + prompt * 100 B / 1e5 B/s):
    # A (t=0, prompt 8, out 3): prefill step 0.01+0.008 -> 0.018; transfer 0.010 -> 0.028 =
    #   first token (KV 9, 2 decode steps left). Decode step: 0.01 + 0.002 + 1e-6*9 = 0.012009
    #   -> 0.040009.
    # B (t=0.005, same 8-token prompt, out 2): waits for A's prefill step; at 0.018 A's 2 blocks
    #   are cached -> cached = min(8, 8-1) = 7, computes 1 token: 0.011 -> 0.029; transfer
    #   -> 0.039, mid A's first decode step; admitted at its end 0.040009 = B's first token.
    # Joint step (A KV 10, B KV 9): 0.01 + 0.004 + 19e-6 = 0.014019 -> both finish at 0.054028.
    reqs = [
        Request("A", 0.0, 8, (11, 12), max_output_tokens=3, expected_output_tokens=3),
        Request("B", 0.005, 8, (11, 12), max_output_tokens=2, expected_output_tokens=2),
    ]
    res = simulate(tiny_scenario(fast_forward), reqs, "round_robin", perf_factory=lambda sc, pool: LinearPerf())
    r = res.records
    np.testing.assert_allclose(r.prefill_end_s, [0.018, 0.029], atol=1e-12)
    np.testing.assert_allclose(r.transfer_end_s, [0.028, 0.039], atol=1e-12)
    np.testing.assert_allclose(r.first_token_s, [0.028, 0.040009], atol=1e-12)
    np.testing.assert_allclose(r.finish_s, [0.054028, 0.054028], atol=1e-12)
    assert r.cached_tokens.tolist() == [0, 7]
    from sim.run.metrics import per_request

    d = per_request(res)
    np.testing.assert_allclose(d["ttft_s"], [0.028, 0.035009], atol=1e-12)
    np.testing.assert_allclose(d["tpot_s"], [(0.054028 - 0.028) / 2, 0.014019], atol=1e-12)


def test_ep_group_steps_at_the_pace_of_its_most_loaded_rank() -> None:
    # Two DP ranks in one EP engine; round robin puts a 100-token prompt on rank 0 and a
    # 10-token prompt on rank 1 at t=0. One EP step: 0.01 + max(0.100, 0.010) = 0.110 s, so both
    # finish prefill at 0.110; with independent (dense) ranks rank 1 finishes at 0.020.
    reqs = [Request("big", 0.0, 100, (), 1, 1), Request("small", 0.0, 10, (), 1, 1)]
    for ep, expected in ((True, [0.110, 0.110]), (False, [0.110, 0.020])):
        sc = Scenario(name="ep", block_size=4,
                      prefill=PoolConfig(num_engines=1, dp_ranks=2, max_prefill_tokens=256, ep=ep),
                      decode=PoolConfig(num_engines=1, dp_ranks=1))
        res = simulate(sc, reqs, "round_robin", perf_factory=lambda s, p, ep=ep: LinearPerf(ep))
        np.testing.assert_allclose(res.records.prefill_end_s, expected, atol=1e-12)


def test_decode_admission_waits_for_kv_capacity() -> None:
    # Decode rank of 1000 KV tokens; each request reserves ceil((600 + 2) / 4) = 151 blocks = 604
    # tokens, so the second waits until the first finishes. A: prefill 0.01+0.6 = 0.61, transfer
    # 0.002 + 0.6 = 0.602 -> first token 1.212, one decode step 0.01+0.002+601e-6 = 0.012601 ->
    # finish 1.224601. B: prefilled after A (0.61 + 0.61 = 1.22), transfer -> 1.822: A is gone by
    # then, so B is admitted at once. With capacity for both, B's first token is the same 1.822;
    # the check that matters is the rank never holds both reservations.
    reqs = [Request("A", 0.0, 600, (), 2, 2), Request("B", 0.0, 600, (), 2, 2)]
    sc = Scenario(name="kv", block_size=4,
                  prefill=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=600),
                  decode=PoolConfig(num_engines=1, dp_ranks=1),
                  kv_transfer_bandwidth_bytes_per_s=1e5, kv_transfer_latency_s=0.002)
    res = simulate(sc, reqs, "round_robin", perf_factory=lambda s, p: LinearPerf())
    np.testing.assert_allclose(res.records.first_token_s, [1.212, 1.822], atol=1e-9)
    np.testing.assert_allclose(res.records.finish_s[0], 1.224601, atol=1e-9)


def test_admission_blocks_when_kv_is_full() -> None:
    # Both KV transfers land at once; only one 604-token reservation fits in 1000 tokens, so B is
    # admitted exactly when A finishes. Two prefill ranks (dense) prefill both in parallel:
    # prefill 0.61, transfer 0.602 -> both at 1.212; A admitted, decodes 1 step -> 1.224601;
    # B admitted at 1.224601 and finishes one step (0.012601) later.
    reqs = [Request("A", 0.0, 600, (), 2, 2), Request("B", 0.0, 600, (), 2, 2)]
    sc = Scenario(name="kv", block_size=4,
                  prefill=PoolConfig(num_engines=2, dp_ranks=1, max_prefill_tokens=600),
                  decode=PoolConfig(num_engines=1, dp_ranks=1),
                  kv_transfer_bandwidth_bytes_per_s=1e5, kv_transfer_latency_s=0.002)
    res = simulate(sc, reqs, "round_robin", perf_factory=lambda s, p: LinearPerf())
    np.testing.assert_allclose(res.records.transfer_end_s, [1.212, 1.212], atol=1e-9)
    np.testing.assert_allclose(res.records.first_token_s, [1.212, 1.224601], atol=1e-9)
    np.testing.assert_allclose(res.records.finish_s, [1.224601, 1.224601 + 0.012601], atol=1e-9)


def test_aggregated_mixed_rank_prefills_then_decodes_in_place() -> None:
    # Mixed rank: prefill 8 tokens (0.01 + 0.008 = 0.018) -> first token; then 2 decode steps:
    # KV 9: 0.01 + 0.002 + 9e-6 = 0.012009; KV 10: 0.01201 -> finish 0.018 + 0.024019 = 0.042019.
    sc = Scenario(name="agg", block_size=4, mixed=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=64))
    res = simulate(sc, [Request("A", 0.0, 8, (1, 2), 3, 3)], "round_robin", perf_factory=lambda s, p: LinearPerf())
    np.testing.assert_allclose(res.records.first_token_s, [0.018], atol=1e-12)
    np.testing.assert_allclose(res.records.finish_s, [0.042019], atol=1e-12)


# ---------------------------------------------------------------------- real trace slices
@pytest.fixture(scope="module")
def trace_slice() -> list[Request]:
    return spread_batches(take_slice(read_trace(), 0, 400), 3.0, seed=0)


def _pd_scenario(fast_forward: bool = True) -> Scenario:
    return Scenario(name="slice-pd", model="deepseek-v3", hardware="h200",
                    prefill=PoolConfig(num_engines=2, dp_ranks=8), decode=PoolConfig(num_engines=1, dp_ranks=8),
                    fast_forward=fast_forward)


def _agg_scenario(fast_forward: bool = True) -> Scenario:
    return Scenario(name="slice-agg", model="llama-3.1-8b", hardware="h100",
                    mixed=PoolConfig(num_engines=4, max_prefill_tokens=2048), fast_forward=fast_forward)


@pytest.mark.parametrize("make", [_pd_scenario, _agg_scenario])
def test_every_request_routed_and_finished_once_in_order(trace_slice, make) -> None:
    res = simulate(make(), trace_slice, "cache_aware")
    r = res.records
    n = len(trace_slice)
    assert r.num_routed == n and r.num_finished == n
    assert not np.isnan(r.finish_s).any()
    # timestamps in life-cycle order
    assert (r.prefill_start_s >= r.arrival_s).all()
    assert (r.prefill_end_s >= r.prefill_start_s).all()
    assert (r.first_token_s >= r.prefill_end_s).all()
    assert (r.finish_s >= r.first_token_s).all()
    if res.scenario.disaggregated:
        assert (r.transfer_end_s > r.prefill_end_s).all()
    # work conservation: every uncached prompt token was prefilled exactly once; every
    # decode step produced one token per running sequence (output - 1 tokens after the first)
    assert res.rank_prefill_tokens.sum() == (r.prompt_tokens - r.cached_tokens).sum()
    assert res.rank_decode_tokens.sum() == (r.output_tokens - 1).sum()
    assert (r.cached_tokens <= r.prompt_tokens - 1).all()


@pytest.mark.parametrize("make", [_pd_scenario, _agg_scenario])
def test_same_seed_same_numbers(trace_slice, make) -> None:
    a = simulate(make(), trace_slice, "power_of_two", seed=7).records
    b = simulate(make(), trace_slice, "power_of_two", seed=7).records
    for name, col in a.columns().items():
        np.testing.assert_array_equal(col, b.columns()[name], err_msg=name)


@pytest.mark.parametrize("make", [_pd_scenario, _agg_scenario])
def test_fast_forward_equals_exact_step_by_step(trace_slice, make) -> None:
    reqs = trace_slice[:150]
    ff = simulate(make(True), reqs, "least_load")
    ex = simulate(make(False), reqs, "least_load")
    for name, col in ff.records.columns().items():
        np.testing.assert_allclose(col, ex.records.columns()[name], rtol=1e-9, atol=1e-9, err_msg=name)
    assert ff.num_steps == ex.num_steps  # same forward steps, fewer events
    assert ff.num_waits < ex.num_waits


# Prefill-heavy slices: a small chunked-prefill budget makes most prompts take many chunk steps,
# so the prefill fast-forward (several chunk steps per event) is exercised against the exact
# step-by-step mode, for wide-EP PD, dense PD (independent TP ranks, conditional PD so decode
# ranks prefill too), aggregated mixed ranks (decode + prefill in one step) and aggregated ranks
# with KV tiers (jobs waiting for host/store fetches are skipped by the chunking).
def _pd_ep_prefill_heavy(fast_forward: bool = True) -> Scenario:
    return Scenario(name="pf-pd-ep", model="deepseek-v3", hardware="h200",
                    prefill=PoolConfig(num_engines=2, dp_ranks=8, max_prefill_tokens=1024),
                    decode=PoolConfig(num_engines=1, dp_ranks=8), fast_forward=fast_forward)


def _pd_dense_prefill_heavy(fast_forward: bool = True) -> Scenario:
    return Scenario(name="pf-pd-dense", model="llama-3.1-70b", hardware="h100",
                    prefill=PoolConfig(num_engines=3, gpus_per_rank=4, max_prefill_tokens=1024),
                    decode=PoolConfig(num_engines=2, gpus_per_rank=4, max_prefill_tokens=512),
                    pd_min_uncached_tokens=600, fast_forward=fast_forward)


def _agg_prefill_heavy(fast_forward: bool = True) -> Scenario:
    return Scenario(name="pf-agg", model="llama-3.1-8b", hardware="h100",
                    mixed=PoolConfig(num_engines=3, max_prefill_tokens=512), fast_forward=fast_forward)


def _agg_tiers_prefill_heavy(fast_forward: bool = True) -> Scenario:
    from sim.scenario import HostTierConfig, SharedStoreConfig

    return Scenario(name="pf-agg-tiers", model="llama-3.1-8b", hardware="h100",
                    mixed=PoolConfig(num_engines=3, max_prefill_tokens=1024, kv_capacity_tokens=60_000),
                    host_tier=HostTierConfig(capacity_blocks=100, bandwidth_bytes_per_s=20e9),
                    shared_store=SharedStoreConfig(),
                    # "reserve": running prompts squeeze the HBM cache, so blocks reach the host tier
                    # and come back from it on this slice (with "shared" HBM keeps every reused block)
                    kv_accounting="reserve", fast_forward=fast_forward)


@pytest.mark.parametrize("make", [_pd_ep_prefill_heavy, _pd_dense_prefill_heavy, _agg_prefill_heavy,
                                  _agg_tiers_prefill_heavy])
def test_prefill_fast_forward_equals_exact_step_by_step(trace_slice, make) -> None:
    reqs = trace_slice[:120]
    ff = simulate(make(True), reqs, "cache_aware")
    ex = simulate(make(False), reqs, "cache_aware")
    for name, col in ff.records.columns().items():
        np.testing.assert_allclose(col, ex.records.columns()[name], rtol=1e-9, atol=1e-9, err_msg=name)
    np.testing.assert_array_equal(ff.rank_prefill_tokens, ex.rank_prefill_tokens)
    assert ff.num_steps == ex.num_steps
    # prompts average ~8k tokens here, i.e. many chunk steps each; the fast-forward waits far less
    assert ff.num_waits < 0.5 * ex.num_waits, (ff.num_waits, ex.num_waits)
    if "tiers" in ff.extra:  # tiers: the fetches really happened, the same in both modes
        assert ff.extra["tiers"] == ex.extra["tiers"]
        assert ff.records.host_hit_tokens.sum() > 0 and ff.records.store_hit_tokens.sum() > 0
    # the step-imbalance counters see the same steps in both modes (a segment sums its steps)
    for key, value in ex.extra["step_imbalance"].items():
        assert ff.extra["step_imbalance"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_prefill_fast_forward_takes_the_chunk_steps_in_one_event() -> None:
    # One 100-token prompt, 1 output token, chunk budget 16 (LinearPerf): 6 full chunk steps of
    # 0.01 + 0.016 = 0.026 s and a finishing chunk of 4 tokens, 0.014 s -> prefill ends at
    # 6 * 0.026 + 0.014 = 0.170 in both modes. Waits (SimPy events of the step processes):
    # exact = prefill group 1 idle + 7 steps + 1 idle, decode group 1 idle = 10; fast-forward =
    # 1 idle + 1 segment of 6 steps + 1 finishing step + 1 idle, decode 1 idle = 5.
    reqs = [Request("A", 0.0, 100, (), 1, 1)]
    got = {}
    for ff in (True, False):
        sc = Scenario(name="pf", block_size=4,
                      prefill=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=16),
                      decode=PoolConfig(num_engines=1, dp_ranks=1), fast_forward=ff)
        res = simulate(sc, reqs, "round_robin", perf_factory=lambda s, p: LinearPerf())
        np.testing.assert_allclose(res.records.prefill_end_s, [0.170], rtol=1e-12)
        assert res.num_steps == 7
        got[ff] = res.num_waits
    assert got == {True: 5, False: 10}


def test_mixed_rank_prefill_segment_is_interrupted_by_an_arrival() -> None:
    # Mixed rank, budget 16, LinearPerf. A (t=0, prompt 100, 3 output tokens) alone: chunk steps
    # of 0.01 + 0.016 = 0.026 s. B (t=0.03, prompt 8, 2 output tokens) arrives during A's second
    # chunk step (0.026 .. 0.052): the fast-forward segment is interrupted, that step completes at
    # 0.052, and the re-planned steps give A the whole budget again (A is ahead in FIFO order)
    # until A's 7th step, which has 4 tokens left for A and 12 of budget for B's whole 8-token
    # prompt: 0.01 + 0.012 = 0.022 s -> both prefills (and first tokens) at 6 * 0.026 + 0.022 =
    # 0.178. Then decode A (KV 101, 2 left) + B (KV 9, 1 left): 0.01 + 0.004 + 110e-6 = 0.01411
    # -> B finishes at 0.19211; A alone (KV 102): 0.01 + 0.002 + 102e-6 = 0.012102 -> 0.204212.
    reqs = [Request("A", 0.0, 100, (), 3, 3), Request("B", 0.03, 8, (), 2, 2)]
    waits = {}
    for ff in (True, False):
        sc = Scenario(name="mix", block_size=4, mixed=PoolConfig(num_engines=1, max_prefill_tokens=16),
                      fast_forward=ff)
        res = simulate(sc, reqs, "round_robin", perf_factory=lambda s, p: LinearPerf())
        r = res.records
        np.testing.assert_allclose(r.prefill_start_s, [0.0, 0.156], rtol=1e-12)
        np.testing.assert_allclose(r.prefill_end_s, [0.178, 0.178], rtol=1e-12)
        np.testing.assert_allclose(r.first_token_s, [0.178, 0.178], rtol=1e-12)
        np.testing.assert_allclose(r.finish_s, [0.204212, 0.19211], rtol=1e-12)
        assert res.num_steps == 9
        waits[ff] = res.num_waits
    assert waits[True] < waits[False]


def test_rank_tracks_the_fewest_remaining_decode_steps() -> None:
    # Hand-tracked: sequences with 5 and 3 steps left -> 3; 2 steps later 3 and 1 -> 1; one more
    # step finishes the second (removed), the first has 2 left; a local start with 7 left -> 2.
    from balancer.types import ReplicaId, Role
    from sim.run.engine.rank import DecodeSeq, PrefillJob, Rank

    rank = Rank(ReplicaId("m", 0), 0, Role.MIXED, kv_capacity_blocks=100, block_size=4,
                max_prefill_tokens=16, max_decode_batch=8)
    rank.enqueue_decode(DecodeSeq(0, 10, 5, 2))
    rank.enqueue_decode(DecodeSeq(1, 10, 3, 2))
    assert [s.index for s in rank.admit_decode()] == [0, 1] and rank.min_remaining == 3
    assert rank.apply_decode(2) == [] and rank.min_remaining == 1
    assert [s.index for s in rank.apply_decode(1)] == [1] and rank.min_remaining == 2
    job = PrefillJob(2, 8, 8, ())
    job.reserved_blocks = 4
    rank.start_decode_local(job, 7)
    assert rank.min_remaining == 2
    assert [s.index for s in rank.apply_decode(2)] == [0] and rank.min_remaining == 5
    assert [s.index for s in rank.apply_decode(5)] == [2] and rank.min_remaining == 0


def test_cache_aware_beats_round_robin_on_hit_rate_and_nothing_beats_ideal(trace_slice) -> None:
    from sim.run.metrics import summarize

    rr = summarize(simulate(_pd_scenario(), trace_slice, "round_robin"))
    ca = summarize(simulate(_pd_scenario(), trace_slice, "cache_aware"))
    assert ca["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.05
    for s in (rr, ca):
        assert s["prefix_hit_rate"] <= s["ideal_hit_rate"]


def test_load_samples_stay_bounded_and_evenly_spaced_on_a_long_run():
    # One request with a 100k-token output: the arrivals span nothing, so the sampling period
    # starts at 1 ms (duration 1 s / 400 -> 2.5 ms) while the run lasts minutes. The sampler must
    # thin itself (keep every other sample, double the period) instead of taking ~10^5 samples.
    from sim.run.cluster import simulate
    from sim.run.records import MAX_LOAD_SAMPLES
    from sim.scenario import load_scenario

    sc = load_scenario("llama8b-agg-h100").with_pools(mixed_engines=1)
    req = Request("long", 0.0, 1000, (), 100_000, 100_000)
    res = simulate(sc, [req], "round_robin")
    t = np.asarray(res.samples.times_s)
    assert 0 < len(t) <= MAX_LOAD_SAMPLES
    # the period is 2.5 ms doubled k times (k >= 1 here), and the kept samples are evenly spaced
    k = np.log2(res.samples.interval_s / 2.5e-3)
    assert k >= 1 and abs(k - round(k)) < 1e-9
    assert np.allclose(np.diff(t), res.samples.interval_s, rtol=1e-9, atol=1e-12)
    # the samples cover the whole run: the last one is within one period of the finish
    assert res.records.finish_s[0] - t[-1] <= res.samples.interval_s + 1e-9


def test_step_imbalance_counters_by_hand():
    # two steps of a 2-rank EP group: [8, 0] tokens for 1 s (max/mean 2, the idle rank waits the
    # whole second: mean/max 0.5 -> 0.5 s), then [4, 4] for 2 s (balanced)
    from types import SimpleNamespace

    from sim.run.engine.step_group import StepGroup

    g = SimpleNamespace(prefill_busy_s=0.0, prefill_imbalance_s=0.0, prefill_wait_s=0.0)
    StepGroup._account(g, "prefill", np.array([[8.0, 0.0], [4.0, 4.0]]), np.array([1.0, 2.0]))
    assert g.prefill_busy_s == pytest.approx(3.0)
    assert g.prefill_imbalance_s / g.prefill_busy_s == pytest.approx((1 * 2 + 2 * 1) / 3)
    assert g.prefill_wait_s == pytest.approx(0.5)
