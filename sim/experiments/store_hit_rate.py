"""Experiment 1: the prefix hit rate of a shared KV store vs its TTL and capacity, per class.

The hit rate of a cluster-wide store (DeepSeek's 3FS KV cache) is a property of the store and of
the request stream, not of routing or engine timing, so a *store-only replay* measures it: take
requests in arrival order; for each, the hit is the number of leading prompt blocks the store
holds live at the arrival time (:meth:`sim.run.engine.kv_store.KvStore.match`); then every prompt
block is stored or refreshed (:meth:`~sim.run.engine.kv_store.KvStore.insert`). In a multi-turn
session the previous output's blocks reach the store as part of the next prompt, which is when
they can first be hit anyway. Hit rates are token-weighted: ``sum(min(k * block_size,
prompt_tokens)) / sum(prompt_tokens)`` over the requests arriving at or after
``measure_from_s`` (earlier ones only warm the store up).

Two implementations:

* :func:`replay_store` drives a real :class:`~sim.run.engine.kv_store.KvStore` (any capacity, TTL per
  class). O(total prompt blocks) Python steps.
* :func:`ttl_hit_rates` computes the hit rate of an **unbounded** store for many uniform TTLs at
  once from reuse gaps (numpy): a block is hit at TTL ``T`` iff it was last accessed at most
  ``T`` before, and since block ``i + 1`` of a prompt names a prefix that contains block ``i``
  (chained hashes), the hit prefix is the run of leading blocks whose running-max gap is
  ``<= T``. It equals :func:`replay_store` with ``KvStore(None, ttl_s=T)`` (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from balancer.types import Request
from sim.run.engine.kv_store import KvStore

__all__ = ["ClassHits", "replay_store", "ttl_hit_rates"]

ALL = "all"


@dataclass
class ClassHits:
    """Token-weighted prefix hits of one traffic class (or ``"all"``) over the measured requests."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` in [0, 1]; 0 when there are no tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _class(r: Request) -> str:
    return r.traffic_class or "none"


def replay_store(
    requests: Sequence[Request],
    store: KvStore,
    block_size: int,
    *,
    measure_from_s: float = 0.0,
    expire_every_s: float = 3600.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, ClassHits]:
    """Replay ``requests`` (in arrival order, stable) through ``store``; count hits per class.

    Args:
        requests: requests with chained ``block_hashes``.
        store: the store (mutated); its TTLs apply per ``traffic_class``.
        block_size: tokens per block (converts hit blocks to tokens).
        measure_from_s: only requests arriving at or after this time are counted, s.
        expire_every_s: sweep expired blocks this often in simulated time (bounds memory only;
            expired blocks are misses either way), s.
        progress: called as ``progress(done, total)`` every 4096 requests and at the end.

    Returns:
        ``{traffic_class: ClassHits}`` plus ``"all"``; a request without a class counts as
        ``"none"``.
    """
    out: dict[str, ClassHits] = {ALL: ClassHits()}
    next_sweep = -math.inf
    total = len(requests)
    for n, r in enumerate(sorted(requests, key=lambda r: r.arrival_time_s), start=1):
        t = r.arrival_time_s
        if t >= next_sweep:
            store.expire(t)
            next_sweep = t + expire_every_s
        k = store.match(r.block_hashes, t)
        if t >= measure_from_s:
            hit = min(k * block_size, r.prompt_tokens)
            for key in (ALL, _class(r)):
                c = out.get(key)
                if c is None:
                    c = out[key] = ClassHits()
                c.requests += 1
                c.prompt_tokens += r.prompt_tokens
                c.hit_tokens += hit
        store.insert(r.block_hashes, t, r.traffic_class)
        if progress is not None and (n % 4096 == 0 or n == total):
            progress(n, total)
    return out


def ttl_hit_rates(
    requests: Sequence[Request],
    ttls_s: Sequence[float | None],
    block_size: int,
    *,
    measure_from_s: float = 0.0,
) -> dict[str, list[ClassHits]]:
    """Hit counts of an unbounded store with one TTL for every class, for each of ``ttls_s``.

    Same result as ``replay_store(requests, KvStore(None, ttl_s=T), block_size, ...)`` for each
    ``T`` (``None`` = never expire), computed at once from reuse gaps (see the module docstring).
    Cost: a sort of all prompt blocks, O(B log B) for B blocks; memory about 60 bytes per block.

    Returns:
        ``{traffic_class: [ClassHits per TTL]}`` plus ``"all"``.

    Raises:
        ValueError: a TTL that is negative or NaN.
    """
    for t in ttls_s:
        if t is not None and not (t >= 0):
            raise ValueError(f"TTL must be >= 0 s or None, got {t!r}")
    reqs = sorted(requests, key=lambda r: r.arrival_time_s)
    lens = np.fromiter((len(r.block_hashes) for r in reqs), dtype=np.int64, count=len(reqs))
    n_blocks = int(lens.sum())
    t_req = np.fromiter((r.arrival_time_s for r in reqs), dtype=np.float64, count=len(reqs))
    prompt = np.fromiter((r.prompt_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    names = sorted({_class(r) for r in reqs})
    code = {c: i for i, c in enumerate(names)}
    cls_req = np.fromiter((code[_class(r)] for r in reqs), dtype=np.int64, count=len(reqs))
    counted_req = t_req >= measure_from_s

    hashes = np.fromiter((h for r in reqs for h in r.block_hashes), dtype=np.uint64, count=n_blocks)
    seg = np.repeat(np.arange(len(reqs), dtype=np.int64), lens)
    t_blk = t_req[seg]
    # Gap since the previous access of the same hash (inf for a first access): a stable sort by
    # hash keeps each hash's accesses in arrival order.
    order = np.argsort(hashes, kind="stable")
    hs, ts = hashes[order], t_blk[order]
    gap_sorted = np.full(n_blocks, np.inf)
    if n_blocks > 1:
        same = hs[1:] == hs[:-1]
        gap_sorted[1:][same] = ts[1:][same] - ts[:-1][same]
    gaps = np.empty(n_blocks)
    gaps[order] = gap_sorted
    del order, hs, ts, gap_sorted, hashes
    # Running max of the gap along each prompt (exact per-segment cummax on ranks).
    uniq, rank = np.unique(gaps, return_inverse=True)
    key = seg * len(uniq) + rank
    np.maximum.accumulate(key, out=key)
    lead_gap = uniq[key - seg * len(uniq)]
    del key, rank
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(reqs) else np.zeros(0, np.int64)
    pos = np.arange(n_blocks, dtype=np.int64) - starts[seg]
    weight = np.clip(prompt[seg] - pos * block_size, 0, block_size)
    counted = counted_req[seg]

    result: dict[str, list[ClassHits]] = {}
    for name in [ALL, *names]:
        if name == ALL:
            mreq, mblk = counted_req, counted
        else:
            mreq = counted_req & (cls_req == code[name])
            mblk = counted & (cls_req[seg] == code[name])
        g = lead_gap[mblk]
        w = weight[mblk]
        o = np.argsort(g, kind="stable")
        g, cw = g[o], np.concatenate(([0], np.cumsum(w[o])))
        n_req, n_tok = int(mreq.sum()), int(prompt[mreq].sum())
        rows = []
        for ttl in ttls_s:
            lim = math.inf if ttl is None else float(ttl)
            idx = np.searchsorted(g, lim, side="right") if ttl is not None else np.searchsorted(g, np.inf, side="left")
            rows.append(ClassHits(n_req, n_tok, int(cw[idx])))
        result[name] = rows
    return result
