"""Compiled hot paths of the route decision, with the numpy code they replace as the fallback.

``ep_aware`` prices every candidate against every rank of its engine: ``(n, R)`` matrices for
``n`` candidates of ``R``-rank engines (:func:`balancer.cost_model.prefill_wait_features`,
``EpAware._requests_after``, ``EpAware._decode_cost_one``). In numpy that is some 30 calls on
small arrays per decision, each paying numpy's per-call overhead (1-5 us): at 512 ranks (64
engines of 8, 32k-token prompts, under load; thread CPU time, 2-core host) the prefill features
took 93 us, ``N_after`` 30 and the decode cost 14 of ep_aware's ~215 us per decision; compiled,
16, 10 and 2 us. The kernels here do the same arithmetic in one compiled loop each (numba), **bit
for bit** (see :mod:`balancer._jit_kernels`): decisions do not change, only their cost.

numba is optional. Without it (``pip install pdlb`` alone), or after :func:`use_compiled` ``(False)``
(which ``pdlb``'s commands call for the environment variable ``PDLB_KERNELS=off``, :data:`ENV_VAR`,
in every process they start: :func:`enabled_by_env`), every function here returns ``None`` and the caller runs its numpy code, which stays the
reference (tests/balancer/test_kernels.py runs both and compares with ``==``). With it (the ``serve``,
``sim`` and ``test`` extras install it), the kernels are compiled, or loaded from numba's cache,
the first time :func:`compiled` is called: a :class:`~balancer.router.Router` with a policy that
uses them (:attr:`balancer.policies.Policy.uses_kernels`: ep_aware, kv_cost, scored) calls it when it is built, so
its first decision does not pay the compile, while building a policy alone (validating a config,
``import balancer``) loads nothing (about 1-3 s once per
machine, then well under a second per process to load from the cache).

Source: pdlb. numba: https://numba.readthedocs.io (``njit``, ``cache=True``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import ModuleType

import numpy as np

ENV_VAR = "PDLB_KERNELS"
"""The environment variable with which ``pdlb``'s commands turn the compiled kernels off (``off``,
``0``, ``false``, ``no``) or leave them on (``on``, ``1``, ``true``, ``yes``, unset or empty; any
case), in their own process and every process they start (``pdlb serve``'s router processes, the
simulator's worker processes). This module reads no environment itself (the core does no I/O):
the entry points pass it to :func:`enabled_by_env`."""
_ON = frozenset({"on", "1", "true", "yes", ""})
_OFF = frozenset({"off", "0", "false", "no"})

_enabled = True
_module: ModuleType | None = None
_tried = False


def enabled_by_env(environ: Mapping[str, str]) -> bool:
    """Whether :data:`ENV_VAR` in ``environ`` (a process's environment, e.g. ``os.environ``) leaves
    the kernels on; ``use_compiled(enabled_by_env(os.environ))`` applies it.

    Raises:
        ValueError: a value that is neither on nor off (the message names the variable)."""
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV_VAR} must be 'on' or 'off' (the compiled ep_aware kernels), got {value[:40]!r}")


def use_compiled(enabled: bool) -> None:
    """Turn the compiled paths on (default, when numba is installed) or off (the numpy code runs:
    to compare the two, or to rule the kernels out when debugging). Process-wide."""
    global _enabled
    _enabled = bool(enabled)


def compiled() -> ModuleType | None:
    """The kernels module (compiling or loading them on the first call), or ``None`` when numba is
    not installed, fails to import, or :func:`use_compiled` turned them off."""
    global _module, _tried
    if not _enabled:
        return None
    if not _tried:
        _tried = True
        try:
            from balancer import _jit_kernels
        except Exception:  # noqa: BLE001 - numba absent (ImportError) or broken (its own errors): numpy path
            _module = None
        else:
            _module = _jit_kernels
    return _module


def _f8(x: np.ndarray) -> np.ndarray:
    """``x`` as a C-contiguous float64 array (itself when it is one): the value numpy's arithmetic
    would promote it to."""
    return np.ascontiguousarray(x, dtype=np.float64)


#: ``(idx, rows)`` pairs already checked by :func:`_layout_ok`, by identity (the router's pools
#: reuse theirs: :func:`balancer.cost_model.engine_groups` caches them), with the objects kept
_LAYOUTS_OK: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _layout_ok(k: ModuleType, idx: np.ndarray, rows: np.ndarray) -> bool:
    """Whether the kernels take this ``(idx, rows)`` layout (int64, C order, some ranks, and
    :func:`balancer.cost_model.engine_groups`' arrangement: ``rows[e] = e R .. e R + R - 1``,
    ``idx[i] = i // R``); a pair that passed once passes at once (its arrays are not written)."""
    got = _LAYOUTS_OK.get((id(idx), id(rows)))
    if got is not None and got[0] is idx and got[1] is rows:
        return True
    ok = (idx.dtype == np.int64 and rows.dtype == np.int64 and rows.ndim == 2 and idx.flags.c_contiguous
          and rows.flags.c_contiguous and rows.shape[1] > 0 and idx.ndim == 1 and len(idx) == rows.size
          # engine_groups' layout, which the kernels read as such: engine e's candidates side by side
          and np.array_equal(rows.ravel(), np.arange(rows.size)) and np.array_equal(idx, np.arange(len(idx)) // rows.shape[1]))
    if ok:
        if len(_LAYOUTS_OK) >= 64:
            _LAYOUTS_OK.clear()
        _LAYOUTS_OK[(id(idx), id(rows))] = (idx, rows)
    return ok


def prefill_wait_rows(q: np.ndarray, a: np.ndarray, u: np.ndarray, cached: np.ndarray, chunk_tokens: float,
                      per_token_s: float, per_attn_pair_s: float, idx: np.ndarray,
                      rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`balancer.cost_model.prefill_wait_features` for a wide-EP pool in the row layout that
    is not idle: ``(features (n, 4), horizon (n,))``, float64, equal bit for bit; ``None`` when the
    compiled path is off or cannot take these arrays."""
    k = compiled()
    if k is None or not _layout_ok(k, idx, rows):
        return None
    n = len(q)
    feats, horizon = np.empty((n, 4)), np.empty(n)
    k.prefill_wait_rows(_f8(q), _f8(a), _f8(u), _f8(cached), float(chunk_tokens), float(per_token_s),
                        float(per_attn_pair_s), idx, rows, feats, horizon)
    return feats, horizon


def prefill_ep_rows(q: np.ndarray, a: np.ndarray, u: np.ndarray, cached: np.ndarray, n_req: np.ndarray,
                    chunk_tokens: float, per_token_s: float, per_attn_pair_s: float, idx: np.ndarray,
                    rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`prefill_wait_rows` and :func:`requests_after_rows` (``n_req`` requests per
    candidate) in one compiled pass: ``(features (n, 4), horizon (n,), N_after (n,))``, float64,
    each equal bit for bit to its own kernel's (and so to the numpy code); ``None`` when the
    compiled path is off or cannot take these arrays."""
    k = compiled()
    if k is None or not _layout_ok(k, idx, rows):
        return None
    n = len(q)
    feats, horizon, after = np.empty((n, 4)), np.empty(n), np.empty(n)
    if n_req.dtype != np.int64 or not n_req.flags.c_contiguous:  # int64 counts go as they are
        n_req = _f8(n_req)
    k.prefill_ep_rows(_f8(q), _f8(a), _f8(u), _f8(cached), n_req, float(chunk_tokens), float(per_token_s),
                      float(per_attn_pair_s), idx, rows, True, feats, horizon, after)
    return feats, horizon, after


def requests_after_rows(q: np.ndarray, n_req: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """``ep_aware``'s ``N_after`` (``EpAware._requests_after``) in the row layout, shape ``(n,)``,
    float64, equal bit for bit; ``None`` when the compiled path is off or cannot take these arrays."""
    k = compiled()
    if k is None or not _layout_ok(k, idx, rows):
        return None
    out = np.empty(len(q))
    k.requests_after_rows(_f8(q), _f8(n_req), idx, rows, out)
    return out


def decode_cost_rows(b: np.ndarray, k: np.ndarray, matched_tokens: np.ndarray, idx: np.ndarray, rows: np.ndarray,
                     out_tokens: float, kv_new_tokens: float, prompt_tokens: float, overhead_s: float,
                     per_seq_s: float, per_kv_token_s: float, per_group_seq_s: float, externality_weight: float,
                     transfer_s_per_token: float, transfer: bool) -> np.ndarray | None:
    """``EpAware._decode_cost_one`` for wide-EP engines in the row layout: the decode cost per
    candidate, shape ``(n,)``, float64, equal bit for bit (``b`` sequences and ``k`` KV tokens per
    candidate, ``matched_tokens`` its prefix hit; the step model's coefficients); ``None`` when
    the compiled path is off or cannot take these arrays."""
    kern = compiled()
    if kern is None or not _layout_ok(kern, idx, rows):
        return None
    cost = np.empty(len(b))
    if not (b.dtype == k.dtype == matched_tokens.dtype == np.int64 and b.flags.c_contiguous and k.flags.c_contiguous
            and matched_tokens.flags.c_contiguous):  # int64 columns go as they are (the kernel converts)
        b, k, matched_tokens = _f8(b), _f8(k), _f8(matched_tokens)
    kern.decode_cost_rows(b, k, matched_tokens, idx, rows, float(out_tokens), float(kv_new_tokens),
                          float(prompt_tokens), float(overhead_s), float(per_seq_s), float(per_kv_token_s),
                          float(per_group_seq_s), float(externality_weight), float(transfer_s_per_token),
                          bool(transfer), cost)
    return cost


def tie_pick(cost: np.ndarray, load: np.ndarray, tie_tolerance: float) -> tuple[int, np.ndarray] | None:
    """``EpAware._pick``'s candidates before its random draw, compiled: ``(count, positions)``
    where ``positions[:count]`` (int64) are the candidates ``_pick`` draws from (one: the cheapest;
    several: the least ``load`` among the costs within ``tie_tolerance``), or count -1 where it
    draws among the cheapest costs instead (no tolerance, a cheapest cost that is not finite).
    ``cost`` float64 and ``load`` int64, shapes ``(n,)``; ``None`` when the compiled path is off or
    cannot take these arrays."""
    k = compiled()
    if k is None or cost.dtype != np.float64 or load.dtype != np.int64 or not cost.flags.c_contiguous \
            or not load.flags.c_contiguous or cost.ndim != 1 or load.shape != cost.shape:
        return None
    out = np.empty(len(cost), dtype=np.int64)
    return k.tie_pick(cost, load, float(tie_tolerance), out), out


def count_no_room(cap: np.ndarray, kv: np.ndarray, need: int) -> int | None:
    """``EpAware._capacity``'s test, compiled: the number of candidates with a known KV capacity
    (``cap > 0``) and less room than ``need`` tokens (``cap - kv < need``), -1 when no capacity is
    known; ``cap``/``kv`` int64, shape ``(n,)``. ``None`` when the compiled path is off or cannot
    take these arrays."""
    k = compiled()
    if (k is None or cap.dtype != np.int64 or kv.dtype != np.int64 or cap.shape != kv.shape or cap.ndim != 1
            or not cap.flags.c_contiguous or not kv.flags.c_contiguous or not 0 <= need < 2 ** 62):
        return None
    return k.count_no_room(cap, kv, int(need))


def decode_select_rows(b: np.ndarray, k: np.ndarray, matched_tokens: np.ndarray, cap: np.ndarray, idx: np.ndarray,
                       rows: np.ndarray, out_tokens: float, kv_new_tokens: float, prompt_tokens: float,
                       overhead_s: float, per_seq_s: float, per_kv_token_s: float, per_group_seq_s: float,
                       externality_weight: float, transfer_s_per_token: float, transfer: bool, need: int,
                       tie_tolerance: float) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``EpAware.select``'s work on a wide-EP decode pool before its random draw, one compiled
    call: :func:`decode_cost_rows`' costs, :func:`count_no_room` (``cap``, ``need`` tokens) and
    :func:`tie_pick` on the costs with the KV tokens ``k`` as the load. Returns ``(count, cost
    (n,), positions (n,))``: ``count >= 1`` and ``positions[:count]`` as :func:`tie_pick`'s, -1
    where ``_pick`` draws among the cheapest costs, -2 where some candidate lacks KV room (the
    costs change: take the numpy path). ``b``, ``k``, ``matched_tokens``, ``cap`` int64, shape
    ``(n,)``. ``None`` when the compiled path is off or cannot take these arrays."""
    kern = _module if _enabled and _tried else compiled()
    n = len(b)
    if (kern is None or not len(k) == len(matched_tokens) == len(cap) == len(idx) == n or not 0 <= need < 2 ** 62
            or not _layout_ok(kern, idx, rows)):
        return None
    cost = np.empty(n)
    pos = np.empty(n, dtype=np.int64)
    try:  # numba's dispatcher takes only its signature's int64 C-contiguous columns (numbers it converts
        # as float() and int() do: the scalars go as they are)
        count = kern.decode_select_rows(b, k, matched_tokens, idx, rows, out_tokens, kv_new_tokens, prompt_tokens,
                                        overhead_s, per_seq_s, per_kv_token_s, per_group_seq_s, externality_weight,
                                        transfer_s_per_token, transfer, cost, cap, need, tie_tolerance, pos)
    except (TypeError, OverflowError):  # other dtypes or layouts ("No matching definition"): the numpy path
        return None
    return count, cost, pos


def kv_cost_select(prefill_tokens: np.ndarray, matched_tokens: np.ndarray, kv_tokens: np.ndarray, prompt_tokens: float,
                   block_size: float, overlap_weight: float) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``kv_cost``'s costs and its cheapest candidates in one compiled call: ``(count, cost (n,),
    positions (n,))`` with ``positions[:count]`` (int64) the candidates whose cost equals the least
    (``KvCost.costs`` bit for bit; count -1 where a cost is NaN). The three load columns int64,
    shape ``(n,)``. ``None`` when the compiled path is off or cannot take these arrays."""
    k = compiled()
    n = len(prefill_tokens)
    if k is None or not len(matched_tokens) == len(kv_tokens) == n:
        return None
    cost = np.empty(n)
    pos = np.empty(n, dtype=np.int64)
    try:  # numba's dispatcher takes only its signature's int64 C-contiguous columns
        count = k.kv_cost_select(prefill_tokens, matched_tokens, kv_tokens, float(prompt_tokens), float(block_size),
                                 float(overlap_weight), overlap_weight != 1.0, cost, pos)
    except TypeError:  # other dtypes or layouts: the numpy path
        return None
    return count, cost, pos


def fewest_among(values: np.ndarray, count: int, positions: np.ndarray) -> int | None:
    """The tie rule "fewest ``values`` among ``positions[:count]``" before its random draw
    (``argmin_random(values[positions[:count]], rng)``'s candidates), compiled: keeps those
    positions in ``positions`` (in order) and returns how many; ``values`` int64, shape ``(n,)``,
    ``positions`` int64 with ``count >= 1`` valid entries. ``None`` when the compiled path is off
    or cannot take these arrays (then nothing changed)."""
    k = compiled()
    if (k is None or values.dtype != np.int64 or positions.dtype != np.int64 or not values.flags.c_contiguous
            or not positions.flags.c_contiguous or not 1 <= count <= len(positions)):
        return None
    return k.fewest_among(values, int(count), positions)


def scored_select(matched_blocks: np.ndarray, num_requests: np.ndarray, kv_tokens: np.ndarray, cap: np.ndarray,
                  n_blocks: int, weights: tuple[float, float, float, float],
                  load_queue_cap: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``scored``'s weighted total and its best candidates in one compiled call: ``(count, total
    (n,), positions (n,))`` with ``positions[:count]`` (int64) the candidates at the highest total
    (``Scored.select``'s, bit for bit; count -1 where a total is NaN). ``matched_blocks`` int64
    or float64 (tier-weighted), the three other columns int64, shapes ``(n,)``; ``weights`` the
    prefix, queue, kv_utilization and load weights (0: left out). ``None`` when the compiled path
    is off or cannot take these arrays."""
    k = compiled()
    n = len(num_requests)
    if k is None or not len(matched_blocks) == len(kv_tokens) == len(cap) == n:
        return None
    total = np.empty(n)
    pos = np.empty(n, dtype=np.int64)
    w_prefix, w_queue, w_kv, w_load = weights
    try:  # numba's dispatcher takes only its signatures' dtypes (int64; matches also float64), C-contiguous
        count = k.scored_select(matched_blocks, num_requests, kv_tokens, cap, int(n_blocks), float(w_prefix),
                                float(w_queue), float(w_kv), float(w_load), float(load_queue_cap), total, pos)
    except TypeError:  # other dtypes or layouts: the numpy path
        return None
    return count, total, pos


def prefill_ep_cost_rows(q: np.ndarray, a: np.ndarray, matched_tokens: np.ndarray, n_req: np.ndarray,
                         prompt_tokens: float, chunk_tokens: float, per_token_s: float, per_attn_pair_s: float,
                         w_ext: float, idx: np.ndarray, rows: np.ndarray, memo: bool = True
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """``EpAware._prefill_cost_one``'s wide-EP work up to its matrix product, one compiled call, for
    a pool without lower KV tiers: ``(features (n, 4), horizon (n,), ext (n,), u (n,), cached (n,),
    busy)``: the cached tokens ``min(matched, P - 1)``, the prompt's uncached ``u = P - cached``,
    :func:`prefill_ep_rows`' features and horizon, ``ext = w_ext u N_after`` and the number of
    candidates with queued tokens; float64, equal bit for bit to the numpy code's. ``memo``
    (default): keep what does not depend on the request between calls, per pool layout and
    thread (:func:`balancer._jit_kernels.prefill_ep_rows_memo`: O(n) per call plus O(R^2) per
    engine whose ranks' load changed, instead of O(n R)); False: compute everything afresh (the
    same bits). ``None`` when the compiled path is off or cannot take these arrays."""
    k = compiled()
    n = len(q)
    if k is None or not len(a) == len(matched_tokens) == len(n_req) == len(idx) == n or not _layout_ok(k, idx, rows):
        return None
    P = float(prompt_tokens)
    scalars = (P, P - 1.0, float(chunk_tokens), float(per_token_s), float(per_attn_pair_s), float(w_ext), idx, rows)
    buf = np.empty((4, n))
    outs = (np.empty((n, 4)), buf[0], buf[1], buf[2], buf[3])
    entry = _memo_entry(k, idx, rows) if memo else None
    if entry is None:  # afresh (the kernel takes float64 queues)
        q, a = _f8(q), _f8(a)
        try:  # int64 C-contiguous counts go as they are (numba's dispatcher matches the signature)
            busy = k.prefill_ep_cost_rows(q, a, matched_tokens, n_req, *scalars, *outs)
        except TypeError:  # other dtypes or layouts: as float64 (what numpy's arithmetic promotes them to)
            busy = k.prefill_ep_cost_rows(q, a, _f8(matched_tokens), _f8(n_req), *scalars, *outs)
    else:
        busy = _cost_memo(k, q, a, matched_tokens, n_req, scalars, outs, entry[0])
        busy = busy if busy >= 0 else -1 - busy
    return outs[0], outs[1], outs[2], outs[3], outs[4], int(busy)


def prefill_ep_select_parts(q: np.ndarray, a: np.ndarray, matched_tokens: np.ndarray, n_req: np.ndarray,
                            prompt_tokens: float, chunk_tokens: float, per_token_s: float, per_attn_pair_s: float,
                            w_ext: float, idx: np.ndarray, rows: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """``EpAware``'s compiled wide-EP prefill selection, its part before the matrix product:
    :func:`prefill_ep_cost_rows`' ``(features (n, 4), horizon (n,), ext (n,), busy)`` with the
    memo, bit for bit, into arrays that the next call on this pool (in this thread) overwrites:
    for a caller that has used them before its next decision. ``None`` where the compiled path
    is off or cannot take these arrays, or where the pool is idle (no queue above 0: the caller
    prices that case otherwise)."""
    k = _module if _enabled and _tried else compiled()
    n = len(q)
    if k is None or not len(a) == len(matched_tokens) == len(n_req) == len(idx) == n:
        return None
    entry = _memo_entry(k, idx, rows)
    if entry is None:
        return None
    memo, outs = entry
    P = float(prompt_tokens)
    scalars = (P, P - 1.0, float(chunk_tokens), float(per_token_s), float(per_attn_pair_s), float(w_ext), idx, rows)
    busy = _cost_memo(k, q, a, matched_tokens, n_req, scalars, outs, memo)
    if busy < 0:
        return None
    return outs[0], outs[1], outs[2], int(busy)


def _cost_memo(k: ModuleType, q: np.ndarray, a: np.ndarray, matched_tokens: np.ndarray, n_req: np.ndarray,
               scalars: tuple[object, ...], outs: tuple[np.ndarray, ...], memo: tuple[np.ndarray, ...]) -> int:
    """``prefill_ep_cost_memo`` with these arguments (int64 or float64 columns as they are; other
    dtypes or layouts as float64): ``np.count_nonzero(q)``, or ``-1 -`` it for an idle pool."""
    try:  # int64 (the router's) or float64 C-contiguous columns go as they are
        return int(k.prefill_ep_cost_memo(q, a, matched_tokens, n_req, *scalars, *outs, *memo))
    except TypeError:  # other dtypes or layouts: as float64 (what numpy's arithmetic promotes them to)
        return int(k.prefill_ep_cost_memo(_f8(q), _f8(a), _f8(matched_tokens), _f8(n_req), *scalars, *outs, *memo))


class _ThreadMemos(threading.local):
    """One table of memos per thread (``threading.local`` runs ``__init__`` in each thread)."""

    def __init__(self) -> None:
        self.d: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, tuple[tuple[np.ndarray, ...],
                                                                          tuple[np.ndarray, ...]]]] = {}


#: per thread, the prefill memos by ``(idx, rows)`` identity (one per pool:
#: :func:`balancer.cost_model.engine_groups` caches the pair per candidate tuple), with the
#: objects kept so that their ids stay theirs; per thread, as the kernels run without the GIL
_MEMOS = _ThreadMemos()
#: most memos kept per thread (a pool whose candidate tuple changed starts a new one)
_MEMOS_MAX = 16


def _memo_entry(k: ModuleType, idx: np.ndarray, rows: np.ndarray
                ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None:
    """``(memo, outputs)`` for this pool layout, or None where the kernels do not take it
    (:func:`_layout_ok`): the memo arrays of :func:`balancer._jit_kernels.prefill_ep_rows_memo`
    (new ones, marked stale, the first time: the kernel fills them) and output arrays of
    :func:`prefill_ep_select_parts` (features (n, 4) and four (n,) rows). The memo is a cache
    checked against the inputs on every call (a rank whose inputs differ from the memo's copy is
    recomputed), so a pool that shares a layout with another costs time, never a different
    answer."""
    memos = _MEMOS.d
    got = memos.get((id(idx), id(rows)))
    if got is not None and got[0] is idx and got[1] is rows:
        return got[2]
    if not _layout_ok(k, idx, rows):
        return None
    n, E = len(idx), rows.shape[0]
    memo = (np.zeros(4), np.zeros((k.MEMO_RANK_ROWS, n)), np.zeros((E, 2)), np.zeros((E, 2), dtype=np.int64))
    buf = np.empty((4, n))
    entry = (memo, (np.empty((n, 4)), buf[0], buf[1], buf[2], buf[3]))
    if len(memos) >= _MEMOS_MAX:
        memos.clear()
    memos[(id(idx), id(rows))] = (idx, rows, entry)
    return entry


def prefill_cost_pick(ttft: np.ndarray, ext: np.ndarray, horizon: np.ndarray, horizon_scale: float | None,
                      load: np.ndarray, tie_tolerance: float) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``EpAware``'s wide-EP prefill cost from its parts and :func:`tie_pick` on it, one compiled
    call: ``cost = ttft + 0.0 + ext (+ horizon_scale * horizon)`` (no horizon term where
    ``horizon_scale`` is None), bit for bit as ``EpAware._prefill_cost_one``, then the candidates
    ``EpAware._pick`` draws from with ``load`` (the prefill tokens) as the tie rule's. Returns
    ``(count, cost (n,), positions (n,))`` as :func:`decode_select_rows` (count -1: the numpy pick
    decides). ``ttft``/``ext``/``horizon`` float64, ``load`` int64, shapes ``(n,)``; ``None`` when
    the compiled path is off or cannot take these arrays."""
    k = _module if _enabled and _tried else compiled()
    n = len(ttft)
    if k is None or not len(ext) == len(horizon) == len(load) == n:
        return None
    cost = np.empty(n)
    pos = np.empty(n, dtype=np.int64)
    try:  # numba's dispatcher takes only its signature's dtypes, C-contiguous (numbers as float() converts)
        count = k.prefill_cost_pick(ttft, ext, horizon, 0.0 if horizon_scale is None else horizon_scale,
                                    horizon_scale is not None, load, tie_tolerance, cost, pos)
    except (TypeError, OverflowError):  # other dtypes or layouts: the numpy path
        return None
    return count, cost, pos
