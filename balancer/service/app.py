"""The ``pdlb serve`` aiohttp application: OpenAI-compatible PD router.

Endpoints:

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /generate`` (SGLang native;
  not with ``pd_protocol: vllm``): routed and forwarded (:mod:`balancer.service.proxy`),
  JSON or SSE passed through chunk by chunk.
* ``GET /v1/models``: the configured ``served_model_name``, else a routable worker's list, else
  (no engine lists its models) the workers' configured or discovered model names.
* ``GET /health``: 200 when a decode/mixed worker is routable and the router is not draining,
  else 503; the body counts routable workers per role and names the answering process
  (``{"index", "count", "pid"}``; ``count`` > 1 with ``pdlb serve --processes``).
* ``GET /metrics``: Prometheus text (:mod:`balancer.service.metrics`).
* ``GET/POST/DELETE /workers``: admin API (list, add a :class:`WorkerConfig` JSON body, remove by
  ``?url=``). With ``admin_api_key`` configured it needs ``Authorization: Bearer <key>`` (401
  otherwise); without one only loopback clients may use it (403 otherwise). With several router
  processes (``pdlb serve --processes N``) an add or remove is applied by every process, all or
  none, before it is answered (:mod:`balancer.service.processes.shared_admin`); the list shows the answering
  process's view (the same workers in every process; health, breakers and in-flight counts are
  that process's).
  Adding an SGLang prefill worker without ``bootstrap_port`` logs a warning and returns it in the
  201 body's ``warnings`` (:func:`balancer.service.config.bootstrap_warning`).

Every answer carries ``X-Request-Id`` (the request's id at the engines' side as the client sees
it; for pdlb's own answers the client's ``X-Request-Id`` or a new id). Errors are OpenAI-style JSON
objects (``{"error": {"message", "type", "code"}}``; an engine's error in another shape is wrapped,
its original in ``error.engine_error``, :func:`balancer.service.proxy.engine_error_response`): invalid JSON or
missing fields 400, a missing, wrong or malformed admin credential 401, unknown route 404, wrong
method 405, body over ``max_body_bytes`` 413, a compressed body 415 (never inflated), no routable
worker (or too many large bodies being parsed) 503, timeout 504; unexpected exceptions 500 without
details (logged, at most once per 10 s: :attr:`Service.client_errors_log`).

Every answer says ``Server: pdlb`` (:data:`SERVER_HEADER`: aiohttp's default names the Python and
aiohttp versions); an HTTP request aiohttp cannot parse is answered ``HTTP/1.1 400`` with a JSON
error, a new ``X-Request-Id`` (``pdlb-<24 hex digits>``, as every id of the router's own) and
``Connection: close``, and counted in ``pdlb_http_parse_errors_total{status}``; a connection closed
at accept because ``max_connections`` are open is counted in
``pdlb_client_connections_rejected_total{reason="max_connections"}``.

Bodies of :data:`~balancer.service.body_offload.OFFLOAD_BODY_BYTES` or more are parsed, checked and
hashed in a worker process (:mod:`balancer.service.body_offload`); docs/serving.md, "Limits and
hardening", lists every limit, its default and its answer.

Run it with ``handler_cancellation=True`` (as ``pdlb serve`` does) so that a client disconnect
cancels the handler and aborts both PD legs. On shutdown the app stops taking new requests
(503) and drains in-flight ones for at most ``shutdown_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from balancer.policies import available_policies
from balancer.policies.base import policy_class
from balancer.parts import LoadSources
from balancer.router import Router, policies_use_prefix_index
from balancer.service import memory_debug
from balancer.service.app_server import AppServerRunner, RouterServer
from balancer.service.body_offload import (MAX_PENDING, MAX_TOP_LEVEL_FIELDS, OFFLOAD_BODY_BYTES, Analysis, BodyOffload,
                                           trim_malloc)
from balancer.service.config import ServiceConfig, WorkerConfig, bootstrap_warning
from balancer.service.lean_front import LeanProtocol, LeanRequest
from balancer.service.log_limit import RateLimitedLog
from balancer.service.loop_watch import LOOP_LAG_IDLE_INTERVAL_S, LOOP_LAG_INTERVAL_S, LoopWatch
from balancer.service.metrics import MULTIPROCESS_GAUGE_REFRESH_S, ServiceMetrics
from balancer.service.prompt import PromptHasher
from balancer.service.proxy import SERVER_HEADER, STREAM_STATUS, Proxy, error_response
from balancer.service.request_checks import MAX_REQUEST_ID_CHARS, parse_json_body
from balancer.service.upstream import UpstreamClient
from balancer.service.workers import MAX_REPLICAS, Worker, WorkerPool
from balancer.service.admission_gate import AdmissionGate
from balancer.types import Role
from balancer.validation import format_validation_error

log = logging.getLogger("pdlb.service")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}

GC_AFTER_LARGE_BYTES = 1024 * 1024
"""Bytes of large request bodies after which :meth:`Service.after_large_body` collects garbage."""

COST_MODEL_POLICIES = frozenset(n for n in available_policies() if policy_class(n).uses_cost_model)
"""Policies that read the router's cost model (``SelectContext.cost_model``, declared by
:attr:`balancer.policies.Policy.uses_cost_model`). ``learn_cost_model`` refits it online only when
a pool uses one of them: for other policies the fit is work whose result no decision reads (about
12% of the router's CPU per request under ``round_robin``, cProfile; ``tests/service/test_service.py``
checks that no other policy reads the model)."""


def _policies_in_use(cfg: ServiceConfig) -> set[str]:
    """The policy names that route something: the decode pool's, and the prefill pool's with a PD
    protocol (``pd_protocol: none`` takes no prefill workers)."""
    return {cfg.router.decode_policy.name} | ({cfg.router.prefill_policy.name} if cfg.pd_protocol != "none" else set())


class Service:
    """Per-app state: config, router, workers, metrics, the HTTP client and the proxy.

    ``process_index``: this process's number (0..``cfg.processes`` - 1) under ``pdlb serve --processes``;
    ``shared_load``: the name of the in-flight load block the processes share
    (:mod:`balancer.service.processes.shared_load`); ``shared_prefix_dir``: where the processes'
    approximate-index rings live (:mod:`balancer.service.processes.shared_prefix`). The router's parts that
    share load and decisions (the shared load view, the decision rings, the broker) are built here,
    before the router, and given to it at construction (:mod:`balancer.parts`); the event loop
    starts them (:func:`create_app`).
    """

    def __init__(self, cfg: ServiceConfig, process_index: int = 0, *, shared_load: str | None = None,
                 shared_prefix_dir: str | None = None) -> None:
        #: router processes of this pdlb serve (``cfg.processes``; unset: one, in process)
        self.processes = cfg.processes or 1
        if not 0 <= process_index < self.processes:
            raise ValueError(f"process_index {process_index} outside 0..{self.processes - 1}")
        self.cfg = cfg
        self.process_index = process_index
        #: what clients can trigger at will is logged through this, per app: one short line per
        #: kind per 10 s, with a count of the lines left out (malformed HTTP, unexpected errors)
        self.client_errors_log = RateLimitedLog(log, interval_s=10.0)
        self.multiprocess = self.processes > 1
        rc = cfg.router
        learn = rc.learn_cost_model
        if learn is None or learn:  # auto, or on: only when a pool that exists reads the model
            learn = bool(COST_MODEL_POLICIES & _policies_in_use(cfg))
        prefill_policy, decode_policy = rc.prefill_policy.build(), rc.decode_policy.build()
        # decisions are shared only for policies that read prefix matches (round robin, random and
        # consistent hash do not: Policy.uses_prefix_index); as Router.uses_prefix_index once the
        # configured workers are registered
        shares_prefix = rc.index_mode == "approximate" and policies_use_prefix_index(
            prefill_policy, decode_policy, any(w.role == "prefill" for w in cfg.workers))
        #: this process's view of the in-flight load shared by the processes of one pdlb serve
        self.shared_load: Any = None
        if shared_load is not None:
            from balancer.service.processes.shared_load import SharedLoad

            self.shared_load = SharedLoad(shared_load, self.processes, process_index, columns=MAX_REPLICAS)
        #: the decision rings of the processes of one pdlb serve (approximate mode), or None
        self.prefix_share: Any = None
        if shared_prefix_dir is not None and self.multiprocess and shares_prefix:
            from balancer.service.processes.shared_prefix import PrefixShare

            self.prefix_share = PrefixShare(shared_prefix_dir, self.processes, process_index)
        #: the routers on other hosts (``broker:``), or None; started with the app
        self.broker: Any = None
        if cfg.broker.enabled:
            from balancer.service.broker_sync import BrokerSync, new_group_id

            self.broker = BrokerSync(cfg.broker, shared_load or new_group_id(), process_index, inner=self.shared_load,
                                     share_decisions=cfg.broker.share_decisions and shares_prefix)
        listeners = [part for part in (self.prefix_share and self.prefix_share.publish,
                                       self.broker and self.broker.share_decisions and self.broker.on_routed) if part]
        self.router = Router.from_config(rc.with_(
            seed=rc.seed + process_index, learn_cost_model=learn,
            load_report_max_age_s=cfg.load_scrape.max_age_s if cfg.load_scrape.enabled else None),
            prefill_policy=prefill_policy, decode_policy=decode_policy,
            load_sources=LoadSources(peer=self.broker or self.shared_load), listeners=listeners,
            reject_listeners=[self.prefix_share.retract] if self.prefix_share is not None else ())
        #: the KV-event subscriber, started with the app when a worker has an events endpoint
        self.kv_subscriber: Any = None
        self.kv_delivery: Any = None  # its LoopDelivery
        #: several processes: the directory of the KV fan-out ring (balancer.service.processes.kv_fanout)
        self.kv_fanout_dir: str | None = None
        #: the control channel that applies admin changes in every process (several processes)
        self.admin: Any = None
        self.metrics = ServiceMetrics(multiprocess=self.multiprocess)
        #: deadline admission (balancer.service.admission_gate), or None (off: the default)
        self.admission = AdmissionGate(cfg.admission, self.router, self.metrics.registry, self.multiprocess) \
            if cfg.admission.enabled else None
        self.pool = WorkerPool(self.router, cfg.circuit_breaker, cfg.health_check,
                               on_breaker_change=lambda url, state: self.metrics.breaker_transitions.labels(
                                   url, state.name.lower()).inc())
        self.metrics.live_workers = lambda: self.pool.workers.keys()
        if cfg.health_check.enabled and cfg.circuit_breaker.enabled:  # the prober brings it back (_probe_loop)
            self.pool.early_probe = self._start_early_probe
        for w in cfg.workers:
            self.pool.add(w)
        if self.shared_load is not None:  # the configured workers' DP ranks take columns 0, 1, ...
            self.shared_load.add([rep for w in cfg.workers for rep in self.pool.workers[w.url].replicas])
        if not self.multiprocess:  # read at scrape time instead of set per request (no callbacks across processes)
            self.metrics.in_flight.set_function(lambda: self.in_flight)
        else:  # set once per event-loop iteration that changed it (ServiceMetrics.flush)
            self.metrics.in_flight_of = lambda: self.in_flight
        # loads tokenizer_path now, so that a bad file fails at startup (ValueError), not per request
        self.hasher = PromptHasher(cfg.router.block_size, cfg.chars_per_token, cfg.tokenizer_path, engine=cfg.chat_engine)
        self.hasher.on_inexact = lambda reason: self.metrics.prompt_inexact.labels(reason).inc()
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.in_flight: int = 0
        #: the loop-lag timer (started with the app, :meth:`start_lag_watch`)
        self.lag_watch: LoopWatch | None = None
        #: large bodies (>= OFFLOAD_BODY_BYTES) are parsed, checked and hashed in a worker process
        self.offload = BodyOffload(cfg.router.block_size, cfg.chars_per_token, cfg.tokenizer_path, cfg.lora_adapters,
                                   cfg.max_tokens_limit, cfg.default_max_tokens, cfg.chat_engine)
        #: the last /metrics render: (time.monotonic(), body), reused for large fleets (METRICS_CACHE_S)
        self.metrics_cache: tuple[float, bytes] | None = None
        self._large_bytes_since_gc = 0
        self._last_gc_s = float("-inf")
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def _probe_passes(self, w: Worker) -> bool:
        """One active health check of ``w``: whether ``GET health_check.endpoint`` answered 200
        within ``health_check.timeout_s``."""
        assert self.session is not None
        hc = self.cfg.health_check
        try:
            async with self.session.get(w.url + hc.endpoint, timeout=aiohttp.ClientTimeout(total=hc.timeout_s)) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def check_health_once(self, workers: list | None = None) -> list[Worker]:
        """One round of active health checks of every worker (or of ``workers``), concurrently;
        returns the workers whose check passed."""
        passed: list[Worker] = []

        async def one(w: Worker) -> None:
            ok = await self._probe_passes(w)
            self.pool.record_health(w, ok, time.monotonic())
            if ok:
                passed.append(w)

        await asyncio.gather(*(one(w) for w in (list(self.pool.workers.values()) if workers is None else workers)))
        return passed

    def _start_early_probe(self, w: Worker) -> None:
        """:attr:`WorkerPool.early_probe`: health-check ``w`` now, in the background (a request
        could not connect to it), and report the outcome to :meth:`WorkerPool.record_early_probe`."""
        proxy = self.proxy
        if proxy is None or self.session is None:
            self.pool.record_early_probe(w, None, time.monotonic())
            return

        async def probe() -> None:
            ok: bool | None = None
            try:
                ok = await self._probe_passes(w)
            except Exception:  # the session closed under it (shutdown): not run
                pass
            finally:  # cancelled at shutdown: None
                self.pool.record_early_probe(w, ok, time.monotonic())
            if ok and not w.caps.probed:  # review5 U7: its names now (the alias answer), not at the next round
                with contextlib.suppress(Exception):  # the session closed under it (shutdown)
                    await self.discover_engines([w])

        t = asyncio.get_running_loop().create_task(probe())
        proxy.background.add(t)
        t.add_done_callback(proxy.background.discard)

    async def discover_engines(self, workers: list[Worker] | None = None) -> None:
        """Probe the capabilities of every worker (or of ``workers``) not probed yet, concurrently
        (:mod:`balancer.service.engine_caps`); each engine found is logged once (process 0)."""
        session = self.session
        assert session is not None
        from balancer.service.engine_caps import EngineCaps, discover

        ws = [w for w in (list(self.pool.workers.values()) if workers is None else workers) if not w.caps.probed]
        limit = asyncio.Semaphore(64)  # engines probed at once (a router may hold thousands)

        async def one(w: Worker) -> EngineCaps:
            async with limit:
                return await discover(session, w.url, self.cfg.health_check.timeout_s)

        found = await asyncio.gather(*(one(w) for w in ws))
        for w, caps in zip(ws, found):
            if self.pool.get(w.url) is not w or not caps.probed:
                continue
            w.caps = caps
            self.pool.record_answer(w, time.monotonic())  # probed: some probe got an HTTP answer
            if self.process_index == 0:
                log.info("engine %s: %s, models %s, abort %s, metrics %s", w.url, caps.engine,
                         ", ".join(caps.served_models[:4]) or "not listed", caps.abort_endpoint or "none",
                         caps.metrics_endpoint or "none")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check.interval_s)
            try:
                await self.check_health_once()
                await self.discover_engines()  # those that did not answer before
            except Exception:  # never let the checker die
                log.exception("health check round failed")

    async def _probe_loop(self) -> None:
        """Every ``circuit_breaker.probe_interval_s``: health-check the workers that are not
        routable (breaker open, or unhealthy), so that one that recovered gets traffic back within
        about that long (a passing probe turns an open breaker half-open)."""
        while True:
            await asyncio.sleep(self.cfg.circuit_breaker.probe_interval_s)
            try:
                self.pool.refresh(time.monotonic())
                if (down := self.pool.to_probe()):
                    back = await self.check_health_once(down)
                    # review5 U7: an engine that came up after the router is probed for its names now
                    # (the alias answer needs its served name), not at the next health round (60 s)
                    if (fresh := [w for w in back if not w.caps.probed]):
                        await self.discover_engines(fresh)
            except Exception:  # never let the prober die
                log.exception("health probe round failed")

    def start_lag_watch(self) -> LoopWatch:
        """Start measuring how late the loop wakes a timer, into ``pdlb_event_loop_lag_seconds``
        (work that blocks the loop shows there, whoever did it), and the part of it the router
        process's own CPU time explains, into ``pdlb_event_loop_cpu_lag_seconds``, every
        :data:`LOOP_LAG_INTERVAL_S` while requests come or are in flight, backing off to
        :data:`LOOP_LAG_IDLE_INTERVAL_S` while quiet (:class:`balancer.service.loop_watch.LoopWatch`;
        :func:`_observed` kicks it per request)."""
        lag, cpu_lag = self.metrics.loop_lag, self.metrics.loop_cpu_lag

        def observe(lag_s: float, cpu_lag_s: float) -> None:
            lag.observe(lag_s)
            cpu_lag.observe(cpu_lag_s)

        watch = self.lag_watch = LoopWatch(observe, LOOP_LAG_INTERVAL_S, LOOP_LAG_IDLE_INTERVAL_S,
                                           busy=lambda: self.in_flight > 0)
        watch.start()
        return watch

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        if self.multiprocess:
            self.metrics.changed()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.multiprocess:
            self.metrics.changed()
        if self.in_flight == 0:
            self._idle.set()

    async def _gauge_loop(self) -> None:
        """Multiprocess mode: keep this process's per-worker gauges fresh for scrapes that another
        process answers."""
        while True:
            self.metrics.refresh_gauges(self.router, self.pool)
            self.write_kv_stats()
            await asyncio.sleep(MULTIPROCESS_GAUGE_REFRESH_S)

    def write_kv_stats(self) -> None:
        """Several processes: write this process's KV-event subscriber counters for the scrapes
        (:func:`balancer.service.kv_subscriber.write_stats_file`)."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if self.kv_subscriber is None or not self.multiprocess or not directory:
            return
        from balancer.service.kv_metrics import write_stats_file

        try:
            write_stats_file(directory, self.process_index, self.kv_subscriber, self.kv_delivery,
                             self.kv_subscriber.fanout_stats() if self.kv_fanout_dir is not None else None)
        except OSError as e:
            log.warning("KV event stats not written: %s", e)

    def after_large_body(self, nbytes: int, now_s: float | None = None) -> None:
        """A request with a large body (``nbytes``) ended: once such bodies add up to
        :data:`GC_AFTER_LARGE_BYTES` and a second has passed since the last time, collect the young
        generations now, so that a failed request's reference cycles (exceptions, tracebacks and
        frames that hold the body) free it within seconds rather than after thousands of other
        requests (``pdlb serve`` raises the young generation's threshold: :func:`~balancer.service.launch.tune_gc`),
        and hand the heap's free pages back to the OS (``malloc_trim``: the body arrived in 64 KB
        socket chunks, below the mmap threshold, and their pages stayed resident after the join)."""
        now_s = time.monotonic() if now_s is None else now_s
        self._large_bytes_since_gc += nbytes
        if self._large_bytes_since_gc >= GC_AFTER_LARGE_BYTES and now_s - self._last_gc_s >= 1.0:
            self._large_bytes_since_gc = 0
            self._last_gc_s = now_s
            gc.collect(1)
            trim_malloc()  # the body's socket chunks (64 KB each, from the heap) back to the OS

    def process_info(self) -> dict[str, int]:
        return {"index": self.process_index, "count": self.processes, "pid": os.getpid()}

    async def drain(self) -> None:
        """Refuse new requests and wait (at most ``shutdown_timeout_s``) for in-flight ones; one
        log line says what was left and how it ended."""
        self.draining = True
        t0, n = time.monotonic(), self.in_flight
        unreachable = [w.url for w in self.pool.workers.values() if w.unreachable_since_s is not None]
        try:
            await asyncio.wait_for(self._idle.wait(), self.cfg.shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("shutdown: %d requests still in flight after %.1f s", self.in_flight, self.cfg.shutdown_timeout_s)
        else:
            log.info("shutdown%s: %d requests were in flight, drained in %.1f s%s",
                     f" (process {self.process_index})" if self.multiprocess else "", n, time.monotonic() - t0,
                     f"; unreachable workers: {', '.join(unreachable)}" if unreachable else "")


SERVICE: web.AppKey[Service] = web.AppKey("pdlb_service", Service)
METRICS_CACHE_MIN_WORKERS = 64
METRICS_CACHE_S = 1.0
"""With more than ``METRICS_CACHE_MIN_WORKERS`` workers, ``GET /metrics`` answers scrapes within
``METRICS_CACHE_S`` of a render with that render (1,024 workers: ~300 KB, ~0.1 s to render), so a
flood of unauthenticated scrapes costs the event loop at most one render a second."""
MAX_ADMIN_BODY_BYTES = 64 * 1024
"""Largest ``POST /workers`` body (a worker's config is well under 1 KB); larger gets 413."""


# ---------------------------------------------------------------------- middleware
@web.middleware
async def _errors_and_metrics(request: web.Request, handler):  # noqa: ANN001, ANN202
    route = request.match_info.route.resource
    if route is not None:
        endpoint = route.canonical
    else:  # no route: a known path with another method (405) keeps its name; anything else is one label
        endpoint = request.path if any(r.canonical == request.path for r in request.app.router.resources()) \
            else "unmatched"
    return await _observed(request.app[SERVICE], request, endpoint, handler)


async def _observed(svc: Service, request: web.Request, endpoint: str, handler, *args):  # noqa: ANN001, ANN002, ANN202
    """``handler(request, *args)`` with errors as JSON and the request counted in the metrics under
    ``endpoint`` (the middleware of every route, and the generation endpoints' fast path)."""
    t0 = time.monotonic()
    watch = svc.lag_watch
    if watch is not None:  # the loop-lag timer's interval: the usual one while requests come
        watch.kick()
    status = 500
    try:
        resp = await handler(request, *args)
        # a stream that failed after its 200 headers says so in the request (a plain response never)
        if type(resp) is web.Response:
            status = resp.status
            headers = resp.headers
            if "X-Request-Id" not in headers:
                headers["X-Request-Id"] = _answer_id(request, svc)
            headers[hdrs.SERVER] = SERVER_HEADER
        else:
            status = request.get(STREAM_STATUS, resp.status)
            if not resp.prepared:
                resp.headers[hdrs.SERVER] = SERVER_HEADER
        return resp
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        msg = {404: f"no route for {request.method} {request.path}", 405: f"method {request.method} not allowed on {request.path}",
               413: f"request body too large (limit {svc.cfg.max_body_bytes} bytes)"}.get(e.status, e.reason)
        out = error_response(e.status, msg)
        out.headers["X-Request-Id"] = _answer_id(request, svc)
        out.headers[hdrs.SERVER] = SERVER_HEADER
        if hdrs.ALLOW in e.headers:  # a 405 names the methods the resource takes (RFC 9110 §15.5.6)
            out.headers[hdrs.ALLOW] = e.headers[hdrs.ALLOW]
        return out
    except asyncio.CancelledError:
        status = 499  # client closed the connection
        raise
    except Exception:  # a bug: its traceback, at most once per 10 s (clients could repeat it at will)
        if svc.client_errors_log.log(logging.ERROR, "unhandled", time.monotonic(), "unhandled error on %s %s",
                                 request.method, request.path[:200]):
            log.error("traceback of the error above", exc_info=True)
        out = error_response(500, "internal router error")
        out.headers["X-Request-Id"] = _answer_id(request, svc)
        out.headers[hdrs.SERVER] = SERVER_HEADER
        return out
    finally:
        svc.metrics.request_done(endpoint, status, time.monotonic() - t0)


def new_request_id() -> str:
    """A new id for an answer of the router's own: ``pdlb-<24 hex digits>`` (96 bits from the OS's
    random source), the format of :meth:`Proxy.new_upstream_id` (docs/serving.md, "Request ids")."""
    return f"pdlb-{secrets.token_hex(12)}"


def _answer_id(request: web.Request, svc: Service) -> str:
    """The ``X-Request-Id`` of an answer that has none yet (pdlb's own answers: errors before
    routing, ``/health``, ``/metrics``...): the client's ``X-Request-Id`` when it is a valid one
    (1..256 printable characters), else a new router id."""
    given = request.headers.get("X-Request-Id")
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return new_request_id()


# ---------------------------------------------------------------------- handlers
async def _read_json(request: web.Request) -> dict[str, Any] | web.Response:
    body, _ = await _read_json_raw(request, request.app[SERVICE], MAX_ADMIN_BODY_BYTES)
    return body


def _declared_too_large(request: web.Request, svc: Service, limit: int | None = None) -> web.Response | None:
    """413 at once for a request whose ``Content-Length`` is over ``max_body_bytes`` (or the
    route's lower ``limit``; without it, the router would wait up to ``body_read_timeout_s`` for a
    body it is going to refuse, holding the connection), on a connection closed after the answer
    (its body is never read)."""
    declared = request.content_length
    limit = svc.cfg.max_body_bytes if limit is None else min(limit, svc.cfg.max_body_bytes)
    if declared is None or declared <= limit:
        return None
    resp = error_response(413, f"request body too large (limit {limit} bytes)")
    resp.force_close()
    return resp


def _compressed(request: web.Request) -> web.Response | None:
    """415 for a request body with a ``Content-Encoding`` other than ``identity`` (gzip, deflate,
    br, anything), on a connection closed after the answer (its body is never read): the router
    never inflates a client's body, as Envoy and NGINX do not by default (a 30 KB gzip inflates to
    a 30 MiB prompt; inflating is CPU and memory a client spends of the router's). ``pdlb serve``'s
    runner does not decompress request bodies either (:func:`make_runner`)."""
    enc = request.headers.get(hdrs.CONTENT_ENCODING)
    if enc is None or enc.strip().lower() in ("", "identity"):
        return None
    resp = error_response(415, f"Content-Encoding {enc[:40]!r} is not accepted: send the request body uncompressed")
    resp.headers["Accept-Encoding"] = "identity"
    resp.force_close()
    return resp


async def _expect_continue(request: web.Request) -> None:
    """The generation and admin routes' ``Expect`` handler: no ``100 Continue`` for a declared body
    over ``max_body_bytes`` (the handler then answers 413 at once, through the middleware, and the
    client never sends the body); otherwise as aiohttp's default handler: ``100 Continue`` for
    ``100-continue`` on HTTP/1.1, 417 for another expectation."""
    if _declared_too_large(request, request.app[SERVICE]) is not None or _compressed(request) is not None:
        return
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version == aiohttp.HttpVersion11:
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect[:100]}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response's own bytes start after it


class _CloseAfterResponse(web.Response):
    """A response after which the connection is closed at once: ``Connection: close``, and no
    lingering read of the request body the client is still (slowly) sending (aiohttp reads and
    drops it up to 10 s otherwise, holding the connection's slot: issue 25 review finding F3)."""

    _close_request: web.BaseRequest | None = None

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(data)
        request, self._close_request = self._close_request, None
        if request is not None and request.protocol is not None:
            request.protocol.force_close()  # the answer is written: close, skip the lingering read


def _closing(request: web.Request, svc: Service, resp: web.Response) -> web.Response:
    """``resp`` (a JSON error) as a :class:`_CloseAfterResponse` for ``request`` (RFC 9110 §15.5.9:
    a 408 closes the connection), with its ``X-Request-Id`` (the middleware adds it to plain
    :class:`web.Response` objects only)."""
    out = _CloseAfterResponse(body=resp.body, status=resp.status, content_type=resp.content_type)
    out.headers["X-Request-Id"] = _answer_id(request, svc)
    out._close_request = request
    out.force_close()  # Connection: close
    return out


async def _read_raw(request: web.Request, svc: Service, limit: int | None = None) -> bytes | web.Response:
    """The raw body, or the 408 / 413 / 415 response (``limit``: a lower bound than
    ``max_body_bytes`` for this route, in bytes)."""
    too_large = _declared_too_large(request, svc, limit)
    if too_large is not None:
        return too_large
    if (refused := _compressed(request)) is not None:
        return refused
    content = request.content
    try:  # raises HTTPRequestEntityTooLarge (413) over client_max_size (a chunked body, say)
        if content.is_eof():  # the whole body is here already (most requests): no wait, no timer
            # the buffered chunks as they are (one join at most), not request.read()'s two copies
            raw = content.read_nowait()
            if len(raw) > svc.cfg.max_body_bytes:  # what request.read() checks (client_max_size)
                return error_response(413, f"request body too large (limit {svc.cfg.max_body_bytes} bytes)")
        else:
            async with asyncio.timeout(svc.cfg.body_read_timeout_s):
                raw = await request.read()
    except TimeoutError:
        return _closing(request, svc, error_response(408, "request body not received within body_read_timeout_s="
                                                     f"{svc.cfg.body_read_timeout_s:g} s", "timeout"))
    if limit is not None and len(raw) > limit:
        return error_response(413, f"request body too large (limit {limit} bytes)")
    return raw


async def _read_json_raw(request: web.Request, svc: Service, limit: int | None = None
                         ) -> tuple[dict[str, Any] | web.Response, bytes]:
    """The parsed JSON object body (or the 400 / 408 / 413 / 415 response) and the raw bytes."""
    raw = await _read_raw(request, svc, limit)
    if type(raw) is not bytes:
        assert isinstance(raw, web.Response)
        return raw, b""
    return _parse_json_object(raw), raw


def _parse_json_object(raw: bytes) -> dict[str, Any] | web.Response:
    """The JSON object of ``raw`` (on the event loop: bodies under ``OFFLOAD_BODY_BYTES``), or the 400."""
    try:
        body = parse_json_body(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return error_response(400, f"invalid JSON body: {str(e)[:200]}")
    if not isinstance(body, dict):
        return error_response(400, "the JSON body must be an object")
    if len(body) > MAX_TOP_LEVEL_FIELDS:
        return error_response(400, f"the JSON body has more than {MAX_TOP_LEVEL_FIELDS} top-level fields")
    return body


async def _generate(request: web.Request, svc: Service, endpoint: str) -> web.StreamResponse:
    """A generation request on ``endpoint`` (a value of :data:`ENDPOINTS`)."""
    if endpoint == "generate" and svc.cfg.pd_protocol == "vllm":
        return error_response(404, "/generate is SGLang's native API; not available with pd_protocol 'vllm'")
    if svc.draining:
        return error_response(503, "the router is shutting down")
    # the lean front serves only bodies it holds whole, under max_body_bytes and not encoded (see
    # balancer.service.lean_front), where _read_raw would return them as they are
    raw = request.read_nowait() if type(request) is LeanRequest else await _read_raw(request, svc)
    if type(raw) is not bytes:  # the error response (an exact type check: cheaper than isinstance)
        assert isinstance(raw, web.Response)
        return raw
    pre: Analysis | None = None
    if len(raw) >= OFFLOAD_BODY_BYTES:  # parsed, checked and hashed in the worker process
        svc.enter()  # counted in flight (a drain waits for it) from here
        try:
            out = await svc.offload.analyze(raw, endpoint, request.headers.get("X-Request-Id"))
        except BaseException:
            svc.leave()
            raise
        if not isinstance(out, Analysis):
            svc.leave()
            if out is None:
                resp = error_response(503, f"the router is busy parsing large request bodies (at most {MAX_PENDING} "
                                           "at once): retry shortly")
                resp.headers["Retry-After"] = "1"
                return resp
            return error_response(400, out)
        pre = out
        body: dict[str, Any] | web.Response = pre.body
        if pre.raw is not None:
            raw = pre.raw
    else:
        body = _parse_json_object(raw)
        if type(body) is not dict:
            assert isinstance(body, web.Response)
            return body
        svc.enter()
    assert svc.proxy is not None and type(body) is dict
    try:
        return await svc.proxy.handle(request, endpoint, body, raw, pre)
    finally:
        svc.leave()
        if pre is not None:  # once this handler's frame (which holds the body) is gone
            asyncio.get_running_loop().call_later(0.2, svc.after_large_body, len(raw))


def _fast_path(app: web.Application, fallback):  # noqa: ANN001, ANN202
    """The server's request handler: ``POST`` to a generation endpoint (no ``Expect`` header) goes
    straight to :func:`_generate` through :func:`_observed`, as the app would send it (same
    answers, same metrics), without the app's per-request route resolution and middleware chain
    (about 6% of the router's CPU per request); every other request goes to ``fallback`` (the
    app's own handler)."""
    svc = app[SERVICE]

    async def handle(request: web.Request) -> web.StreamResponse:
        endpoint = ENDPOINTS.get(request.path) if request.method == "POST" else None
        if endpoint is None or hdrs.EXPECT in request.headers:
            return await fallback(request)
        return await _observed(svc, request, request.path, _generate, svc, endpoint)

    return handle


async def _health(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    svc.pool.refresh(time.monotonic())
    # routable and reachable: a worker whose connections are refused (marked by the proxy until a
    # request or health check gets through) serves nobody, even before its breaker opens
    counts = {r.value: sum(1 for w in svc.pool.routable((r,)) if w.unreachable_since_s is None) for r in Role}
    ok = (counts["decode"] + counts["mixed"]) > 0 and not svc.draining
    # PD with prefill workers registered but none routable: requests get 503 (see proxy)
    no_prefill = svc.cfg.pd_protocol != "none" and svc.pool.num_prefill > 0 and counts["prefill"] == 0
    ok = ok and not no_prefill
    status = "draining" if svc.draining else ("ok" if ok else ("no_prefill" if no_prefill else "unavailable"))
    body = {"status": status, "routable_workers": counts, "in_flight": svc.in_flight, "process": svc.process_info()}
    if svc.kv_subscriber is not None:  # the KV-event feed: routing goes on without it, on a view that ages
        body["kv_events"] = svc.kv_subscriber.health()
    return web.json_response(body, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    now = time.monotonic()
    cached = svc.metrics_cache
    if cached is not None and now - cached[0] < METRICS_CACHE_S and len(svc.pool.workers) > METRICS_CACHE_MIN_WORKERS:
        body = cached[1]
    else:
        svc.write_kv_stats()
        body = svc.metrics.render(svc.router, svc.pool)
        svc.metrics_cache = (now, body)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _models(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if svc.cfg.served_model_name:
        return web.json_response({"object": "list", "data": [
            {"id": svc.cfg.served_model_name, "object": "model", "created": 0, "owned_by": "pdlb"}]})
    assert svc.session is not None
    for w in svc.pool.routable((Role.DECODE, Role.MIXED, Role.PREFILL)):
        try:
            async with svc.session.get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    listing = await r.json()
                    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
                        return web.json_response(listing)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            continue
    # no engine listed its models (transformers serve answers 500 without a Hugging Face cache):
    # the names the workers were configured with, else those discovered at registration
    names = dict.fromkeys(n for w in svc.pool.routable((Role.DECODE, Role.MIXED, Role.PREFILL))
                          for n in w.model_names())
    if names:
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "pdlb"} for n in names]})
    return error_response(503, "no routable worker listed its models (GET /v1/models) and none has a configured "
                               "served_model_name (worker spec model=NAME, or --served-model-name)")


def is_loopback(peer: str | None) -> bool:
    """Whether a peer address is loopback: ``127.0.0.0/8``, ``::1`` or ``::ffff:127.x.y.z``.
    Behind a reverse proxy on the same host every client looks like loopback: configure
    ``admin_api_key`` there."""
    if not peer:
        return False
    try:
        addr = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def admin_denied(request: web.Request, api_key: str | None) -> web.Response | None:
    """``None`` if the request may use the admin API, else the 401/403 error response."""
    if api_key:
        given = request.headers.get("Authorization", "")
        # header bytes that are not UTF-8 arrive as surrogates (aiohttp decodes with
        # surrogateescape): encoded back the same way, any malformed credential is a plain 401
        try:
            ok = hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {api_key}".encode())
        except UnicodeError:  # lone surrogates from another decoder: not the key either
            ok = False
        if not ok:
            return error_response(401, "admin API: missing or wrong bearer token", "authentication_error")
        return None
    if is_loopback(request.remote):
        return None
    return error_response(403, "admin API is loopback-only when no admin_api_key is configured", "permission_error")


def _no_admin_channel(svc: Service) -> web.Response | None:
    """``None`` if workers may be added/removed, else the 409: several processes (an app built
    by hand with ``processes`` > 1) but no control channel to reach the others."""
    if svc.multiprocess and svc.admin is None:
        return error_response(409, f"this router runs {svc.processes} processes without a control channel between "
                                   "them (not started by pdlb serve); workers cannot be added or removed at run "
                                   "time: change the config and restart", "conflict")
    return None


async def apply_admin_change(svc: Service, op: str, payload: Any, columns: list[int]) -> None:
    """Apply one admin change to this process: ``op`` ``"add"`` (``payload``: a worker config
    dict; ``columns``: its DP ranks' shared-load columns, several processes only) or ``"remove"``
    (``payload``: the URL).

    Raises:
        AdminRefused: 409 (already registered, over the limits) or 404 (unknown URL).
    """
    from balancer.service.processes.shared_admin import AdminRefused

    if op == "add":
        wcfg = WorkerConfig.model_validate(payload)
        try:
            w = svc.pool.add(wcfg)
        except ValueError as e:
            raise AdminRefused(409, str(e)) from None
        try:
            if svc.shared_load is not None:
                svc.shared_load.add(dict(zip(w.replicas, columns)))
            await _follow_kv_events(svc, wcfg)
            if svc.session is not None and svc.cfg.health_check.enabled:
                t = asyncio.create_task(svc.discover_engines([w]))
                if svc.proxy is not None:
                    svc.proxy.background.add(t)
                    t.add_done_callback(svc.proxy.background.discard)
        except BaseException:  # all or nothing here too: no half-registered worker stays
            if svc.shared_load is not None:
                svc.shared_load.remove(w.replicas)
            svc.pool.remove(w.url)
            raise
    elif op == "remove":
        gone = svc.pool.get(str(payload).rstrip("/"))
        if gone is None:
            raise AdminRefused(404, f"no worker {payload}")
        if svc.shared_load is not None:
            svc.shared_load.remove(gone.replicas)
        svc.pool.remove(gone.url)
        if svc.kv_subscriber is not None:
            svc.kv_subscriber.remove_replicas(list(gone.replicas))
    else:
        raise AdminRefused(400, f"unknown admin change {op!r}")


async def _admin_change(svc: Service, op: str, payload: Any) -> web.Response | None:
    """Apply a change here, or in every process through the parent; ``None`` or the refusal."""
    from balancer.service.processes.shared_admin import AdminRefused

    try:
        if svc.admin is not None:
            await svc.admin.request(op, payload)
        else:
            await apply_admin_change(svc, op, payload, [])
    except AdminRefused as e:
        kind = {404: "not_found", 409: "conflict"}.get(e.status)
        return error_response(e.status, e.message, kind)
    return None


async def _list_workers(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if (denied := admin_denied(request, svc.cfg.admin_api_key)) is not None:
        return denied
    svc.pool.refresh(time.monotonic())
    out = []
    for w in svc.pool.workers.values():
        d = w.describe()
        d["in_flight"] = sum(svc.router.load.get(r).num_requests for r in w.replicas)
        out.append(d)
    return web.json_response({"workers": out, "process": svc.process_info()})


async def _add_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if (denied := admin_denied(request, svc.cfg.admin_api_key)) is not None:
        return denied
    if (refused := _no_admin_channel(svc)) is not None:
        return refused
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    try:
        wcfg = WorkerConfig.model_validate(body)
    except ValidationError as e:  # one readable line: "field: reason; field: reason"
        return error_response(400, f"invalid worker: {format_validation_error(e, model=WorkerConfig)}")
    if wcfg.role == "prefill" and svc.cfg.pd_protocol == "none":
        return error_response(400, "pd_protocol 'none' takes no prefill workers")
    if svc.pool.get(wcfg.url) is not None:  # answered here (every process has the same workers)
        return error_response(409, f"worker {wcfg.url} is already registered", "conflict")
    if (refused := await _admin_change(svc, "add", wcfg.model_dump())) is not None:
        return refused
    w = svc.pool.get(wcfg.url)
    assert w is not None  # applied here before the change was confirmed
    out = w.describe()
    if (warning := bootstrap_warning(svc.cfg.pd_protocol, wcfg)) is not None:
        log.warning("%s", warning.removeprefix("warning: "))
        out["warnings"] = [warning.removeprefix("warning: ")]
    if svc.multiprocess:
        out["processes"] = svc.processes  # added in every one of them
    return web.json_response(out, status=201)


async def _remove_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if (denied := admin_denied(request, svc.cfg.admin_api_key)) is not None:
        return denied
    if (refused := _no_admin_channel(svc)) is not None:
        return refused
    url = request.query.get("url")
    if not url:
        return error_response(400, "query parameter 'url' is required")
    w = svc.pool.get(url.rstrip("/"))
    if w is None:
        return error_response(404, f"no worker {url}", "not_found")
    if (refused := await _admin_change(svc, "remove", w.url)) is not None:
        return refused
    return web.json_response({"removed": w.url})


async def _follow_kv_events(svc: Service, wcfg: WorkerConfig) -> None:
    """A worker added at run time with an ``events`` endpoint: subscribe to it (starting the
    subscriber if it is the first), off the event loop (the child process takes a second to start)."""
    if wcfg.events is None or svc.cfg.router.index_mode == "approximate":
        return
    from balancer.service.kv_subscriber import sources_for_worker

    loop = asyncio.get_running_loop()
    if svc.kv_subscriber is not None:
        svc.kv_subscriber.add_sources(sources_for_worker(wcfg.url, wcfg.dp_size, wcfg.events, wcfg.replay))
        return
    _install_kv_feed(svc, await loop.run_in_executor(None, _start_kv_feed, svc, [wcfg], loop))


def _start_kv_feed(svc: Service, workers: list, loop: asyncio.AbstractEventLoop) -> tuple[Any, Any] | None:
    """The KV-event feed of ``workers`` (blocking: a subscriber process takes a second to start):
    several processes with a shared directory, one subscriber in process 0 fanned out to all of
    them (:mod:`balancer.service.processes.kv_fanout`); else this process's own subscriber."""
    if svc.kv_fanout_dir is not None:
        from balancer.service.processes.kv_fanout import start_fanout

        fan = start_fanout(workers, svc.router, svc.cfg.router.block_size, svc.cfg.kv_events, svc.kv_fanout_dir,
                           svc.process_index)
        return None if fan is None else (fan, fan)
    from balancer.service.kv_subscriber import start_for_service

    return start_for_service(workers, svc.router, svc.cfg.router.block_size, loop, svc.cfg.kv_events)


def _install_kv_feed(svc: Service, started: tuple[Any, Any] | None) -> None:
    """In the event loop: keep the feed :func:`_start_kv_feed` started and export its counters."""
    if started is None:
        return
    svc.kv_subscriber, svc.kv_delivery = started
    if svc.kv_fanout_dir is not None:
        started[0].follower.start()
        if started[0].owner:
            started[0].supervise()
    else:  # one router process: its subscriber is checked and started again if it dies
        started[0].supervise()
    if not svc.multiprocess:  # several processes: their stats files (Service.write_kv_stats)
        from balancer.service.kv_metrics import KvEventsCollector

        svc.metrics.registry.register(KvEventsCollector(*started))


# ---------------------------------------------------------------------- factory
def make_runner(app: web.Application, cfg: ServiceConfig) -> AppServerRunner:
    """The runner for ``app`` (:class:`~balancer.service.app_server.AppServerRunner`: used as an
    :class:`aiohttp.web.AppRunner`), whose server takes the generation endpoints' fast path
    (:func:`_fast_path`): handler cancellation (a client disconnect aborts both PD legs), no access
    log, ``client_idle_timeout_s`` as the keep-alive timeout (it also closes a connection whose
    headers never complete: slowloris), no decompression of request bodies (a compressed one gets
    415 unread, :func:`_compressed`), graceful shutdown for ``shutdown_timeout_s``. Call it inside
    the serving event loop; call :func:`limit_connections` and :func:`json_parser_errors` after
    ``setup()``."""
    runner = AppServerRunner(app, lambda app_handler: _fast_path(app, app_handler), handler_cancellation=True,
                             access_log=None, shutdown_timeout=cfg.shutdown_timeout_s,
                             keepalive_timeout=cfg.client_idle_timeout_s, auto_decompress=False)
    if cfg.http_front == "lean":
        runner.router_server.serve_lean(_lean_front(app, cfg))
    return runner


def _lean_front(app: web.Application, cfg: ServiceConfig) -> Callable[[RouterServer], LeanProtocol]:
    """The protocol factory of ``http_front: lean`` (:mod:`balancer.service.lean_front`): the
    generation requests it serves go to :func:`_generate` through :func:`_observed`, as the
    fast path sends them (same answers, same metrics)."""
    svc = app[SERVICE]
    routes = {path.encode(): endpoint for path, endpoint in ENDPOINTS.items()}
    max_body = min(OFFLOAD_BODY_BYTES, cfg.max_body_bytes + 1)  # larger: aiohttp's path (413, offload)
    idle_s, body_s = cfg.client_idle_timeout_s, cfg.body_read_timeout_s

    def handle(request: LeanRequest, endpoint: str) -> Awaitable[web.StreamResponse]:
        # _observed's coroutine itself, awaited by the lean front: one coroutine fewer per request
        return _observed(svc, request, request.path, _generate, svc, endpoint)  # type: ignore[arg-type]

    def late_body(path: str, headers: Any) -> web.Response:  # as _read_raw's 408, counted as the middleware does
        out = error_response(408, f"request body not received within body_read_timeout_s={body_s:g} s", "timeout")
        given = headers.get("X-Request-Id")
        out.headers["X-Request-Id"] = given if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable() \
            else new_request_id()
        out.headers[hdrs.SERVER] = SERVER_HEADER
        svc.metrics.request_done(path, 408, body_s)
        return out

    def factory(server: RouterServer) -> LeanProtocol:
        return LeanProtocol(server, handle, routes, max_body_bytes=max_body, idle_timeout_s=idle_s,
                            body_timeout_s=body_s, body_timeout_answer=late_body)

    return factory


class _JsonErrorHandler(web.RequestHandler):
    """aiohttp's connection handler, answering HTTP parser errors (bad request line, headers,
    chunked encoding) with an OpenAI-style JSON error instead of text/plain, counting them in
    ``pdlb_http_parse_errors_total{status}`` and logging them as one short line per 10 s at most
    (:attr:`Service.client_errors_log`), not one traceback each. :func:`json_parser_errors` serves
    each app's connections with a subclass bound to its :class:`Service` (:attr:`service`)."""

    #: the app's service (its log limiter and metrics); set on the subclass made per server
    service: Service | None = None
    #: the log limiter when there is no service
    errors_log = RateLimitedLog(log, interval_s=10.0)

    def _errors_log(self) -> RateLimitedLog:
        return self.service.client_errors_log if self.service is not None else self.errors_log

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        now = time.monotonic()
        limiter = self._errors_log()
        if isinstance(exc, HttpProcessingError):  # the client's malformed request: no traceback
            limiter.log(logging.INFO, "http_parser", now, "malformed HTTP request: %s",
                        str(exc.message if isinstance(exc.message, str) else exc).replace("\n", " ")[:200])
        elif limiter.log(logging.ERROR, "connection_handler", now, "%s",
                         str(args[0] if args else "error in the connection handler")[:200]):
            self.logger.error("traceback of the error above", exc_info=exc)

    def handle_error(self, request, status=500, exc=None, message=None):  # noqa: ANN001, ANN201
        resp = super().handle_error(request, status, exc, message)  # logs; raises if already sent
        text = (message or (exc.message if isinstance(getattr(exc, "message", None), str) else "") or
                f"HTTP {status}").replace("\n", " ")[:300]
        out = error_response(status, f"malformed HTTP request: {text}" if status < 500 else "internal router error")
        out.headers["X-Request-Id"] = new_request_id()  # no request to take an id from
        out.headers[hdrs.SERVER] = SERVER_HEADER
        out.force_close()
        del resp
        svc = self.service
        if svc is not None and status < 500:
            svc.metrics.count(svc.metrics.http_parse_errors, str(status))
        return out


def _router_server(runner: web.BaseRunner) -> RouterServer:
    server = runner.server
    assert server is not None, "call after runner.setup()"
    if not isinstance(server, RouterServer):
        raise TypeError(f"{type(runner).__name__} does not serve with a RouterServer: make it with make_runner()")
    return server


def json_parser_errors(runner: web.BaseRunner) -> None:
    """Make ``runner``'s server (:func:`make_runner`'s) answer HTTP parser errors with JSON on the
    connections it accepts from now on (call after ``setup()``).

    Raises:
        TypeError: ``runner`` was not made by :func:`make_runner`."""
    server = _router_server(runner)
    svc = _service_of(runner)
    server.use_connection_class(type("JsonErrorHandler", (_JsonErrorHandler,), {"service": svc})
                                if svc is not None else _JsonErrorHandler)


def _service_of(runner: web.BaseRunner) -> Service | None:
    """The :class:`Service` of ``runner``'s app (None: an app :func:`create_app` did not make)."""
    app = runner.app if isinstance(runner, AppServerRunner) else None
    return app.get(SERVICE) if app is not None else None


def limit_connections(runner: web.BaseRunner, max_connections: int) -> None:
    """Close client connections beyond ``max_connections`` as they are accepted (logged once per
    burst at warning level, each counted in ``pdlb_client_connections_rejected_total{reason=
    "max_connections"}``; call after ``setup()``).

    Raises:
        TypeError: ``runner`` was not made by :func:`make_runner`.
        ValueError: ``max_connections`` < 1."""
    server = _router_server(runner)
    svc = _service_of(runner)
    on_refused = None if svc is None else functools.partial(
        svc.metrics.count, svc.metrics.connections_rejected, "max_connections")
    server.limit_connections(max_connections, on_refused)


def make_client_session(cfg: ServiceConfig) -> aiohttp.ClientSession:
    """The one HTTP client session to the workers: unlimited keep-alive connections (60 s idle),
    no cookie jar (engines set none; the jar would be consulted per request), no
    ``Accept-Encoding`` and no decompression (engine answers are relayed as sent), and only a
    connect timeout (the request and first-byte timeouts are the proxy's)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, skip_auto_headers=("Accept-Encoding",))


def make_upstream_client(cfg: ServiceConfig) -> UpstreamClient | None:
    """The engine legs' lean client (``upstream_client: lean``), with the aiohttp session's pool
    semantics: no limit on connections per worker (the connector's ``limit=0``), 60 s idle
    keep-alive, ``connect_timeout_s``; ``None`` for ``aiohttp`` (the legs then use the session)."""
    if cfg.upstream_client != "lean":
        return None
    return UpstreamClient(connect_timeout_s=cfg.connect_timeout_s, keepalive_s=60.0, limit_per_host=0)


def _start_engine_feeds(svc: Service, shared_dir: str | None = None) -> list[asyncio.Task]:
    """Start what feeds the router from the engines: the KV-event subscriber (index_mode events
    or hybrid, workers with ``events``; with several processes and their shared directory
    ``shared_dir``, one for all of them, :mod:`balancer.service.processes.kv_fanout`) and the load scraper
    (``load_scrape.enabled``)."""
    cfg = svc.cfg
    tasks: list[asyncio.Task] = []
    if cfg.router.index_mode != "approximate":
        svc.kv_fanout_dir = shared_dir if svc.multiprocess else None
        _install_kv_feed(svc, _start_kv_feed(svc, cfg.workers, asyncio.get_running_loop()))
    if cfg.load_scrape.enabled:
        from balancer.service.load_scraper import scrape_loop

        assert svc.session is not None
        ls = cfg.load_scrape
        tasks.append(asyncio.create_task(scrape_loop(
            svc.session, svc.router, lambda: [(w.url, w.cfg.dp_size) for w in svc.pool.workers.values()],
            ls.interval_s, ls.timeout_s)))
    return tasks


def create_app(cfg: ServiceConfig, process_index: int = 0, shared_load: str | None = None,
               shared_prefix_dir: str | None = None, control: Any = None) -> web.Application:
    """Build the router app for ``cfg`` (background health checks start with the app);
    ``process_index``: this process's number when ``cfg.processes`` > 1; ``shared_load``: the
    name of the in-flight load block the processes share (:mod:`balancer.service.processes.shared_load`,
    :data:`~balancer.service.workers.MAX_REPLICAS` columns, the configured workers' DP ranks
    first); ``shared_prefix_dir``: where the processes' approximate-index rings live
    (:mod:`balancer.service.processes.shared_prefix`); ``control``: the duplex pipe to the parent that
    carries admin changes to every process (:mod:`balancer.service.processes.shared_admin`).

    Raises:
        ValueError: ``cfg.tokenizer_path`` is missing or not a valid ``tokenizer.json``;
            ``process_index`` not in ``0..cfg.processes - 1``.
        RuntimeError: ``cfg.tokenizer_path`` is set but ``tokenizers`` is not installed.
    """
    svc = Service(cfg, process_index, shared_load=shared_load, shared_prefix_dir=shared_prefix_dir)
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[_errors_and_metrics])
    app[SERVICE] = svc

    async def lifecycle(app: web.Application):  # noqa: ANN202
        if svc.shared_load is not None:  # its row written, the others' read, once per event-loop pass
            svc.shared_load.coalesce_in(asyncio.get_running_loop())
        svc.session = make_client_session(cfg)
        upstream = make_upstream_client(cfg)
        svc.proxy = Proxy(cfg, svc.router, svc.pool, svc.metrics, svc.session, svc.hasher, upstream)
        svc.proxy.admission = svc.admission
        if svc.admission is not None and svc.multiprocess and shared_prefix_dir is not None:
            svc.admission.share_across(shared_prefix_dir, svc.processes, process_index)  # fair shares for the host
        loops = [asyncio.create_task(svc._health_loop())] if cfg.health_check.enabled else []
        lag_watch = svc.start_lag_watch()
        if cfg.health_check.enabled:  # without health checks pdlb sends engines nothing but requests
            loops.append(asyncio.create_task(svc.discover_engines()))
        if cfg.health_check.enabled and cfg.circuit_breaker.enabled:
            loops.append(asyncio.create_task(svc._probe_loop()))
        if svc.multiprocess:
            loops.append(asyncio.create_task(svc._gauge_loop()))
        loops += _start_engine_feeds(svc, shared_prefix_dir)
        share = svc.prefix_share
        if share is not None:
            share.start(svc.router.record_routed, svc.router.forget_recorded)
            svc.metrics.prefix_share, svc.metrics.process_index = share, process_index
        broker = None
        if svc.broker is not None:  # routers on several hosts
            from balancer.service.broker_sync import start_for_service

            broker = start_for_service(svc)
        if control is not None:
            from balancer.service.processes.shared_admin import AdminChannel

            svc.admin = AdminChannel(control, lambda op, payload, cols: apply_admin_change(svc, op, payload, cols))
            svc.admin.start()
        yield
        if svc.admission is not None:
            svc.admission.close()
        if broker is not None:
            await broker.close()
        if svc.admin is not None:
            await svc.admin.close()
        if share is not None:
            svc.metrics.prefix_share = None
            await share.close()
        lag_watch.stop()
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for t in list(svc.proxy.background):
            t.cancel()
        if svc.kv_subscriber is not None:
            await asyncio.get_running_loop().run_in_executor(None, svc.kv_subscriber.stop)
        if svc.shared_load is not None:
            svc.shared_load.close()
        svc.offload.close()
        svc.metrics.flush()  # the last loop iteration's counts
        await svc.session.close()
        if upstream is not None:
            await upstream.close()

    async def on_shutdown(app: web.Application) -> None:
        await svc.drain()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    for path, endpoint in ENDPOINTS.items():
        async def generate(request: web.Request, endpoint: str = endpoint) -> web.StreamResponse:
            return await _generate(request, svc, endpoint)

        app.router.add_post(path, generate, expect_handler=_expect_continue)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker, expect_handler=_expect_continue)
    app.router.add_delete("/workers", _remove_worker)
    if memory_debug.enabled():
        app.router.add_get("/debug/memory", _debug_memory)
    return app


async def _debug_memory(request: web.Request) -> web.Response:
    """``GET /debug/memory`` (only with ``PDLB_DEBUG_MEMORY=1``; admin API's access rules):
    :func:`balancer.service.memory_debug.memory_report`."""
    if (denied := admin_denied(request, request.app[SERVICE].cfg.admin_api_key)) is not None:
        return denied
    q = request.query
    trace = q.get("trace", "0")
    report = memory_debug.memory_report(collect=q.get("collect") == "1", trim=q.get("trim") == "1",
                                        garbage=q.get("garbage") == "1", trace_frames=int(trace) if trace.isdigit() else 0)
    report["prefix_index_blocks"] = request.app[SERVICE].router.index.num_blocks()  # a bounded cache, not a leak
    return web.json_response(report)
