"""A fair SLO for comparing routing policies: one that every compared policy meets at light load.

"Highest rate at SLO" compares capacities only when every policy meets the SLO with room to spare
when the cluster is nearly idle. If a policy's light-load attainment sits just above the target
(or below it), its attainment curve is nearly flat around the target and its "highest rate" is
where that flat curve happens to cross it: a threshold artefact, not a capacity (issue 23: on the
Mooncake trace at 90% of requests within 2 s + 0.1 s/1k tokens, the best anchors sit 0.75 points
above the target even at 1/64 of the trace rate).

:func:`fair_ttft_scale` finds the smallest factor ``k`` on a grid such that the SLO with its TTFT
budget (flat part and per-1k part) multiplied by ``k`` is met at light load by every policy with
``margin`` to spare: each policy's attainment at light load is at least ``attainment + margin``.
:func:`scaled_slo` applies it. Searching for the highest rate at the scaled SLO then measures how
much load each policy takes before queueing, not the zero-load floor, decides its attainment.

Source: pdlb (issue 23's fairness rule, stated as a computation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from sim.search.capacity import reachable_ttft_scale
from sim.search.point import SLO

#: most grid steps tried (k from 1 to 1 + step * MAX_STEPS): bounds the search on any input
MAX_STEPS = 10_000


@dataclasses.dataclass(frozen=True)
class FairScale:
    """What :func:`fair_ttft_scale` found.

    Attributes:
        scale: the TTFT budget factor ``k`` (>= 1), on the grid; ``inf`` when some policy cannot
            reach ``attainment + margin`` at any budget (its TPOT budget or unfinished requests
            fail too many requests).
        needed: each policy's own smallest factor (unrounded; ``inf`` as above), by policy.
        binding: the policy whose factor set ``scale`` (the one closest to failing idle).
    """

    scale: float
    needed: dict[str, float]
    binding: str


def fair_ttft_scale(light: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]], slo: SLO, margin: float = 0.02,
                    step: float = 0.05) -> FairScale:
    """The smallest TTFT budget factor ``k`` in ``{1, 1 + step, 1 + 2 step, ...}`` at which every
    policy's light-load run meets ``slo`` with attainment at least ``slo.attainment + margin``.

    Args:
        light: per policy, its light-load run's per-request ``(ttft_s, tpot_s, prompt_tokens)``,
            shapes ``(n,)`` each (NaN TTFT = never got a first token: a miss; NaN TPOT = a
            one-token output: no TPOT budget).
        slo: the base SLO (attainment form).
        margin: attainment points to spare at light load (0.02 = 2 points above the target).
        step: grid step of ``k`` (0.05: budgets in 5% steps).

    Returns:
        :class:`FairScale`.

    Raises:
        ValueError: no policies, a percentile-form SLO, ``margin`` outside ``[0, 1 - attainment]``,
            ``step`` not in (0, 10], arrays of different lengths.
    """
    if not light:
        raise ValueError("fair_ttft_scale needs at least one policy's light-load run")
    if slo.percentile is not None:
        raise ValueError("fair_ttft_scale works on an attainment-form SLO (percentile is set)")
    if not (0.0 <= margin <= 1.0 - slo.attainment + 1e-12):
        raise ValueError(f"margin must be in [0, {1.0 - slo.attainment:g}] (target + margin <= 1), got {margin!r}")
    if not (0.0 < step <= 10.0 and math.isfinite(step)):
        raise ValueError(f"step must be in (0, 10], got {step!r}")
    target = SLO(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s, attainment=min(1.0, slo.attainment + margin),
                 ttft_per_1k_prompt_tokens_s=slo.ttft_per_1k_prompt_tokens_s)
    needed: dict[str, float] = {}
    for name, (ttft, tpot, prompt) in light.items():
        ttft, tpot, prompt = (np.asarray(x, dtype=np.float64) for x in (ttft, tpot, prompt))
        if not (len(ttft) == len(tpot) == len(prompt)):
            raise ValueError(f"{name}: ttft, tpot and prompt arrays differ in length "
                             f"({len(ttft)}, {len(tpot)}, {len(prompt)})")
        k = reachable_ttft_scale(ttft, tpot, prompt, target)
        needed[name] = float("inf") if k is None else float(k)
    binding = max(needed, key=lambda p: needed[p])
    k = needed[binding]
    if not math.isfinite(k):
        return FairScale(float("inf"), needed, binding)
    steps = math.ceil((k - 1.0) / step - 1e-9)
    if steps > MAX_STEPS:
        return FairScale(float("inf"), needed, binding)
    return FairScale(1.0 + step * max(steps, 0), needed, binding)


def scaled_slo(slo: SLO, scale: float) -> SLO:
    """``slo`` with both parts of its TTFT budget multiplied by ``scale`` (> 0, finite).

    Raises:
        ValueError: a non-positive or non-finite ``scale``.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    return dataclasses.replace(slo, ttft_s=slo.ttft_s * scale,
                               ttft_per_1k_prompt_tokens_s=slo.ttft_per_1k_prompt_tokens_s * scale)


def attainment_at(ttft_s: np.ndarray, tpot_s: np.ndarray, prompt_tokens: np.ndarray, slo: SLO) -> float:
    """Fraction of requests meeting both budgets of ``slo`` (NaN TTFT = a miss; NaN TPOT = no TPOT
    budget), as :meth:`sim.search.point.SLO.verdict` counts them; NaN for no requests."""
    ttft_s, tpot_s = np.asarray(ttft_s, dtype=np.float64), np.asarray(tpot_s, dtype=np.float64)
    if not len(ttft_s):
        return float("nan")
    budget = slo.ttft_budget_s(np.asarray(prompt_tokens, dtype=np.float64))
    with np.errstate(invalid="ignore"):
        ok = (ttft_s <= budget) & np.where(np.isnan(tpot_s), True, tpot_s <= slo.tpot_s)
    return float(ok.mean())


def rate_at_ttft_scale(rates: np.ndarray, needed: np.ndarray, scale: float) -> float:
    """The highest rate at which the SLO with its TTFT budget times ``scale`` holds, read off runs
    on a grid of rates: ``needed[i]`` is the smallest budget factor at which run ``i`` (at
    ``rates[i]``) meets the SLO (:func:`sim.search.capacity.reachable_ttft_scale`; ``inf`` or NaN where no
    factor does). The SLO holds up to the first grid rate whose factor exceeds ``scale``; between
    that rate and the one before it the crossing is interpolated linearly in ``(log factor, log
    rate)`` (not interpolated when the failing run has no finite factor: the last rate that holds).

    Args:
        rates: grid rates (any unit; > 0, strictly increasing), shape ``(n,)``.
        needed: each run's factor, shape ``(n,)``.
        scale: the budget factor judged (> 0).

    Returns:
        The rate (in ``rates``' unit); ``0.0`` when the SLO fails already at ``rates[0]`` (the
        rate is below the grid), ``inf`` when it holds at every grid rate (above it).

    Raises:
        ValueError: empty or unequal arrays, rates not positive and strictly increasing, a scale
            that is not a positive finite number.
    """
    r = np.asarray(rates, dtype=np.float64)
    k = np.asarray(needed, dtype=np.float64)
    if r.ndim != 1 or len(r) == 0 or r.shape != k.shape:
        raise ValueError(f"rates and needed must be non-empty 1-d arrays of one length, got {r.shape} and {k.shape}")
    if not (np.all(np.isfinite(r)) and np.all(r > 0) and np.all(np.diff(r) > 0)):
        raise ValueError("rates must be positive, finite and strictly increasing")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    k = np.where(np.isnan(k), np.inf, k)
    fail = np.flatnonzero(k > scale)
    if not len(fail):
        return float("inf")
    i = int(fail[0])
    if i == 0:
        return 0.0
    if not math.isfinite(k[i]):
        return float(r[i - 1])
    lo, hi = math.log(max(k[i - 1], 1e-12)), math.log(k[i])
    t = (math.log(scale) - lo) / (hi - lo) if hi > lo else 0.0
    t = min(max(t, 0.0), 1.0)
    return float(math.exp(math.log(r[i - 1]) + t * (math.log(r[i]) - math.log(r[i - 1]))))
