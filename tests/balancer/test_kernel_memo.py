"""ep_aware's prefill memo (:func:`balancer._jit_kernels.prefill_ep_rows_memo`: per-rank and
per-engine numbers kept between decisions, recomputed for the engines whose ranks' load changed)
against the same kernel computed afresh, compared bit for bit over sequences of decisions whose
pools change a few ranks at a time, as a router's do.

References: ``prefill_ep_rows_plain`` (the branching per-candidate loop that tests/balancer/
test_kernels.py pins to the numpy code) and, on some steps, the numpy code itself
(:func:`balancer.cost_model.prefill_wait_features` and ``EpAware._requests_after`` with the
kernels off). About 10 s with the kernels in numba's cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from balancer import kernels
from balancer.candidates import Candidates
from balancer.cost_model import EngineCost, PrefillStepCost, engine_groups, prefill_wait_features
from balancer.policies.ep_aware import EpAware
from balancer.types import ReplicaId, Role

numba = pytest.importorskip("numba")


def same_bits(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def fresh_memo(idx, rows):
    """New memo arrays (stale), shaped as kernels' own."""
    n, E = len(idx), rows.shape[0]
    return np.zeros(4), np.zeros((kernels.compiled().MEMO_RANK_ROWS, n)), np.zeros((E, 2)), np.zeros((E, 2), np.int64)


def outputs(n):
    return np.empty((n, 4)), np.empty(n), np.empty(n)


class Pool:
    """A wide-EP prefill pool whose load changes a few ranks per decision (a dispatch, finishes)."""

    def __init__(self, seed: int, ranks: int, engines: int):
        self.rng = np.random.default_rng(seed)
        self.reps = tuple(ReplicaId(f"p{e:02d}", r) for e in range(engines) for r in range(ranks))
        _, self.idx, self.rows = engine_groups(self.reps)
        n = len(self.reps)
        rng = self.rng
        self.q = rng.integers(0, 6, n) * 8192.0 * (rng.random(n) < 0.7)
        self.a = self.q * rng.uniform(0, 3000, n)
        self.n_req = rng.integers(0, 40, n)

    def step(self) -> None:
        rng = self.rng
        n = len(self.q)
        for _ in range(int(rng.integers(0, 4))):
            r = int(rng.integers(n))
            kind = rng.integers(4)
            if kind == 0:  # a queue that moves (a dispatch, a finish): at, just past or past a chunk multiple
                self.q[r] = float(rng.integers(0, 9) * 8192 + rng.choice([0, 1, int(rng.integers(2, 9000))]))
                self.a[r] = self.q[r] * rng.uniform(0, 3000)
            elif kind == 1:  # the requests count alone (N_after reads it, nothing else does)
                self.n_req[r] = int(rng.integers(0, 40))
            elif kind == 2:  # the pairs alone (W)
                self.a[r] = self.q[r] * rng.uniform(0, 3000)
            else:  # a whole engine emptied (its requests finished)
                e = int(self.idx[r])
                self.q[self.rows[e]] = 0.0
                self.a[self.rows[e]] = 0.0
                self.n_req[self.rows[e]] = 0

    def request(self, P: float):
        """``(u, cached)`` of a prompt of ``P`` tokens: no hit, one hit for all, or one per rank."""
        rng = self.rng
        n = len(self.q)
        kind = rng.integers(3)
        hits = (np.zeros(n) if kind == 0 else np.full(n, 512.0 * rng.integers(0, 64)) if kind == 1
                else rng.integers(0, 64, n) * 512.0)
        cached = np.minimum(hits, P - 1.0)
        return P - cached, cached


@pytest.mark.parametrize("ranks", [2, 3, 8, 9, 16])
@pytest.mark.parametrize("engines", [1, 4, 9])
def test_memo_equals_the_fresh_kernels_over_a_sequence_of_decisions(ranks, engines):
    """300 decisions on a pool whose ranks change a few at a time, prompts of 1k-100k tokens,
    two coefficient sets alternating now and then: the memo's features, horizon and N_after equal
    the branching loop's bit for bit on every decision, the numpy code's on every tenth; the memo
    answered every one (no fallback), and both its paths ran (a candidate's X at least its
    engine's largest queue: the memo's numbers; below it: the engine evaluated at that X). With
    the router's share rule (the fresh kernel where many candidates are below) the same bits."""
    k = kernels.compiled()
    pool = Pool(ranks * 100 + engines, ranks, engines)
    idx, rows = pool.idx, pool.rows
    n = len(pool.q)
    memo = fresh_memo(idx, rows)
    below = within = 0
    ran = [0, 0, 0]
    for step in range(300):
        pool.step()
        P = float(pool.rng.choice([1000.0, 4096.0, 32_768.0, 100_000.0]))
        u, cached = pool.request(P)
        per_token = 5.1e-5 if step % 50 < 40 else 6.0e-5  # a refit changes the coefficients
        n_req = pool.n_req if step % 2 else pool.n_req.astype(np.float64)  # both signatures
        q_in = pool.q if step % 3 else pool.q.astype(np.int64)  # int64 queues: the router's (whole tokens)
        got, ref = outputs(n), outputs(n)
        assert k.prefill_ep_rows_memo(q_in, pool.a, u, cached, n_req, 8192.0, per_token, 1.0e-8, idx, rows, *got,
                                      1.0, *memo) == 2, step  # the memo answers every candidate
        k.prefill_ep_rows_plain(pool.q, pool.a, u, cached, n_req, 8192.0, per_token, 1.0e-8, idx, rows, True, *ref)
        assert all(same_bits(x, y) for x, y in zip(got, ref)), (step, [same_bits(x, y) for x, y in zip(got, ref)])
        got2 = outputs(n)  # the router's share rule: the memo or, for many candidates below, the fresh kernel
        ran[k.prefill_ep_rows_memo(q_in, pool.a, u, cached, n_req, 8192.0, per_token, 1.0e-8, idx, rows, *got2,
                                   k.MEMO_MAX_BELOW, *memo)] += 1
        assert all(same_bits(x, y) for x, y in zip(got2, ref)), step
        X = np.ceil((pool.q + u) / 8192.0) * 8192.0
        top = pool.q.reshape(-1, ranks).max(axis=1)[idx]
        below += int(np.count_nonzero(X < top))
        within += int(np.count_nonzero(X >= top))
        if step % 10 == 0:  # the numpy code itself
            eng = EngineCost(prefill=PrefillStepCost(0.02, per_token, 1.0e-8, 4.2e-6), chunk_tokens=8192,
                             ep_synchronous=True)
            c = Candidates(Role.PREFILL, pool.reps, pool.n_req, pool.q.astype(np.int64), np.zeros(n, np.int64),
                           np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), 512)
            kernels.use_compiled(False)
            try:
                f0, h0 = prefill_wait_features(pool.q, pool.a, u, cached, eng, idx, rows)
                n0 = EpAware._requests_after(pool.q, c, idx, rows)
            finally:
                kernels.use_compiled(True)
            assert same_bits(got[0], f0) and same_bits(got[1], h0) and same_bits(got[2], n0), step
    assert below > 30 and within > 30, (below, within)
    assert ran[0] == 0 and ran[2] > 0, ran  # never the fallback; the memo on the usual pools


@pytest.mark.parametrize("spoil", ["nan_q", "inf_a", "negative_a", "zero_chunk", "negative_coefficient",
                                   "one_rank", "nan_cached"])
def test_memo_hands_inputs_it_does_not_cover_to_the_fresh_kernel_and_recovers(spoil):
    """A NaN, an infinity, negative pairs, a zero chunk, a negative coefficient, one rank per
    engine, a NaN prefix hit: the memo kernel says it did not answer (False) and its outputs are
    the branching loop's bit for bit; the next decision on good inputs (the same memo) is the
    memo's again and right (nothing stale survives the bad call)."""
    k = kernels.compiled()
    ranks = 1 if spoil == "one_rank" else 8
    pool = Pool(7, ranks, 3)
    idx, rows = pool.idx, pool.rows
    n = len(pool.q)
    memo = fresh_memo(idx, rows)
    u, cached = pool.request(32_768.0)
    assert k.prefill_ep_rows_memo(pool.q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows,
                                  *outputs(n), 1.0, *memo) == (0 if spoil == "one_rank" else 2)
    q, a, C, pt = pool.q.copy(), pool.a.copy(), 8192.0, 5.1e-5
    if spoil == "nan_q":
        q[5] = np.nan
    elif spoil == "inf_a":
        a[9] = np.inf
    elif spoil == "negative_a":
        a[3] = -1e12
    elif spoil == "zero_chunk":
        C = 0.0
    elif spoil == "negative_coefficient":
        pt = -5.1e-5
    elif spoil == "nan_cached":
        cached = cached.copy()
        cached[4] = np.nan
    got, ref = outputs(n), outputs(n)
    with np.errstate(all="ignore"):
        assert not k.prefill_ep_rows_memo(q, a, u, cached, pool.n_req, C, pt, 1e-8, idx, rows, *got, 1.0, *memo)
        k.prefill_ep_rows_plain(q, a, u, cached, pool.n_req, C, pt, 1e-8, idx, rows, True, *ref)
    assert all(same_bits(x, y) for x, y in zip(got, ref))
    if spoil == "one_rank":
        return
    pool.step()
    u, cached = pool.request(32_768.0)
    got, ref = outputs(n), outputs(n)
    assert k.prefill_ep_rows_memo(pool.q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, *got, 1.0, *memo)
    k.prefill_ep_rows_plain(pool.q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *ref)
    assert all(same_bits(x, y) for x, y in zip(got, ref))


def test_one_memo_for_two_pools_of_the_same_layout_stays_right():
    """Two pools that share a layout (and so, through kernels' cache by layout identity, could
    share a memo) decided alternately with one memo: every decision equals the fresh kernel's
    (each call finds the other pool's numbers and recomputes the engines that differ)."""
    k = kernels.compiled()
    p1, p2 = Pool(1, 8, 4), Pool(2, 8, 4)
    idx, rows = p1.idx, p1.rows
    n = len(p1.q)
    memo = fresh_memo(idx, rows)
    for step in range(40):
        pool = p1 if step % 2 else p2
        pool.step()
        u, cached = pool.request(32_768.0)
        got, ref = outputs(n), outputs(n)
        assert k.prefill_ep_rows_memo(pool.q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, *got,
                                      1.0, *memo)
        k.prefill_ep_rows_plain(pool.q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *ref)
        assert all(same_bits(x, y) for x, y in zip(got, ref)), step


def test_cost_rows_wrapper_keeps_one_memo_per_layout_and_equals_the_memo_free_call():
    """kernels.prefill_ep_cost_rows (the memo on by default) and with memo=False: the same six
    results bit for bit over a sequence of decisions; the wrapper keeps one memo per (idx, rows)
    pair and thread, bounded."""
    pool = Pool(3, 8, 8)
    idx, rows = pool.idx, pool.rows
    for step in range(50):
        pool.step()
        matched = pool.rng.integers(0, 64, len(pool.q)) * 512
        q = pool.q.astype(np.int64)
        got = kernels.prefill_ep_cost_rows(q, pool.a, matched, pool.n_req, 32_768.0, 8192, 5.1e-5, 1e-8, 4.2e-6,
                                           idx, rows)
        ref = kernels.prefill_ep_cost_rows(q, pool.a, matched, pool.n_req, 32_768.0, 8192, 5.1e-5, 1e-8, 4.2e-6,
                                           idx, rows, memo=False)
        assert got is not None and ref is not None
        assert all(same_bits(x, y) for x, y in zip(got[:5], ref[:5])) and got[5] == ref[5], step
    k = kernels.compiled()
    assert kernels._memo_entry(k, idx, rows) is kernels._memo_entry(k, idx, rows)
    for e in range(kernels._MEMOS_MAX + 3):  # new layouts: the per-thread table stays bounded
        reps = tuple(ReplicaId(f"x{e}-{i}", r) for i in range(2) for r in range(4))
        _, i2, r2 = engine_groups(reps)
        assert kernels._memo_entry(k, i2, r2) is not None
    assert len(kernels._MEMOS.d) <= kernels._MEMOS_MAX


def test_select_parts_equal_the_cost_rows_and_leave_idle_pools_to_the_caller():
    """kernels.prefill_ep_select_parts (the selection's memo call into reused arrays): features,
    horizon, ext and the busy count equal prefill_ep_cost_rows' without the memo, bit for bit,
    on two pools decided alternately (the reused arrays of one do not leak into the other's
    answer); an idle pool (no queue above 0) gives None, as does a layout the kernels do not take."""
    p1, p2 = Pool(4, 8, 6), Pool(5, 8, 3)
    idle = 0
    for step in range(60):
        pool = p1 if step % 3 else p2
        pool.step()
        q = pool.q.astype(np.int64)
        if step % 10 == 9:
            q[:] = 0  # idle
        matched = pool.rng.integers(0, 64, len(q)) * 512
        got = kernels.prefill_ep_select_parts(q, pool.a, matched, pool.n_req, 32_768.0, 8192, 5.1e-5, 1e-8, 4.2e-6,
                                              pool.idx, pool.rows)
        ref = kernels.prefill_ep_cost_rows(q, pool.a, matched, pool.n_req, 32_768.0, 8192, 5.1e-5, 1e-8, 4.2e-6,
                                           pool.idx, pool.rows, memo=False)
        if q.max() <= 0:
            assert got is None
            idle += 1
            continue
        assert got is not None and ref is not None
        assert same_bits(got[0], ref[0]) and same_bits(got[1], ref[1]) and same_bits(got[2], ref[2]), step
        assert got[3] == ref[5] == np.count_nonzero(q)
    assert 6 <= idle < 30
    reps = tuple(ReplicaId(f"e{e}", r) for e in range(2) for r in range(3))[:5]  # uneven engines: no row layout
    names, idx, rows = engine_groups(reps)
    assert rows is None or kernels.prefill_ep_select_parts(np.ones(5, np.int64), np.ones(5), np.zeros(5, np.int64),
                                                           np.ones(5, np.int64), 100.0, 8192, 1e-5, 1e-8, 1e-6, idx,
                                                           rows) is None


def test_memo_sees_the_other_zero_and_int_queues_as_their_floats():
    """A queue that turns from 0.0 to -0.0 (same value, other bits: a candidate's features can
    differ in a zero's sign) refreshes the engine; int64 queues give the bits of their float64
    values (the router's columns are int64; the memo compares float(q))."""
    k = kernels.compiled()
    pool = Pool(9, 8, 2)
    idx, rows = pool.idx, pool.rows
    n = len(pool.q)
    memo = fresh_memo(idx, rows)
    q = pool.q.copy()
    q[3] = 0.0
    u, cached = pool.request(32_768.0)
    for qq in (q, q.astype(np.int64)):
        got, ref = outputs(n), outputs(n)
        assert k.prefill_ep_rows_memo(qq, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, *got, 1.0, *memo)
        k.prefill_ep_rows_plain(q, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *ref)
        assert all(same_bits(x, y) for x, y in zip(got, ref))
    q2 = q.copy()
    q2[3] = -0.0
    got, ref = outputs(n), outputs(n)
    assert k.prefill_ep_rows_memo(q2, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, *got, 1.0, *memo)
    k.prefill_ep_rows_plain(q2, pool.a, u, cached, pool.n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *ref)
    assert all(same_bits(x, y) for x, y in zip(got, ref))
    assert memo[1][kernels.compiled()._QF][3].tobytes() == np.float64(-0.0).tobytes()  # the copy is the new zero
