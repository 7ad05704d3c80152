"""The ``admission`` config section of ``pdlb serve`` (and what ``pdlb sim``'s ``--admission*`` flags
set; the flags: :mod:`pdlb_cli.admission_args`).

Deadline admission (:mod:`balancer.deadline_admission`) is off by default; ``admission.enabled:
true`` in a ``pdlb serve`` config file, or ``--admission`` on either command, turns it on. The
fields map one to one onto :class:`balancer.deadline_admission.AdmissionConfig` (see there for the
algorithm); the service adds how a request names its tenant, class and deadline (headers, the API
key). docs/serving.md lists the keys.
"""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from balancer.deadline_admission import MAX_DEADLINE_S, WAIT_MODELS, AdmissionConfig
from balancer.types import TtftSlo

__all__ = ["AdmissionSettings"]


class AdmissionSettings(BaseModel):
    """Deadline admission settings (units in the names).

    Attributes:
        enabled: hold, order and shed requests before routing (default off: every request is
            routed at arrival, as before).
        ttft_slo_s / ttft_slo_per_1k_tokens_s: the TTFT budget that sets a request's deadline
            (``pdlb sim`` takes ``--slo-ttft-s`` instead).
        dispatch_wait_s: dispatch held requests while the predicted engine wait is below this;
            default a quarter of ``ttft_slo_s``.
        prefill_tokens_per_s: one prefill (or mixed) replica's prefill rate; default from the
            router's cost model.
        priority_classes / default_priority: class names, highest first, and the class of requests
            that name none (or an unknown one).
        tenant_weights: deficit-round-robin weight per tenant (others 1.0).
        quantum_tokens: DRR quantum in prompt tokens.
        max_queue_requests / max_queue_per_tenant: queue bounds (a request past them gets 429).
        max_tenants_tracked: tenant names kept in the metrics (others count as ``other``).
        tenant_header / priority_header / deadline_header: request headers naming the tenant, the
            class and the deadline in milliseconds after arrival (at most 3,600,000).
        tenant_from_api_key: with no tenant header, the tenant is ``key-`` plus the first 12 hex
            digits of the SHA-256 of the ``Authorization: Bearer`` token (the key itself is never
            logged or exported); without either the tenant is ``default``.
        drain_interval_s: the service re-checks the queue at least this often (deadlines pass
            while nothing finishes).
        wait_model: ``auto`` (the routing policy's TTFT prediction when it has one, e.g.
            ``ep_aware``; else prefill backlog / rate) or ``backlog`` (always backlog / rate).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    ttft_slo_s: float = Field(2.0, gt=0, le=MAX_DEADLINE_S)
    ttft_slo_per_1k_tokens_s: float = Field(0.0, ge=0, le=MAX_DEADLINE_S)
    dispatch_wait_s: float | None = Field(None, gt=0, le=MAX_DEADLINE_S)
    prefill_tokens_per_s: float | None = Field(None, gt=0, le=1e12)
    priority_classes: list[str] = Field(default_factory=lambda: ["high", "normal", "low"], min_length=1, max_length=16)
    default_priority: str = "normal"
    tenant_weights: dict[str, float] = Field(default_factory=dict, max_length=1024)
    quantum_tokens: int = Field(8192, ge=1, le=2**31)
    max_queue_requests: int = Field(1024, ge=1, le=1_000_000)
    max_queue_per_tenant: int = Field(256, ge=1, le=1_000_000)
    max_tenants_tracked: int = Field(64, ge=1, le=10_000)
    tenant_header: str = "x-pdlb-tenant"
    priority_header: str = "x-pdlb-priority"
    deadline_header: str = "x-pdlb-deadline-ms"
    tenant_from_api_key: bool = True
    drain_interval_s: float = Field(0.02, gt=0, le=10.0)
    wait_model: str = "backlog"

    @field_validator("wait_model")
    @classmethod
    def _wait_model(cls, v: str) -> str:
        if v not in WAIT_MODELS:
            raise ValueError(f"wait_model must be one of {', '.join(WAIT_MODELS)}, got {v!r}")
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for t, w in v.items():
            if not w > 0 or w == float("inf"):
                raise ValueError(f"tenant_weights[{t!r}] must be a finite number > 0, got {w}")
        return v

    @model_validator(mode="after")
    def _check_core(self) -> AdmissionSettings:
        self.to_core()  # the core's own checks (distinct classes, a known default)
        return self

    def to_core(self, ttft_slo: TtftSlo | None = None) -> AdmissionConfig:
        """The policy core's config (``ttft_slo`` overrides this section's budget: ``pdlb sim``'s
        ``--slo-ttft-s``)."""
        return AdmissionConfig(
            ttft_slo=ttft_slo or TtftSlo(self.ttft_slo_s, self.ttft_slo_per_1k_tokens_s),
            dispatch_wait_s=self.dispatch_wait_s, prefill_tokens_per_s=self.prefill_tokens_per_s,
            priority_classes=tuple(self.priority_classes), default_priority=self.default_priority,
            tenant_weights=dict(self.tenant_weights), quantum_tokens=self.quantum_tokens,
            max_queue_requests=self.max_queue_requests, max_queue_per_tenant=self.max_queue_per_tenant,
            max_tenants_tracked=self.max_tenants_tracked, wait_model=self.wait_model)
