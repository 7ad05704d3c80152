"""The compiled hot paths (:mod:`balancer.kernels`, numba) against the numpy code they replace,
compared bit for bit (``tobytes``), and the numpy fallback.

Reference: the numpy expressions in :func:`balancer.cost_model.prefill_wait_features`,
``EpAware._requests_after`` and ``EpAware._decode_cost_one`` (run with the kernels turned off by
:func:`balancer.kernels.use_compiled`), which tests/balancer/test_ep_aware_features.py in turn pins to a
per-candidate loop written from the docstrings. The summation order the kernels reproduce is
numpy's pairwise sum: ``test_row_sum_is_numpys_add_reduce`` checks it against ``np.add.reduce``
itself on rows whose sum depends on the order (a sequential sum fails it: checked by hand), so a
numpy release that changed its order fails here rather than changing decisions silently.
Speed: bench/route_latency.py (ratios against main in one run). About 5 s with the kernels
already in numba's cache, 10-20 s more the first time (compiling).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from balancer import kernels
from balancer.candidates import Candidates
from balancer.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    DecodeStepCost,
    EngineCost,
    PrefillStepCost,
    engine_groups,
    prefill_wait_features,
)
from balancer.policies import SelectContext
from balancer.policies.ep_aware import EpAware
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role

numba = pytest.importorskip("numba")  # in the serve/sim/test extras; the fallback tests below need it not


@pytest.fixture(autouse=True)
def _compiled_on():
    kernels.use_compiled(True)
    yield
    kernels.use_compiled(True)


def both(fn):
    """``(compiled result, numpy result)`` of ``fn()``."""
    kernels.use_compiled(True)
    fast = fn()
    kernels.use_compiled(False)
    try:
        slow = fn()
    finally:
        kernels.use_compiled(True)
    return fast, slow


def same_bits(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


#: ranks per engine: below 8 (a running sum), 8..128 (8 running sums + tail), above 128 (halves)
RANKS = [1, 2, 3, 7, 8, 9, 16, 17, 72, 128, 129, 144]


def pool(seed: int, ranks: int, engines: int, pattern: str):
    rng = np.random.default_rng(seed)
    reps = tuple(ReplicaId(f"e{e:03d}", r) for e in range(engines) for r in range(ranks))
    n = len(reps)
    if pattern == "random":
        q = np.where(rng.random(n) < 0.3, 0.0, rng.integers(1, 60_000, n).astype(np.float64))
    elif pattern == "ties":  # equal queues: argmax ties, equal sums
        q = np.full(n, 8192.0)
        q[rng.random(n) < 0.2] = 0.0
    else:  # "wide": magnitudes spread so that the summation order changes the sum's bits
        q = np.where(rng.random(n) < 0.1, 0.0, np.round(10.0 ** rng.uniform(0, 9, n)) + rng.random(n))
    a = q * rng.uniform(0, 30_000, n)
    P = 32_768.0
    cached = np.minimum(rng.integers(0, 64, n) * 512.0, P - 1.0)
    return reps, q, a, P - cached, cached


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("pattern", ["random", "ties", "wide"])
def test_prefill_wait_features_compiled_equals_numpy(ranks, pattern):
    eng = EngineCost(prefill=PrefillStepCost(0.02, 5.1e-5, 1.0e-8, 4.2e-6), chunk_tokens=8192, ep_synchronous=True)
    for seed in range(3):
        reps, q, a, u, cached = pool(seed, ranks, 1 + seed * 3, pattern)
        _, idx, rows = engine_groups(reps)
        assert rows is not None
        if ranks > 1:  # the kernel runs (not the numpy path twice)
            assert kernels.prefill_wait_rows(q, a, u, cached, 8192.0, 5.1e-5, 1e-8, idx, rows) is not None
        (f1, h1), (f0, h0) = both(lambda: prefill_wait_features(q, a, u, cached, eng, idx, rows))
        assert same_bits(f1, f0) and same_bits(h1, h0), (seed, np.abs(f1 - f0).max(), np.abs(h1 - h0).max())


@pytest.mark.parametrize("ranks", RANKS)
def test_requests_after_compiled_equals_numpy(ranks):
    pol = EpAware()
    for seed in range(3):
        for pattern in ("random", "ties", "wide"):
            reps, q, _, _, _ = pool(seed, ranks, 2 + seed, pattern)
            _, idx, rows = engine_groups(reps)
            rng = np.random.default_rng(seed)
            c = Candidates(Role.PREFILL, reps, rng.integers(0, 40, len(reps)), q.astype(np.int64), np.zeros(len(reps), np.int64),
                           np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), 512)
            n1, n0 = both(lambda: EpAware._requests_after(q, c, idx, rows))
            assert same_bits(n1, n0), (ranks, seed, pattern)
    assert pol.name == "ep_aware"


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("pattern", ["random", "ties", "wide"])
def test_fused_prefill_kernel_equals_both_numpy_paths(ranks, pattern):
    """kernels.prefill_ep_rows (features, horizon and N_after in one pass; N_after reused between
    candidates of one engine with equal queues) against the numpy code of
    prefill_wait_features and EpAware._requests_after, bit for bit. "ties" makes most queues of an
    engine equal (the reuse runs); the reused N_after must be the one computed afresh (the numpy
    reference computes every candidate's)."""
    eng = EngineCost(prefill=PrefillStepCost(0.02, 5.1e-5, 1.0e-8, 4.2e-6), chunk_tokens=8192, ep_synchronous=True)
    for seed in range(3):
        reps, q, a, u, cached = pool(seed, ranks, 1 + seed * 3, pattern)
        _, idx, rows = engine_groups(reps)
        n_req = np.random.default_rng(seed).integers(0, 40, len(reps))
        c = Candidates(Role.PREFILL, reps, n_req, q.astype(np.int64), np.zeros(len(reps), np.int64),
                       np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), 512)
        got = kernels.prefill_ep_rows(q, a, u, cached, n_req, 8192, 5.1e-5, 1.0e-8, idx, rows)
        assert got is not None
        kernels.use_compiled(False)
        try:
            f0, h0 = prefill_wait_features(q, a, u, cached, eng, idx, rows)
            n0 = EpAware._requests_after(q, c, idx, rows)
        finally:
            kernels.use_compiled(True)
        assert same_bits(got[0], f0) and same_bits(got[1], h0) and same_bits(got[2], n0), (ranks, seed, pattern)
    if pattern == "ties" and ranks >= 8:  # equal queues in an engine: the reuse was exercised
        assert any(len(set(q[rows[e]].tolist())) < ranks for e in range(len(rows)))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("pattern", ["random", "ties", "wide"])
def test_prefill_cost_compiled_equals_numpy(ranks, pattern):
    """EpAware._prefill_cost_one on a wide-EP pool without lower tiers (kernels.prefill_ep_cost_rows
    up to the matrix product) against its numpy code: cost, TTFT and own seconds, bit for bit, with
    and without the horizon term."""
    eng = EngineCost(prefill=PrefillStepCost(0.02, 5.1e-5, 1.0e-8, 4.2e-6), chunk_tokens=8192, ep_synchronous=True)
    model = CostModel(prefill=eng)
    for seed in range(3):
        reps, q, a, _, cached = pool(seed, ranks, 1 + seed * 3, pattern)
        names, idx, rows = engine_groups(reps)
        n = len(reps)
        n_req = np.random.default_rng(seed).integers(0, 40, n)
        zeros = np.zeros(n, np.int64)
        c = Candidates(Role.PREFILL, reps, n_req, np.round(q).astype(np.int64), zeros, zeros,
                       (cached // 512).astype(np.int64), cached.astype(np.int64), 512, prefill_attn_pairs=a)
        req = Request("r", 0.0, 32_768, (), 64, 64)
        for pol in (EpAware(), EpAware(horizon_weight=0.0), EpAware(horizon_power=0.5)):
            (c1, t1, o1), (c0, t0, o0) = both(lambda: pol._prefill_cost_one(req, c, model, eng, idx, rows, None, True, 1.0))
            assert same_bits(c1, c0) and same_bits(t1, t0) and same_bits(o1, o0), (ranks, seed, pattern)
    if ranks > 1:  # the compiled path ran
        assert kernels.prefill_ep_cost_rows(q, a, cached.astype(np.int64), n_req, 32_768, 8192, 5.1e-5, 1e-8, 1e-6,
                                            idx, rows) is not None


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("transfer", [True, False])
def test_decode_cost_compiled_equals_numpy(ranks, transfer):
    d = DecodeStepCost(0.012, 6.0e-5, 3.0e-9, 1.5e-6)
    eng = EngineCost(decode=d, ep_synchronous=True)
    model = CostModel(decode=eng, transfer_s_per_token=2.5e-7)
    pol = EpAware()
    for seed in range(4):
        rng = np.random.default_rng(seed)
        reps = tuple(ReplicaId(f"d{e}", r) for e in range(1 + seed) for r in range(ranks))
        n = len(reps)
        b = rng.integers(0, 200, n) * (rng.random(n) < 0.8)
        k = b * rng.integers(0, 40_000, n)
        matched = np.minimum(rng.integers(0, 70, n) * 512, 32_768)
        c = Candidates(Role.DECODE, reps, b, np.zeros(n, np.int64), k, np.full(n, 2_000_000), matched // 512, matched, 512)
        _, idx, rows = engine_groups(reps)
        for out in (1, 128, 100_000):
            req = Request("r", 0.0, 32_768, (), out, out)
            c1, c0 = both(lambda: pol._decode_cost_one(req, c, model, eng, idx, rows, transfer))
            assert same_bits(c1, c0), (ranks, seed, out)
            # the kernel's float64 signature (columns that are not int64) gives the same bits
            args = (idx, rows, float(out), 32_768 + out / 2.0, 32_768.0, d.overhead_s, d.per_seq_s, d.per_kv_token_s,
                    d.per_group_seq_s, 1.0, 2.5e-7, transfer)
            as_f8 = kernels.decode_cost_rows(b.astype(np.float64), k.astype(np.float64), matched.astype(np.float64), *args)
            assert same_bits(as_f8, kernels.decode_cost_rows(b, k, matched, *args))


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_tie_pick_compiled_equals_numpy(role):
    """EpAware._pick with the compiled tie_pick against its numpy code: the same candidate and the
    same RNG state afterwards (the draw happens exactly when numpy's path draws), on costs with
    near ties, equal loads, inf (no KV room), NaN, negative costs and a zero tolerance."""
    rng = np.random.default_rng(5)
    for trial in range(400):
        n = int(rng.integers(1, 40))
        cost = np.round(rng.uniform(0.5, 2.0, n), int(rng.integers(0, 3)))  # rounding makes exact ties
        if trial % 5 == 1:
            cost[rng.random(n) < 0.3] = np.inf
        if trial % 7 == 2:
            cost[rng.integers(0, n)] = np.nan
        if trial % 11 == 3:
            cost = -cost
        load = rng.integers(0, 4, n) * 1000
        reps = tuple(ReplicaId("e", i) for i in range(n))
        zeros = np.zeros(n, np.int64)
        c = Candidates(role, reps, zeros, load, load, zeros, zeros, zeros, 512)
        for tol in (0.05, 0.0, 0.5):
            pol = EpAware(tie_tolerance=tol)
            r1, r0 = random.Random(trial), random.Random(trial)
            kernels.use_compiled(True)
            fast = _outcome(lambda: pol._pick(cost, c, SelectContext(r1, 0.0, 0, None, None)))
            kernels.use_compiled(False)
            slow = _outcome(lambda: pol._pick(cost, c, SelectContext(r0, 0.0, 0, None, None)))
            kernels.use_compiled(True)
            assert fast == slow and r1.getstate() == r0.getstate(), (trial, tol, cost, load)


def test_capacity_compiled_equals_numpy():
    """EpAware._capacity with the compiled room count against its numpy code: the same costs (bits)
    and feasibility, with capacities unknown (0), all fitting, some and none fitting."""
    rng = np.random.default_rng(9)
    pol = EpAware()
    for trial in range(300):
        n = int(rng.integers(1, 30))
        cap = rng.integers(0, 3, n) * 50_000 * (trial % 4 != 0)  # every 4th trial: no capacity known
        kv = rng.integers(0, 60_000, n)
        reps = tuple(ReplicaId("d", i) for i in range(n))
        zeros = np.zeros(n, np.int64)
        c = Candidates(Role.DECODE, reps, zeros, zeros, kv, cap, zeros, zeros, 512)
        cost = rng.uniform(0, 1, n)
        req = Request("r", 0.0, int(rng.integers(1, 40_000)), (), 64, int(rng.integers(1, 9000)))
        (c1, f1), (c0, f0) = both(lambda: pol._capacity(req, c, cost))
        assert f1 == f0 and same_bits(c1, c0), trial


def _outcome(fn):
    """``fn()``'s value, or its exception's type (numpy's path raises on a NaN cheapest cost, and
    the compiled one must leave it to that path)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return type(e)


def test_row_sum_is_numpys_add_reduce():
    """The kernels' pairwise sum against np.add.reduce along rows whose sum depends on the order."""
    k = kernels.compiled()
    assert k is not None
    rng = np.random.default_rng(0)
    for R in [1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 64, 127, 128, 129, 200, 256, 300, 1000]:
        M = rng.standard_normal((16, R)) * 10.0 ** rng.integers(-8, 9, (16, R))
        want = np.add.reduce(M, axis=1)
        got = np.array([k._row_sum(np.ascontiguousarray(M[i]), R) for i in range(16)])
        assert same_bits(got, want), R
    # order matters for these rows (else the test could not tell a sequential sum from numpy's)
    M = rng.standard_normal((16, 64)) * 10.0 ** rng.integers(-8, 9, (16, 64))
    seq = np.array([sum(M[i].tolist(), 0.0) for i in range(16)])
    assert not same_bits(seq, np.add.reduce(M, axis=1))


def _router(policy: EpAware, ranks: int, engines: int) -> Router:
    r = Router(policy, policy, block_size=512, seed=3)
    for e in range(engines):
        for k in range(ranks):
            r.add_replica(ReplicaId(f"p{e}", k), "prefill")
            r.add_replica(ReplicaId(f"d{e}", k), "decode", kv_capacity_tokens=4_000_000)
    return r


@pytest.mark.parametrize("ranks, engines", [(8, 8), (16, 3), (3, 5)])
def test_routes_and_scores_equal_with_and_without_kernels(ranks, engines):
    """Two routers, one with the kernels and one without, fed the same requests: the same replicas
    for every request and the same cost scores, bit for bit (the whole policy, default cost model)."""
    routers = {True: _router(EpAware(), ranks, engines), False: _router(EpAware(), ranks, engines)}
    rng = random.Random(1)
    roots = [[rng.getrandbits(40) for _ in range(20)] for _ in range(6)]
    live: list[str] = []
    for i in range(300):
        blocks = tuple(rng.choice(roots)[: rng.randrange(1, 21)] + [rng.getrandbits(40) for _ in range(rng.randrange(0, 40))])
        req = Request(f"r{i}", 0.0, len(blocks) * 512 - rng.randrange(0, 512), blocks, 64, rng.randrange(1, 2000))
        got = {}
        for on, router in routers.items():
            kernels.use_compiled(on)
            route = router.route(req, i * 0.01)
            got[on] = (route.prefill, route.decode, list(route.prefill_choice.scores.values()),
                       list(route.decode_choice.scores.values()))
        kernels.use_compiled(True)
        assert got[True][:2] == got[False][:2], i
        assert same_bits(got[True][2], got[False][2]) and same_bits(got[True][3], got[False][3]), i
        live.append(req.request_id)
        if len(live) > 40:
            done = live.pop(rng.randrange(len(live)))
            for router in routers.values():
                router.on_prefill_done(done, i * 0.01)
                router.on_finished(done, i * 0.01)


def test_off_or_missing_numba_falls_back_to_numpy(monkeypatch):
    """use_compiled(False), or numba missing (the module not loadable): every kernel answers None and
    ep_aware decides with its numpy code, to the same choice."""
    reps, q, a, u, cached = pool(0, 8, 4, "random")
    _, idx, rows = engine_groups(reps)
    kernels.use_compiled(False)
    assert kernels.compiled() is None
    assert kernels.prefill_wait_rows(q, a, u, cached, 8192.0, 1e-5, 1e-9, idx, rows) is None
    assert kernels.requests_after_rows(q, q, idx, rows) is None
    assert kernels.prefill_ep_rows(q, a, u, cached, q, 8192.0, 1e-5, 1e-9, idx, rows) is None
    kernels.use_compiled(True)
    assert kernels.compiled() is not None
    monkeypatch.setattr(kernels, "_module", None)  # as after a failed `import numba`
    assert kernels.compiled() is None
    assert kernels.decode_cost_rows(q, q, q, idx, rows, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, True) is None
    c = Candidates(Role.PREFILL, reps, np.ones(len(reps), np.int64), q.astype(np.int64), np.zeros(len(reps), np.int64),
                   np.zeros(len(reps), np.int64), (cached // 512).astype(np.int64), cached.astype(np.int64), 512,
                   prefill_attn_pairs=a)
    req = Request("r", 0.0, 32_768, (), 64, 64)
    slow = EpAware().select(req, c, SelectContext(random.Random(0), 1.0, 0, DEFAULT_COST_MODEL, None))
    monkeypatch.undo()
    fast = EpAware().select(req, c, SelectContext(random.Random(0), 1.0, 0, DEFAULT_COST_MODEL, None))
    assert fast.replica == slow.replica
    assert same_bits(list(fast.scores.values()), list(slow.scores.values()))


def test_layouts_the_kernels_do_not_take_fall_back():
    """Arrays of other dtypes for the layout, or no row layout: None (the caller's numpy path)."""
    reps, q, a, u, cached = pool(1, 4, 3, "random")
    _, idx, rows = engine_groups(reps)
    assert kernels.prefill_wait_rows(q, a, u, cached, 8192.0, 1e-5, 1e-9, idx.astype(np.int32), rows) is None
    assert kernels.requests_after_rows(q, q, idx, rows.astype(np.int32)) is None
    assert kernels.requests_after_rows(q, q, idx, rows[:, :0].copy()) is None
    # int64 load columns are taken (converted as numpy's arithmetic would)
    assert same_bits(kernels.requests_after_rows(q.astype(np.int64), q, idx, rows),
                     kernels.requests_after_rows(q.astype(np.int64).astype(np.float64), q, idx, rows))


@pytest.mark.parametrize("ranks", [2, 3, 8, 9, 16, 72])
@pytest.mark.parametrize("pattern", ["random", "ties", "wide"])
def test_prefill_kernel_selects_equal_numpy_and_the_branching_loop(ranks, pattern):
    """kernels.prefill_ep_rows (selects instead of branches in the loop over an engine's ranks)
    with one prefix hit for the whole pool (X repeats within an engine, queues equal to X, ties)
    and one hit per engine: features, horizon and N_after equal the numpy code's bit for bit
    (reference: prefill_wait_features and EpAware._requests_after with the kernels off), and the
    branching kernel's (prefill_ep_rows_plain) too."""
    eng = EngineCost(prefill=PrefillStepCost(0.02, 5.1e-5, 1.0e-8, 4.2e-6), chunk_tokens=8192, ep_synchronous=True)
    k = kernels.compiled()
    for seed in range(4):
        reps, q, a, _, _ = pool(seed, ranks, 2 + seed, pattern)
        if seed == 3:  # queues at chunk multiples: some equal X exactly (the 0 < Qr <= X edge of the fraction)
            q = np.random.default_rng(ranks).integers(0, 6, len(q)) * 8192.0
            a = q * 1000.0 + (q == 0) * 7.0  # and pairs on an empty queue (W > 0 there: its fraction shows)
        _, idx, rows = engine_groups(reps)
        P = 32_768.0
        hits = np.full(len(q), 1024.0 * seed) if seed % 2 == 0 else np.repeat(np.arange(len(rows)) * 512.0, ranks)
        cached = np.minimum(hits, P - 1.0)
        u = P - cached
        n_req = np.random.default_rng(seed).integers(0, 40, len(reps))
        c = Candidates(Role.PREFILL, reps, n_req, q.astype(np.int64), np.zeros(len(reps), np.int64),
                       np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), np.zeros(len(reps), np.int64), 512)
        got = kernels.prefill_ep_rows(q, a, u, cached, n_req, 8192, 5.1e-5, 1.0e-8, idx, rows)
        kernels.use_compiled(False)
        try:
            f0, h0 = prefill_wait_features(q, a, u, cached, eng, idx, rows)
            n0 = EpAware._requests_after(q, c, idx, rows)
        finally:
            kernels.use_compiled(True)
        assert same_bits(got[0], f0) and same_bits(got[1], h0) and same_bits(got[2], n0), (ranks, seed, pattern)
        n = len(q)
        plain = np.empty((n, 4)), np.empty(n), np.empty(n)
        k.prefill_ep_rows_plain(q, a, u, cached, n_req, 8192.0, 5.1e-5, 1.0e-8, idx, rows, True, *plain)
        assert all(same_bits(x, y) for x, y in zip(got, plain))


@pytest.mark.parametrize("spoil", ["nan_q", "inf_a", "negative_a", "zero_chunk"])
def test_prefill_kernel_falls_back_to_the_per_candidate_loop(spoil):
    """Inputs the selects do not cover (a NaN, an infinity, a zero chunk: X not finite) and a
    negative queued-pair count (covered) give exactly the branching kernel's answer."""
    reps, q, a, u, cached = pool(1, 8, 3, "random")
    _, idx, rows = engine_groups(reps)
    q, a = q.copy(), a.copy()
    C = 8192.0
    if spoil == "nan_q":
        q[5] = np.nan
    elif spoil == "inf_a":
        a[9] = np.inf
    elif spoil == "negative_a":
        a[3] = -1e12
    else:
        C = 0.0
    n_req = np.arange(len(q), dtype=np.int64)
    k = kernels.compiled()
    n = len(q)
    fast = np.empty((n, 4)), np.empty(n), np.empty(n)
    plain = np.empty((n, 4)), np.empty(n), np.empty(n)
    with np.errstate(all="ignore"):
        k.prefill_ep_rows(q, a, u, cached, n_req, C, 5.1e-5, 1.0e-8, idx, rows, True, *fast)
        k.prefill_ep_rows_plain(q, a, u, cached, n_req, C, 5.1e-5, 1.0e-8, idx, rows, True, *plain)
    assert all(same_bits(x, y) for x, y in zip(fast, plain))


@pytest.mark.parametrize("ranks", [1, 2, 8, 9, 16])
def test_decode_select_compiled_equals_numpy(ranks):
    """EpAware.select on a wide-EP decode pool (one compiled call: cost, room test, tie pick)
    against the numpy code (kernels off): the same replica, reason, scores (bits) and RNG state
    afterwards, with capacities that all fit, some or none (the compiled call hands over to the
    numpy path), exact ties (the draw), a zero tie tolerance and seq_cap with full ranks."""
    d = DecodeStepCost(0.012, 6.0e-5, 3.0e-9, 1.5e-6)
    eng = EngineCost(decode=d, ep_synchronous=True, max_num_seqs=64)
    model = CostModel(decode=eng, transfer_s_per_token=2.5e-7)
    rng = np.random.default_rng(ranks)
    ran_compiled = 0
    for trial in range(120):
        engines = int(rng.integers(1, 6))
        reps = tuple(ReplicaId(f"d{e}", r) for e in range(engines) for r in range(ranks))
        n = len(reps)
        b = rng.integers(0, 70, n) * (rng.random(n) < 0.7)
        if trial % 3 == 0:  # equal loads: exact cost ties, the random draw
            b[:] = b[0]
        k = b * 4_000 + (0 if trial % 3 == 0 else rng.integers(0, 40_000, n))
        cap = np.full(n, 2_000_000) if trial % 4 else rng.integers(0, 3, n) * 150_000
        matched = np.minimum(rng.integers(0, 70, n) * 512, 32_768) * (trial % 3 != 0)
        c = Candidates(Role.DECODE, reps, b, np.zeros(n, np.int64), k, cap, matched // 512, matched, 512)
        req = Request("r", 0.0, 32_768, (), 128, int(rng.integers(1, 9000)))
        pol = EpAware(tie_tolerance=(0.05, 0.0, 0.3)[trial % 3], seq_cap=trial % 5 == 4)
        r1, r0 = random.Random(trial), random.Random(trial)
        kernels.use_compiled(True)
        fast = pol.select(req, c, SelectContext(r1, 0.0, 0, model, None))
        kernels.use_compiled(False)
        slow = pol.select(req, c, SelectContext(r0, 0.0, 0, model, None))
        kernels.use_compiled(True)
        assert (fast.replica, fast.reason) == (slow.replica, slow.reason), trial
        assert same_bits(list(fast.scores.values()), list(slow.scores.values())), trial
        assert r1.getstate() == r0.getstate(), trial
        _, idx, rows = engine_groups(reps)
        ran_compiled += pol._decode_select_compiled(req, c, model, ("d",), idx, rows,
                                                    SelectContext(random.Random(0), 0.0, 0, model, None)) is not None
    assert ran_compiled > 30  # the one-call path decided most trials (the rest: the numpy hand-over)


@pytest.mark.parametrize("overlap_weight", [1.0, 0.0, 0.7, 3.0])
def test_kv_cost_select_compiled_equals_numpy(overlap_weight):
    """KvCost.select (temperature 0) with its compiled cost-and-minimum call against the numpy
    code (kernels off): the same replica, reason, scores (bits) and RNG state afterwards, on
    pools with exact cost ties (broken by the fewest cached blocks, then at random) and without."""
    from balancer.policies.kv_cost import KvCost

    pol = KvCost(overlap_weight=overlap_weight)
    rng = np.random.default_rng(int(overlap_weight * 10))
    for trial in range(300):
        n = int(rng.integers(1, 80))
        reps = tuple(ReplicaId(f"e{i // 8}", i % 8) for i in range(n))
        scale = 512 if trial % 2 else 1  # block multiples tie often; raw token counts rarely
        pt = rng.integers(0, 4, n) * scale * 16
        kv = rng.integers(0, 4, n) * scale * 16
        matched_blocks = rng.integers(0, 5, n)
        matched = np.minimum(matched_blocks * 512, 2048)
        bs = (512, 100, 48)[trial % 3]  # 100 and 48: divisions that round (a reordering shows)
        c = Candidates(Role.DECODE, reps, np.zeros(n, np.int64), pt, kv, np.zeros(n, np.int64), matched_blocks, matched,
                       bs)
        req = Request("r", 0.0, 2048 + int(rng.integers(0, 3000)), (), 64, 64)
        r1, r0 = random.Random(trial), random.Random(trial)
        kernels.use_compiled(True)
        fast = pol.select(req, c, SelectContext(r1, 0.0, 0, None, None))
        kernels.use_compiled(False)
        slow = pol.select(req, c, SelectContext(r0, 0.0, 0, None, None))
        kernels.use_compiled(True)
        assert (fast.replica, fast.reason) == (slow.replica, slow.reason), trial
        assert same_bits(list(fast.scores.values()), list(slow.scores.values())), trial
        assert r1.getstate() == r0.getstate(), trial
    assert kernels.kv_cost_select(pt, matched, kv, 2048.0, 512.0, overlap_weight) is not None  # the compiled call ran


@pytest.mark.parametrize("weights", [(3.0, 2.0, 2.0, 0.0), (0.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.5, 0.7),
                                     (0.0, 0.0, 0.0, 2.5), (0.3, 0.1, 0.7, 0.9)])
def test_scored_select_compiled_equals_numpy(weights):
    """Scored.select with its compiled total-and-maximum call against the numpy code (kernels
    off), the independent reference: the same replica, reason, scores (bits) and RNG state
    afterwards, over pools with exact ties (equal queues and matches: a draw), capacities all /
    none / some known, KV past the capacity (usage clipped to 1), prompts without blocks, and
    tier-weighted (float) matches; weights of 0 leave a scorer out (its term is not added)."""
    from balancer.policies.scored import Scored

    pol = Scored(*weights, load_queue_cap=(128, 5, 1)[int(sum(weights) * 10) % 3])
    rng = np.random.default_rng(int(sum(weights) * 100))
    ran = 0
    for trial in range(300):
        n = int(rng.integers(1, 80))
        reps = tuple(ReplicaId(f"e{i // 8}", i % 8) for i in range(n))
        spread = (1, 3, 200)[trial % 3]  # 1: every queue equal (the queue scorer is all ones)
        num = rng.integers(0, spread, n)
        kv = rng.integers(0, 4, n) * (250_000 if trial % 2 else 7_777)
        cap = np.full(n, 1_000_000, np.int64)
        if trial % 5 == 1:
            cap[:] = 0  # none known
        elif trial % 5 == 2:
            cap[rng.random(n) < 0.5] = 0  # some known
        elif trial % 5 == 3:
            cap = rng.integers(1, 900_000, n)  # KV beyond capacity: usage clipped to 1
        n_blocks = (0, 3, 64, 7)[trial % 4]
        matched_blocks = rng.integers(0, max(n_blocks, 1) + 2, n)  # may exceed the prompt's blocks: clipped
        if trial % 7 == 6:
            matched_blocks = matched_blocks + 0.75 * rng.integers(0, 3, n)  # tier-weighted, float64
        c = Candidates(Role.DECODE, reps, num, np.zeros(n, np.int64), kv, cap, matched_blocks,
                       np.zeros(n, np.int64), 512)
        req = Request("r", 0.0, 512 * max(n_blocks, 1), tuple(range(n_blocks)), 64, 64)
        r1, r0 = random.Random(trial), random.Random(trial)
        kernels.use_compiled(True)
        fast = pol.select(req, c, SelectContext(r1, 0.0, 0, None, None))
        ran += kernels.scored_select(c.matched_blocks, num, kv, cap, n_blocks, weights, pol.load_queue_cap) is not None
        kernels.use_compiled(False)
        slow = pol.select(req, c, SelectContext(r0, 0.0, 0, None, None))
        kernels.use_compiled(True)
        assert (fast.replica, fast.reason) == (slow.replica, slow.reason), trial
        assert same_bits(list(fast.scores.values()), list(slow.scores.values())), trial
        assert r1.getstate() == r0.getstate(), trial
    assert ran == 300  # the compiled call took every pool (int and float matches)


def test_scored_select_nan_total_hands_over():
    """An infinite weight times a 0.0 score is NaN: the kernel returns -1 and the numpy code
    decides (its own NaN rule), as with the kernels off."""
    from balancer.policies.scored import Scored

    n = 4
    got = kernels.scored_select(np.zeros(n, np.int64), np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64), 2,
                                (np.inf, 1.0, 0.0, 0.0), 128)
    assert got is not None and got[0] == -1  # inf * (0 / 2) = NaN
    c = Candidates(Role.DECODE, tuple(ReplicaId("e", i) for i in range(n)), np.arange(n), np.zeros(n, np.int64),
                   np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), 512)
    req = Request("r", 0.0, 1024, (1, 2), 64, 64)
    with pytest.raises(ValueError), np.errstate(invalid="ignore"):  # numpy's rule: all NaN, nothing is the max
        Scored(np.inf, 1.0, 0.0, 0.0).select(req, c, SelectContext(random.Random(0), 0.0, 0, None, None))


@pytest.mark.parametrize("seed", range(4))
def test_fewest_among_keeps_argmin_randoms_candidates(seed):
    """kernels.fewest_among against argmin_random's rule written here (independent): among the
    given positions, those with the least value, in order."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 3, 40)
    positions = np.sort(rng.choice(40, size=15, replace=False)).astype(np.int64)
    least = min(values[p] for p in positions)
    expected = [int(p) for p in positions if values[p] == least]
    out = positions.copy()
    m = kernels.fewest_among(values, 15, out)
    assert m == len(expected) and out[:m].tolist() == expected
    # float values (tier-weighted matches) are not taken: None, positions untouched
    out2 = positions.copy()
    assert kernels.fewest_among(values.astype(np.float64), 15, out2) is None and out2.tolist() == positions.tolist()


@pytest.mark.parametrize("ranks", [1, 2, 8, 9, 16])
def test_prefill_select_compiled_equals_numpy(ranks):
    """EpAware.select on a wide-EP prefill pool (two compiled calls around numpy's matrix product:
    features, N_after and externality; then cost and tie pick) against the numpy code (kernels
    off), the reference: the same replica, reason, scores (bits) and RNG state afterwards, on
    busy pools, idle pools (the numpy path), exact ties (equal queues: the draw), a zero tie
    tolerance, no horizon term, no externality (a dense-like weight 0), and a cost model with
    vLLM's chunk limit (cadence: the numpy path)."""
    p = PrefillStepCost(0.02, 5.1e-5, 1.0e-8, 4.2e-6)
    plain = CostModel(prefill=EngineCost(prefill=p, ep_synchronous=True, chunk_tokens=8192))
    chunked = CostModel(prefill=EngineCost(prefill=p, ep_synchronous=True, chunk_tokens=8192,
                                           request_chunk_tokens=2048))
    rng = np.random.default_rng(ranks + 100)
    ran_compiled = 0
    for trial in range(150):
        engines = int(rng.integers(1, 6))
        reps = tuple(ReplicaId(f"p{e}", r) for e in range(engines) for r in range(ranks))
        n = len(reps)
        q = rng.integers(1, 60_000, n) * (rng.random(n) < 0.6)
        if trial % 4 == 0:  # equal queues: exact cost ties, the random draw
            q[:] = q[0]
        if trial % 9 == 8:
            q[:] = 0  # idle pool
        pairs = q * rng.uniform(0, 3000, n)
        matched = np.minimum(rng.integers(0, 70, n) * 512, 32_768) * (trial % 4 != 0)
        c = Candidates(Role.PREFILL, reps, rng.integers(0, 9, n) * (q > 0), q, np.zeros(n, np.int64),
                       np.zeros(n, np.int64), matched // 512, matched, 512, prefill_attn_pairs=pairs)
        req = Request("r", 0.0, 32_768, (), 128, 128)
        pol = EpAware(tie_tolerance=(0.05, 0.0, 0.3)[trial % 3], horizon_weight=(4.0, 0.0)[trial % 5 == 3],
                      externality_weight=(1.0, 0.0)[trial % 11 == 10])
        model = chunked if trial % 7 == 6 else plain
        r1, r0 = random.Random(trial), random.Random(trial)
        kernels.use_compiled(True)
        fast = pol.select(req, c, SelectContext(r1, 0.0, 0, model, None))
        _, idx, rows = engine_groups(reps)
        ran_compiled += pol._prefill_select_compiled(req, c, model, ("p",), idx, rows,
                                                     SelectContext(random.Random(0), 0.0, 0, model, None)) is not None
        kernels.use_compiled(False)
        slow = pol.select(req, c, SelectContext(r0, 0.0, 0, model, None))
        kernels.use_compiled(True)
        assert (fast.replica, fast.reason) == (slow.replica, slow.reason), trial
        assert same_bits(list(fast.scores.values()), list(slow.scores.values())), trial
        assert r1.getstate() == r0.getstate(), trial
    assert ran_compiled > 60  # the compiled path decided most trials (the rest: the numpy hand-over)


@pytest.mark.parametrize("spoil", ["int32", "float", "strided", "readonly", "object", "2d", "list"])
def test_hot_wrappers_hand_other_arrays_to_numpy(spoil):
    """The one-call wrappers leave dtype and layout checks to numba's dispatcher (its explicit
    signatures): a column of another dtype or layout gives None (the caller's numpy path), never an
    error nor a wrong read; prefill_ep_cost_rows converts such count columns to float64 instead
    (as numpy's arithmetic would), with the same bits as the int64 columns."""
    n = 16
    reps = tuple(ReplicaId(f"e{i // 8}", i % 8) for i in range(n))
    _, idx, rows = engine_groups(reps)
    good = np.arange(n, dtype=np.int64) * 100

    def bad(x):
        if spoil == "int32":
            return x.astype(np.int32)
        if spoil == "float":
            return x.astype(np.float64)
        if spoil == "strided":
            return np.repeat(x, 2)[::2]
        if spoil == "readonly":
            y = x.copy()
            y.flags.writeable = False
            return y
        if spoil == "object":
            return x.astype(object)
        if spoil == "2d":
            return x.reshape(n, 1)
        return x.tolist()

    x = bad(good)
    assert kernels.kv_cost_select(x, good, good, 3000.0, 16.0, 1.0) is None
    assert kernels.decode_select_rows(good, x, good, good + 10**7, idx, rows, 128.0, 3064.0, 3000.0, 0.01, 1e-5,
                                      1e-9, 1e-6, 1.0, 1e-7, True, 3128, 0.05) is None
    assert kernels.prefill_cost_pick(np.ones(n), np.ones(n), np.ones(n), 1.0, x, 0.05) is None
    if spoil != "float":  # float64 matches are a signature of scored's (tier-weighted matches)
        assert kernels.scored_select(x, good, good, good, 4, (3.0, 2.0, 2.0, 0.0), 128) is None
    q = good.astype(np.float64)
    if spoil in ("int32", "float", "strided", "readonly"):  # numeric: converted to float64, the same bits
        got = kernels.prefill_ep_cost_rows(q, q * 10.0, x, good, 4096.0, 8192, 5.1e-5, 1e-8, 4.2e-6, idx, rows)
        ref = kernels.prefill_ep_cost_rows(q, q * 10.0, good, good, 4096.0, 8192, 5.1e-5, 1e-8, 4.2e-6, idx, rows)
        assert all(same_bits(g, r) for g, r in zip(got[:5], ref[:5])) and got[5] == ref[5]
