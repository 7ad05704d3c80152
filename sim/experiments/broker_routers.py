"""K routers that share state through a broker, with its sync delay (issue 28 item 2).

:class:`BrokerKRouters` extends :class:`sim.experiments.k_routers.KRouters` (request ``i`` to
router ``i mod K``, KV events to all) with what ``pdlb serve --broker`` does
(:mod:`balancer.service.broker_sync`), timed as the service is:

* **load**: every router publishes a snapshot of its own in-flight counts at each boundary of the
  publish interval ``interval_s`` (the service publishes when changed, every 50 ms); the snapshot
  is delivered ``latency_s`` later, and each router adds the other routers' latest delivered
  snapshots to its own counts (the tracker's peer arrays, as the service does). A peer's load is
  thus between ``latency_s`` and ``interval_s + latency_s`` old.
* **decisions** (approximate mode): a prompt routed at ``t`` is sent at the next interval boundary
  and recorded by the other routers ``latency_s`` after it (:meth:`balancer.router.Router.record_routed`).

The same policy code (the routers are :class:`balancer.router.Router`) routes in both.
Defaults: ``interval_s`` 0.05 s (the service's ``publish_interval_s``) and ``latency_s`` 0.001 s
(loopback NATS delivery measured by ``tests/service/test_broker_sync.py``, well under 1 ms; across hosts
in one data centre add the network's round trip).

Modes of :func:`run` (``MODE[+SHARING]``): ``approximate`` (no sharing: each router knows its own
prompts and load), ``events`` (every router consumes every engine's KV events; own load),
``approximate+broker`` (decisions and load through the broker), ``events+broker`` (events, plus
load through the broker) and ``events+shared-load`` (one instant load view: the bound that a
zero-delay broker would reach).

Run: ``pdlb dev broker-routers [--ks 1,2,4,8] [--limit N]``, or
``bench/k_routers_figure.py`` for the table and the plot.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from balancer.parts import LoadSources
from balancer.router import Router
from balancer.types import ReplicaId, Request, Route
from sim.experiments.k_routers import DEFAULT_POLICIES, KRouters

__all__ = ["BrokerKRouters", "DEFAULT_INTERVAL_S", "DEFAULT_LATENCY_S", "MODES", "run"]

DEFAULT_INTERVAL_S = 0.05
DEFAULT_LATENCY_S = 0.001
MODES = ("approximate", "events", "approximate+broker", "events+broker", "events+shared-load")


class _ViewOnly:
    """A router's peer load source (:class:`balancer.parts.PeerLoad`): the wrapper sets the peer
    arrays before each decision; this only makes the router add them (``refresh``/``publish`` do
    nothing)."""

    def bind(self, tracker: Any) -> None:
        return None

    def refresh(self, force: bool = False) -> bool:
        return True

    def publish(self) -> None:
        return None


class BrokerKRouters(KRouters):
    """K routers sharing load (and, in approximate mode, decisions) through a broker with a delay.

    Args:
        make: builds one router from its parts (see :class:`KRouters`; same policies, replicas
            registered in the same order).
        k: how many routers (>= 1).
        seed: see :class:`KRouters`.
        interval_s: publish interval (> 0).
        latency_s: delivery time (>= 0).
        share_decisions: approximate mode: send routing decisions too.

    Raises:
        ValueError: a bad interval or latency, ``k`` < 1.
    """

    def __init__(self, make: Callable[..., Router], k: int, seed: int = 0, interval_s: float = DEFAULT_INTERVAL_S,
                 latency_s: float = DEFAULT_LATENCY_S, share_decisions: bool = True) -> None:
        if not (interval_s > 0 and math.isfinite(interval_s)) or not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ValueError(f"need interval_s > 0 and latency_s >= 0, got {interval_s!r}, {latency_s!r}")
        self.interval_s, self.latency_s = interval_s, latency_s
        self._tick = -1  # the last interval boundary (index) whose snapshots were taken
        self._pending: list[deque[tuple[float, np.ndarray]]] = [deque() for _ in range(k)]
        self._visible: list[np.ndarray | None] = [None] * k
        self._total: np.ndarray | None = None  # sum of the visible snapshots
        self._decisions: deque[tuple[float, int, tuple[ReplicaId, ...], tuple[int, ...]]] = deque()
        self.snapshots_sent = self.decisions_sent = self.decisions_recorded = 0
        self._share = False  # decided once the routers' index mode is known
        super().__init__(make, k, seed, shared_load=False)
        self._share = share_decisions and self.index_mode == "approximate" and k > 1

    def _parts(self, j: int) -> dict[str, Any]:
        return {"load_sources": LoadSources(peer=_ViewOnly()), "listeners": [self._routed_by(j)]}

    @classmethod
    def broker_wrapper(cls, k: int, seed: int = 0, interval_s: float = DEFAULT_INTERVAL_S,
                       latency_s: float = DEFAULT_LATENCY_S
                       ) -> Callable[[Callable[[Any], Router]], Callable[[Any], Any]]:
        """For :func:`sim.run.cluster.simulate` ``router_wrapper``: K broker-sharing routers (the
        factory is called with the cluster's :class:`sim.run.router_config.RankCacheBlocks`)."""
        def wrap(factory: Callable[..., Router]) -> Callable[[Any], Any]:
            return lambda ranks: cls(lambda **parts: factory(ranks, **parts), k, seed, interval_s, latency_s)
        return wrap

    def _routed_by(self, k: int) -> Callable[[Collection[ReplicaId], tuple[int, ...], float], None]:
        def routed(replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
            if not self._share:
                return
            send_s = math.ceil(now_s / self.interval_s) * self.interval_s  # the next batch
            self._decisions.append((send_s + self.latency_s, k, tuple(replicas), block_hashes))
            self.decisions_sent += 1
        return routed

    def _advance(self, now_s: float) -> None:
        """Take the snapshots of the boundaries passed since the last call (the state now, before
        this call's change, is the state at each of them: take the earliest's delivery time), and
        deliver what is due by ``now_s``."""
        tick = math.floor(now_s / self.interval_s)
        if tick > self._tick and len(self.routers) > 1:
            first = max(self._tick + 1, 0) * self.interval_s + self.latency_s
            for j, r in enumerate(self.routers):
                t = r.load
                snap = np.stack([t.num_requests, t.prefill_tokens, t.decode_kv_tokens])
                self._pending[j].append((first, snap))
            self.snapshots_sent += len(self.routers)
        self._tick = max(self._tick, tick)
        changed = False
        for j, q in enumerate(self._pending):
            while q and q[0][0] <= now_s:
                self._visible[j] = q.popleft()[1]
                changed = True
        if changed:
            vis = [v for v in self._visible if v is not None]
            width = max(v.shape[1] for v in vis)
            total = np.zeros((3, width), dtype=np.int64)
            for v in vis:
                total[:, : v.shape[1]] += v
            self._total = total
        while self._decisions and self._decisions[0][0] <= now_s:
            _, k, reps, hashes = self._decisions.popleft()
            for j, r in enumerate(self.routers):
                if j != k:  # recorded now (the routers' clocks never go back)
                    r.record_routed(reps, hashes, now_s)
                    self.decisions_recorded += 1

    def _set_view(self, k: int) -> None:
        r = self.routers[k]
        t = r.load
        t.peer_requests[:] = 0
        t.peer_prefill_tokens[:] = 0
        t.peer_kv_tokens[:] = 0
        if self._total is None:
            return
        others = self._total.copy()
        own = self._visible[k]
        if own is not None:
            others[:, : own.shape[1]] -= own
        n = min(others.shape[1], len(t.peer_requests))
        t.peer_requests[:n] = others[0, :n]
        t.peer_prefill_tokens[:n] = others[1, :n]
        t.peer_kv_tokens[:n] = others[2, :n]

    def route(self, request: Request, now_s: float, **kw: Any) -> Route:
        self._advance(now_s)
        k = self._next % len(self.routers)
        self._next += 1
        r = self.routers[k]
        self._owner[request.request_id] = r
        self._set_view(k)
        return r.route(request, now_s, **kw)

    def on_prefill_done(self, request_id: str, now_s: float) -> None:
        self._advance(now_s)
        super().on_prefill_done(request_id, now_s)

    def on_first_token(self, request_id: str, now_s: float) -> None:
        self._advance(now_s)
        super().on_first_token(request_id, now_s)

    def on_finished(self, request_id: str, now_s: float, num_output_tokens: int | None = None) -> None:
        self._advance(now_s)
        super().on_finished(request_id, now_s, num_output_tokens)


def run(ks: list[int], modes: list[str], limit: int | None = None, seed: int = 0, rate_scale: float = 1.0,
        interval_s: float = DEFAULT_INTERVAL_S, latency_s: float = DEFAULT_LATENCY_S,
        log: Callable[[str], None] | None = None, prefill_policy: str = DEFAULT_POLICIES[0],
        decode_policy: str = DEFAULT_POLICIES[1]) -> list[dict[str, Any]]:
    """One summary row per (mode, K) on the embedded Mooncake trace (``dsv3-pd-h200``,
    :data:`~sim.experiments.k_routers.DEFAULT_POLICIES` by default, as :func:`sim.experiments.k_routers.run`).

    Raises:
        ValueError: an unknown mode or a K below 1.
    """
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize
    from sim.scenario import DEFAULT_PRESET, load_scenario
    from sim.workload import read_trace, scale_rate, spread_batches, take_slice

    bad = [m for m in modes if m not in MODES]
    if bad or any(k < 1 for k in ks):
        raise ValueError(f"unknown mode(s) {bad} (one of {', '.join(MODES)}) or K < 1 in {ks}")
    sc = load_scenario(DEFAULT_PRESET)
    reqs = read_trace()
    if limit is not None:
        reqs = take_slice(reqs, 0, limit)
    reqs = spread_batches(reqs, 3.0, seed=seed)
    if rate_scale != 1.0:
        reqs = scale_rate(reqs, rate_scale)
    rows = []
    for label in modes:
        mode, _, sharing = label.partition("+")
        for k in ks:
            if sharing == "broker":
                wrapper = BrokerKRouters.broker_wrapper(k, seed, interval_s, latency_s)
            else:
                wrapper = KRouters.wrapper(k, seed, shared_load=sharing == "shared-load")
            t0 = time.perf_counter()
            s = summarize(simulate(sc, reqs, prefill_policy, decode_policy, seed=seed, index_mode=mode,
                                   router_wrapper=wrapper))
            rows.append({"mode": label, "k": k, "hit_rate": s["prefix_hit_rate"], "ideal_hit_rate": s["ideal_hit_rate"],
                         "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p50_s": s["ttft_s"]["p50"],
                         "ttft_p99_s": s["ttft_s"]["p99"], "goodput_rps": s["goodput_rps"],
                         "num_requests": s["num_requests"], "sync_interval_s": interval_s if sharing == "broker" else None,
                         "sync_latency_s": latency_s if sharing == "broker" else None,
                         "wall_s": time.perf_counter() - t0})
            if log is not None:
                r = rows[-1]
                log(f"{label:>19} K={k}: hit {100 * r['hit_rate']:.1f}%  TTFT p50 {r['ttft_p50_s']:.3f} s  "
                    f"p99 {r['ttft_p99_s']:.2f} s  goodput {r['goodput_rps']:.3f} r/s  ({r['wall_s']:.1f} s wall)")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The figure's table: per mode and K, hit rate, TTFT p50/p99, goodput, and ratios to K = 1."""
    base = {r["mode"]: r for r in rows if r["k"] == min(x["k"] for x in rows if x["mode"] == r["mode"])}
    out = ["| sharing | K routers | prefix hit rate | TTFT p50 s | TTFT p99 s | goodput r/s | TTFT p50 vs K=1 "
           "| goodput vs K=1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["mode"]]
        out.append(f"| {r['mode']} | {r['k']} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50_s']:.3f} | "
                   f"{r['ttft_p99_s']:.2f} | {r['goodput_rps']:.3f} | x{r['ttft_p50_s'] / b['ttft_p50_s']:.2f} | "
                   f"x{r['goodput_rps'] / b['goodput_rps']:.2f} |")
    return "\n".join(out)
