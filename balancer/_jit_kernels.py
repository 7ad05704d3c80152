"""numba kernels of the route decision's hot path; import :mod:`balancer.kernels`, not this.

Imported by :mod:`balancer.kernels` only when numba is installed. Each kernel computes, bit for
bit, what a numpy expression elsewhere in ``balancer`` computes (named in its docstring): the same
IEEE operations on the same operands in the same order. Elementwise arithmetic is reproduced as
written (no fused multiply-add: numba contracts only under ``fastmath``); ``ndarray.argmax`` as
numpy's loop (the first maximum, a NaN wins); ``np.add.reduce`` along a row as numpy's pairwise
summation (:func:`_row_sum`); ``np.minimum``/``np.maximum`` propagate NaN as numpy's do. The
tests (tests/balancer/test_kernels.py) compare every kernel with its numpy expression with ``==`` on
fuzzed inputs, so a numpy release that changed its summation order would be caught there.

Compiled ahead of the first call (explicit signatures) and cached on disk by numba
(``cache=True``: numba's own cache directory, ``__pycache__`` beside this file or the user's
cache), so a process that finds the cache loads the machine code instead of compiling it.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.ma  # noqa: F401 - numba's typeof of an ndarray touches np.ma (numpy loads it lazily): load it
from numba import njit  # here, not in a router's first decision (~120 ms of imports there: issue 25 review F11)



def _jit(signature: str | list[str]):  # noqa: ANN202
    """``numba.njit`` with explicit signatures (compiled at import, or loaded from numba's cache),
    no GIL held, no bounds checks (the callers check shapes), numpy's float error model (x / 0 is
    inf or NaN, as in numpy, not an exception)."""
    return njit(signature, cache=True, nogil=True, boundscheck=False, error_model="numpy")


@_jit("f8(f8[::1], i8, i8)")
def _pairwise(v, lo, n):  # noqa: ANN001, ANN202
    """numpy's ``pairwise_sum`` of ``v[lo:lo + n]``: below 8 elements a running sum; up to 128, 8
    running sums combined as a tree, then the tail; above, the two halves (the first a multiple
    of 8 long) summed apart."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += v[i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = v[lo], v[lo + 1], v[lo + 2], v[lo + 3]
        r4, r5, r6, r7 = v[lo + 4], v[lo + 5], v[lo + 6], v[lo + 7]
        i = lo + 8
        end = lo + n - n % 8
        while i < end:
            r0 += v[i]
            r1 += v[i + 1]
            r2 += v[i + 2]
            r3 += v[i + 3]
            r4 += v[i + 4]
            r5 += v[i + 5]
            r6 += v[i + 6]
            r7 += v[i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < lo + n:
            res += v[i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise(v, lo, n2) + _pairwise(v, lo + n2, n - n2)


@_jit("f8(f8[::1], i8)")
def _row_sum(v, n):  # noqa: ANN001, ANN202
    """``np.add.reduce`` of the row ``v[:n]``: its pairwise sum added to the reduction's identity
    ``0.0`` (numpy starts an add reduction from it)."""
    return 0.0 + _pairwise(v, 0, n)


@_jit("f8(f8, f8)")
def _minimum(x, y):  # noqa: ANN001, ANN202
    """``np.minimum(x, y)`` of two floats (a NaN operand is the result)."""
    if x != x:
        return x
    if y != y:
        return y
    return x if x < y else y


@_jit("f8(f8, f8)")
def _maximum(x, y):  # noqa: ANN001, ANN202
    """``np.maximum(x, y)`` of two floats (a NaN operand is the result)."""
    if x != x:
        return x
    if y != y:
        return y
    return x if x > y else y


@_jit("i8(f8[::1], i8, f8, i8[::1])")
def _positions_of(values, n, target, out):  # noqa: ANN001, ANN202
    """Writes the positions ``i < n`` with ``values[i] == target`` into ``out`` in order; returns
    how many (the candidates a selection draws from)."""
    m = 0
    for i in range(n):
        if values[i] == target:
            out[m] = i
            m += 1
    return m


@_jit("f8(f8, f8)")
def _frac(X, Qr):  # noqa: ANN001, ANN202
    """``np.minimum(np.divide(X, Qr, where=Qr > 0, out=0), 1.0)`` of two floats, without the
    division where ``0 < Qr <= X < inf``: there ``X / Qr >= 1`` (a correctly rounded quotient of
    ``X >= Qr`` is not below 1), so the minimum is 1.0 either way."""
    if Qr > 0:
        if Qr <= X and X < np.inf:
            return 1.0
        return _minimum(X / Qr, 1.0)
    return 0.0


_EP_ROWS_SIGS = [f"void(f8[::1], f8[::1], f8[::1], f8[::1], {t}[::1], f8, f8, f8, i8[::1], i8[:, ::1], b1, f8[:, ::1], "
                 "f8[::1], f8[::1])" for t in ("f8", "i8")]  # n_req: int64 counts as they are (float() converts as astype)


@_jit(_EP_ROWS_SIGS)
def prefill_ep_rows_plain(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, want_after, feats,
                          horizon, n_after):  # noqa: ANN001, ANN201
    """:func:`prefill_wait_rows` and, with ``want_after``, :func:`requests_after_rows` (into
    ``n_after`` (n,), from ``n_req``) in one pass over each candidate's engine: one call instead of
    two, each rank's queue read once; every candidate reads all ``R`` ranks of its engine (O(n R)).
    :func:`prefill_ep_rows` is the same loop with selects instead of branches; this one (NaN-aware
    branches) is its fallback and its reference. ``N_after`` of a candidate whose queue equals an earlier
    candidate's of the same engine is that one's: its terms are the same values in the same order
    (each rank ``r`` contributes ``n_r max((q_r - q_i) / q_r, 0)``, 0 where ``q_r <= q_i``, which
    reads ``q_i`` only), so the sum is the same bits."""
    n = q.shape[0]
    R = rows.shape[1]
    mins = np.empty(R)
    vals = np.empty(R)
    W = np.empty(n)
    for r in range(n):
        W[r] = per_token_s * q[r] + per_attn_pair_s * a[r]
    for i in range(n):
        ui = u[i]
        own_pairs = ui * cached[i] + ui * (ui + 1.0) / 2.0
        q_new = q[i] + ui
        a_new = a[i] + own_pairs
        steps = np.ceil(q_new / C)
        X = steps * C
        w_new = per_token_s * q_new + per_attn_pair_s * a_new
        e = idx[i]
        own = i % R
        qi = q[i]
        # N_after: reuse an earlier candidate's of this engine with the same queue (docstring)
        after_from = -1
        if want_after:
            for c in range(own):
                rc = rows[e, c]
                if rc < i and q[rc] == qi:
                    after_from = rc
                    break
        # work = W * frac with the own rank at -1.0; j = its argmax (numpy's: the first maximum,
        # a NaN ends the search); busiest_other = max of W with the own rank at 0.0
        best = 0.0
        j = 0
        done = False
        busiest = 0.0
        for c in range(R):
            r = rows[e, c]
            Qr = q[r]
            Wr = W[r]
            wk = -1.0 if c == own else Wr * _frac(X, Qr)
            if c == 0:
                best = wk
                done = wk != wk
            elif not done and not (wk <= best):
                best = wk
                j = c
                done = wk != wk
            mins[c] = _minimum(Qr, X)
            wo = 0.0 if c == own else Wr
            busiest = wo if c == 0 else _maximum(busiest, wo)
            if want_after and after_from < 0:
                if Qr > 0 and not Qr <= qi:
                    vals[c] = float(n_req[r]) * _maximum((Qr - qi) / Qr, 0.0)
                else:
                    vals[c] = float(n_req[r]) * 0.0
        if w_new >= best:
            tok = q_new
            pairs = a_new
        else:
            rj = rows[e, j]
            fj = _frac(X, q[rj])
            tok = q[rj] * fj
            pairs = a[rj] * fj
        feats[i, 0] = steps
        feats[i, 1] = tok
        feats[i, 2] = pairs
        feats[i, 3] = (_row_sum(mins, R) - _minimum(qi, X)) + q_new
        horizon[i] = _maximum(w_new - busiest, 0.0) if busiest > 0 else 0.0
        if want_after:
            n_after[i] = n_after[after_from] if after_from >= 0 else _row_sum(vals, R)


@_jit(_EP_ROWS_SIGS)
def prefill_ep_rows(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, want_after, feats, horizon,
                    n_after):  # noqa: ANN001, ANN201
    """:func:`prefill_ep_rows_plain`, bit for bit, without data-dependent branches in the loop
    over a candidate's engine (the argmax, the minima and maxima, the clipped fractions are
    selects): on real pools (queues and prefix hits that differ by rank and change every
    decision) the plain loop's branches are mispredicted about every other rank, which cost more
    than its arithmetic. The divisions (each rank's fraction ``X / Q_r`` and ``(Q_r - q_i) / Q_r``)
    and minima run in loops of their own over the engine's ranks, which sit side by side
    (:func:`balancer.cost_model.engine_groups`' layout: ``rows[e, c] = rows[e, 0] + c``), so the
    compiler vectorises them (several divisions per instruction; the same correctly rounded
    quotients); the argmax and the busiest rank then read the fractions in a scalar pass. The
    fractions, minima and the minima's sum depend on the engine and ``X`` only: a candidate whose
    ``X`` equals the previous candidate's of the same engine reuses them (the same values). The
    selects equal the plain code's comparisons where every input is finite, ``q >= 0`` and ``X >
    0`` (no NaN, whose handling needs the branches): other inputs run
    :func:`prefill_ep_rows_plain` for the whole call."""
    n = q.shape[0]
    R = rows.shape[1]
    W = np.empty(n)
    ok = C > 0 and C < np.inf and R >= 1
    for r in range(n):
        W[r] = per_token_s * q[r] + per_attn_pair_s * a[r]
        ok = ok and q[r] >= 0.0 and q[r] < np.inf and np.abs(W[r]) < np.inf and np.abs(a[r]) < np.inf \
            and np.abs(u[r]) < np.inf and np.abs(cached[r]) < np.inf
    for i in range(n):
        X = np.ceil((q[i] + u[i]) / C) * C
        ok = ok and X > 0.0 and X < np.inf  # X <= 0 (nothing to prefill) or an overflow: the branches
    if not ok:
        prefill_ep_rows_plain(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, want_after, feats,
                              horizon, n_after)
        return
    mins = np.empty(R)
    vals = np.empty(R)
    frac = np.empty(R)
    col = 0
    prev_base = -1
    prev_X = 0.0
    mins_sum = 0.0
    for i in range(n):
        ui = u[i]
        own_pairs = ui * cached[i] + ui * (ui + 1.0) / 2.0
        q_new = q[i] + ui
        a_new = a[i] + own_pairs
        steps = np.ceil(q_new / C)
        X = steps * C
        w_new = per_token_s * q_new + per_attn_pair_s * a_new
        base = rows[idx[i], 0]  # the engine's ranks: base .. base + R - 1
        own = col  # i % R, counted
        col = col + 1 if col + 1 < R else 0
        qi = q[i]
        after_from = -1
        if want_after:
            for c in range(own):
                if q[base + c] == qi:
                    after_from = base + c
                    break
        if not (base == prev_base and X == prev_X):  # else the previous candidate's (same engine, same X)
            for c in range(R):  # vectorised: _frac(X, Q_r) and min(Q_r, X) per rank
                Qr = q[base + c]
                pos = Qr > 0.0
                d = X / (Qr if pos else 1.0)
                frac[c] = (1.0 if Qr <= X else d) if pos else 0.0  # 0 where Q_r == 0, 1 where Q_r <= X
                mins[c] = Qr if Qr < X else X
            mins_sum = _row_sum(mins, R)
            prev_base = base
            prev_X = X
        if want_after and after_from < 0:
            for c in range(R):  # vectorised: n_r max((Q_r - q_i) / Q_r, 0), 0 where Q_r <= q_i
                Qr = q[base + c]
                more = Qr > 0.0 and Qr > qi
                g = (Qr - qi) / (Qr if more else 1.0)
                vals[c] = float(n_req[base + c]) * ((g if g > 0.0 else 0.0) if more else 0.0)
        best = 0.0
        j = 0
        busiest = 0.0
        for c in range(R):
            Wr = W[base + c]
            wk = -1.0 if c == own else Wr * frac[c]
            if c == 0:
                best = wk
            up = wk > best  # the first maximum (no NaN: "not wk <= best")
            best = wk if up else best
            j = c if up else j
            wo = 0.0 if c == own else Wr
            busiest = wo if c == 0 else (busiest if busiest > wo else wo)
        if w_new >= best:
            tok = q_new
            pairs = a_new
        else:
            rj = base + j
            fj = _frac(X, q[rj])
            tok = q[rj] * fj
            pairs = a[rj] * fj
        feats[i, 0] = steps
        feats[i, 1] = tok
        feats[i, 2] = pairs
        feats[i, 3] = (mins_sum - _minimum(qi, X)) + q_new
        horizon[i] = _maximum(w_new - busiest, 0.0) if busiest > 0 else 0.0
        if want_after:
            n_after[i] = n_after[after_from] if after_from >= 0 else _row_sum(vals, R)


@_jit("void(f8[::1], f8[::1], f8[::1], f8[::1], f8, f8, f8, i8[::1], i8[:, ::1], f8[:, ::1], f8[::1])")
def prefill_wait_rows(q, a, u, cached, C, per_token_s, per_attn_pair_s, idx, rows, feats, horizon):  # noqa: ANN001, ANN201
    """:func:`balancer.cost_model.prefill_wait_features` of a wide-EP pool in the row layout
    (``rows`` (E, R)), written into ``feats`` (n, 4) and ``horizon`` (n,): its numpy expressions
    one candidate at a time, in its order of operations (``w`` per rank computed once, as there)."""
    none = np.empty(0)
    prefill_ep_rows(q, a, u, cached, none, C, per_token_s, per_attn_pair_s, idx, rows, False, feats, horizon, none)


@_jit("void(f8[::1], f8[::1], i8[::1], i8[:, ::1], f8[::1])")
def requests_after_rows(q, n_req, idx, rows, out):  # noqa: ANN001, ANN201
    """``ep_aware``'s ``N_after`` (``EpAware._requests_after``) in the row layout, into ``out`` (n,):
    ``np.add.reduce(N * max((Q - q_i) / Q, 0), axis=1)`` with 0 where ``Q == 0`` (no division
    where ``0 < Q <= q_i``: the clipped fraction is 0.0 there)."""
    n = q.shape[0]
    R = rows.shape[1]
    vals = np.empty(R)
    for i in range(n):
        e = idx[i]
        qi = q[i]
        for c in range(R):
            r = rows[e, c]
            Qr = q[r]
            if Qr > 0 and not Qr <= qi:
                vals[c] = n_req[r] * _maximum((Qr - qi) / Qr, 0.0)
            else:
                vals[c] = n_req[r] * 0.0
        out[i] = _row_sum(vals, R)


@_jit([f"void({t}[::1], {t}[::1], {t}[::1], i8[::1], i8[:, ::1], f8, f8, f8, f8, f8, f8, f8, f8, f8, b1, f8[::1])"
      for t in ("f8", "i8")])  # int64 load columns as they are: float(x) converts as numpy's astype
def decode_cost_rows(b, k, matched, idx, rows, out_tokens, kv_new, prompt_tokens, overhead_s, per_seq_s,  # noqa: ANN001, ANN201
                     per_kv_token_s, per_group_seq_s, externality_weight, transfer_s_per_token, transfer, cost):
    """``EpAware._decode_cost_one`` for wide-EP engines in the row layout, into ``cost`` (n,):
    ``B``/``K`` the engine maxima of ``b``/``k`` (``np.maximum.reduce`` of the row), ``n_e`` their
    sum in candidate order (``np.bincount`` with weights), once per engine; then its elementwise
    expressions per candidate."""
    n = b.shape[0]
    E = rows.shape[0]
    R = rows.shape[1]
    Bs = np.empty(E)
    Ks = np.empty(E)
    Ns = np.empty(E)
    for e in range(E):
        r0 = rows[e, 0]
        B = float(b[r0])
        K = float(k[r0])
        n_e = 0.0 + float(b[r0])
        for c in range(1, R):
            r = rows[e, c]
            B = _maximum(B, float(b[r]))
            K = _maximum(K, float(k[r]))
            n_e += float(b[r])
        Bs[e] = B
        Ks[e] = K
        Ns[e] = n_e
    for i in range(n):
        e = idx[i]
        B = Bs[e]
        K = Ks[e]
        n_e = Ns[e]
        bi = float(b[i])
        ki = float(k[i])
        before = ((overhead_s + per_seq_s * B) + per_kv_token_s * K) + per_group_seq_s * n_e
        after = (((overhead_s + per_seq_s * _maximum(B, bi + 1.0)) + per_kv_token_s * _maximum(K, ki + kv_new))
                 + per_group_seq_s * (n_e + 1.0))
        c_i = out_tokens * (after + (externality_weight * n_e) * (after - before))
        if transfer:
            c_i = c_i + transfer_s_per_token * _maximum(prompt_tokens - float(matched[i]), 0.0)
        cost[i] = c_i


@_jit("i8(f8[::1], i8[::1], f8, i8[::1])")
def tie_pick(cost, load, tie_tolerance, out):  # noqa: ANN001, ANN201
    """``EpAware._pick`` without its random draw: the candidates to draw from, in ``out``, and
    their count; -1 where ``_pick`` draws among the cheapest costs instead (``tie_tolerance <=
    0``, or a cheapest cost that is not finite: any NaN counts, as numpy's argmin returns the
    first NaN). Otherwise the cheapest ``i`` (numpy's argmin: the first minimum) and the costs
    ``<= cost_i (1 + tie_tolerance)`` tie: one alone is ``i`` (count 1); several, those among
    them with the least ``load`` as float64 (``np.where(near, load, inf)``'s values), in order."""
    n = cost.shape[0]
    if tie_tolerance <= 0 or n == 0:
        return -1
    i = 0
    best = cost[0]
    for j in range(n):
        x = cost[j]
        if x != x:
            return -1
        if x < best:
            best = x
            i = j
    if not (best < np.inf and best > -np.inf):
        return -1
    bound = best * (1.0 + tie_tolerance)
    n_near = 0
    least = np.inf
    for j in range(n):
        if cost[j] <= bound:
            n_near += 1
            v = float(load[j])
            if v < least:
                least = v
    if n_near == 1:
        out[0] = i
        return 1
    m = 0
    for j in range(n):
        if cost[j] <= bound and float(load[j]) == least:
            out[m] = j
            m += 1
    return m


@_jit("i8(i8[::1], i8[::1], i8)")
def count_no_room(cap, kv, need):  # noqa: ANN001, ANN201
    """``EpAware._capacity``'s test: how many candidates have a known capacity (``cap > 0``) with
    less room than ``need`` (``cap - kv < need``, int64 as numpy's); -1 when no capacity is
    known (``max(cap) <= 0``, or no candidate)."""
    known = False
    bad = 0
    for j in range(cap.shape[0]):
        if cap[j] > 0:
            known = True
            if cap[j] - kv[j] < need:
                bad += 1
    return bad if known else -1


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i8[:, ::1], f8, f8, f8, f8, f8, f8, f8, f8, f8, b1, f8[::1], i8[::1], i8, "
      "f8, i8[::1])")
def decode_select_rows(b, k, matched, idx, rows, out_tokens, kv_new, prompt_tokens, overhead_s, per_seq_s,  # noqa: ANN001, ANN201
                       per_kv_token_s, per_group_seq_s, externality_weight, transfer_s_per_token, transfer, cost, cap,
                       need, tie_tolerance, out):
    """``EpAware.select`` on a wide-EP decode pool up to its random draw, one call:
    :func:`decode_cost_rows` (into ``cost``), then :func:`count_no_room` (``cap``, ``k``,
    ``need``) and, when every candidate has room or none has a known capacity, :func:`tie_pick`
    (``k`` as the load; into ``out``). Returns ``tie_pick``'s count (>= 1; -1: draw among the
    cheapest costs), or -2 when some candidate lacks room (``EpAware._capacity`` changes the
    costs: the caller takes the numpy path)."""
    decode_cost_rows(b, k, matched, idx, rows, out_tokens, kv_new, prompt_tokens, overhead_s, per_seq_s,
                     per_kv_token_s, per_group_seq_s, externality_weight, transfer_s_per_token, transfer, cost)
    bad = count_no_room(cap, k, need)
    if bad != 0 and bad != -1:
        return -2
    return tie_pick(cost, k, tie_tolerance, out)


@_jit("i8(i8[::1], i8[::1], i8[::1], f8, f8, f8, b1, f8[::1], i8[::1])")
def kv_cost_select(prefill_tokens, matched_tokens, kv_tokens, prompt, bs, overlap_weight, weighted, cost, out):  # noqa: ANN001, ANN201
    """``kv_cost``'s costs (``KvCost.costs``: ``(prefill + (prompt - matched)) / bs``, times
    ``overlap_weight`` when ``weighted``, plus ``(kv + prompt) / bs``, numpy's operations in its
    order, into ``cost``) and, at temperature 0, the candidates at the least cost (``cost ==
    cost.min()``, in order, into ``out``); returns their count, or -1 where a cost is NaN (numpy's
    minimum is then NaN and nothing equals it: the caller's numpy path decides)."""
    n = cost.shape[0]
    if n == 0:
        return -1
    for i in range(n):
        c = (float(prefill_tokens[i]) + (prompt - float(matched_tokens[i]))) / bs
        if weighted:
            c *= overlap_weight
        c += (float(kv_tokens[i]) + prompt) / bs
        if c != c:
            return -1
        cost[i] = c
    least = cost[0]
    for i in range(1, n):
        if cost[i] < least:
            least = cost[i]
    return _positions_of(cost, n, least, out)


@_jit([f"i8(f8[::1], f8[::1], {t}[::1], {t}[::1], f8, f8, f8, f8, f8, f8, i8[::1], i8[:, ::1], f8[:, ::1], f8[::1], "
       "f8[::1], f8[::1], f8[::1])" for t in ("f8", "i8")])
def prefill_ep_cost_rows(q, a, matched, n_req, P, P_minus_1, C, per_token_s, per_attn_pair_s, w_ext, idx, rows,  # noqa: ANN001, ANN201
                         feats, horizon, ext, u, cached):
    """``EpAware._prefill_cost_one``'s wide-EP work before its matrix product, for a pool without
    lower KV tiers: ``cached = np.minimum(matched, P - 1)``, ``u = P - cached`` (into ``cached``,
    ``u``), :func:`prefill_ep_rows` (features, horizon, ``N_after``), ``ext = w_ext u N_after``
    (into ``ext``, ``(w_ext u_i) N_i`` as numpy's ``w_ext * u * n_after``); returns
    ``np.count_nonzero(q)``."""
    n = q.shape[0]
    for i in range(n):
        c = _minimum(float(matched[i]), P_minus_1)
        cached[i] = c
        u[i] = P - c
    prefill_ep_rows(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, True, feats, horizon, ext)
    busy = 0
    for i in range(n):
        ext[i] = (w_ext * u[i]) * ext[i]
        if q[i] != 0:
            busy += 1
    return busy


@_jit([f"i8({t}[::1], i8[::1], i8[::1], i8[::1], i8, f8, f8, f8, f8, f8, f8[::1], i8[::1])" for t in ("i8", "f8")])
def scored_select(matched_blocks, num_requests, kv_tokens, cap, n_blocks, w_prefix, w_queue, w_kv, w_load, queue_cap,
                  total, out):  # noqa: ANN001, ANN201
    """``scored``'s weighted total (``Scored.select``: :meth:`Scored.component_scores` of the
    scorers with a non-zero weight, ``w_0 c_0`` then ``+= w c`` in the order prefix, queue,
    kv_utilization, load; numpy's operations per element in its order, into ``total``) and the
    candidates at its maximum (``total == max``, in order, into ``out``); returns their count, or
    -1 where a total is NaN (numpy's maximum is then NaN: the caller's numpy path decides).
    ``matched_blocks`` int64 or (tier-weighted) float64; a weight 0.0 leaves its scorer out."""
    n = total.shape[0]
    if n == 0:
        return -1
    qmin = float(num_requests[0])
    qmax = qmin
    known = False
    for i in range(n):
        x = float(num_requests[i])
        if x < qmin:
            qmin = x
        if x > qmax:
            qmax = x
        if cap[i] > 0:
            known = True
    nb = float(n_blocks)
    for i in range(n):
        q = float(num_requests[i])
        t = 0.0
        first = True
        if w_prefix != 0.0:
            p = _minimum(float(matched_blocks[i]) / nb, 1.0) if n_blocks > 0 else 0.0
            t = w_prefix * p
            first = False
        if w_queue != 0.0:
            s = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            t = w_queue * s if first else t + w_queue * s
            first = False
        if w_kv != 0.0:
            u = 0.0
            if known and cap[i] > 0:
                u = _minimum(float(kv_tokens[i]) / float(cap[i]), 1.0)
            s = 1.0 - u
            t = w_kv * s if first else t + w_kv * s
            first = False
        if w_load != 0.0:
            s = 0.5 * (1.0 - _minimum(q, queue_cap) / queue_cap)
            t = w_load * s if first else t + w_load * s
        if t != t:
            return -1
        total[i] = t
    best = total[0]
    for i in range(1, n):
        if total[i] > best:
            best = total[i]
    return _positions_of(total, n, best, out)


@_jit("i8(i8[::1], i8, i8[::1])")
def fewest_among(values, count, out):  # noqa: ANN001, ANN201
    """``argmin_random(values[out[:count]], rng)`` before its draw: keeps in ``out`` (in order)
    the positions among ``out[:count]`` whose value is the least, and returns how many."""
    least = values[out[0]]
    for j in range(1, count):
        v = values[out[j]]
        if v < least:
            least = v
    m = 0
    for j in range(count):
        if values[out[j]] == least:
            out[m] = out[j]
            m += 1
    return m


@_jit("i8(f8[::1], f8[::1], f8[::1], f8, b1, i8[::1], f8, f8[::1], i8[::1])")
def prefill_cost_pick(ttft, ext, horizon, horizon_scale, with_horizon, load, tie_tolerance, cost, out):  # noqa: ANN001, ANN201
    """``EpAware``'s wide-EP prefill cost after its matrix product and its pick, one call:
    ``cost = (ttft + 0.0) + ext`` and, ``with_horizon``, ``+ horizon_scale horizon`` (numpy's
    ``f_cost + f_ext + (scale) * f_horizon``, in its order, into ``cost``), then :func:`tie_pick`
    on it with ``load`` (into ``out``); returns ``tie_pick``'s count (-1: the caller's numpy
    pick decides)."""
    n = cost.shape[0]
    for i in range(n):
        c = (ttft[i] + 0.0) + ext[i]
        if with_horizon:
            c = c + horizon_scale * horizon[i]
        cost[i] = c
    return tie_pick(cost, load, tie_tolerance, out)


@_jit("void(f8[::1], f8[::1], i8, i8, f8, f8[::1], f8[::1], f8[::1], i8[::1])")
def _engine_at(q, W, base, R, X, mins, vals, got, js):  # noqa: ANN001, ANN202
    """One engine's part of :func:`prefill_ep_rows` that depends on ``X`` alone (not on which of
    its ranks is the candidate): ``got[0]`` the pairwise sum of ``min(Q_c, X)`` over its ranks
    ``base .. base + R - 1`` (its ``mins_sum``), ``js[0]`` the first rank (column) with the most
    ``W_c frac_c`` (the fraction as there: 0 where ``Q_c == 0``, 1 where ``Q_c <= X``, else ``X /
    Q_c``) and ``js[1]`` the first with the most among the others: a candidate's argmax over its
    engine's other ranks is ``js[0]``, or ``js[1]`` where the candidate is ``js[0]`` (the values
    are >= 0 here: ``W >= 0``; ``R >= 2``). ``X = inf`` gives every ``min(Q_c, X) = Q_c`` and
    fraction 1 (0 on an empty rank): what every ``X >= max_c Q_c`` gives, bit for bit."""
    for c in range(R):
        Qr = q[base + c]
        pos = Qr > 0.0
        d = X / (Qr if pos else 1.0)
        fr = (1.0 if Qr <= X else d) if pos else 0.0
        mins[c] = Qr if Qr < X else X
        vals[c] = W[base + c] * fr
    got[0] = _row_sum(mins, R)
    j1 = 0
    b1 = vals[0]
    for c in range(1, R):
        if vals[c] > b1:
            b1 = vals[c]
            j1 = c
    j2 = 1 if j1 == 0 else 0
    b2 = vals[j2]
    for c in range(j2 + 1, R):
        if c != j1 and vals[c] > b2:
            b2 = vals[c]
            j2 = c
    js[0] = j1
    js[1] = j2


@_jit("b1(f8, f8)")
def _differs(x, y):  # noqa: ANN001, ANN202
    """Whether two floats differ as stored values: ``!=`` (a NaN differs from everything, itself
    too), or equal zeros of opposite sign (``-0.0`` and ``0.0`` can give results of different
    bits)."""
    return x != y or (x == 0.0 and math.copysign(1.0, x) != math.copysign(1.0, y))


#: the rows of a prefill memo's per-rank array (:func:`prefill_ep_rows_memo`)
_W, _NA, _BX, _NQ, _QF, _AF = 0, 1, 2, 3, 4, 5
#: rows of that array
MEMO_RANK_ROWS = 6
#: :func:`prefill_ep_rows_memo`'s share rule as the router's decisions use it: the memo answers
#: where at most this share of the candidates need their engine evaluated at their own ``X``
#: (bench/route_latency.py's memo lines measure both kernels on such pools)
MEMO_MAX_BELOW = 0.25


@_jit("void(f8[:, ::1], i8, i8, f8[::1], f8[::1], f8[::1], i8[::1], f8[:, ::1], i8[:, ::1], i8)")
def _memo_weights(rank_vals, base, R, mins, vals, got, js, eng_vals, eng_cols, e):  # noqa: ANN001, ANN202
    """The part of engine ``e``'s memo that reads the coefficients, from its ranks' ``W``: each
    rank's busiest other rank (``max`` over the others' ``W`` with 0.0 for its own, as
    :func:`prefill_ep_rows`: its value, which is all that is read of it where it is above 0) and
    the engine's two ranks of most ``W frac`` at ``X = inf`` (with its queue sum)."""
    W = rank_vals[_W]
    BX = rank_vals[_BX]
    i1 = 0
    m1 = W[base]
    for c in range(1, R):
        if W[base + c] > m1:
            m1 = W[base + c]
            i1 = c
    m2 = 0.0
    for c in range(R):
        if c != i1 and W[base + c] > m2:
            m2 = W[base + c]
    for o in range(R):
        BX[base + o] = (m2 if o == i1 else (m1 if m1 > 0.0 else 0.0))
    _engine_at(rank_vals[_QF], W, base, R, np.inf, mins, vals, got, js)
    eng_vals[e, 1] = got[0]
    eng_cols[e, 0] = js[0]
    eng_cols[e, 1] = js[1]


@_jit([f"b1({t}[::1], f8[::1], {s}[::1], f8, f8, f8, i8[:, ::1], f8[::1], f8[:, ::1], f8[:, ::1], i8[:, ::1])"
       for t in ("f8", "i8") for s in ("f8", "i8")])
def _memo_refresh(q, a, n_req, C, per_token_s, per_attn_pair_s, rows, key, rank_vals, eng_vals, eng_cols):  # noqa: ANN001, ANN202
    """:func:`prefill_ep_rows_memo`'s first part: brings the memo up to date with ``q``, ``a``,
    ``n_req`` and the coefficients: every engine in full when the memo is stale (``key[3]``); an
    engine with a rank whose ``float(q)``, ``a`` or ``float(n_req)`` differs from the memo's copy
    (:func:`_differs`) in full (O(R^2): ``N_after``); the others' coefficient-dependent part alone
    (:func:`_memo_weights`, O(R)) when ``per_token_s`` or ``per_attn_pair_s`` changed (a refit of
    the cost model). False where the memo cannot cover these inputs (then ``key`` stays stale).
    Its own function: inlined into one with the candidates' loop, LLVM compiled that loop about
    twice as slow (measured)."""
    E = rows.shape[0]
    R = rows.shape[1]
    fine = (C > 0.0 and C < np.inf and R >= 2 and per_token_s >= 0.0 and per_token_s < np.inf
            and per_attn_pair_s >= 0.0 and per_attn_pair_s < np.inf)
    if not fine:
        key[3] = 0.0
        return False
    fresh = key[3] != 1.0
    coef = fresh or key[1] != per_token_s or key[2] != per_attn_pair_s
    key[3] = 0.0  # stale until every engine is up to date
    key[0] = C
    key[1] = per_token_s
    key[2] = per_attn_pair_s
    W = rank_vals[_W]
    NA = rank_vals[_NA]
    NQ = rank_vals[_NQ]
    QF = rank_vals[_QF]
    AF = rank_vals[_AF]
    mins = np.empty(R)
    vals = np.empty(R)
    got = np.empty(1)
    js = np.empty(2, dtype=np.int64)
    for e in range(E):
        base = rows[e, 0]
        dirty = fresh
        if not dirty:
            for c in range(R):
                r = base + c
                if _differs(float(q[r]), QF[r]) or _differs(a[r], AF[r]) or float(n_req[r]) != NQ[r]:
                    dirty = True
                    break
        if not dirty:
            if coef:
                for c in range(R):
                    r = base + c
                    w = per_token_s * QF[r] + per_attn_pair_s * AF[r]
                    if not w < np.inf:
                        return False
                    W[r] = w
                _memo_weights(rank_vals, base, R, mins, vals, got, js, eng_vals, eng_cols, e)
            continue
        top = 0.0
        for c in range(R):
            r = base + c
            Qr = float(q[r])
            Ar = a[r]
            w = per_token_s * Qr + per_attn_pair_s * Ar
            if not (Qr >= 0.0 and Qr < np.inf and Ar >= 0.0 and Ar < np.inf and w < np.inf):
                return False
            QF[r] = Qr
            AF[r] = Ar
            NQ[r] = float(n_req[r])
            W[r] = w
            top = Qr if c == 0 or Qr > top else top
        for o in range(R):  # each rank as the candidate: N_after (it reads no coefficient)
            qi = QF[base + o]
            for c in range(R):
                Qr = QF[base + c]
                more = Qr > 0.0 and Qr > qi
                g = (Qr - qi) / (Qr if more else 1.0)
                vals[c] = NQ[base + c] * ((g if g > 0.0 else 0.0) if more else 0.0)
            NA[base + o] = _row_sum(vals, R)
        eng_vals[e, 0] = top
        _memo_weights(rank_vals, base, R, mins, vals, got, js, eng_vals, eng_cols, e)
    key[3] = 1.0
    return True


@_jit("b1(f8[::1], f8[::1], f8, f8, f8, i8[::1], i8[:, ::1], f8[:, ::1], f8[::1], f8[::1], "
      "f8[:, ::1], f8[:, ::1], i8[:, ::1])")
def _memo_candidates(u, cached, C, per_token_s, per_attn_pair_s, idx, rows, feats, horizon, n_after,  # noqa: ANN001, ANN202
                     rank_vals, eng_vals, eng_cols):
    """:func:`prefill_ep_rows_memo`'s second part: every candidate's features, horizon and
    ``N_after`` from an up-to-date memo (its queues and pairs are the inputs'); False (outputs
    incomplete) where a candidate's ``u``, ``cached`` or ``X`` is outside what the memo covers."""
    n = u.shape[0]
    R = rows.shape[1]
    W = rank_vals[_W]
    NA = rank_vals[_NA]
    BX = rank_vals[_BX]
    q = rank_vals[_QF]
    a = rank_vals[_AF]
    mins = np.empty(R)
    vals = np.empty(R)
    got = np.empty(1)
    js = np.empty(2, dtype=np.int64)
    col = 0
    prev_base = -1
    prev_X = 0.0
    g_sum = 0.0
    g1 = 0
    g2 = 0
    for i in range(n):
        ui = u[i]
        ci = cached[i]
        if not (np.abs(ui) < np.inf and np.abs(ci) < np.inf):
            return False
        own_pairs = ui * ci + ui * (ui + 1.0) / 2.0
        q_new = q[i] + ui
        a_new = a[i] + own_pairs
        steps = np.ceil(q_new / C)
        X = steps * C
        if not (X > 0.0 and X < np.inf):
            return False
        w_new = per_token_s * q_new + per_attn_pair_s * a_new
        e = idx[i]
        base = rows[e, 0]
        own = col
        col = col + 1 if col + 1 < R else 0
        if X >= eng_vals[e, 0]:  # every queue of the engine within X: the memo's
            mins_sum = eng_vals[e, 1]
            j1 = eng_cols[e, 0]
            j2 = eng_cols[e, 1]
        else:
            if not (base == prev_base and X == prev_X):
                _engine_at(q, W, base, R, X, mins, vals, got, js)
                g_sum = got[0]
                g1 = js[0]
                g2 = js[1]
                prev_base = base
                prev_X = X
            mins_sum = g_sum
            j1 = g1
            j2 = g2
        rj = base + (j2 if own == j1 else j1)
        fj = _frac(X, q[rj])
        if w_new >= W[rj] * fj:
            tok = q_new
            pairs = a_new
        else:
            tok = q[rj] * fj
            pairs = a[rj] * fj
        feats[i, 0] = steps
        feats[i, 1] = tok
        feats[i, 2] = pairs
        feats[i, 3] = (mins_sum - _minimum(q[i], X)) + q_new
        busiest = BX[i]
        horizon[i] = _maximum(w_new - busiest, 0.0) if busiest > 0 else 0.0
        n_after[i] = NA[i]
    return True


@_jit("i8(f8[::1], f8, i8[::1], f8[:, ::1], f8[:, ::1])")
def _memo_below(u, C, idx, rank_vals, eng_vals):  # noqa: ANN001, ANN202
    """How many candidates have an ``X`` (``ceil((q_i + u_i) / C) C``) below their engine's largest
    queue (the memo's), i.e. would need their engine evaluated at that ``X``; a NaN counts."""
    q = rank_vals[_QF]
    m = 0
    for i in range(u.shape[0]):
        X = np.ceil((q[i] + u[i]) / C) * C
        if not X >= eng_vals[idx[i], 0]:
            m += 1
    return m


@_jit([f"i8({t}[::1], f8[::1], f8[::1], f8[::1], {s}[::1], f8, f8, f8, i8[::1], i8[:, ::1], f8[:, ::1], f8[::1], "
       "f8[::1], f8, f8[::1], f8[:, ::1], f8[:, ::1], i8[:, ::1])" for t in ("f8", "i8") for s in ("f8", "i8")])
def prefill_ep_rows_memo(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, feats, horizon,  # noqa: ANN001, ANN201
                         n_after, max_below, key, rank_vals, eng_vals, eng_cols):
    """:func:`prefill_ep_rows` (``want_after``) on ``float(q)``, bit for bit, with what does not
    depend on the request kept between calls (the memo: ``key`` (4,), ``rank_vals``
    (:data:`MEMO_RANK_ROWS`, n), ``eng_vals`` (E, 2), ``eng_cols`` (E, 2), one set per pool, owned
    by the caller and written here). Per rank: ``W``, ``N_after`` and the busiest other rank's
    ``W`` (the horizon's), none of which reads the prompt, and copies of its inputs; per engine:
    its largest queue, the pairwise sum of its queues and its two ranks of most ``W``
    (``_engine_at`` at ``X = inf``). An engine is recomputed when one of its ranks' ``float(q)``
    or ``a`` differs from the memo's copy (:func:`_differs`: any other value, a NaN, the other
    zero), or its ``float(n_req)`` (``!=``: a NaN always differs; the sign of a zero count cannot
    change ``N_after``'s bits, whose terms ``n_r x`` with ``x >= 0`` are summed from ``0.0``), or
    the coefficients changed (``key``): between two decisions, the engines the last dispatch,
    finishes and load reports touched, so a decision costs O(n) plus O(R^2) per changed engine
    instead of O(n R). Per candidate: its ``X``; where ``X`` is at least its engine's largest
    queue (every fraction 1: the usual case) the engine's memo answers, else the engine is
    evaluated at that ``X`` (O(R), shared by the engine's next candidates with the same ``X``).
    Where more than ``max_below`` of the candidates (a share) have an ``X`` below their engine's
    largest queue, that O(R) evaluation per candidate costs more than :func:`prefill_ep_rows`'
    (which shares its work between a candidate's engine and ``X`` differently), so that kernel
    runs instead (the memo is still brought up to date). Covers finite ``q, a >= 0``, finite
    ``u``/``cached``, ``X`` in ``(0, inf)``, coefficients ``>= 0`` and ``R >= 2`` (then every
    value compared in the argmax is >= 0, so the own rank's -1.0 never wins); anything else runs
    :func:`prefill_ep_rows` for the whole call (the memo stays stale where its refresh did not
    finish). Returns 2 where the memo answered, 1 where :func:`prefill_ep_rows` did by the share
    rule, 0 where it did because the memo does not cover these inputs."""
    n = q.shape[0]
    if _memo_refresh(q, a, n_req, C, per_token_s, per_attn_pair_s, rows, key, rank_vals, eng_vals, eng_cols):
        if _memo_below(u, C, idx, rank_vals, eng_vals) <= max_below * n:
            if _memo_candidates(u, cached, C, per_token_s, per_attn_pair_s, idx, rows, feats, horizon, n_after,
                                rank_vals, eng_vals, eng_cols):
                return 2
        else:
            prefill_ep_rows(rank_vals[_QF], a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, True,
                            feats, horizon, n_after)
            return 1
    qf = np.empty(n)
    for r in range(n):
        qf[r] = float(q[r])
    prefill_ep_rows(qf, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, True, feats, horizon, n_after)
    return 0


@_jit([f"i8({t}[::1], f8[::1], {t}[::1], {t}[::1], f8, f8, f8, f8, f8, f8, i8[::1], i8[:, ::1], f8[:, ::1], f8[::1], "
       "f8[::1], f8[::1], f8[::1], f8[::1], f8[:, ::1], f8[:, ::1], i8[:, ::1])" for t in ("f8", "i8")])
def prefill_ep_cost_memo(q, a, matched, n_req, P, P_minus_1, C, per_token_s, per_attn_pair_s, w_ext, idx, rows,  # noqa: ANN001, ANN201
                         feats, horizon, ext, u, cached, key, rank_vals, eng_vals, eng_cols):
    """:func:`prefill_ep_cost_rows` on ``float(q)`` with :func:`prefill_ep_rows_memo` (the memo
    arrays after ``cached``), bit for bit. Returns ``b = np.count_nonzero(q)``, or ``-1 - b`` where
    no queue is above 0 and none is NaN (``q[q.argmax()] <= 0``: an idle pool, whose cost some
    callers take elsewhere; the outputs are computed all the same)."""
    n = q.shape[0]
    for i in range(n):
        c = _minimum(float(matched[i]), P_minus_1)
        cached[i] = c
        u[i] = P - c
    prefill_ep_rows_memo(q, a, u, cached, n_req, C, per_token_s, per_attn_pair_s, idx, rows, feats, horizon, ext,
                         MEMO_MAX_BELOW, key, rank_vals, eng_vals, eng_cols)
    busy = 0
    idle = True
    for i in range(n):
        ext[i] = (w_ext * u[i]) * ext[i]
        x = float(q[i])
        if x != 0:
            busy += 1
        if not x <= 0.0:  # above 0, or NaN (numpy's argmax stops at a NaN, which is not <= 0)
            idle = False
    return -1 - busy if idle else busy
