"""Deadline admission in the simulator: the policy core's :class:`~balancer.deadline_admission.DeadlineAdmission`
between a request's arrival and :meth:`balancer.router.Router.route`.

Not :mod:`sim.run.admission` (what a simulated engine refuses: a prompt over ``max_model_len``). With
``simulate(..., admission=AdmissionConfig(...))`` the cluster (:class:`sim.run.cluster.Cluster`) hands
each arrival to :meth:`SimAdmission.on_arrival` instead of routing it; the gate routes it at once,
holds it, or sheds it, and re-checks its queue at every prefill done and finish (the times the
router's prefill backlog shrinks), exactly as the service does with real clocks
(:mod:`balancer.service.admission_gate`). A shed request is never simulated: it counts as an SLO miss
(NaN TTFT) and in ``summary["admission"]``.

Per-request columns (:class:`AdmissionRecords`, ``SimResult.extra["admission"]``): the tenant and
class, ``dispatch_s`` (routed; the arrival when never held; NaN when shed), ``shed_s`` and the shed
reason. The tenant of a request is ``tenant_of(request)`` (default: its ``traffic_class``, else
``"default"``), its class ``priority_of(request)`` (default: its ``priority``, else the configured
default class).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer.cost_model import DEFAULT_COST_MODEL
from balancer.deadline_admission import (
    AdmissionConfig,
    DeadlineAdmission,
    decode_headroom,
    prefill_backlog,
    prefill_rate_tokens_per_s,
)
from balancer.types import Request

__all__ = ["AdmissionRecords", "SimAdmission", "admission_line", "admission_summary",
           "default_priority", "default_tenant"]


def default_tenant(req: Request) -> str:
    """A simulated request's tenant: its ``traffic_class``, else ``"default"``."""
    return req.traffic_class or "default"


def default_priority(req: Request) -> str | None:
    """A simulated request's admission class: its ``priority`` (a trace line's ``priority`` field),
    else None (the configured default class)."""
    return req.priority


@dataclass
class AdmissionRecords:
    """Per-request admission columns, row ``i`` = request ``i`` of the run."""

    tenant: list[str]
    priority: list[str]
    dispatch_s: np.ndarray
    shed_s: np.ndarray
    shed_reason: list[str]
    stats: dict[str, Any]

    @property
    def num_shed(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.shed_s)))


class SimAdmission:
    """The gate of one simulated cluster (see the module docstring).

    Args:
        cluster: the :class:`sim.run.cluster.Cluster` (its router, ``requests``, ``dispatch`` and
            ``on_shed``; not imported here: the cluster imports this module).
        config: the admission settings.
        tenant_of / priority_of: a request's tenant and class names.
        cost_model: the router's cost model, for the prefill rate when ``config`` gives none.
    """

    def __init__(self, cluster: Any, config: AdmissionConfig,
                 tenant_of: Callable[[Request], str] = default_tenant,
                 priority_of: Callable[[Request], str | None] = default_priority,
                 cost_model: Any = None) -> None:
        self.cluster = cluster
        router = cluster.router
        _, num = prefill_backlog(router)
        rate = config.prefill_tokens_per_s or prefill_rate_tokens_per_s(
            cost_model or router.cost_model or DEFAULT_COST_MODEL, router.disaggregated)
        self.core = DeadlineAdmission(config, rate, num)
        self.tenant_of = tenant_of
        self.priority_of = priority_of
        self.records: AdmissionRecords | None = None

    def start(self, requests: Sequence[Request]) -> None:
        n = len(requests)
        self.records = AdmissionRecords(
            tenant=[self.tenant_of(r) for r in requests],
            priority=[self.core.resolve_priority(self.priority_of(r)) for r in requests],
            dispatch_s=np.full(n, np.nan), shed_s=np.full(n, np.nan), shed_reason=[""] * n, stats={})

    def on_arrival(self, i: int, req: Request, now_s: float) -> None:
        rec = self.records
        assert rec is not None
        backlog, _ = prefill_backlog(self.cluster.router)
        out = self.core.offer(i, rec.tenant[i], rec.priority[i], req.prompt_tokens, now_s, backlog,
                              kv_tokens=req.prompt_tokens + req.output_tokens)
        if out.action == "shed":
            self._shed(i, out.reason, now_s)
        self.drain(now_s)

    def drain(self, now_s: float) -> None:
        """Dispatch (route) or shed what the gate says, in its order."""
        if not self.core.num_held:
            return
        rec = self.records
        assert rec is not None
        backlog, _ = prefill_backlog(self.cluster.router)
        for out in self.core.drain(now_s, backlog, decode_headroom(self.cluster.router)):
            i = out.held.key
            if out.action == "dispatch":
                rec.dispatch_s[i] = now_s
                self.cluster.dispatch(i, self.cluster.requests[i], now_s)
            else:
                self._shed(i, out.reason, now_s)

    def on_dispatched_directly(self, i: int, now_s: float) -> None:
        assert self.records is not None
        self.records.dispatch_s[i] = now_s

    def _shed(self, i: int, reason: str, now_s: float) -> None:
        rec = self.records
        assert rec is not None
        rec.shed_s[i] = now_s
        rec.shed_reason[i] = reason
        self.cluster.on_shed(i, now_s)

    def finish(self) -> AdmissionRecords:
        assert self.records is not None
        self.records.stats = self.core.stats()
        return self.records


def admission_summary(adm: AdmissionRecords, arrival_s: np.ndarray, ttft_s: np.ndarray, ok: np.ndarray
                      ) -> dict[str, Any]:
    """``summary["admission"]``: sheds by reason, and per tenant and per class the requests, the
    shed ones, those answered (a first token or a shed: ``answered == requests`` means none was
    dropped silently), the SLO attainment (a shed request misses) and the mean hold time in seconds
    of the dispatched ones.

    ``arrival_s`` / ``ttft_s`` / ``ok``: per-request arrival, TTFT (NaN: none) and whether it met the
    SLO, shape ``(n,)``."""
    reasons: dict[str, int] = {}
    for r in adm.shed_reason:
        if r:
            reasons[r] = reasons.get(r, 0) + 1

    def group(labels: list[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        arr = np.array(labels, dtype=object)
        for name in sorted(set(labels)):
            m = arr == name
            disp = m & ~np.isnan(adm.dispatch_s)
            out[name] = {"requests": int(m.sum()), "shed": int((m & ~np.isnan(adm.shed_s)).sum()),
                         "slo_attainment": float(ok[m].mean()) if m.any() else float("nan"),
                         "answered": int((m & (~np.isnan(ttft_s) | ~np.isnan(adm.shed_s))).sum()),
                         "mean_held_s": float(np.mean(adm.dispatch_s[disp] - arrival_s[disp])) if disp.any()
                         else float("nan")}
        return out

    return {"num_shed": adm.num_shed, "shed": reasons, "by_tenant": group(adm.tenant),
            "by_class": group(adm.priority)}


def admission_line(summary: dict[str, Any]) -> str:
    """One line per run: sheds by reason and SLO attainment per tenant."""
    a = summary["admission"]
    shed = ", ".join(f"{k} {v}" for k, v in sorted(a["shed"].items())) or "none"
    tenants = ", ".join(f"{t} {100 * v['slo_attainment']:.1f}% ({v['shed']} shed)" for t, v in a["by_tenant"].items())
    return f"{summary['policy']}: admission shed {a['num_shed']} ({shed}); SLO attainment by tenant: {tenants}"
