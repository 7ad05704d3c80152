"""Prometheus metrics of the router service (one registry per app, scraped at ``GET /metrics``).

Names follow Prometheus conventions: ``pdlb_`` prefix, base units (seconds, ratios 0..1),
``_total`` for counters (added by prometheus-client), labels for dimensions.

With several router processes (``pdlb serve --processes N``) prometheus-client's multiprocess mode
is used (``PROMETHEUS_MULTIPROC_DIR``, set by the parent before the processes start): a scrape
answered by any process reports counters and histograms summed over all processes, per-worker load
gauges (in-flight requests, prefill tokens) as the most recent value any live process wrote, each
process writing the total over all processes (its own counts plus the others' rows of the shared
load block, :mod:`balancer.service.processes.shared_load`) every ``MULTIPROCESS_GAUGE_REFRESH_S`` and the
answering process at the scrape itself (so a scrape never sums another process's value of up to a
second ago), breaker state as the worst (max) and health as the lowest (min)
view of any process; the per-worker gauges of a worker removed through the admin API disappear
(the processes' files keep its last values: the scrape leaves out workers no longer registered);
and the KV-event series from the processes' stats files
(:class:`balancer.service.kv_metrics.KvEventsFilesCollector`): the one subscriber's
``pdlb_kv_events_*`` counters (batches, events, gaps, replays, restarts, decode errors, stale,
last seq, translator blocks) once, labelled ``process="0"`` (the process that runs it: each
engine batch is decoded once), and each process's fan-out reader
(:mod:`balancer.service.processes.kv_fanout`) as ``pdlb_kv_events_fanout_{applied,apply_errors,records,
lost_records,lost_bytes,corrupt_records,laps,resyncs,snapshot_records}_total{process}`` and the
gauge ``pdlb_kv_events_fanout_lag_bytes{process}`` (ring bytes written, not yet applied there),
plus ``pdlb_kv_events_fanout_subscriber_restarts_total{process="0"}`` (and process 0's ring
writer: ``pdlb_kv_events_fanout_mirror_{blocks,evicted_total}``,
``pdlb_kv_events_fanout_snapshots_written_total``). In approximate mode the processes' shared
decision rings (:mod:`balancer.service.processes.shared_prefix`) are counted as
``pdlb_shared_prefix_decisions_total{process,kind}`` (``written``, ``read``, ``folded``,
``dropped``, ``recovered``: a replacement's predecessor's, read back; ``retracted``: retractions
of refused prompts written) and
``pdlb_shared_prefix_lost_bytes_total{process}``. The parent's restarts of
dead router processes are counted by the replacements:
``pdlb_router_process_restarts_total{process}`` and ``pdlb_router_process_reaped_requests_total{process}``
(:mod:`balancer.service.processes.supervise`).

No ``*_created`` series: prometheus-client adds one per counter and histogram child by default
(the Unix time it was created, which Prometheus reads as a separate series), and multiprocess mode
drops them anyway; building :class:`ServiceMetrics` turns them off with the library's own switch,
``prometheus_client.disable_created_metrics()``, which holds for the whole process (as the
``PROMETHEUS_DISABLE_CREATED_SERIES`` environment variable would).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess as prom_multiprocess

from balancer.router import Router
from balancer.service.workers import WorkerPool

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_PID = {"value": os.getpid()}
os.register_at_fork(after_in_child=lambda: _PID.__setitem__("value", os.getpid()))
_cached_pid_installed = False


def _cached_pid() -> int:
    return _PID["value"]


def _install_cached_pid() -> None:
    """Multiprocess mode: have prometheus-client's mmap-backed values take this process's id from a
    cache kept right across ``fork`` instead of calling ``os.getpid()`` (a system call) on every
    ``inc``/``set``/``observe`` (about 10 per request). Done once per process, before its first
    metric exists (the values of one class share its files; a second class would reopen them)."""
    global _cached_pid_installed
    from prometheus_client import values

    if not _cached_pid_installed and getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue(process_identifier=_cached_pid)
        _cached_pid_installed = True


MULTIPROCESS_GAUGE_REFRESH_S = 1.0
"""Seconds between refreshes of a process's per-worker gauges in multiprocess mode."""


class ServiceMetrics:
    """The service's metric families.

    Args:
        multiprocess: aggregate over the router processes of ``pdlb serve --processes N`` (needs
            ``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client`` was imported).
    """

    def __init__(self, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        disable_created_metrics()  # no *_created series (module docstring); process-wide
        if multiprocess:
            _install_cached_pid()
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdlb_requests", "Client requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.duration = Histogram("pdlb_request_duration_seconds", "Client request latency (to the last byte)",
                                  ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("pdlb_time_to_first_token_seconds",
                              "Router-observed time from a streamed request's arrival to the decode leg's first event with "
                              "generated content (text, tool-call delta or token ids; not the role-only chunk)",
                              ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.decisions = Counter("pdlb_routing_decisions", "Routing decisions by worker, pool, policy and reason",
                                 ["worker", "pool", "policy", "reason"], registry=r)
        self.match_ratio = Histogram("pdlb_prefix_match_ratio",
                                     "Prompt fraction the chosen replica is believed to hold (router's prefix index)",
                                     ["pool"], buckets=RATIO_BUCKETS, registry=r)
        self.loop_lag = Histogram("pdlb_event_loop_lag_seconds",
                                  "How late the event loop woke a timer due every 50 ms: time it spent on "
                                  "other work (a blocked loop delays every client)",
                                  buckets=LOOP_LAG_BUCKETS_S, registry=r)
        self.loop_cpu_lag = Histogram("pdlb_event_loop_cpu_lag_seconds",
                                      "The part of pdlb_event_loop_lag_seconds the router process's own CPU time "
                                      "explains: min(lag, CPU seconds the process used while the timer waited); "
                                      "waiting for a CPU on a busy host does not count",
                                      buckets=LOOP_LAG_BUCKETS_S, registry=r)
        self.retries = Counter("pdlb_retries", "Request attempts retried, by reason", ["reason"], registry=r)
        self.http_parse_errors = Counter("pdlb_http_parse_errors",
                                         "Malformed HTTP requests answered by the connection handler before any "
                                         "route (bad request line, header, Content-Length or chunked encoding), by "
                                         "HTTP status", ["status"], registry=r)
        self.connections_rejected = Counter("pdlb_client_connections_rejected",
                                            "Client connections closed as they were accepted, by reason "
                                            "(max_connections: that many were open already)", ["reason"], registry=r)
        self.prompt_inexact = Counter("pdlb_prompt_inexact",
                                      "Chat prompts whose token ids may differ from the engine's, by reason "
                                      "(no_chat_template, multimodal, request_chat_template, chat_template_kwargs, "
                                      "engine_renderer)", ["reason"], registry=r)
        self.upstream_failures = Counter("pdlb_upstream_failures", "Failed worker legs by worker and kind",
                                         ["worker", "kind"], registry=r)
        self.in_flight = Gauge("pdlb_in_flight_requests", "Client requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.worker_load = Gauge("pdlb_worker_in_flight_requests",
                                 "Requests the router counts on each worker DP rank (from dispatch; with several processes or a "
                                 "broker, every router's that it knows of)",
                                 ["worker", "dp_rank", "role"], registry=r, multiprocess_mode="livemostrecent")
        self.worker_prefill_tokens = Gauge("pdlb_worker_prefill_tokens",
                                           "Uncached prompt tokens routed to each rank and not yet prefilled",
                                           ["worker", "dp_rank", "role"], registry=r,
                                           multiprocess_mode="livemostrecent")
        self.breaker = Gauge("pdlb_circuit_breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open",
                             ["worker"], registry=r, multiprocess_mode="livemax")
        self.breaker_transitions = Counter("pdlb_circuit_breaker_transitions",
                                           "Circuit breaker state changes by worker and new state",
                                           ["worker", "state"], registry=r)
        self.healthy = Gauge("pdlb_worker_healthy", "1 if the worker passes active health checks", ["worker"], registry=r,
                             multiprocess_mode="livemin")
        self.reachable = Gauge("pdlb_worker_reachable", "0 while requests cannot connect to the worker (since the "
                               "first failed connection until it answers again), else 1", ["worker"], registry=r,
                               multiprocess_mode="livemin")
        self.processes_active = Gauge("pdlb_router_processes_active",
                                      "Router processes that take new client connections now (connection_placement "
                                      "follow_load: the others give theirs back; round_robin, --http-front aiohttp or one "
                                      "process: all)", registry=r,
                                      multiprocess_mode="livemax")
        self.given_back = Counter("pdlb_connections_given_back",
                                  "Client connections closed after an answer (Connection: close) so that the client "
                                  "reconnects where the connection placement puts it, by reason (inactive: this "
                                  "process takes no new connections; rebalance: new active processes take a share)",
                                  ["reason"], registry=r)
        self.shared_prefix = Counter("pdlb_shared_prefix_decisions",
                                     "Approximate mode, several processes: routing decisions shared through the "
                                     "processes' rings, by process and kind (written, read, folded, dropped, "
                                     "recovered, retracted)", ["process", "kind"], registry=r)
        self.shared_prefix_lost = Counter("pdlb_shared_prefix_lost_bytes",
                                          "Approximate mode, several processes: ring bytes a reader skipped "
                                          "because the writer lapped it", ["process"], registry=r)
        #: several processes, approximate mode: this process's ring side
        #: (:class:`balancer.service.processes.shared_prefix.PrefixShare`) and its process number, counted
        #: at each gauge refresh
        self.prefix_share: Any = None
        #: several processes, follow_load: this process's PlacementView (its gauge is set at render)
        self.placement: Any = None
        self.process_index = 0
        self._share_seen: dict[str, int] = {}
        self._scrape_registry = r
        #: the URLs registered now (multiprocess scrapes leave out other workers' gauges)
        self.live_workers: Callable[[], Collection[str]] | None = None
        if multiprocess:
            self._scrape_registry = CollectorRegistry()
            self._scrape_registry.register(_LiveWorkersOnly(prom_multiprocess.MultiProcessCollector(None), self))
            directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if directory:
                from balancer.service.kv_metrics import KvEventsFilesCollector

                self._scrape_registry.register(KvEventsFilesCollector(directory))
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        #: counter increments not yet applied, (family, labels) -> count (see count)
        self._pending: dict[tuple[Counter, tuple[str, ...]], int] = {}
        #: several processes: this process's in-flight count, set on the gauge at each flush
        self.in_flight_of: Callable[[], int] | None = None
        self._flush_scheduled = False

    def count(self, family: Counter, *labels: str) -> None:
        """``family.labels(*labels).inc()``, batched: in one process the increments are applied at
        the next :meth:`flush` (every scrape flushes first, so scrapes see every count); with
        several processes (whose scrapes read every process's files) also as soon as the event
        loop is done with what is ready now (:meth:`changed`): one write per counter per loop
        iteration, not per request."""
        key = (family, labels)
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1
        # after the increment: outside a running event loop changed() flushes at once, swapping
        # self._pending (an increment made after it into the old dict was lost)
        if self.multiprocess and not self._flush_scheduled:
            self.changed()

    def changed(self) -> None:
        """Several processes: flush once the event loop has run what is ready now (at once
        outside a running loop)."""
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Apply the batched counter increments (:meth:`count`) and, with several processes, the
        in-flight gauge (:attr:`in_flight_of`)."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for (family, labels), n in pending.items():
            self.child(family, *labels).inc(n)
        if self.multiprocess and self.in_flight_of is not None:
            self.in_flight.set(self.in_flight_of())

    def request_done(self, endpoint: str, status: int, duration_s: float) -> None:
        """One client request answered on ``endpoint`` with ``status`` after ``duration_s``."""
        self.count(self.requests, endpoint, str(status))
        self.child(self.duration, endpoint).observe(duration_s)

    def child(self, family: Counter | Histogram, *labels: str) -> Any:
        """``family.labels(*labels)``, cached: the hot path skips prometheus-client's label
        validation and lock per request. Only for counters and histograms (never cleared)."""
        key = (family._name, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = family.labels(*labels)
        return c

    def refresh_gauges(self, router: Router, pool: WorkerPool) -> None:
        """Set the per-worker gauges from the router's load tracker and the pool (a removed worker's
        series disappear; in multiprocess mode the worker set is fixed and nothing is cleared)."""
        if not self.multiprocess:
            self.worker_load.clear()
            self.worker_prefill_tokens.clear()
            self.breaker.clear()
            self.healthy.clear()
            self.reachable.clear()
        if self.prefix_share is not None:
            self._count_share(self.prefix_share)
        if self.placement is not None:
            self.processes_active.set(self.placement.block.active)
        load = router.load
        shared = load.peer  # sibling processes (shared memory) and, with a broker, the other routers
        if shared is not None:
            shared.refresh(force=True)  # every process's counts now, from the shared load block
        per_rank = pool.num_replicas <= PER_RANK_SERIES_MAX
        for w in pool.workers.values():
            self.breaker.labels(w.url).set(int(w.breaker.state))
            self.healthy.labels(w.url).set(1 if w.healthy else 0)
            self.reachable.labels(w.url).set(0 if w.unreachable_since_s is not None else 1)
            total_requests = total_prefill = 0
            for rep in w.replicas:
                snap = load.get(rep)
                requests, prefill = snap.num_requests, snap.prefill_tokens
                if shared is not None:
                    s = load.slot(rep)
                    requests += int(load.peer_requests[s])
                    prefill += int(load.peer_prefill_tokens[s])
                if per_rank:
                    labels = (w.url, str(rep.dp_rank), w.cfg.role)
                    self.worker_load.labels(*labels).set(requests)
                    self.worker_prefill_tokens.labels(*labels).set(prefill)
                else:
                    total_requests += requests
                    total_prefill += prefill
            if not per_rank:  # one series per worker: the sum over its ranks
                labels = (w.url, "all", w.cfg.role)
                self.worker_load.labels(*labels).set(total_requests)
                self.worker_prefill_tokens.labels(*labels).set(total_prefill)

    def _count_share(self, share: Any) -> None:
        """Add what the shared prefix ring's counters gained since the last call."""
        seen, process = self._share_seen, str(self.process_index)
        now = {"written": share.sent, "read": share.received, "folded": share.folded, "dropped": share.dropped,
               "recovered": share.recovered, "retracted": share.retracted, "lost_bytes": share.lost_bytes}
        for kind, value in now.items():
            step = value - seen.get(kind, 0)
            if step > 0:
                if kind == "lost_bytes":
                    self.shared_prefix_lost.labels(process).inc(step)
                else:
                    self.shared_prefix.labels(process, kind).inc(step)
            seen[kind] = value

    def render(self, router: Router, pool: WorkerPool) -> bytes:
        """Refresh this process's per-worker gauges and return the exposition text (all processes'
        in multiprocess mode)."""
        self.flush()
        self.refresh_gauges(router, pool)
        return generate_latest(self._scrape_registry)


LOOP_LAG_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Buckets of ``pdlb_event_loop_lag_seconds`` and ``pdlb_event_loop_cpu_lag_seconds`` (issue 25's bounds: p99 under 0.1 s, never over 0.25 s)."""

PER_RANK_SERIES_MAX = 1024
"""Up to this many DP ranks over all workers, ``pdlb_worker_in_flight_requests`` and
``pdlb_worker_prefill_tokens`` have one series per rank; beyond, one per worker (``dp_rank="all"``,
the sum over its ranks), so that a scrape of a large fleet stays a few hundred KB and well under
100 ms (16,384 ranks rendered per rank: 2.9 MB in 1.5-2 s, the event loop blocked throughout)."""

PER_WORKER_GAUGES = ("pdlb_worker_in_flight_requests", "pdlb_worker_prefill_tokens", "pdlb_circuit_breaker_state",
                     "pdlb_worker_healthy")


class _LiveWorkersOnly:
    """The multiprocess collector's families, less the per-worker gauges' samples of workers that
    are no longer registered (``metrics.live_workers()``)."""

    def __init__(self, inner: Any, metrics: ServiceMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def collect(self):  # noqa: ANN201
        live_of = self.metrics.live_workers
        live = None if live_of is None else set(live_of())
        for fam in self.inner.collect():
            if live is not None and fam.name in PER_WORKER_GAUGES:
                fam.samples = [s for s in fam.samples if s.labels.get("worker") in live]
            yield fam
