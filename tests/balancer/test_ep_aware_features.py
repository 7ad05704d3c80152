"""``prefill_wait_features`` and ``ep_aware``'s ``N_after`` term against a plain per-candidate loop
written from their docstrings' formulas (an independent implementation: Python floats, one
candidate and one rank at a time), for wide-EP engines with equal rank counts (the cached
``(E, R)`` row layout, :func:`balancer.cost_model.engine_layout`), uneven ones (no row layout),
idle pools and dense engines. The vectorised code was reshaped for speed (issue 26); these
pin its values, and the simulator's per-request CSVs were checked byte-identical by hand."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from balancer.candidates import Candidates
from balancer.cost_model import EngineCost, PrefillStepCost, engine_groups, engine_layout, prefill_wait_features
from balancer.policies.ep_aware import EpAware
from balancer.types import ReplicaId, Role

PF = PrefillStepCost(overhead_s=0.02, per_token_s=2.0e-5, per_attn_pair_s=1.0e-10, per_group_token_s=3.0e-6)


def reference(q, a, u, p, eng: EngineCost, engine_of):
    """The docstring of prefill_wait_features, one candidate at a time."""
    c, C = eng.prefill, float(eng.chunk_tokens)
    feats, horizon = [], []
    for i in range(len(q)):
        q_new = q[i] + u[i]
        a_new = a[i] + (u[i] * p[i] + u[i] * (u[i] + 1.0) / 2.0)
        S = math.ceil(q_new / C)
        if not eng.ep_synchronous:
            feats.append([S, q_new, a_new, 0.0])
            horizon.append(0.0)
            continue
        X = S * C
        w_new = c.per_token_s * q_new + c.per_attn_pair_s * a_new
        others = [r for r in range(len(q)) if engine_of[r] == engine_of[i] and r != i]
        frac = {r: min(1.0, X / q[r]) if q[r] > 0 else 0.0 for r in others}
        work = {r: (c.per_token_s * q[r] + c.per_attn_pair_s * a[r]) * frac[r] for r in others}
        j = max(others, key=lambda r: (work[r], -r)) if others else None  # the first busiest rank
        if j is None or w_new >= work[j]:
            tok, pairs = q_new, a_new
        else:
            tok, pairs = q[j] * frac[j], a[j] * frac[j]
        clip = sum(min(q[r], X) for r in others) + q_new
        feats.append([S, tok, pairs, clip])
        busiest = max((c.per_token_s * q[r] + c.per_attn_pair_s * a[r] for r in others), default=0.0)
        horizon.append(max(w_new - busiest, 0.0) if busiest > 0 else 0.0)
    return np.array(feats), np.array(horizon)


def workload(seed: int, ranks_per_engine: list[int], idle: bool = False):
    rng = random.Random(seed)
    replicas = tuple(ReplicaId(f"e{e}", r) for e, k in enumerate(ranks_per_engine) for r in range(k))
    n = len(replicas)
    q = np.array([0.0 if idle or rng.random() < 0.3 else float(rng.randrange(1, 40_000)) for _ in range(n)])
    a = np.array([0.0 if x == 0 else x * rng.uniform(0, 30_000) for x in q])
    P = 32_768.0
    p = np.array([float(min(rng.randrange(0, 64) * 512, P - 1)) for _ in range(n)])
    return replicas, q, a, P - p, p


@pytest.mark.parametrize("ranks, idle, ep", [
    ([8] * 8, False, True),     # 64 ranks in the row layout
    ([8] * 8, True, True),      # an idle pool (its own shortcut)
    ([4, 1, 3, 8], False, True),  # uneven engines: no row layout
    ([1] * 6, False, True),     # one rank per engine: nobody to wait for
    ([8] * 4, False, False),    # dense engines
])
@pytest.mark.parametrize("seed", range(5))
def test_prefill_wait_features_match_the_docstring_loop(ranks, idle, ep, seed):
    replicas, q, a, u, p = workload(seed, ranks, idle)
    eng = EngineCost(prefill=PF, chunk_tokens=8192, ep_synchronous=ep)
    names, idx, rows = engine_groups(replicas)
    assert (rows is not None) == (len(set(ranks)) == 1)
    feats, horizon = prefill_wait_features(q, a, u, p, eng, idx, rows)
    want_f, want_h = reference(q.tolist(), a.tolist(), u.tolist(), p.tolist(), eng, idx.tolist())
    np.testing.assert_allclose(feats, want_f, rtol=1e-12, atol=0)
    np.testing.assert_allclose(horizon, want_h, rtol=1e-9, atol=1e-15)
    # the same call again (cached layout, cached groups) gives the same bits
    again_f, again_h = prefill_wait_features(q, a, u, p, eng, idx, rows)
    assert again_f.tobytes() == feats.tobytes() and again_h.tobytes() == horizon.tobytes()


@pytest.mark.parametrize("ranks", [[8] * 8, [4, 1, 3, 8]])
def test_requests_after_matches_its_formula(ranks):
    """N_after_i = sum over i's engine's other ranks r of n_r clip((q_r - q_i) / q_r, 0, 1)."""
    replicas, q, _, _, _ = workload(7, ranks)
    rng = random.Random(8)
    n_req = np.array([rng.randrange(0, 50) for _ in replicas], dtype=np.int64)
    z = np.zeros(len(replicas), dtype=np.int64)
    cands = Candidates(Role.PREFILL, replicas, n_req, q.astype(np.int64), z, z, z, z, 512)
    names, idx, rows = engine_groups(replicas)
    got = EpAware._requests_after(q, cands, idx, rows)
    want = [sum(n_req[r] * min(1.0, max(0.0, (q[r] - q[i]) / q[r])) for r in range(len(q))
                if idx[r] == idx[i] and r != i and q[r] > 0) for i in range(len(q))]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_engine_layout_is_each_candidates_engine_row_and_cached():
    replicas = tuple(ReplicaId(f"e{e}", r) for e in range(3) for r in range(4))
    _, idx, rows = engine_groups(replicas)
    ri, ar, own = engine_layout(idx, rows)
    # candidate 5 is engine 1's rank 1: its engine's positions are 4..7, its own column 1
    assert ri[5].tolist() == [4, 5, 6, 7] and own[5] == 1 and ar.tolist() == list(range(12))
    assert ri.shape == (12, 4) and not ri.flags.writeable
    assert engine_layout(idx, rows)[0] is ri  # the same pair of objects: cached
