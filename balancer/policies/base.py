"""The policy interface, the registry, and helpers shared by policies.

A policy is a pure selection function of ``(request, candidates, context)``: it reads the
snapshot, may draw from ``context.rng`` (a seeded ``random.Random``), and returns a
:class:`~balancer.types.Choice`. It never mutates the prefix index or the load tracker, never
reads a clock and never does I/O, so the same object runs in the simulator and the live router.

Adding a policy is one module with one ``@register`` decorator; see :func:`make_policy`.
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from balancer.candidates import Candidates
from balancer.cost_model import CostModel
from balancer.types import Choice, Request, Role, TtftSlo


# Read-only by contract. Not frozen: one is built per routing decision, and a frozen __init__ is ~3x slower.
@dataclass(slots=True)
class SelectContext:
    """What a policy may know besides the request and the candidates.

    Attributes:
        rng: the router's seeded random source (the only randomness a policy may use).
        now_s: the caller's clock, seconds (for time-aware policies; most ignore it).
        decision_index: how many decisions this router made before for this pool (round robin).
        cost_model: the router's step-time cost model (:class:`balancer.cost_model.CostModel`)
            for cost-based policies (``ep_aware``), or None; the simulator fits it to its perf
            model, the service takes it from its config and may learn it online.
        ttft_slo: the TTFT budget the operator routes against (:class:`balancer.types.TtftSlo`),
            or None; SLO-aware policies (``ep_aware``) use it, the others ignore it.
    """

    rng: random.Random
    now_s: float = 0.0
    decision_index: int = 0
    cost_model: CostModel | None = None
    ttft_slo: TtftSlo | None = None


class Policy(ABC):
    """Base class of routing policies. Subclasses are frozen dataclasses of their parameters."""

    name: ClassVar[str] = ""
    #: whether :meth:`select` reads the candidates' load (``num_requests``, ``prefill_tokens``,
    #: ``decode_kv_tokens``). ``False`` lets a router skip what only keeps load fresh: with
    #: ``pdlb serve --processes N``, reading the other processes' load before each decision.
    #: Subclasses that never look at load (round robin, random) set it ``False``; the default is
    #: the safe ``True``.
    uses_load: ClassVar[bool] = True
    #: whether :meth:`select` reads the candidates' prefix matches (``cached_tokens`` and the
    #: tiers'). ``False`` (round robin, random, consistent hash) lets ``pdlb serve --processes N``
    #: in approximate mode skip sharing routing decisions between its processes, which only
    #: serves prefix matches. Default ``True``. (Load-aware policies keep it: a prefill pool's
    #: load counts the uncached tokens, which the index's matches decide.)
    uses_prefix_index: ClassVar[bool] = True
    #: whether :meth:`select` reads ``SelectContext.cost_model``; a router fits the cost model
    #: online (``RouterConfig.learn_cost_model``) only when one of its policies does. Default
    #: ``False``; ``ep_aware`` sets it.
    uses_cost_model: ClassVar[bool] = False
    #: whether :meth:`select` runs :mod:`balancer.kernels`' compiled loops: a :class:`Router`
    #: built with such a policy loads them (numba) then, so that its first decision does not pay
    #: it, and building the policy alone (e.g. validating a config) never does. ``ep_aware``,
    #: ``kv_cost`` and ``scored`` set it.
    uses_kernels: ClassVar[bool] = False
    #: the pool roles on which :meth:`select` reads the candidates' in-service prefill columns
    #: (``Candidates.prefill_head_start_s``, ``prefill_head_tokens``, ``prefill_head_pairs``): a
    #: router's decision leaves them ``None`` on its other pools (three gathers of the load per
    #: pool fewer). Default: every role (the safe choice for a policy of one's own); the built-in
    #: policies that never read them set it empty, ``ep_aware`` to prefill pools.
    prefill_head_roles: ClassVar[frozenset[Role]] = frozenset(Role)

    @property
    def session_facts(self) -> float | None:
        """Whether :meth:`select` reads the facts a router keeps of what it routed itself
        (``Candidates.prefill_inflight``, ``returning_requests``, ``returning_kv_tokens``:
        :mod:`balancer.session_forecast`): ``None`` (the default) when not (the router then keeps
        none of them and leaves the columns ``None``), else the returning-session forecast's horizon
        in seconds (> 0). ``ep_aware`` with ``session_forecast`` or ``prefill_at_once`` sets it."""
        return None

    @abstractmethod
    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        """Pick one of ``cands`` (non-empty) for ``request``."""

    def params(self) -> dict[str, object]:
        """The policy's parameters (for logs and result files)."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` constructible by ``make_policy(cls.name, ...)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (its dataclass fields are the policy's parameters).

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(available_policies())}")
    return cls


def make_policy(name: str, **params: object) -> Policy:
    """Construct a registered policy by name.

    Raises:
        ValueError: unknown name (the message lists the valid names), or unknown / invalid
            parameters (the message lists the accepted ones).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(available_policies())}")
    fields: set[str] = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(fields)) or 'none'}"
        )
    return cls(**params)


# ---------------------------------------------------------------------- shared helpers
LOAD_METRICS = ("auto", "requests", "prefill_tokens", "kv_tokens")


def load_values(cands: Candidates, metric: str = "auto") -> np.ndarray:
    """The load number a load-balancing policy minimises, shape ``(n,)``, float64.

    ``auto`` follows DeepSeek's V3/R1 balancers (ANCHORS.md): a prefill pool balances the
    uncached prompt tokens still to compute (core-attention work), a decode pool balances KV
    tokens, each with the request count as a tie-breaker (added as a fraction < 1 so it only
    breaks ties); a mixed pool balances request count with prefill tokens as the tie-breaker.
    """
    if metric == "requests":
        return cands.num_requests.astype(np.float64)
    if metric == "prefill_tokens":
        return cands.prefill_tokens.astype(np.float64)
    if metric == "kv_tokens":
        return cands.decode_kv_tokens.astype(np.float64)
    if metric != "auto":
        raise ValueError(f"unknown load metric {metric!r}; valid: {', '.join(LOAD_METRICS)}")
    if cands.role is Role.PREFILL:
        primary, secondary = cands.prefill_tokens, cands.num_requests
    elif cands.role is Role.DECODE:
        primary, secondary = cands.decode_kv_tokens, cands.num_requests
    else:
        primary, secondary = cands.num_requests, cands.prefill_tokens
    load = primary.astype(np.float64)
    top = float(array_max(secondary)) if len(secondary) else 0.0
    if top > 0:
        load += secondary / (top + 1.0)
    return load


def check_metric(metric: str) -> None:
    if metric not in LOAD_METRICS:
        raise ValueError(f"unknown load metric {metric!r}; valid: {', '.join(LOAD_METRICS)}")


# ``ndarray.min()`` / ``.max()`` / ``np.flatnonzero`` go through Python-level wrappers that cost
# about 1 us each on the small arrays of one decision; ``argmin`` / ``argmax`` / ``nonzero`` are
# direct C calls. These helpers give the same values (first extreme; NaN propagates) for the
# non-empty 1-D arrays policies work on.
def array_min(values: np.ndarray) -> np.generic:
    """``values.min()`` of a non-empty 1-D array."""
    return values[values.argmin()]


def array_max(values: np.ndarray) -> np.generic:
    """``values.max()`` of a non-empty 1-D array."""
    return values[values.argmax()]


def argmin_random(values: np.ndarray, rng: random.Random, mask: np.ndarray | None = None) -> int:
    """Index of the minimum of ``values`` (restricted to ``mask`` if given), ties broken by ``rng``."""
    v = values if mask is None else np.where(mask, values, np.inf)
    idx = (v == array_min(v)).nonzero()[0]
    return int(idx[0]) if len(idx) == 1 else int(idx[rng.randrange(len(idx))])


def argmax_random(values: np.ndarray, rng: random.Random, mask: np.ndarray | None = None) -> int:
    """Index of the maximum of ``values`` (restricted to ``mask`` if given), ties broken by ``rng``."""
    v = values if mask is None else np.where(mask, values, -np.inf)
    idx = (v == array_max(v)).nonzero()[0]
    return int(idx[0]) if len(idx) == 1 else int(idx[rng.randrange(len(idx))])


class ScoreMap(Mapping):
    """``{replica: float(score)}`` for a :class:`~balancer.types.Choice`, built on first read.

    Most decisions are never explained, so the per-candidate dict (512 entries at 512 DP ranks)
    is only materialised when logs, ``Route.explain()`` or tests read it. ``values`` is copied,
    shape ``(n,)``, aligned with ``replicas``; or a function returning such an array, called on
    first read (for scores that cost work of their own, e.g. ranks). ``copy=False``: ``values``
    is kept as it is (an array the caller made for this map and never writes again).
    """

    __slots__ = ("_replicas", "_values", "_dict")

    def __init__(self, replicas: tuple, values: np.ndarray | Callable[[], np.ndarray], *, copy: bool = True) -> None:
        self._replicas = replicas
        self._values = values if callable(values) or not copy else np.array(values, dtype=np.float64)
        self._dict: dict | None = None

    def _get(self) -> dict:
        if self._dict is None:
            values = self._values() if callable(self._values) else self._values
            self._dict = dict(zip(self._replicas, np.asarray(values, dtype=np.float64).tolist()))
        return self._dict

    def __getitem__(self, replica):  # noqa: ANN001, ANN204
        return self._get()[replica]

    def __iter__(self):  # noqa: ANN204
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._replicas)

    def __repr__(self) -> str:
        return f"ScoreMap({self._get()!r})"


def scores_of(cands: Candidates, values: np.ndarray) -> ScoreMap:
    """``{replica: float(value)}`` for a Choice, materialised lazily (see :class:`ScoreMap`)."""
    return ScoreMap(cands.replicas, values)


def fresh_scores(cands: Candidates, values: np.ndarray) -> ScoreMap:
    """:func:`scores_of` of an array the caller made for it and never writes again (float64, shape
    ``(n,)``; e.g. a compiled kernel's output): kept as it is, not copied."""
    return ScoreMap(cands.replicas, values, copy=False)
