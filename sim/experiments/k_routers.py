"""Several routers in front of one cluster: what do independent approximate routers lose?

A real gateway runs K router replicas (or ``pdlb serve --processes K``) behind an L4 balancer that
spreads requests over them. With ``index_mode="approximate"`` each replica only knows the prompts
*it* routed, so a prefix cached through replica 1 is invisible to replica 2; with
``index_mode="events"`` every replica consumes every engine's KV events (Dynamo and llm-d do this),
so their prefix views agree. In-flight load is each replica's own, unless ``+shared-load``: one
load view for all (what the processes of one ``pdlb serve`` would get from shared memory), or
``+reports``: every ``report_interval_s`` each router receives the engines' own load reports
(:meth:`balancer.router.Router.on_load_report`: running + waiting requests and KV usage per DP
rank, what ``pdlb serve``'s ``load_scrape`` reads from the engines' Prometheus metrics), here the
sum of every router's in-flight counts at that moment (what the engine holds: the simulated
hooks are instant).

:class:`KRouters` is a drop-in for :class:`balancer.router.Router` in the simulator: request ``i``
(in arrival order) goes to replica ``i mod K``, its hooks to the same replica, and KV events to
all of them. :func:`run` simulates K in ``--ks`` for both modes on the embedded Mooncake trace
(default scenario ``dsv3-pd-h200``, cache_aware prefill, least_load decode, or ``--policy``) and
reports the prefix hit rate and TTFT, with ratios to K = 1 of the same mode.

Run: ``pdlb dev k-routers [--ks 1,2,4,8] [--limit 3000] [--policy ep_aware]``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from balancer.load import LoadReport, LoadTracker
from balancer.parts import LoadSources
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role, Route

#: seconds between the engines' load reports in ``+reports`` mode (``pdlb serve``'s load_scrape default)
DEFAULT_REPORT_INTERVAL_S = 1.0
#: the routers' (prefill, decode) policies of the K-routers experiments (this one and
#: :mod:`sim.experiments.broker_routers`) unless one is given for both pools
DEFAULT_POLICIES = ("cache_aware", "least_load")


class _LoadGroup:
    def __init__(self, routers: list[Router]) -> None:
        self._routers = routers

    @property
    def num_in_flight(self) -> int:
        return sum(t.num_in_flight for t in {id(r.load): r.load for r in self._routers}.values())


class KRouters:
    """K independent routers splitting the traffic round-robin (see the module docstring).

    Args:
        make: builds one router from its parts, called as ``make(seed=..., load_sources=...,
            listeners=...)`` (keywords of :meth:`balancer.router.Router.from_config` and the
            config's ``seed``); same policies and settings for every router.
        k: how many routers (>= 1).
        seed: router ``j`` is seeded with ``seed * 1000 + j``, so that they do not make
            correlated random choices.
        shared_load: all routers count in-flight load in one tracker (what shared memory
            between the processes of one ``pdlb serve`` gives); else each counts its own.
        report_interval_s: every this many seconds (at the first call at or after each boundary)
            each router gets one :class:`~balancer.load.LoadReport` per replica: the requests all
            routers have in flight there and their decode KV tokens over its capacity (the
            engine's own view); ``None``: no reports.

    Raises:
        ValueError: ``k`` < 1, or a report interval that is not a positive finite number.
    """

    def __init__(self, make: Callable[..., Router], k: int, seed: int = 0, shared_load: bool = False,
                 report_interval_s: float | None = None) -> None:
        if k < 1:
            raise ValueError("need at least one router")
        if report_interval_s is not None and not (report_interval_s > 0 and math.isfinite(report_interval_s)):
            raise ValueError(f"report_interval_s must be a positive number of seconds, got {report_interval_s!r}")
        self.report_interval_s = report_interval_s
        self._report_tick = -1
        self._replicas: list[tuple[ReplicaId, int]] = []
        self.reports_sent = 0
        own = LoadTracker() if shared_load else None
        self.routers = [make(**{"seed": seed * 1000 + j, "load_sources": LoadSources(own=own) if own is not None else None,
                                **self._parts(j)}) for j in range(k)]
        routers = self.routers
        self.index_mode = routers[0].index_mode
        self.load = _LoadGroup(routers)
        self._owner: dict[str, Router] = {}
        self._next = 0

    def _parts(self, j: int) -> dict[str, Any]:
        """Parts of router ``j`` beyond its seed and load sources, or replacing them (subclasses:
        listeners, a peer load source)."""
        return {}

    @classmethod
    def wrapper(cls, k: int, seed: int = 0, shared_load: bool = False, report_interval_s: float | None = None
                ) -> Callable[[Callable[..., Router]], Callable[[Any], Any]]:
        """For :func:`sim.run.cluster.simulate` ``router_wrapper``: K routers from its factory
        (called with the cluster's :class:`sim.run.router_config.RankCacheBlocks` and the parts)."""
        def wrap(factory: Callable[..., Router]) -> Callable[[Any], Any]:
            return lambda ranks: cls(lambda **parts: factory(ranks, **parts), k, seed, shared_load, report_interval_s)
        return wrap

    def add_replica(self, replica: ReplicaId, role: Role | str, kv_capacity_tokens: int = 0) -> None:
        for r in self.routers:
            r.add_replica(replica, role, kv_capacity_tokens)
        self._replicas.append((replica, kv_capacity_tokens))

    def _report(self, now_s: float) -> None:
        """The engines' load reports of the interval boundaries passed since the last call (one
        round: the state now is the state at the latest boundary, as no hook ran in between)."""
        if self.report_interval_s is None:
            return
        tick = math.floor(now_s / self.report_interval_s)
        if tick <= self._report_tick:
            return
        self._report_tick = tick
        trackers = {id(r.load): r.load for r in self.routers}.values()  # a shared tracker counts once
        for replica, cap in self._replicas:
            n = sum(int(t.num_requests[t.slot(replica)]) for t in trackers)
            kv = sum(int(t.decode_kv_tokens[t.slot(replica)]) for t in trackers)
            report = LoadReport(num_running=n, kv_usage=min(1.0, kv / cap) if cap > 0 else None)
            for r in self.routers:
                r.on_load_report(replica, report, now_s)
            self.reports_sent += len(self.routers)

    def route(self, request: Request, now_s: float) -> Route:
        self._report(now_s)
        r = self.routers[self._next % len(self.routers)]
        self._next += 1
        self._owner[request.request_id] = r
        return r.route(request, now_s)

    def on_prefill_done(self, request_id: str, now_s: float) -> None:
        self._report(now_s)
        r = self._owner.get(request_id)
        if r is not None:
            r.on_prefill_done(request_id, now_s)

    def on_first_token(self, request_id: str, now_s: float) -> None:
        self._report(now_s)
        r = self._owner.get(request_id)
        if r is not None:
            r.on_first_token(request_id, now_s)

    def on_finished(self, request_id: str, now_s: float, num_output_tokens: int | None = None) -> None:
        self._report(now_s)
        r = self._owner.pop(request_id, None)
        if r is not None:
            r.on_finished(request_id, now_s, num_output_tokens)

    def on_kv_event(self, replica: ReplicaId, event: Any, now_s: float | None = None) -> None:
        for r in self.routers:
            r.on_kv_event(replica, event, now_s)


def run(ks: list[int], modes: list[str], limit: int | None = None, seed: int = 0,
        rate_scale: float = 1.0, prefill_policy: str = DEFAULT_POLICIES[0], decode_policy: str = DEFAULT_POLICIES[1],
        report_interval_s: float = DEFAULT_REPORT_INTERVAL_S) -> list[dict[str, Any]]:
    """One summary row per (mode, K); a mode is ``approximate``, ``events`` or ``hybrid``, with
    ``+shared-load`` or ``+reports`` (engine load reports every ``report_interval_s``)."""
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize
    from sim.scenario import DEFAULT_PRESET, load_scenario
    from sim.workload import read_trace, scale_rate, spread_batches, take_slice

    sc = load_scenario(DEFAULT_PRESET)
    reqs = read_trace()
    if limit is not None:
        reqs = take_slice(reqs, 0, limit)
    reqs = spread_batches(reqs, 3.0, seed=seed)
    if rate_scale != 1.0:
        reqs = scale_rate(reqs, rate_scale)
    rows = []
    for label in modes:
        mode, _, shared = label.partition("+")
        for k in ks:
            t0 = time.perf_counter()
            res = simulate(sc, reqs, prefill_policy, decode_policy, seed=seed, index_mode=mode,
                           router_wrapper=KRouters.wrapper(k, seed, shared_load=shared == "shared-load",
                                                           report_interval_s=report_interval_s if shared == "reports"
                                                           else None))
            s = summarize(res)
            rows.append({"mode": label, "k": k, "prefill_policy": prefill_policy, "decode_policy": decode_policy,
                         "attainment": s.get("slo_attainment"), "hit_rate": s["prefix_hit_rate"], "ideal_hit_rate": s["ideal_hit_rate"],
                         "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p50_s": s["ttft_s"]["p50"],
                         "ttft_p90_s": s["ttft_s"]["p90"], "ttft_p99_s": s["ttft_s"]["p99"],
                         "goodput_rps": s["goodput_rps"], "prefill_load_imbalance": s["prefill_load_imbalance"],
                         "num_requests": s["num_requests"], "wall_s": time.perf_counter() - t0})
            print(f"  {mode:>11} K={k}: hit {100 * rows[-1]['hit_rate']:.1f}%  TTFT mean {rows[-1]['ttft_mean_s']:.3f} s"
                  f"  p90 {rows[-1]['ttft_p90_s']:.3f} s  ({rows[-1]['wall_s']:.1f} s wall)", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    base = {(r["mode"]): r for r in rows if r["k"] == min(x["k"] for x in rows)}
    out = ["| index mode | K routers | prefix hit rate | TTFT mean s | TTFT p90 s | TTFT p99 s | goodput r/s "
           "| TTFT mean vs K=1 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["mode"]]
        out.append(f"| {r['mode']} | {r['k']} | {100 * r['hit_rate']:.1f}% | {r['ttft_mean_s']:.3f} | "
                   f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.2f} | {r['goodput_rps']:.2f} | "
                   f"x{r['ttft_mean_s'] / b['ttft_mean_s']:.2f} |")
    return "\n".join(out)
