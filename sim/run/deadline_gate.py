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
reason, the deadline the gate gave it (``deadline_s``) and, with the routing policy's prediction
(``wait_model`` "policy" or "max"), its predicted prefill time at dispatch (``predicted_prefill_s``).
Several router processes, each with its own queue: :class:`GateProcesses`. The tenant of a request is ``tenant_of(request)`` (default: its ``traffic_class``, else
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
    TtftPrediction,
    decode_headroom,
    predict_pool_wait_s,
    predict_ttft,
    predictor_of,
    prefill_backlog,
    prefill_rate_tokens_per_s,
    process_share,
)
from balancer.types import Request

__all__ = ["AdmissionRecords", "GateProcesses", "SimAdmission", "admission_line", "admission_summary",
           "default_priority", "default_tenant", "round_robin_process"]


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
    #: the deadline the gate gave each request (seconds; a prompt longer than its budget gets
    #: its own prefill on top), shape ``(n,)``
    deadline_s: np.ndarray | None = None
    #: the routing policy's predicted prefill time at dispatch (wait + own prefill, seconds; NaN:
    #: not dispatched, or no prediction: ``wait_model`` "backlog" or a policy without one)
    predicted_prefill_s: np.ndarray | None = None

    @property
    def num_shed(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.shed_s)))


def round_robin_process(i: int, req: Request, processes: int) -> int:
    """Request ``i``'s router process when every request comes on its own connection and the parent
    hands connections to the processes in turn (``pdlb serve --processes N``): ``i mod N``."""
    return i % processes


@dataclass(frozen=True)
class GateProcesses:
    """The router processes of ``pdlb serve --processes N`` with admission on, as the simulator
    models them (:class:`SimAdmission`).

    Attributes:
        count: processes, each with its own queue (>= 1).
        process_of: ``(i, request, count) -> process``: where request ``i`` arrives (default
            :func:`round_robin_process`; a tenant on one keep-alive connection stays on one).
        shared: the processes publish their held work per tenant slot, and each bounds its own
            prefill backlog by its share of the engines' queue budget
            (:func:`balancer.deadline_admission.process_share`), as the service does through a
            file in the processes' shared directory; False: each process on its own (the
            service before that, for comparison).
    """

    count: int = 1
    process_of: Callable[[int, Request, int], int] | None = None
    shared: bool = True

    def __post_init__(self) -> None:
        if type(self.count) is not int or self.count < 1:
            raise ValueError(f"admission processes must be an integer >= 1, got {self.count!r}")


class SimAdmission:
    """The gate of one simulated cluster (see the module docstring).

    With several ``processes`` (:class:`GateProcesses`) it models ``pdlb serve --processes N``
    with admission on: each process has its own queue
    (:class:`~balancer.deadline_admission.DeadlineAdmission`), request ``i`` joins the queue of
    ``process_of(i, request, N)``, and every process reads the same router load, so each sees the
    others' dispatched prompts at once (the service's shared load block is at most one event-loop
    pass behind). At each re-check the processes drain one after the other, starting one further
    each time (each process's timer fires in turn); with ``shared`` each bounds its own prefill
    backlog (its dispatched prompts not yet prefilled) by its
    :func:`~balancer.deadline_admission.process_share`. The counters in ``stats`` are summed.

    Args:
        cluster: the :class:`sim.run.cluster.Cluster` (its router, ``requests``, ``dispatch`` and
            ``on_shed``; not imported here: the cluster imports this module).
        config: the admission settings.
        tenant_of / priority_of: a request's tenant and class names.
        cost_model: the router's cost model, for the prefill rate when ``config`` gives none.
        processes: the router processes (default: one).
    """

    def __init__(self, cluster: Any, config: AdmissionConfig,
                 tenant_of: Callable[[Request], str] = default_tenant,
                 priority_of: Callable[[Request], str | None] = default_priority,
                 cost_model: Any = None, processes: GateProcesses | None = None) -> None:
        processes = processes or GateProcesses()
        self.cluster = cluster
        router = cluster.router
        _, num = prefill_backlog(router)
        rate = config.prefill_tokens_per_s or prefill_rate_tokens_per_s(
            cost_model or router.cost_model or DEFAULT_COST_MODEL, router.disaggregated)
        self.cores = [DeadlineAdmission(config, rate, num) for _ in range(processes.count)]
        self.core = self.cores[0]
        self.process_of = processes.process_of or round_robin_process
        self.shared = processes.shared and processes.count > 1
        self._process: list[int] = []
        self._turn = 0
        #: per process: its dispatched requests not yet prefilled, index -> prompt tokens (shared mode)
        self._own: list[dict[int, int]] = [{} for _ in self.cores]
        #: the routing policy's TTFT prediction is used (``wait_model`` "policy" or "max", and a policy that has one)
        self.predicts = config.wait_model != "backlog" and predictor_of(router) is not None
        self.tenant_of = tenant_of
        self.priority_of = priority_of
        self.records: AdmissionRecords | None = None

    def start(self, requests: Sequence[Request]) -> None:
        n = len(requests)
        self.records = AdmissionRecords(
            tenant=[self.tenant_of(r) for r in requests],
            priority=[self.core.resolve_priority(self.priority_of(r)) for r in requests],
            dispatch_s=np.full(n, np.nan), shed_s=np.full(n, np.nan), shed_reason=[""] * n, stats={},
            deadline_s=np.full(n, np.nan), predicted_prefill_s=np.full(n, np.nan))
        k = len(self.cores)
        self._process = [0] * n if k == 1 else [int(self.process_of(i, r, k)) % k for i, r in enumerate(requests)]

    def on_arrival(self, i: int, req: Request, now_s: float) -> None:
        rec = self.records
        assert rec is not None
        router = self.cluster.router
        backlog, _ = prefill_backlog(router)
        out = self.cores[self._process[i]].offer(i, rec.tenant[i], rec.priority[i], req.prompt_tokens, now_s, backlog,
                              kv_tokens=req.prompt_tokens + req.output_tokens,
                              prediction=predict_ttft(router, req, now_s) if self.predicts else None)
        assert rec.deadline_s is not None
        rec.deadline_s[i] = out.held.deadline_s
        if out.action == "shed":
            self._shed(i, out.reason, now_s)
        self.drain(now_s)

    def drain(self, now_s: float) -> None:
        """Dispatch (route) or shed what the gate says, in its order (each process's, in turn)."""
        k = len(self.cores)
        if k == 1:
            self._drain(0, now_s)
            return
        self._turn = (self._turn + 1) % k
        if self.shared:  # prefills done since: out of their processes' own backlogs
            done = self.cluster.records.prefill_end_s
            for own in self._own:
                for i in [i for i in own if not np.isnan(done[i])]:
                    del own[i]
        for j in range(k):
            self._drain((self._turn + j) % k, now_s)

    def _own_and_share(self, p: int) -> tuple[float | None, float]:
        """``(own_backlog_tokens, share)`` of process ``p`` in shared mode, else ``(None, 1.0)``."""
        if not self.shared:
            return None, 1.0
        slots = [core.held_by_slot() for core in self.cores]
        held = np.stack([t for t, _ in slots])
        weights = np.stack([w for _, w in slots])
        return float(sum(self._own[p].values())), process_share(held, weights, p)

    def _drain(self, p: int, now_s: float) -> None:
        core = self.cores[p]
        if not core.num_held:
            return
        rec = self.records
        assert rec is not None
        router = self.cluster.router
        backlog, _ = prefill_backlog(router)
        if not self.predicts:
            own, share = self._own_and_share(p)
            self._apply(core.drain(now_s, backlog, decode_headroom(router), own_backlog_tokens=own, share=share),
                        now_s, p)
            return
        requests = self.cluster.requests

        predicted = rec.predicted_prefill_s
        assert predicted is not None

        def predict(h: Any) -> TtftPrediction | None:
            p = predict_ttft(router, requests[h.key], now_s)
            predicted[h.key] = np.nan if p is None else p.wait_s + p.own_s  # kept if it is dispatched now
            return p

        while True:  # one dispatch at a time, routed before the next prediction (it sees its load)
            own, share = self._own_and_share(p)
            outs = core.drain(now_s, prefill_backlog(router)[0], decode_headroom(router),
                              predict_pool_wait_s(router, now_s), predict, max_dispatch=1,
                              own_backlog_tokens=own, share=share)
            self._apply(outs, now_s, p)
            if not outs or outs[-1].action != "dispatch" or not core.num_held:
                return

    def _apply(self, outs: list[Any], now_s: float, p: int) -> None:
        rec = self.records
        assert rec is not None
        for out in outs:
            i = out.held.key
            if out.action == "dispatch":
                rec.dispatch_s[i] = now_s
                if self.shared:
                    self._own[p][i] = out.held.prompt_tokens
                self.cluster.dispatch(i, self.cluster.requests[i], now_s)
            else:
                self._shed(i, out.reason, now_s)
                if rec.predicted_prefill_s is not None:
                    rec.predicted_prefill_s[i] = np.nan

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
        stats = self.core.stats()
        for core in self.cores[1:]:  # several processes: counts and hold times summed
            for part, values in core.stats().items():
                into = stats[part]
                for key, v in values.items():
                    into[key] = into.get(key, 0) + v
        self.records.stats = stats
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
