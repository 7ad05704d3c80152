"""Deadline admission under overload: hold, order and shed requests before routing them.

Not to be confused with :mod:`sim.run.admission`, which is what a simulated *engine* refuses at
arrival (a prompt over ``max_model_len``). This module is the *router's* flow control: it decides
when a request reaches :meth:`balancer.router.Router.route` at all. Pure: no I/O, no clock (every
method takes ``now_s``); the simulator (:mod:`sim.run.deadline_gate`) and the service
(:mod:`balancer.service.admission_gate`) drive the same object.

The algorithm has the shape of llm-d's EPP flow control (requests keyed by tenant and priority, held
at the router instead of in an engine's queue, dispatched by priority band first, then round robin
over the tenants of a band, then an ordering within a tenant; llm-d docs, "Flow Control"), with
deadlines ordering each tenant's queue and deciding sheds (what Dynamo's deadline queues and
llm-d's EDF ordering add). None of their code is used:

1. **Deadline.** A request's deadline is ``arrival_s + budget``: the budget is the TTFT SLO's
   (:class:`~balancer.types.TtftSlo`, ``ttft_s + per_1k_prompt_tokens_s * prompt / 1000``) unless
   the client gave its own (``x-pdlb-deadline-ms`` in the service), at most
   :data:`MAX_DEADLINE_S`. A request that no idle replica could serve within its budget (its own
   prefill ``P / r`` is longer) gets ``arrival_s + P / r + budget`` (a first version never shed
   such requests, and on the Mooncake trace, 100k-token prompts against a flat 2 s SLO, they filled
   the queue).
2. **Gate.** The cluster's prefill backlog ``B`` (prompt tokens dispatched and not yet prefilled,
   from the router's load tracker: :func:`prefill_backlog`) drains at ``R`` tokens/s
   (``prefill_tokens_per_s`` per prefill replica, or the router's cost model, times the healthy
   prefill (or mixed) replicas). The predicted engine wait is ``W = B / R`` (a fluid model: work
   spread over the pool). Held requests are dispatched while ``W < dispatch_wait_s`` and, when the
   decode replicas' KV capacities are known, while their free KV (:func:`decode_headroom`: 90% of
   the capacity less the prompts in flight) is above 0; each dispatch adds its prompt to ``B`` and
   takes its prompt + output from the free KV. With both under their bounds nothing is held (the
   light-load path costs two comparisons).

   **The routing policy's prediction** (``wait_model="auto"``, the default): when the policy of
   the first pool a request meets (prefill in PD, else mixed) implements :class:`TtftPredictor`
   (``ep_aware`` does), the gate asks it instead: :func:`predict_ttft` gives a request's predicted
   TTFT on the replica that would serve it soonest, split into ``wait_s`` (the queue ahead there,
   counting a dense rank's in-service progress and, on wide EP, the pace of the engine's busiest
   rank) and ``own_s`` (its own prefill, prefix hits counted, attention's quadratic term included).
   ``W`` is then the pool's predicted wait (:func:`predict_pool_wait_s`: the least ``wait_s`` of a
   one-token probe) plus the prompts dispatched since that snapshot at ``R``; the shed tests
   (4b-d) use the request's own ``wait_s`` and ``own_s`` in place of ``W`` and ``P / r``. The
   fluid ``B / R`` counts a prompt being prefilled in full until it is done and prices every token
   at a full chunk's rate: pessimistic on dense engines with short prompts, optimistic on wide-EP
   engines with long ones (their step pace and attention). ``wait_model="backlog"`` keeps
   ``B / R`` whatever the policy (as do policies without a prediction).
3. **Order.** Held requests are served by strict priority between classes (``priority_classes``,
   first = highest), then **deficit round robin** between the tenants of a class (Shreedhar and
   Varghese, "Efficient Fair Queuing Using Deficit Round Robin", SIGCOMM 1995): each visit adds
   ``quantum_tokens * weight`` to a tenant's deficit, and its head is dispatched while its prompt
   tokens fit the deficit; a tenant whose queue empties loses its deficit. The cost is prompt tokens,
   the work the gate meters (the token-counting idea of VTC, Sheng et al., "Fairness in Serving
   Large Language Models", OSDI 2024, without its output-token term). Within a tenant: earliest
   deadline first (EDF), ties by arrival order.
4. **Shed.** A request is refused (HTTP 429 with ``Retry-After`` in the service, a ``shed`` row in
   the simulator) when (a) the whole queue or its tenant's queue (in its class) is full
   (``max_queue_requests``, ``max_queue_per_tenant``); (b) at arrival, its predicted start
   ``now + W + H / R + A / R_t`` plus its own prefill ``P / r`` passes its deadline, where ``H`` is
   the prompt tokens held in higher classes, ``A`` those held ahead of it in its tenant's queue
   (deadlines up to its own) and ``R_t = R * weight / (sum of the weights of tenants with held
   requests in its class, its own included)`` its fair share of the rate; (c) while held, its
   latest start ``deadline - P / r - W`` passes (a sweep at every drain, O(log n) per request); (d)
   at dispatch, ``now + W + P / r`` passes its deadline (it would miss anyway; serving it would make
   others miss). ``Retry-After`` is the predicted time for the queue ahead to drain, at least 1 s.
5. **Several queues** (the processes of ``pdlb serve --processes N``, each holding the requests of
   its own client connections): every process reads the same backlog ``B`` and publishes its held
   prompt tokens per tenant slot (:meth:`DeadlineAdmission.held_by_slot`, :func:`tenant_slot`);
   each keeps its own prefill backlog under its share of the engines' queue budget
   ``dispatch_wait_s * R``, the share (:func:`process_share`) giving each tenant with held work
   anywhere its weight once, split between the processes by their held tokens of it. Without
   that, each process's DRR is fair only among its own tenants and the engines go to whichever
   process re-checks first (``balancer/service/processes/shared_admission.py`` has the measurements).

Every request offered gets exactly one outcome: dispatched or shed (or cancelled by the caller,
:meth:`DeadlineAdmission.cancel`, e.g. a client that went away while held). Counters per
``(class, tenant)`` (at most ``max_tenants_tracked`` tenants by name; the rest are counted as
``"other"``) are in :meth:`DeadlineAdmission.stats`.

Known limits: the decode side is gated on KV tokens only (not on decode step time, TPOT); the
predicted wait ``W`` counts prefill work only, so a request held behind a full decode pool is shed
by (c) when its deadline is near rather than at arrival. ``R`` is configured or modelled (the
service refreshes it from the router's online cost fit when there is one), not measured here.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from balancer.candidates import Candidates
from balancer.policies.base import SelectContext
from balancer.types import Request, Role, TtftSlo, is_finite_seconds

__all__ = ["MAX_DEADLINE_S", "OUTCOMES", "WAIT_MODELS", "AdmissionConfig", "DeadlineAdmission", "Held", "Outcome",
           "TtftPrediction", "TtftPredictor", "decode_headroom", "predict_pool_wait_s", "predict_ttft",
           "TENANT_SLOTS", "predictor_of", "prefill_backlog", "prefill_rate_tokens_per_s", "process_share", "wait_model_warning",
           "tenant_slot"]

#: Longest deadline a request may ask for (seconds after its arrival).
MAX_DEADLINE_S = 3600.0
#: Outcomes counted per (class, tenant).
OUTCOMES = ("dispatched", "shed_deadline", "shed_queue_full", "cancelled")
#: The tenant label of tenants past ``max_tenants_tracked``.
OTHER_TENANT = "other"
#: How the gate predicts a request's wait and own prefill (module docstring, 2): ``B / R`` and
#: ``P / r`` ("backlog"), the routing policy's prediction when it has one ("policy"), or the larger
#: of the two, each term ("max").
WAIT_MODELS = ("backlog", "policy", "max")
#: Tenant slots a router process publishes its held work in (:func:`tenant_slot`, :func:`process_share`).
TENANT_SLOTS = 256


@dataclass(frozen=True)
class AdmissionConfig:
    """Settings of :class:`DeadlineAdmission` (units in the names).

    Attributes:
        ttft_slo: the TTFT budget that sets each request's default deadline.
        dispatch_wait_s: dispatch held requests while the predicted engine wait ``W`` is below this
            (seconds); default (``None``): a quarter of ``ttft_slo.ttft_s`` (engines keep work queued
            for that long, and a dispatched request still has most of its budget).
        prefill_tokens_per_s: prefill rate of one prefill (or mixed) replica, tokens/s; ``None``:
            from the router's cost model (:func:`prefill_rate_tokens_per_s`).
        priority_classes: class names, highest priority first; a request names one (unknown or
            none: ``default_priority``).
        default_priority: the class of requests that name none.
        tenant_weights: DRR weight per tenant name (default 1.0 for the others).
        quantum_tokens: DRR quantum (prompt tokens added to a tenant's deficit per visit).
        max_queue_requests: most requests held at once (all classes and tenants).
        max_queue_per_tenant: most requests one tenant may have held.
        max_tenants_tracked: most tenant names kept in the counters (others count as ``"other"``).
        wait_model: one of :data:`WAIT_MODELS` (module docstring, 2): ``"backlog"`` (the fluid
            ``B / R`` and ``P / r``), ``"policy"`` (the routing policy's TTFT prediction when it
            has one, :class:`TtftPredictor`; else as backlog) or ``"max"`` (the larger of the two,
            term by term).

    Raises:
        ValueError: a number out of range, an empty or duplicate class list, an unknown default.
    """

    ttft_slo: TtftSlo = field(default_factory=lambda: TtftSlo(2.0))
    dispatch_wait_s: float | None = None
    prefill_tokens_per_s: float | None = None
    priority_classes: tuple[str, ...] = ("high", "normal", "low")
    default_priority: str = "normal"
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    quantum_tokens: int = 8192
    max_queue_requests: int = 1024
    max_queue_per_tenant: int = 256
    max_tenants_tracked: int = 64
    wait_model: str = "backlog"

    def __post_init__(self) -> None:
        if not isinstance(self.ttft_slo, TtftSlo):
            raise TypeError(f"ttft_slo must be a TtftSlo, got {type(self.ttft_slo).__name__}")
        for name in ("dispatch_wait_s", "prefill_tokens_per_s"):
            v = getattr(self, name)
            if v is not None and not (is_finite_seconds(v) and v > 0):
                raise ValueError(f"admission {name} must be a finite number > 0 or None, got {v!r}")
        classes = tuple(self.priority_classes)
        if not classes or len(set(classes)) != len(classes) or not all(isinstance(c, str) and c for c in classes):
            raise ValueError(f"admission priority_classes must be distinct non-empty names, got {classes!r}")
        object.__setattr__(self, "priority_classes", classes)
        if self.default_priority not in classes:
            raise ValueError(f"admission default_priority {self.default_priority!r} is not one of {classes}")
        for t, w in self.tenant_weights.items():
            if not (is_finite_seconds(w) and w > 0):
                raise ValueError(f"admission tenant_weights[{t!r}] must be a finite number > 0, got {w!r}")
        if self.wait_model not in WAIT_MODELS:
            raise ValueError(f"admission wait_model must be one of {', '.join(WAIT_MODELS)}, got {self.wait_model!r}")
        for name in ("quantum_tokens", "max_queue_requests", "max_queue_per_tenant", "max_tenants_tracked"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"admission {name} must be an integer >= 1, got {v!r}")

    @property
    def effective_dispatch_wait_s(self) -> float:
        return self.dispatch_wait_s if self.dispatch_wait_s is not None else self.ttft_slo.ttft_s / 4.0


@dataclass(slots=True)
class Held:
    """A request in the admission queue (or just decided).

    ``key`` is the caller's handle (a request id, an index); ``prompt_tokens`` the DRR cost and the
    prefill work; times in the caller's seconds.
    """

    key: Any
    tenant: str
    priority: str
    prompt_tokens: int
    arrival_s: float
    deadline_s: float
    seq: int = 0
    kv_tokens: int = 0  # KV tokens it will need on a decode (or mixed) replica; 0: not gated on KV
    own_s: float | None = None  # its own prefill seconds as the policy predicts; None: P / r at the current r
    done: bool = False  # dispatched, shed or cancelled (a lazily deleted heap entry)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a request: ``action`` is ``"hold"``, ``"dispatch"`` or ``"shed"``;
    ``reason`` for sheds: ``"deadline"`` or ``"queue_full"``; ``retry_after_s`` for sheds
    (whole seconds, >= 1)."""

    held: Held
    action: str
    reason: str = ""
    retry_after_s: float = 0.0


class _TenantQueue:
    __slots__ = ("heap", "tokens")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Held]] = []  # (deadline, seq, held): EDF, ties by arrival
        self.tokens = 0


class _ClassQueue:
    """One priority class: DRR over its tenants (module docstring, 3)."""

    __slots__ = ("tenants", "active", "deficit", "turn_started", "num", "tokens")

    def __init__(self) -> None:
        self.tenants: dict[str, _TenantQueue] = {}
        self.active: deque[str] = deque()  # tenants with held requests, in DRR order
        self.deficit: dict[str, float] = {}
        self.turn_started = False  # the tenant at active[0] got its quantum for this visit
        self.num = 0
        self.tokens = 0


class DeadlineAdmission:
    """The admission queue (see the module docstring for the algorithm).

    Use::

        adm = DeadlineAdmission(cfg, rate_tokens_per_s=..., num_replicas=...)
        out = adm.offer(key, tenant, priority, prompt_tokens, now_s, backlog_tokens)   # hold or shed
        for o in adm.drain(now_s, backlog_tokens):   # dispatch or shed, in order
            ...

    ``backlog_tokens`` is the cluster's prefill backlog now (:func:`prefill_backlog`); ``drain``
    adds each dispatched prompt to it as it goes. Call ``drain`` after every ``offer`` and whenever
    the backlog shrinks (a prefill done, a request finished) or time passes (deadlines).

    Args:
        config: the settings.
        rate_tokens_per_s: prefill rate of one replica (tokens/s), > 0.
        num_replicas: prefill (or mixed) replicas sharing the backlog (>= 1; 0 is taken as 1).
    """

    def __init__(self, config: AdmissionConfig, rate_tokens_per_s: float, num_replicas: int = 1) -> None:
        if not (is_finite_seconds(rate_tokens_per_s) and rate_tokens_per_s > 0):
            raise ValueError(f"rate_tokens_per_s must be a finite number > 0, got {rate_tokens_per_s!r}")
        self.config = config
        self.rate_tokens_per_s = float(rate_tokens_per_s)
        self.num_replicas = max(1, int(num_replicas))
        self.dispatch_wait_s = config.effective_dispatch_wait_s
        self._class_rank = {c: i for i, c in enumerate(config.priority_classes)}
        self._classes = [_ClassQueue() for _ in config.priority_classes]
        self._expiry: list[tuple[float, int, Held]] = []  # (latest start ignoring W, seq, held)
        self._seq = itertools.count()
        self._num_held = 0
        self._tracked: set[str] = set()
        self._counts: dict[tuple[str, str, str], int] = {}
        self._wait_sum_s: dict[tuple[str, str], float] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def cluster_rate_tokens_per_s(self) -> float:
        return self.rate_tokens_per_s * self.num_replicas

    @property
    def num_held(self) -> int:
        return self._num_held

    def held_by_class(self) -> dict[str, int]:
        return {c: q.num for c, q in zip(self.config.priority_classes, self._classes)}

    def held_by_slot(self, num_slots: int = TENANT_SLOTS) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, weights)``, shapes ``(num_slots,)``: the prompt tokens held per tenant slot
        (:func:`tenant_slot`, all classes) and the largest DRR weight of the tenants held there (0
        where none is): what a router process publishes for :func:`process_share`."""
        tokens = np.zeros(num_slots)
        weights = np.zeros(num_slots)
        for q in self._classes:
            for t, tq in q.tenants.items():
                i = tenant_slot(t, num_slots)
                tokens[i] += tq.tokens
                weights[i] = max(weights[i], self._weight(t))
        return tokens, weights

    def engine_wait_s(self, backlog_tokens: float) -> float:
        """The predicted engine wait ``W = backlog / (rate * replicas)`` in seconds."""
        return max(0.0, float(backlog_tokens)) / self.cluster_rate_tokens_per_s

    def own_prefill_s(self, prompt_tokens: int) -> float:
        """A prompt's own prefill time on one replica, ``P / r`` seconds."""
        return prompt_tokens / self.rate_tokens_per_s

    def resolve_priority(self, priority: str | None) -> str:
        """The class of a request naming ``priority`` (unknown or None: the default)."""
        return priority if priority in self._class_rank else self.config.default_priority

    def deadline_s(self, arrival_s: float, prompt_tokens: int, deadline_ms: float | None = None) -> float:
        """``arrival_s`` plus the request's own budget (``deadline_ms``, capped at
        :data:`MAX_DEADLINE_S`) or the TTFT SLO's."""
        if deadline_ms is not None:
            return arrival_s + min(float(deadline_ms) / 1000.0, MAX_DEADLINE_S)
        return arrival_s + float(self.config.ttft_slo.budget_s(prompt_tokens))

    # ------------------------------------------------------------------ decisions
    def offer(self, key: Any, tenant: str, priority: str | None, prompt_tokens: int, now_s: float,
              backlog_tokens: float, deadline_s: float | None = None, kv_tokens: int = 0,
              prediction: TtftPrediction | None = None) -> Outcome:
        """Queue a request arriving at ``now_s`` (or shed it: module docstring, 4a-b).

        ``deadline_s``: its absolute deadline (default :meth:`deadline_s` from the SLO).
        ``kv_tokens``: the decode KV it will hold (prompt + output; the KV gate of :meth:`drain`).
        ``prediction``: the routing policy's prediction for it now (:func:`predict_ttft`), used
        instead of ``W = B / R`` and ``P / r``; None: those.
        Follow with :meth:`drain`, which dispatches it at once when the gate is open.

        Raises:
            ValueError: ``now_s`` or ``deadline_s`` not finite, ``prompt_tokens`` < 1.
        """
        if not is_finite_seconds(now_s):
            raise ValueError(f"now_s must be a finite number of seconds, got {now_s!r}")
        if type(prompt_tokens) is not int or prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be an integer >= 1, got {prompt_tokens!r}")
        if deadline_s is None:
            deadline_s = self.deadline_s(now_s, prompt_tokens)
        elif not is_finite_seconds(deadline_s):
            raise ValueError(f"deadline_s must be a finite number of seconds, got {deadline_s!r}")
        if prediction is not None and self.config.wait_model == "max":
            prediction = TtftPrediction(max(prediction.wait_s, self.engine_wait_s(backlog_tokens)),
                                        max(prediction.own_s, self.own_prefill_s(prompt_tokens)))
        own = self.own_prefill_s(prompt_tokens) if prediction is None else prediction.own_s
        if now_s + own > deadline_s:  # no idle cluster could: its budget counts from its own prefill's end
            deadline_s = now_s + own + (deadline_s - now_s if deadline_s > now_s else 0.0)
        cls = self.resolve_priority(priority)
        tenant = str(tenant)
        h = Held(key, tenant, cls, prompt_tokens, float(now_s), float(deadline_s), next(self._seq), max(0, int(kv_tokens)),
                 own_s=None if prediction is None else own)
        q = self._classes[self._class_rank[cls]]
        tq = q.tenants.get(tenant)
        w = self.engine_wait_s(backlog_tokens) if prediction is None else prediction.wait_s
        if self._num_held >= self.config.max_queue_requests or (
                tq is not None and len(tq.heap) >= self.config.max_queue_per_tenant):
            return self._shed(h, "queue_full", w + self._held_ahead_tokens(cls) / self.cluster_rate_tokens_per_s,
                              now_s)
        # would it start in time behind the engines' backlog and its share of the queue? (4b)
        ahead = sum(x.prompt_tokens for _, _, x in tq.heap if x.deadline_s <= h.deadline_s) if tq else 0
        start = w + self._higher_tokens(cls) / self.cluster_rate_tokens_per_s \
            + ahead / self._share_rate(q, tenant, tq is None)
        if self._misses(h, now_s, start):
            return self._shed(h, "deadline", start, now_s)
        self._push(q, h)
        return Outcome(h, "hold")

    def drain(self, now_s: float, backlog_tokens: float, kv_headroom_tokens: float | None = None,
              wait_s: float | None = None, predict: Callable[[Held], TtftPrediction | None] | None = None,
              max_dispatch: int | None = None, own_backlog_tokens: float | None = None,
              share: float = 1.0) -> list[Outcome]:
        """Shed the held requests that can no longer start in time, then dispatch in order while the
        gate is open (module docstring, 2-4); returns the outcomes in that order (``dispatch``
        outcomes are to be routed now, in the order given).

        ``kv_headroom_tokens``: decode KV tokens free for new requests (:func:`decode_headroom`);
        when given, the gate also stays closed while it is <= 0, and each dispatch takes its
        ``kv_tokens`` from it (``None``: no KV gate). ``wait_s``: the pool's predicted wait now
        (:func:`predict_pool_wait_s`) instead of ``B / R``; ``predict``: a held request's
        prediction now (:func:`predict_ttft`, or None), asked for each request about to be
        dispatched: the gate stays closed while that request's own predicted wait is at least
        ``dispatch_wait_s`` too (on wide EP a rank with an empty queue still steps at its busiest
        rank's pace: the pool's wait says little about a long prompt's), and the dispatch-time
        test (4d) uses it. Prompts dispatched earlier in the same call add ``tokens / R`` to both
        (the caller's snapshot does not hold them yet). ``max_dispatch``: stop after that many
        dispatches (a caller that routes each before asking again, so that every prediction sees
        the load of the ones before it; None: no limit). ``own_backlog_tokens`` and ``share``:
        one of several router processes, each with its own queue (module docstring, 5): the gate
        also stays closed while this process's own prefill backlog (plus what it dispatched in
        this call) is at least ``share`` of the engines' queue budget ``dispatch_wait_s * R``
        (``share`` from :func:`process_share`; ``own_backlog_tokens`` None: no such bound)."""
        out: list[Outcome] = []
        kv = math.inf if kv_headroom_tokens is None else float(kv_headroom_tokens)
        fluid = self.engine_wait_s(backlog_tokens)
        floor = fluid if self.config.wait_model == "max" else 0.0
        w0 = fluid if wait_s is None else max(0.0, float(wait_s), floor)
        w = w0
        exp = self._expiry
        while exp and exp[0][0] - w < now_s:  # (c): latest start passed
            _, _, h = heapq.heappop(exp)
            if not h.done:
                self._remove(h)
                out.append(self._shed(h, "deadline", w, now_s))
        added = 0.0
        rate = self.cluster_rate_tokens_per_s
        limit = math.inf if max_dispatch is None else max_dispatch
        dispatched = 0
        own_cap = math.inf if own_backlog_tokens is None else \
            max(0.0, float(share)) * self.dispatch_wait_s * rate - max(0.0, float(own_backlog_tokens))
        while self._num_held and w < self.dispatch_wait_s and kv > 0 and dispatched < limit and added < own_cap:
            q, tq, t, h = self._select_next()
            p = predict(h) if predict is not None else None
            hw = w
            if p is not None:
                hw = max(p.wait_s, floor) + added / rate
                h.own_s = max(p.own_s, self.own_prefill_s(h.prompt_tokens)) if self.config.wait_model == "max" \
                    else p.own_s
                if hw >= self.dispatch_wait_s and not self._misses(h, now_s, hw):
                    break  # its own wait is long: hold it (it keeps its DRR turn)
            q.deficit[t] -= h.prompt_tokens
            self._take(q, tq, t, h)
            if self._misses(h, now_s, hw):  # (d): would miss
                out.append(self._shed(h, "deadline", hw, now_s))
                continue
            h.done = True
            self._count(h, "dispatched", now_s - h.arrival_s)
            out.append(Outcome(h, "dispatch"))
            added += h.prompt_tokens
            w = w0 + added / rate
            kv -= h.kv_tokens
            dispatched += 1
        if not self._num_held:
            exp.clear()
        elif len(exp) > 2 * self._num_held + 64:  # entries of requests that left: keep it O(held)
            self._expiry = [e for e in exp if not e[2].done]
            heapq.heapify(self._expiry)
        return out

    def cancel(self, h: Held, now_s: float) -> bool:
        """Take a held request out (its client went away); False if it was no longer held."""
        if h.done:
            return False
        self._remove(h)
        self._count(h, "cancelled", now_s - h.arrival_s)
        return True

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        """``{"counts": {(class, tenant, outcome): n}, "held": {class: n}, "held_wait_s": {(class,
        tenant): seconds held in total by requests that left the queue}}``."""
        return {"counts": dict(self._counts), "held": self.held_by_class(), "held_wait_s": dict(self._wait_sum_s)}

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as counted: its name while at most ``max_tenants_tracked`` names are, else
        :data:`OTHER_TENANT`."""
        if tenant in self._tracked:
            return tenant
        if len(self._tracked) < self.config.max_tenants_tracked:
            self._tracked.add(tenant)
            return tenant
        return OTHER_TENANT

    # ------------------------------------------------------------------ internals
    def _count(self, h: Held, outcome: str, waited_s: float) -> None:
        t = self.tenant_label(h.tenant)
        k = (h.priority, t, outcome)
        self._counts[k] = self._counts.get(k, 0) + 1
        self._wait_sum_s[(h.priority, t)] = self._wait_sum_s.get((h.priority, t), 0.0) + max(0.0, waited_s)

    def _misses(self, h: Held, now_s: float, start_s: float) -> bool:
        """True when starting ``start_s`` after ``now_s`` makes ``h`` miss its deadline."""
        return now_s + start_s + self._own_s(h) > h.deadline_s

    def _own_s(self, h: Held) -> float:
        return h.own_s if h.own_s is not None else self.own_prefill_s(h.prompt_tokens)

    def _shed(self, h: Held, reason: str, wait_s: float, now_s: float) -> Outcome:
        h.done = True
        self._count(h, "shed_" + reason, now_s - h.arrival_s)
        retry = float(max(1, math.ceil(wait_s))) if math.isfinite(wait_s) else 60.0
        return Outcome(h, "shed", reason, retry)

    def _higher_tokens(self, cls: str) -> int:
        return sum(q.tokens for q in self._classes[:self._class_rank[cls]])

    def _held_ahead_tokens(self, cls: str) -> int:
        return sum(q.tokens for q in self._classes[:self._class_rank[cls] + 1])

    def _weight(self, tenant: str) -> float:
        return float(self.config.tenant_weights.get(tenant, 1.0))

    def _share_rate(self, q: _ClassQueue, tenant: str, new: bool) -> float:
        total = sum(self._weight(t) for t in q.active) + (self._weight(tenant) if new else 0.0)
        return self.cluster_rate_tokens_per_s * self._weight(tenant) / total

    def _push(self, q: _ClassQueue, h: Held) -> None:
        tq = q.tenants.get(h.tenant)
        if tq is None:
            tq = q.tenants[h.tenant] = _TenantQueue()
            q.active.append(h.tenant)
            q.deficit[h.tenant] = 0.0
        heapq.heappush(tq.heap, (h.deadline_s, h.seq, h))
        tq.tokens += h.prompt_tokens
        q.num += 1
        q.tokens += h.prompt_tokens
        self._num_held += 1
        heapq.heappush(self._expiry, (h.deadline_s - self._own_s(h), h.seq, h))

    def _select_next(self) -> tuple[_ClassQueue, _TenantQueue, str, Held]:
        """The next request by class, then DRR, then EDF (module docstring, 3), still held: DRR
        has moved to its tenant's turn (with its quantum credited), so selecting again without
        taking it, or after new arrivals of other tenants, gives the same tenant."""
        q = next(q for q in self._classes if q.num)
        while True:
            t = q.active[0]
            if not q.turn_started:
                q.deficit[t] += self.config.quantum_tokens * self._weight(t)
                q.turn_started = True
            tq = q.tenants[t]
            head = tq.heap[0][2]
            if head.prompt_tokens <= q.deficit[t]:
                return q, tq, t, head
            q.active.rotate(-1)
            q.turn_started = False

    def _pop_next(self) -> Held:
        """Take the request :meth:`_select_next` gives out of the queue."""
        q, tq, t, head = self._select_next()
        q.deficit[t] -= head.prompt_tokens
        self._take(q, tq, t, head)
        return head

    def _take(self, q: _ClassQueue, tq: _TenantQueue, t: str, h: Held) -> None:
        """Remove ``h``, the head of tenant ``t``'s queue, from the class."""
        heapq.heappop(tq.heap)
        tq.tokens -= h.prompt_tokens
        q.num -= 1
        q.tokens -= h.prompt_tokens
        self._num_held -= 1
        if not tq.heap:
            del q.tenants[t]
            del q.deficit[t]
            if q.active[0] == t:
                q.active.popleft()
                q.turn_started = False
            else:
                q.active.remove(t)

    def _remove(self, h: Held) -> None:
        """Remove ``h`` from wherever it is held (O(n) in its tenant's queue; sheds and cancels only)."""
        q = self._classes[self._class_rank[h.priority]]
        tq = q.tenants[h.tenant]
        i = next(i for i, e in enumerate(tq.heap) if e[2] is h)
        if i == 0:
            self._take(q, tq, h.tenant, h)
        else:
            tq.heap[i] = tq.heap[-1]
            tq.heap.pop()
            heapq.heapify(tq.heap)
            tq.tokens -= h.prompt_tokens
            q.num -= 1
            q.tokens -= h.prompt_tokens
            self._num_held -= 1
        h.done = True


def prefill_backlog(router: Any, peers: bool = True) -> tuple[int, int]:
    """``(tokens, replicas)``: prompt tokens dispatched to the healthy prefill replicas (PD) or mixed
    replicas (aggregated) and not yet prefilled (the router's load tracker, other router processes'
    share included unless ``peers`` is False), and how many such replicas there are. Reads under
    ``router.lock``."""
    with router.lock:
        infos = router.replicas()
        pre = [i for i in infos if i.healthy and i.role is Role.PREFILL]
        pool = pre or [i for i in infos if i.healthy and i.role is not Role.PREFILL]
        load = router.load
        tokens = 0
        for i in pool:
            s = load.slot(i.replica)
            tokens += int(load.prefill_tokens[s]) + (int(load.peer_prefill_tokens[s]) if peers else 0)
        return tokens, len(pool)


def decode_headroom(router: Any, max_kv_usage: float = 0.9) -> float | None:
    """KV tokens the healthy decode (or mixed) replicas can take: ``max_kv_usage`` of their summed
    KV capacity less the tokens their in-flight requests hold (the load tracker's projected
    ``decode_kv_tokens``, other processes' and engine reports' shares included); ``None`` when a
    replica's capacity is unknown (0: no KV gate). Reads under ``router.lock``."""
    with router.lock:
        pool = [i for i in router.replicas() if i.healthy and i.role is not Role.PREFILL]
        if not pool or any(i.kv_capacity_tokens <= 0 for i in pool):
            return None
        load = router.load
        used = 0
        for i in pool:
            s = load.slot(i.replica)
            used += int(load.decode_kv_tokens[s]) + int(load.peer_kv_tokens[s]) + int(load.external_kv_tokens[s])
        return max_kv_usage * sum(i.kv_capacity_tokens for i in pool) - used


def prefill_rate_tokens_per_s(cost_model: Any, disaggregated: bool) -> float:
    """One replica's prefill rate from a :class:`~balancer.cost_model.CostModel`: a full chunk's
    tokens over its prefill time (``chunk_tokens / prefill_time_s(chunk_tokens)``), tokens/s."""
    eng = cost_model.prefill if disaggregated else cost_model.decode
    return eng.chunk_tokens / eng.prefill_time_s(eng.chunk_tokens)


# ---------------------------------------------------------------------- several router processes


def tenant_slot(tenant: str, num_slots: int = TENANT_SLOTS) -> int:
    """``tenant``'s slot, the same in every process: CRC-32 of its UTF-8 name mod ``num_slots``
    (tenants that share a slot share its weight in :func:`process_share`)."""
    return zlib.crc32(str(tenant).encode()) % num_slots


def process_share(held_tokens: np.ndarray, weights: np.ndarray, me: int) -> float:
    """Process ``me``'s share of the engines' queue budget when each router process holds its own
    queue (module docstring, 5): every tenant slot with held work anywhere has its weight, split
    between the processes by their held tokens there, ``share_me = sum_s w_s h_me,s / H_s /
    sum_{s: H_s > 0} w_s``. So each tenant gets its weighted share of the budget whichever
    processes its requests reach, as one queue's DRR would give it. 1 when nothing is held
    elsewhere.

    Args:
        held_tokens: ``(processes, slots)`` held prompt tokens per process and slot.
        weights: ``(processes, slots)`` their weights (a slot's weight: the largest any process gives).
        me: this process's row.
    """
    h = np.asarray(held_tokens, dtype=np.float64)
    total = h.sum(axis=0)
    live = total > 0
    if not live.any():
        return 1.0
    w = np.asarray(weights, dtype=np.float64).max(axis=0)[live]
    mine = h[me, live] / total[live]
    den = float(w.sum())
    return float((w * mine).sum() / den) if den > 0 else 1.0


# ---------------------------------------------------------------------- the policy's prediction
@dataclass(frozen=True, slots=True)
class TtftPrediction:
    """A request's predicted time to first token on the replica that would serve it soonest, in
    seconds: ``wait_s`` until its prefill can start there (the queue ahead; >= 0) plus ``own_s``,
    its own prefill there (prefix hits counted)."""

    wait_s: float
    own_s: float


@runtime_checkable
class TtftPredictor(Protocol):
    """What a routing policy implements for the admission gate to use its prediction (module
    docstring, 2); ``ep_aware`` does (:meth:`balancer.policies.ep_aware.EpAware.predict_prefill_s`).
    Pure, like ``select``: no clock (``ctx.now_s``), no I/O, no change to the candidates."""

    def predict_prefill_s(self, request: Request, cands: Candidates, ctx: SelectContext
                          ) -> tuple[np.ndarray, np.ndarray]:
        """``(ttft_s, own_s)``, shapes ``(n,)``: per candidate, the predicted seconds until
        ``request``'s prefill completes there, and its own prefill seconds there on an idle rank."""
        ...


def _first_stage(router: Any) -> tuple[str, Any]:
    """The pool a request's prefill runs in and its policy: ``("prefill", prefill policy)`` in PD,
    ``("decode", decode policy)`` (mixed replicas) otherwise."""
    if router.disaggregated:
        return "prefill", router.prefill_policy
    return "decode", router.decode_policy


def predictor_of(router: Any) -> TtftPredictor | None:
    """The policy of ``router``'s first stage when it predicts TTFT (:class:`TtftPredictor`), else None."""
    policy = _first_stage(router)[1]
    return policy if isinstance(policy, TtftPredictor) else None


def wait_model_warning(wait_model: str, policies: Mapping[str, Any]) -> str | None:
    """One warning line when ``wait_model`` asks for a policy's TTFT prediction (``"policy"`` or
    ``"max"``) and none of ``policies`` (label -> policy object or class) has one
    (:class:`TtftPredictor`): the gate then uses the backlog model alone, so the setting changes
    nothing. None otherwise."""
    if wait_model == "backlog" or not policies:
        return None
    if any(isinstance(p, TtftPredictor) or (isinstance(p, type) and issubclass(p, TtftPredictor))
           for p in policies.values()):
        return None
    names = ", ".join(f"{label} {p.name}" for label, p in policies.items())[:200]
    return (f"warning: admission wait model {wait_model!r} but no routing policy here predicts TTFT ({names}; "
            f"ep_aware does): the gate uses the backlog model")


def predict_ttft(router: Any, request: Request, now_s: float) -> TtftPrediction | None:
    """``request``'s predicted TTFT if it were routed at ``now_s``, from the first stage's policy
    (:class:`TtftPredictor`) on the candidates ``router`` would show it (its load tracker, other
    processes' and routers' shares included; its prefix index): the least predicted TTFT over the
    candidates, split into wait and own prefill at that candidate. None when the policy predicts
    nothing or the pool is empty. Reads under ``router.lock``; changes nothing (the policy's random
    source is not drawn)."""
    with router.lock:
        pool, policy = _first_stage(router)
        if not isinstance(policy, TtftPredictor):
            return None
        peer = router.load.peer
        if peer is not None and router.uses_load():
            peer.refresh()
        cands = router.candidates(request, pool)
        if not len(cands):
            return None
        learner = router.cost_learner
        ctx = SelectContext(router.rng, float(now_s), 0, learner.model if learner is not None else router.cost_model,
                            router.ttft_slo)
        ttft, own = policy.predict_prefill_s(request, cands, ctx)
    i = int(np.argmin(ttft))
    t, o = float(ttft[i]), float(own[i])
    if not (math.isfinite(t) and math.isfinite(o)):
        return None
    return TtftPrediction(max(0.0, t - o), max(0.0, o))


_PROBE = Request("pdlb-admission-probe", 0.0, 1)


def predict_pool_wait_s(router: Any, now_s: float) -> float | None:
    """The pool's predicted wait at ``now_s``: :func:`predict_ttft`'s ``wait_s`` of a one-token
    prompt with no prefix hit (how long until the soonest replica can start new work), or None."""
    p = predict_ttft(router, _PROBE, now_s)
    return None if p is None else p.wait_s
