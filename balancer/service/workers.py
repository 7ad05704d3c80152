"""The service's worker registry: URLs <-> router replicas, circuit breakers, health state.

A worker (one engine URL) with ``dp_size`` DP ranks is registered on the
:class:`~balancer.router.Router` as replicas ``ReplicaId(url, rank)``. It is *routable* when its
active health check passes and its circuit breaker is not open; :meth:`WorkerPool.refresh` pushes
routability into the router with ``set_healthy`` (unroutable replicas are not candidates, but keep
their prefix-index state). Time is passed in (``now_s``, ``time.monotonic()`` in the service).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from yarl import URL

from balancer.router import Router
from balancer.service.config import CircuitBreakerConfig, HealthCheckConfig, WorkerConfig
from balancer.service.engine_caps import EngineCaps
from balancer.types import ReplicaId, Role

log = logging.getLogger("pdlb.service")

MAX_WORKERS = 1024
"""Most workers one router holds (admin API and config); bounds what one admin request can add."""
MAX_REPLICAS = 16_384
"""Most DP ranks over all workers (each is a router replica)."""
UNREACHABLE_LOG_EVERY_S = 60.0
"""While a worker stays unreachable, its burst of failed connections is logged this often."""

EARLY_PROBE_MIN_GAP_S = 1.0
"""A refused connection starts an early health probe of its worker at most this often per worker
(and at most one in flight per worker): :meth:`WorkerPool.record_connect_failure`."""


class BreakerState(enum.IntEnum):
    """Circuit states; the value is the ``pdlb_circuit_breaker_state`` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(slots=True)
class CircuitBreaker:
    """Consecutive-failure circuit breaker with half-open probing (see
    :class:`~balancer.service.config.CircuitBreakerConfig`).

    CLOSED -> OPEN after ``failure_threshold`` consecutive failures (the service counts at most one
    per client request); OPEN -> HALF_OPEN once ``open_duration_s`` passed *or* a health probe
    passed (:meth:`probe_passed`), whichever comes first; HALF_OPEN is routable (trial requests),
    ``success_threshold`` successes close it and one failure reopens it. Every state change is
    logged (``pdlb.service`` logger) and reported to ``on_change`` (the service counts it in
    ``pdlb_circuit_breaker_transitions_total``).
    """

    cfg: CircuitBreakerConfig
    name: str = ""
    on_change: Callable[[str, BreakerState], None] | None = None
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    successes: int = 0
    opened_at_s: float = 0.0
    num_opened: int = 0

    def _set(self, state: BreakerState, why: str) -> None:
        if state is self.state:
            return
        self.state = state
        if state is BreakerState.OPEN:
            log.warning("circuit breaker of %s opened: %s", self.name, why)
        else:
            log.info("circuit breaker of %s is %s: %s", self.name, state.name.lower().replace("_", "-"), why)
        if self.on_change is not None:
            self.on_change(self.name, state)

    def allows(self, now_s: float) -> bool:
        """Whether requests may go to the worker; moves OPEN -> HALF_OPEN once the open period ended."""
        if not self.cfg.enabled:
            return True
        if self.state is BreakerState.OPEN and now_s - self.opened_at_s >= self.cfg.open_duration_s:
            self.successes = 0
            self._set(BreakerState.HALF_OPEN, f"open for {self.cfg.open_duration_s:g} s, letting trial requests through")
        return self.state is not BreakerState.OPEN

    def probe_passed(self) -> None:
        """A health probe of the worker passed: an open breaker goes half-open at once (trial
        requests), without waiting for the rest of ``open_duration_s``."""
        if self.cfg.enabled and self.state is BreakerState.OPEN:
            self.successes = 0
            self._set(BreakerState.HALF_OPEN, "health probe passed, letting trial requests through")

    def record_success(self) -> None:
        self.failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.cfg.success_threshold:
                self._set(BreakerState.CLOSED, f"{self.successes} trial requests succeeded")

    def record_failure(self, now_s: float) -> None:
        self.failures += 1
        if not self.cfg.enabled:
            return
        if self.state is BreakerState.HALF_OPEN or (self.state is BreakerState.CLOSED
                                                    and self.failures >= self.cfg.failure_threshold):
            why = ("a trial request failed" if self.state is BreakerState.HALF_OPEN
                   else f"{self.failures} consecutive failed requests")
            self.opened_at_s = now_s
            self.successes = 0
            self.num_opened += 1
            self._set(BreakerState.OPEN, why)
        elif self.state is BreakerState.OPEN:
            self.opened_at_s = now_s


@dataclass(slots=True)
class Worker:
    """One engine behind the router and its live state."""

    cfg: WorkerConfig
    breaker: CircuitBreaker
    healthy: bool = True
    health_failures: int = 0
    health_successes: int = 0
    routable: bool = True
    replicas: tuple[ReplicaId, ...] = field(default_factory=tuple)
    #: what the engine can do (:mod:`balancer.service.engine_caps`), probed after registration
    caps: EngineCaps = field(default_factory=EngineCaps)
    #: since when requests cannot connect to it (None: reachable), and the failed connections of
    #: the current burst / since registration (WorkerPool.record_connect_failure)
    unreachable_since_s: float | None = None
    burst_connect_failures: int = 0
    connect_failures: int = 0
    last_unreachable_log_s: float = 0.0
    #: whether it is known to be reachable or not: set by the first request, capability probe or
    #: health probe that got an answer, or the first refused connection (``reachable`` is ``null`` in ``/workers``
    #: until then)
    reach_known: bool = False
    #: the early health probe a refused connection started (WorkerPool.record_connect_failure)
    early_probe_in_flight: bool = False
    last_early_probe_s: float = float("-inf")
    _urls: dict[str, URL] = field(default_factory=dict)
    _host_of: tuple[str, str] = ("", "")  # (cfg.url, its host): host is read per SGLang PD request

    def model_names(self) -> tuple[str, ...]:
        """The model names the engine accepts: the configured ``served_model_name``, else the
        discovered ones (empty: unknown)."""
        return (self.cfg.served_model_name,) if self.cfg.served_model_name else self.caps.served_models

    @property
    def url(self) -> str:
        return self.cfg.url

    def endpoint(self, path: str) -> URL:
        """``url + path`` as a parsed :class:`yarl.URL`, built once per path (the HTTP client
        then skips URL parsing per request)."""
        u = self._urls.get(path)
        if u is None:
            u = self._urls[path] = URL(self.cfg.url + path)
        return u

    @property
    def role(self) -> Role:
        return Role(self.cfg.role)

    @property
    def host(self) -> str:
        """The host of ``cfg.url`` (``127.0.0.1`` if it has none), parsed once per URL."""
        url = self.cfg.url
        cached = self._host_of
        if cached[0] != url or not url:
            cached = self._host_of = (url, urlparse(url).hostname or "127.0.0.1")
        return cached[1]

    def describe(self) -> dict:
        return {**self.cfg.model_dump(), "healthy": self.healthy, "routable": self.routable,
                "circuit": self.breaker.state.name.lower(), "consecutive_failures": self.breaker.failures,
                "reachable": (self.unreachable_since_s is None) if self.reach_known else None,
                "connect_failures": self.connect_failures,
                "capabilities": self.caps.describe()}


class WorkerPool:
    """Workers by URL, kept in sync with a :class:`~balancer.router.Router`."""

    def __init__(self, router: Router, breaker_cfg: CircuitBreakerConfig, health_cfg: HealthCheckConfig,
                 on_breaker_change: Callable[[str, BreakerState], None] | None = None) -> None:
        self.router = router
        self.breaker_cfg = breaker_cfg
        self.health_cfg = health_cfg
        self.on_breaker_change = on_breaker_change
        self.workers: dict[str, Worker] = {}
        self.num_replicas = 0
        self.num_prefill = 0  # registered prefill workers
        #: URLs of workers whose breaker is open: the only routability that changes with time alone
        self._open: set[str] = set()
        #: starts an early health probe of a worker whose connection was refused; the service sets
        #: it (with health checks and the circuit breaker on) and reports the outcome to
        #: :meth:`record_early_probe`; None: no early probes
        self.early_probe: Callable[[Worker], None] | None = None

    def add(self, cfg: WorkerConfig) -> Worker:
        """Register a worker and its DP ranks, atomically: if any rank cannot be registered, none
        stays registered (no ghost replicas that routes could pick).

        Raises:
            ValueError: the URL is already registered, or the pool would exceed
                :data:`MAX_WORKERS` workers or :data:`MAX_REPLICAS` DP ranks.
        """
        if cfg.url in self.workers:
            raise ValueError(f"worker {cfg.url} is already registered")
        if len(self.workers) >= MAX_WORKERS:
            raise ValueError(f"the router already has {len(self.workers)} workers (at most {MAX_WORKERS})")
        if self.num_replicas + cfg.dp_size > MAX_REPLICAS:
            raise ValueError(f"adding {cfg.dp_size} DP ranks would give {self.num_replicas + cfg.dp_size} "
                             f"(at most {MAX_REPLICAS} over all workers)")
        reps = tuple(ReplicaId(cfg.url, r) for r in range(cfg.dp_size))
        done: list[ReplicaId] = []
        try:
            with self.router.registering():  # the index's share enforced once for all the ranks
                for rep in reps:
                    self.router.add_replica(rep, cfg.role, cfg.kv_capacity_tokens)
                    done.append(rep)
        except BaseException:
            for rep in done:
                self.router.remove_replica(rep)
            raise
        w = Worker(cfg, CircuitBreaker(self.breaker_cfg, cfg.url, self._breaker_changed), replicas=reps)
        self.workers[cfg.url] = w
        self.num_replicas += len(reps)
        self.num_prefill += cfg.role == "prefill"
        return w

    def remove(self, url: str) -> Worker:
        """Unregister a worker (in-flight requests finish; they stop counting on it).

        Raises:
            KeyError: unknown URL.
        """
        w = self.workers.pop(url.rstrip("/"))
        self._open.discard(w.url)
        self.num_replicas -= len(w.replicas)
        self.num_prefill -= w.cfg.role == "prefill"
        for rep in w.replicas:
            self.router.remove_replica(rep)
        return w

    def get(self, url: str) -> Worker | None:
        return self.workers.get(url)

    def _breaker_changed(self, url: str, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            self._open.add(url)
        else:
            self._open.discard(url)
        if self.on_breaker_change is not None:
            self.on_breaker_change(url, state)

    def refresh_due(self, now_s: float) -> None:
        """:meth:`refresh` if routability can have changed since the last one by time alone (an
        open breaker whose open period may have ended): O(1) per request otherwise. Health results
        and request outcomes refresh as they are recorded."""
        if self._open:
            self.refresh(now_s)

    def refresh(self, now_s: float) -> None:
        """Recompute routability (health and breaker) and push changes into the router."""
        for w in self.workers.values():
            r = w.healthy and w.breaker.allows(now_s)
            if r != w.routable:
                w.routable = r
                for rep in w.replicas:
                    self.router.set_healthy(rep, r)

    def record_connect_failure(self, w: Worker, now_s: float, why: str) -> None:
        """A request could not connect to ``w``: it is marked unreachable (``/workers``,
        ``pdlb_worker_reachable``) until a request or health check gets through. Logged at WARNING
        once when a burst starts, again every :data:`UNREACHABLE_LOG_EVERY_S` while it lasts (with
        the count), and at INFO with the burst's count when the worker answers again.

        While ``w`` is healthy it also starts an early health probe (:attr:`early_probe`; at most
        one in flight per worker and one per :data:`EARLY_PROBE_MIN_GAP_S`): if that fails too,
        :meth:`record_early_probe` marks ``w`` unhealthy at once instead of after
        ``health_check.failure_threshold`` rounds ``interval_s`` apart."""
        w.connect_failures += 1
        w.reach_known = True
        if w.unreachable_since_s is None:
            w.unreachable_since_s = w.last_unreachable_log_s = now_s
            w.burst_connect_failures = 1
            log.warning("worker %s: cannot connect (%s); marked unreachable until it answers (further failures "
                        "are counted, not logged one by one)", w.url, why)
        else:
            w.burst_connect_failures += 1
            if now_s - w.last_unreachable_log_s >= UNREACHABLE_LOG_EVERY_S:
                w.last_unreachable_log_s = now_s
                log.warning("worker %s: still unreachable: %d failed connections in %.0f s (last: %s)", w.url,
                            w.burst_connect_failures, now_s - w.unreachable_since_s, why)
        if (self.early_probe is not None and w.healthy and not w.early_probe_in_flight
                and now_s - w.last_early_probe_s >= EARLY_PROBE_MIN_GAP_S):
            w.early_probe_in_flight = True
            w.last_early_probe_s = now_s
            self.early_probe(w)

    def record_early_probe(self, w: Worker, ok: bool | None, now_s: float) -> None:
        """The outcome of the early health probe :meth:`record_connect_failure` started: passed,
        failed (``w`` is marked unhealthy at once: a refused connection and a failed probe agree;
        the prober then checks it every ``circuit_breaker.probe_interval_s`` and it is healthy
        again after ``health_check.success_threshold`` passing probes), or ``None`` (not run:
        shutdown)."""
        w.early_probe_in_flight = False
        if ok is None or self.workers.get(w.url) is not w:
            return
        if ok:
            self.record_health(w, True, now_s)
            return
        w.health_successes = 0
        w.health_failures += 1
        if w.healthy:
            w.healthy = False
            log.warning("worker %s: connection refused and an early health probe failed: not routable until "
                        "%d health probes pass", w.url, self.health_cfg.success_threshold)
        self.refresh(now_s)

    def _reachable_again(self, w: Worker, now_s: float) -> None:
        since = w.unreachable_since_s
        if since is None:
            return
        w.unreachable_since_s = None
        log.info("worker %s answers again after %d failed connections in %.1f s", w.url, w.burst_connect_failures,
                 now_s - since)
        w.burst_connect_failures = 0

    def record_answer(self, w: Worker, now_s: float) -> None:
        """``w`` gave an HTTP answer to something other than a request or a health probe (its
        capability probe at registration): a connection opened, so it is known reachable."""
        w.reach_known = True
        self._reachable_again(w, now_s)

    def record_result(self, w: Worker, ok: bool, now_s: float) -> None:
        """Feed one request outcome on ``w`` into its breaker (and the router, if routability changed)."""
        if ok:
            w.reach_known = True
            if w.unreachable_since_s is not None:
                self._reachable_again(w, now_s)
            if w.breaker.state is BreakerState.CLOSED:  # the common case: nothing can change
                w.breaker.failures = 0
                return
            w.breaker.record_success()
        else:
            w.breaker.record_failure(now_s)
        self.refresh(now_s)

    def record_health(self, w: Worker, ok: bool, now_s: float) -> None:
        """Feed one active health-check result into ``w``."""
        cfg = self.health_cfg
        if ok:  # a failed probe does not say whether a connection could be opened
            w.reach_known = True
            self._reachable_again(w, now_s)
            w.health_failures = 0
            w.health_successes += 1
            if not w.healthy and w.health_successes >= cfg.success_threshold:
                w.healthy = True
                log.info("worker %s passes health checks again", w.url)
            w.breaker.probe_passed()
        else:
            w.health_successes = 0
            w.health_failures += 1
            if w.healthy and w.health_failures >= cfg.failure_threshold:
                w.healthy = False
                log.warning("worker %s failed %d health checks in a row: not routable", w.url, w.health_failures)
        self.refresh(now_s)

    def to_probe(self) -> list[Worker]:
        """Workers that are not routable now (unhealthy or breaker open): the ones the service
        probes every ``circuit_breaker.probe_interval_s`` so that traffic returns soon after they
        recover."""
        return [w for w in self.workers.values() if not w.routable]

    def routable(self, roles: tuple[Role, ...]) -> list[Worker]:
        return [w for w in self.workers.values() if w.routable and w.role in roles]
