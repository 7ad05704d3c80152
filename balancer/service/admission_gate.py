"""Deadline admission in the live router: the policy core's queue with asyncio waiters.

:class:`AdmissionGate` wraps :class:`balancer.deadline_admission.DeadlineAdmission` (the same object
the simulator drives, :mod:`sim.run.deadline_gate`) with ``time.monotonic()`` as its clock. The proxy
(:meth:`balancer.service.proxy.Proxy.handle`) awaits :meth:`AdmissionGate.admit` once a request is
parsed and checked, before routing: it returns at once when the gate is open, waits while the
request is held, and answers **429** with ``Retry-After`` (whole seconds) when the request is shed.
The queue is re-checked when a request finishes and at least every ``drain_interval_s`` while
something is held (deadlines pass, prefills complete). Every held request ends dispatched, shed
(429) or cancelled (its client went away: the handler's task is cancelled and the request leaves the
queue); none is dropped without an answer.

The prefill rate is ``prefill_tokens_per_s`` when configured, else the router's cost model's, refreshed
every :data:`RATE_REFRESH_S` from the router's online fit when it learns one (``learn_cost_model``,
on by default with ``ep_aware``), so the gate follows the engines' measured prefill times.

With several router processes (``pdlb serve --processes N``) each holds its own queue; the processes
share their held work per tenant through a file in their shared directory and each keeps its own
prefill backlog under its share of the engines' queue budget (:mod:`balancer.service.processes.shared_admission`),
so tenants get their weighted shares of the host, not of one process.

Tenant, class and deadline come from headers (``x-pdlb-tenant``, ``x-pdlb-priority``,
``x-pdlb-deadline-ms``; names configurable) or, for the tenant, a hash of the API key (never the key
itself). A bad deadline header is answered 400.

Metrics: ``pdlb_admission_requests_total{class,tenant,outcome}`` (``dispatched``,
``shed_deadline``, ``shed_queue_full``, ``cancelled``), ``pdlb_admission_held_requests{class}``
and ``pdlb_admission_wait_seconds{class}`` (time from arrival to dispatch or shed).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from balancer.cost_model import DEFAULT_COST_MODEL
from balancer.deadline_admission import (
    MAX_DEADLINE_S,
    DeadlineAdmission,
    Held,
    Outcome,
    TtftPrediction,
    decode_headroom,
    predict_pool_wait_s,
    predict_ttft,
    predictor_of,
    prefill_backlog,
    prefill_rate_tokens_per_s,
)
from balancer.router import Router
from balancer.service.admission_config import AdmissionSettings
from balancer.types import Request

log = logging.getLogger("pdlb.admission")

__all__ = ["AdmissionGate", "Shed", "admission_answer"]

#: Seconds between refreshes of the gate's prefill rate from the router's online cost-model fit
#: (``learn_cost_model``; only when ``prefill_tokens_per_s`` is not configured).
RATE_REFRESH_S = 1.0
_WAIT_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Shed(Exception):
    """A request the gate refused: ``status`` (429, or 400 for a bad header), the message and the
    ``Retry-After`` seconds (0: none)."""

    def __init__(self, status: int, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class AdmissionGate:
    """The service's admission queue (module docstring).

    Args:
        settings: the ``admission`` config section (``enabled`` is the caller's business).
        router: the router whose load is the gate's backlog.
        registry: the Prometheus registry of the app's metrics.
        multiprocess: several router processes (the held gauge is summed over live ones).
    """

    def __init__(self, settings: AdmissionSettings, router: Router, registry: Any, multiprocess: bool = False) -> None:
        self.settings = settings
        self.router = router
        self._config = settings.to_core()
        self.core: DeadlineAdmission | None = None  # built on first use: the replicas are known then
        self._waiters: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._pending_tokens = 0  # dispatched, not yet routed (the waiter has not resumed)
        self._ticker: asyncio.TimerHandle | None = None
        self._rate_at_s = -math.inf  # when the rate was last taken from the router's online cost fit
        #: the routing policy's TTFT prediction is used (wait_model "policy" or "max" and a policy that has one)
        self.predicts = self._config.wait_model != "backlog" and predictor_of(router) is not None
        self._requests: dict[int, Request] = {}  # held requests as the router would see them (predicts only)
        #: several router processes: the host's held work per tenant slot (share_across), or None
        self.shared: Any = None
        self.requests = Counter("pdlb_admission_requests", "Requests leaving the admission queue, by class, tenant "
                                "and outcome (dispatched, shed_deadline, shed_queue_full, cancelled)",
                                ["class", "tenant", "outcome"], registry=registry)
        self.held = Gauge("pdlb_admission_held_requests", "Requests held by deadline admission, by class", ["class"],
                          registry=registry, multiprocess_mode="livesum")  # summed over live processes
        self.wait = Histogram("pdlb_admission_wait_seconds", "Time from arrival to dispatch or shed in the admission "
                              "queue", ["class"], buckets=_WAIT_BUCKETS_S, registry=registry)

    # ------------------------------------------------------------------ the core
    def _core(self) -> DeadlineAdmission:
        _, num = prefill_backlog(self.router)
        if self.core is None:
            rate = self._config.prefill_tokens_per_s or prefill_rate_tokens_per_s(
                self.router.cost_model or DEFAULT_COST_MODEL, self.router.disaggregated)
            self.core = DeadlineAdmission(self._config, rate, num)
        else:
            self.core.num_replicas = max(1, num)  # workers come and go (health, admin API)
        learner = self.router.cost_learner
        if learner is not None and self._config.prefill_tokens_per_s is None:
            now = time.monotonic()
            if now - self._rate_at_s >= RATE_REFRESH_S:  # the online fit's latest prefill rate
                self._rate_at_s = now
                rate = prefill_rate_tokens_per_s(learner.model, self.router.disaggregated)
                if math.isfinite(rate) and rate > 0:
                    self.core.rate_tokens_per_s = rate
        return self.core

    def _backlog(self) -> int:
        return prefill_backlog(self.router)[0] + self._pending_tokens

    def share_across(self, directory: str, processes: int, index: int) -> None:
        """Several router processes: share the held work per tenant through ``directory`` (the
        processes' shared directory) and keep this process's own prefill backlog under its share
        of the engines' queue budget (:mod:`balancer.service.processes.shared_admission`)."""
        from balancer.service.processes.shared_admission import SharedAdmission

        self.shared = SharedAdmission(directory, processes, index)

    def _own_and_share(self) -> tuple[float | None, float]:
        """``(own_backlog_tokens, share)`` for the core's drain: this process's prefill backlog and its
        share of the engines' queue budget with several processes (``(None, 1.0)``: one process)."""
        if self.shared is None:
            return None, 1.0
        own = prefill_backlog(self.router, peers=False)[0] + self._pending_tokens
        return float(own), self.shared.share()

    def _pending_wait_s(self) -> float:
        """Seconds of prefill the dispatched, not yet routed prompts add (the router's snapshot,
        which the policy's prediction reads, does not hold them)."""
        assert self.core is not None
        return self._pending_tokens / self.core.cluster_rate_tokens_per_s if self._pending_tokens > 0 else 0.0

    def _predict(self, request: Request, now: float) -> TtftPrediction | None:
        p = predict_ttft(self.router, request, now)
        if p is None:
            return None
        return TtftPrediction(p.wait_s + self._pending_wait_s(), p.own_s)

    # ------------------------------------------------------------------ request side
    def identify(self, headers: Mapping[str, str]) -> tuple[str, str | None, float | None]:
        """``(tenant, class name or None, deadline_ms or None)`` from the request's headers.

        Raises:
            Shed: 400 for a deadline header that is not a number of milliseconds in (0, 3,600,000].
        """
        s = self.settings
        tenant = headers.get(s.tenant_header)
        if tenant:
            tenant = tenant.strip()[:128] or "default"
        elif s.tenant_from_api_key and (auth := headers.get("Authorization", "")).lower().startswith("bearer "):
            tenant = "key-" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:12]
        else:
            tenant = "default"
        priority = headers.get(s.priority_header)
        raw = headers.get(s.deadline_header)
        deadline_ms = None
        if raw is not None:
            try:
                deadline_ms = float(raw)
            except ValueError:
                deadline_ms = math.nan
            if not 0 < deadline_ms <= MAX_DEADLINE_S * 1000:
                raise Shed(400, f"{s.deadline_header} must be a number of milliseconds in (0, "
                                f"{int(MAX_DEADLINE_S * 1000)}], got {raw[:40]!r}")
        return tenant, priority.strip() if priority else None, deadline_ms

    async def admit(self, headers: Mapping[str, str], prompt_tokens: int, max_output_tokens: int,
                    block_hashes: tuple[int, ...] = ()) -> None:
        """Return when the request may be routed (``block_hashes``: its prompt's, for the policy's
        prediction of its prefix hits).

        Raises:
            Shed: the request is refused (429 with Retry-After; 400 for a bad header).
            asyncio.CancelledError: the client went away while held (the request left the queue).
        """
        tenant, priority, deadline_ms = self.identify(headers)
        core = self._core()
        now = time.monotonic()
        deadline_s = core.deadline_s(now, prompt_tokens, deadline_ms)
        key = next(self._keys)
        prediction = None
        if self.predicts:
            req = Request(f"pdlb-admission-{key}", now, prompt_tokens, block_hashes, max_output_tokens)
            prediction = self._predict(req, now)
        out = core.offer(key, tenant, priority, prompt_tokens, now, self._backlog(), deadline_s,
                         kv_tokens=prompt_tokens + max_output_tokens, prediction=prediction)
        if out.action == "shed":
            self._record(out, now)
            raise self._shed_error(out)
        h = out.held
        if self.shared is not None:
            self.shared.publish(core)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        if self.predicts:
            self._requests[key] = req
        self.drain()
        try:
            outcome: Outcome = await fut
        except asyncio.CancelledError:
            self._waiters.pop(key, None)
            self._requests.pop(key, None)
            if core.cancel(h, time.monotonic()):
                self._record(Outcome(h, "cancelled"), time.monotonic())
                self._set_held()
                if self.shared is not None:
                    self.shared.publish(core)
            elif fut.done() and not fut.cancelled() and fut.result().action == "dispatch":
                self._pending_tokens -= h.prompt_tokens  # dispatched but never routed
            raise
        if outcome.action == "dispatch":
            self._pending_tokens -= h.prompt_tokens  # routed next, in this task, before any await
            return
        raise self._shed_error(outcome)

    def _shed_error(self, out: Outcome) -> Shed:
        why = ("the admission queue is full" if out.reason == "queue_full" else
               "the predicted wait passes the request's deadline")
        return Shed(429, f"overloaded: {why}; retry after {out.retry_after_s:g} s", out.retry_after_s)

    # ------------------------------------------------------------------ queue side
    def drain(self) -> None:
        """Dispatch or shed what the core says now; wakes the waiters."""
        core = self.core
        if core is None or not core.num_held:
            return
        now = time.monotonic()
        self._core()
        own, share = self._own_and_share()
        if self.predicts:
            requests = self._requests

            def predict(h: Held) -> TtftPrediction | None:
                req = requests.get(h.key)
                return None if req is None else self._predict(req, now)

            pool = predict_pool_wait_s(self.router, now)
            outs = core.drain(now, self._backlog(), decode_headroom(self.router),
                              None if pool is None else pool + self._pending_wait_s(), predict,
                              own_backlog_tokens=own, share=share)
        else:
            outs = core.drain(now, self._backlog(), decode_headroom(self.router), own_backlog_tokens=own, share=share)
        for out in outs:
            if out.action == "dispatch":
                self._pending_tokens += out.held.prompt_tokens
            self._record(out, now)
            self._requests.pop(out.held.key, None)
            fut = self._waiters.pop(out.held.key, None)
            if fut is not None and not fut.done():
                fut.set_result(out)
        if self.shared is not None and outs:
            self.shared.publish(core)
        self._set_held()
        self._schedule()

    def on_request_done(self) -> None:
        """A routed request ended (its load left the router): re-check the queue."""
        if self.core is not None and self.core.num_held:
            self.drain()

    def _schedule(self) -> None:
        if self._ticker is not None or self.core is None or not self.core.num_held:
            return
        self._ticker = asyncio.get_running_loop().call_later(self.settings.drain_interval_s, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self.drain()

    def close(self) -> None:
        """Stop the timer and shed whatever is held (the app is shutting down)."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(Shed(503, "the router is shutting down"))
        self._waiters.clear()
        self._requests.clear()
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def _record(self, out: Outcome, now: float) -> None:
        h: Held = out.held
        outcome = "dispatched" if out.action == "dispatch" else (
            "cancelled" if out.action == "cancelled" else f"shed_{out.reason}")
        assert self.core is not None
        self.requests.labels(h.priority, self.core.tenant_label(h.tenant), outcome).inc()
        self.wait.labels(h.priority).observe(max(0.0, now - h.arrival_s))

    def _set_held(self) -> None:
        if self.core is not None:
            for cls, n in self.core.held_by_class().items():
                self.held.labels(cls).set(n)


async def admission_answer(gate: AdmissionGate, request: web.Request, prompt_tokens: int,
                           max_output_tokens: int, block_hashes: tuple[int, ...] = ()) -> web.Response | None:
    """``None`` when the request may be routed (after waiting in the queue if held), else the
    answer: 429 with ``Retry-After`` (shed), 400 (a bad deadline header), 503 (shutting down)."""
    try:
        await gate.admit(request.headers, prompt_tokens, max_output_tokens, block_hashes)
    except Shed as e:  # OpenAI's error shape, as balancer.service.proxy.error_response (which imports this module)
        etype = {429: "rate_limit_exceeded", 400: "invalid_request_error"}.get(e.status, "server_error")
        resp = web.json_response({"error": {"message": e.message, "type": etype, "code": e.status}}, status=e.status)
        if e.retry_after_s:
            resp.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        return resp
    return None
