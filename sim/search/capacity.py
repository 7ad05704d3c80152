"""Capacity planning: the highest request rate a cluster sustains at an SLO, and the fewest engines
that meet an SLO at a given rate.

Two searches, each for one policy (:class:`~sim.search.point.PolicyPair`) on one scenario and workload:

:func:`search_rate` (``pdlb sim capacity --search rate``)
    The highest rate scale ``f`` (arrival times divided by ``f``, :func:`sim.workload.scale_rate`)
    at which the SLO (:class:`~sim.search.point.SLO`) holds, and its request rate: the requests simulated
    at ``f`` over their arrival window (``f * base_rps`` for the whole workload, ``base_rps =
    num_requests / arrival_window_s`` at scale 1; with ``duration_s`` the window's own rate).
    Geometric bisection inside the stated bounds ``[rate_min, rate_max]`` (default 1/64 .. 64):
    start at ``start`` (default 1), double (or halve) until the SLO flips, then bisect the bracket
    ``[lo, hi)`` (``lo`` meets the SLO, ``hi`` does not) at geometric midpoints until
    ``hi / lo <= 1 + tol`` (default ``tol = 0.02``: the answer is within 2% below the true
    capacity). With ``width`` > 1 points per round (free executor slots), a round evaluates
    ``width`` rates at once: ``width`` doublings, or ``width`` geometric points splitting the
    bracket into ``width + 1`` equal ratios, so a round shrinks it ``width + 1``-fold.
    Evaluations are bounded by ``max_evals`` (default 40). The search assumes the SLO verdict is
    monotone in the rate (it is, up to simulation noise); a point that contradicts it is kept in
    ``points`` and noted in ``notes``.

:func:`search_gpus` (``pdlb sim capacity --search gpus``)
    The fewest GPUs, in whole engines of the scenario's shape (DP ranks and GPUs per rank fixed),
    that meet the SLO at rate scale ``rate_scale``. Aggregated: bisection on the mixed pool's
    engine count in ``[1, max]``. PD, prefill and decode together: (1) the fewest prefill engines
    with the decode pool at its maximum and, at the same time, the fewest decode engines with the
    prefill pool at its maximum (bisections; by monotonicity no smaller count of either pool can
    work, whatever the other), then (2) from that corner ``(P*, D*)`` the pairs ``P >= P*, D >= D*``
    in increasing GPU count until one meets the SLO (each failure adds its two successors), so
    the answer has the fewest GPUs of all pairs if the verdict is monotone in each pool.
    Maxima default to ``max(4 x the scenario's count, 8)`` engines per pool.

Before any simulation both check the **zero-load floor** (:func:`zero_load_floor`): a lower bound
of each request's TTFT and TPOT that no rate, policy or engine count can beat (the request alone on
one DP rank, with every prefix hit an infinite cache could give). If the SLO fails on the floor, the
search stops with ``status = "unreachable"`` and a reason naming the worst request, instead of
searching forever. A floor that already misses most of the requests the SLO lets miss, leaving
queueing less than 1% of the requests to spare, gets a ``thin headroom`` note (:func:`thin_headroom_note`): the answer is then decided by noise.

Goodput (:mod:`sim.run.metrics`): requests meeting the SLO per second of the **arrival window**
(``last arrival - first arrival``), so an overloaded run does not look better (or worse) because
its queues took long to drain; at 100% attainment it equals the offered rate.

Points run on an executor (:mod:`sim.search.executor`): in this process, a local process pool or Ray.
:func:`run_searches` runs many searches at once (policies in parallel; each search is sequential
only in its bisection rounds). A failing point stops its simulation as soon as more requests have
provably missed the SLO than it allows (``early_stop``), which makes overloaded points cheap.

Library use (the lead's benchmark, :mod:`bench.capacity_search`)::

    from sim.search.capacity import SLO, search_rate, search_gpus
    r = search_rate("dsv3-pd-h200", None, "cache_aware", slo=SLO(ttft_s=2, tpot_s=0.1, attainment=0.9))
    r.status, r.rate_scale, r.rate_rps, r.bracket, len(r.points)
    g = search_gpus("dsv3-pd-h200", None, "cache_aware", rate_scale=0.5)
    g.prefill_engines, g.decode_engines, g.num_gpus
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import math
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balancer.types import Request
from sim.search.executor import Executor, make_executor
from sim.search.point import (
    SLO,
    Point,
    PointResult,
    PolicyPair,
    SimOptions,
    WorkloadSpec,
    error_result,
    load_workload,
    parse_policy,
    register_workload,
)
from sim.scenario import Scenario, load_scenario

__all__ = ["SLO", "Floor", "at_limit_note", "reachable_ttft_scale", "GpuSearch", "GpuSearchResult", "RateSearch", "RateSearchResult", "run_searches",
           "search_gpus", "search_rate", "thin_headroom_note", "zero_load_floor"]

#: Default bounds and tolerance of the rate search (rate scales).
RATE_MIN = 1 / 64
RATE_MAX = 64.0
RATE_TOL = 0.02
MAX_EVALS = 40
#: A search whose SLO leaves less than this share of requests between what the zero-load floor
#: already misses and what the SLO allows gets a note (:func:`thin_headroom_note`).
THIN_HEADROOM = 0.01

# ---------------------------------------------------------------------- zero-load floor


@dataclass
class Floor:
    """The zero-load floor of a workload on a scenario's engine shape.

    Per request: ``ttft_lb_s`` = the prefill of its uncached tokens alone on one DP rank
    (chunks of ``max_prefill_tokens``, step times of the perf model with every other rank of the
    step group idle; cached = the leading blocks an infinite cache holding every earlier request
    would have, at most ``prompt - 1`` tokens) plus ``kv_transfer_latency_s`` (PD); ``tpot_lb_s``
    = one decode step of a batch of one at the prompt's context (the smallest context of its
    decode steps). Both are lower bounds whatever the rate, policy or engine count, as long as
    step time does not fall with more work (the roofline's does not).

    Attributes:
        ttft_lb_s / tpot_lb_s: shape ``(num_requests,)`` (TPOT NaN for one-token outputs).
        verdict: :meth:`SLO.verdict` of the bounds (``attainment`` is the highest reachable).
        meets: the SLO holds on the floor (necessary, not sufficient, for any size to meet it).
        reason: why not, naming the worst request ("" when ``meets``).
    """

    ttft_lb_s: np.ndarray
    tpot_lb_s: np.ndarray
    verdict: dict[str, Any]
    meets: bool
    reason: str = ""


def zero_load_floor(scenario: Scenario, requests: Sequence[Request], slo: SLO,
                    perf_factory: Callable | None = None) -> Floor:
    """The zero-load floor (see :class:`Floor`) of ``requests`` on ``scenario`` against ``slo``.

    Cost: one vectorised perf-model call over every prefill chunk of the workload (tens of
    milliseconds for the embedded trace); no simulation.
    """
    from balancer.hashing import leading_held
    from sim.run.pool_perf import build_perf

    perf_factory = perf_factory or build_perf
    pre_pool = scenario.prefill if scenario.disaggregated else scenario.mixed
    dec_pool = scenario.decode if scenario.disaggregated else scenario.mixed
    assert pre_pool is not None and dec_pool is not None
    n = len(requests)
    prompt = np.fromiter((r.prompt_tokens for r in requests), dtype=np.int64, count=n)
    out = np.fromiter((r.output_tokens for r in requests), dtype=np.int64, count=n)
    seen: set[int] = set()
    cached = np.zeros(n, dtype=np.int64)
    for i, r in enumerate(sorted(range(n), key=lambda j: requests[j].arrival_time_s)):
        req = requests[r]
        cached[r] = min(leading_held(req.block_hashes, seen) * scenario.block_size, req.prompt_tokens - 1)
        seen.update(req.block_hashes)
    uncached = prompt - cached

    def per_rank(perf: Any, ranks: int, cols: list[np.ndarray]) -> np.ndarray:
        r = ranks if perf.ep_synchronous else 1
        arrays = []
        for c in cols:
            a = np.zeros((len(c), r), dtype=np.float64)
            a[:, 0] = c
            arrays.append(a)
        return np.asarray(perf.step_time_s(*arrays), dtype=np.float64)

    pre_perf = perf_factory(scenario, pre_pool)
    chunk = pre_pool.max_prefill_tokens
    steps = -(-uncached // chunk)  # >= 1: at least one token is computed
    owner = np.repeat(np.arange(n), steps)
    first = np.cumsum(steps) - steps
    j = np.arange(len(owner)) - first[owner]
    tokens = np.minimum(chunk, uncached[owner] - j * chunk).astype(np.float64)
    done = (cached[owner] + j * chunk).astype(np.float64)
    pairs = tokens * done + tokens * (tokens + 1.0) / 2.0  # sim.perf.base.causal_attn_pairs
    zeros = np.zeros(len(owner))
    times = per_rank(pre_perf, pre_pool.dp_ranks, [tokens, pairs, zeros, zeros])
    ttft = np.bincount(owner, weights=times, minlength=n)
    if scenario.disaggregated:
        ttft = ttft + scenario.kv_transfer_latency_s
    dec_perf = perf_factory(scenario, dec_pool) if dec_pool is not pre_pool else pre_perf
    zeros = np.zeros(n)
    tpot_step = per_rank(dec_perf, dec_pool.dp_ranks, [zeros, zeros, np.ones(n), prompt.astype(np.float64)])
    tpot = np.where(out > 1, tpot_step, np.nan)
    # refused at arrival whatever the rate (sim.run.admission): they miss
    too_long = prompt + out > scenario.effective_max_model_len
    ttft = np.where(too_long, np.nan, ttft)
    tpot = np.where(too_long, np.nan, tpot)
    verdict = slo.verdict(ttft, tpot, prompt)
    floor = Floor(ttft, tpot, verdict, bool(verdict["meets"]))
    if not floor.meets:
        budget = slo.ttft_budget_s(prompt)
        over = np.where(too_long, -np.inf, ttft / budget)
        worst = int(np.argmax(over))
        req = requests[worst]
        shape = f"{pre_pool.max_prefill_tokens}-token chunks on one DP rank"
        bits = [f"even at zero load (each request alone on the cluster, every prefix hit an infinite cache "
                f"could give) the SLO ({slo.describe()}) cannot hold: "]
        if slo.percentile is None:
            bits.append(f"at most {100 * verdict['attainment']:.1f}% of {n} requests can meet it "
                        f"(target {100 * slo.attainment:g}%)")
        else:
            bits.append(f"TTFT/budget p{slo.percentile:g} >= {verdict['ttft_ratio_pctl']:.2f}, "
                        f"TPOT p{slo.percentile:g} >= {1e3 * verdict['tpot_pctl_s']:.1f} ms")
        n_long = int(np.count_nonzero(too_long))
        if n_long:
            bits.append(f"; {n_long} requests are longer than max_model_len {scenario.effective_max_model_len:,} "
                        "(prompt + output tokens) and are rejected at arrival")
        with np.errstate(invalid="ignore"):
            n_ttft = int(np.count_nonzero(ttft > budget))
        n_tpot = int(np.count_nonzero(np.nan_to_num(tpot, nan=0.0) > slo.tpot_s))
        bits.append(f"; {n_ttft} requests need more than their TTFT budget to prefill, {n_tpot} decode slower "
                    f"than {1e3 * slo.tpot_s:g} ms per token")
        if n_ttft and np.isfinite(over[worst]):
            bits.append(f"; worst: request {req.request_id} with a {req.prompt_tokens:,}-token prompt "
                        f"({int(cached[worst]):,} cacheable) needs >= {ttft[worst]:.2f} s ({shape}) against a "
                        f"{budget[worst]:.2f} s TTFT budget")
        elif n_tpot:
            w = int(np.nanargmax(tpot))
            bits.append(f"; worst: request {requests[w].request_id} ({requests[w].prompt_tokens:,}-token context) "
                        f"needs >= {1e3 * tpot[w]:.1f} ms per decode step")
        scale = reachable_ttft_scale(ttft, tpot, prompt, slo)
        if scale is not None and math.isfinite(scale):
            bits.append(f"; the closest SLO the floor meets has a TTFT budget {scale:.3g} times as large: "
                        f"--slo-ttft-s {slo.ttft_s * scale:.3g}"
                        + (f" --slo-ttft-per-1k-tokens-s {slo.ttft_per_1k_prompt_tokens_s * scale:.3g}"
                           if slo.ttft_per_1k_prompt_tokens_s else "")
                        + " (at zero load; allow more for queueing)")
        floor.reason = "".join(bits)
    return floor


def reachable_ttft_scale(ttft_s: np.ndarray, tpot_s: np.ndarray, prompt_tokens: np.ndarray, slo: SLO) -> float | None:
    """The smallest factor ``k`` such that the SLO with its TTFT budget multiplied by ``k`` holds on
    these per-request TTFTs and TPOTs (the zero-load floor's): the closest reachable SLO printed with
    an ``unreachable`` verdict. ``None`` when the TPOT budget alone already fails (no TTFT budget
    helps); ``inf`` when too few requests can finish at all (rejected ones have NaN TTFT).

    Attainment form: the ``ceil(attainment x n)``-th smallest ``ttft_i / budget_i`` over the requests
    that meet their TPOT budget; percentile form: the p-th percentile of ``ttft_i / budget_i``
    (numpy's linear interpolation, as :meth:`SLO.verdict`), which scales by ``1 / k`` exactly.
    """
    n = len(ttft_s)
    if n == 0:
        return None
    budget = slo.ttft_budget_s(prompt_tokens)
    with np.errstate(invalid="ignore"):
        ratio = np.where(np.isnan(ttft_s), np.inf, ttft_s / budget)
        tpot_ok = np.where(np.isnan(tpot_s), True, tpot_s <= slo.tpot_s)
    if slo.percentile is None:
        need = math.ceil(slo.attainment * n - 1e-9)
        ok = np.sort(ratio[tpot_ok])
        if len(ok) < need:
            return None
        return max(float(ok[need - 1]), 1.0) if need else 1.0
    tp = tpot_s[~np.isnan(tpot_s)]
    if len(tp) and float(np.percentile(tp, slo.percentile)) > slo.tpot_s:
        return None
    return max(float(np.percentile(ratio, slo.percentile)), 1.0)


# ---------------------------------------------------------------------- results


@dataclass
class RateSearchResult:
    """The answer of :func:`search_rate`.

    Attributes:
        policy: the policy label.
        scenario: the scenario's name; ``num_gpus`` its size.
        slo: the SLO searched against.
        status: ``"found"`` (bracket within tolerance), ``"above_bounds"`` (the SLO holds at
            ``rate_max``), ``"below_bounds"`` (it fails at ``rate_min`` though the floor allows
            it), ``"unreachable"`` (fails on the zero-load floor; no simulation run),
            ``"max_evals"`` (evaluation budget spent; the bracket so far), ``"error"`` (a point
            failed; see ``reason``).
        rate_scale: the highest rate scale that met the SLO (``None`` if none did).
        rate_rps: its offered request rate, requests/s: requests simulated at ``rate_scale`` over
            their arrival window (with ``duration_s``, that window's, not the whole trace's).
        bracket: ``(lo, hi)``: ``lo`` met the SLO, ``hi`` did not (either may be None).
        best: the point at ``rate_scale`` (a complete run: summary, goodput).
        points: every evaluated point, in evaluation order.
        floor: the zero-load floor.
        reason: a sentence for non-"found" statuses.
        notes: non-monotone verdicts and other remarks.
        base_rps: the workload's offered rate at scale 1.
    """

    policy: str
    scenario: str
    num_gpus: int
    slo: SLO
    status: str
    rate_scale: float | None
    rate_rps: float | None
    bracket: tuple[float | None, float | None]
    best: PointResult | None
    points: list[PointResult]
    floor: Floor | None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    base_rps: float = float("nan")

    @property
    def goodput_rps(self) -> float:
        return self.best.goodput_rps if self.best else float("nan")


@dataclass
class GpuSearchResult:
    """The answer of :func:`search_gpus`.

    Attributes:
        policy / scenario / slo / rate_scale: what was searched.
        status: ``"found"``, ``"above_bounds"`` (not met at the maximum engine counts),
            ``"unreachable"`` (fails on the zero-load floor), ``"max_evals"``, ``"error"``.
        prefill_engines / decode_engines / mixed_engines: the answer (None for absent pools or
            when not found).
        num_gpus: its GPU count.
        best: the point of the answer.
        points / floor / reason / notes: as in :class:`RateSearchResult`.
        max_engines: the bounds searched, ``{pool: max engines}``.
    """

    policy: str
    scenario: str
    slo: SLO
    rate_scale: float
    status: str
    prefill_engines: int | None
    decode_engines: int | None
    mixed_engines: int | None
    num_gpus: int | None
    best: PointResult | None
    points: list[PointResult]
    floor: Floor | None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    max_engines: dict[str, int] = field(default_factory=dict)

    @property
    def goodput_rps(self) -> float:
        return self.best.goodput_rps if self.best else float("nan")


def thin_headroom_note(floor: Floor, slo: SLO, limit: float = THIN_HEADROOM) -> str | None:
    """A note when the SLO leaves queueing almost no misses to spend, else None.

    The zero-load floor already misses ``m_floor`` of the ``n`` requests (their prompts alone take
    longer than their budget, :class:`Floor`); the SLO lets ``m_slo`` miss (:meth:`SLO.max_misses`).
    When the floor already spends most of that allowance (``m_floor > m_slo - m_floor``) and the
    slack ``m_slo - m_floor`` left to queueing is below ``limit * n`` (default 1% of the requests),
    the verdict at any rate turns on a handful of requests, so the attainment stays within a few
    tenths of a point of the target over a wide range of rates and the rate (or engine count)
    found is decided by simulation noise. A strict SLO alone is not noted: at p99 (or attainment
    0.99) the allowance itself is 1% of the requests, and a floor that misses 1 of 12,031 (or none,
    at p99.9 or attainment 1.0) leaves queueing almost all of it. Measured: the embedded Mooncake trace on
    ``dsv3-pd-h200`` at TTFT p97 <= 4 s + 0.2 s per 1k tokens (floor 97.53%, 0.53 pt above the
    target) scores 96.8-97.1% with ``ep_aware`` (SLO-aware or not) at every rate scale from 0.30 to 0.48,
    and five variants of ``ep_aware`` searched to answers from 0.32 to 0.42.
    """
    n = len(floor.ttft_lb_s)
    if not floor.meets or not n:
        return None
    floor_misses = n - int(floor.verdict["num_ok"])
    slack = slo.max_misses(n) - floor_misses  # misses queueing may still add (SLO.max_misses)
    if slack >= limit * n or floor_misses <= slack:  # not thin, or the SLO's own strictness
        return None
    return (f"thin headroom: even at zero load {floor_misses} of the {n} requests ({100 * floor_misses / n:.2f}%) "
            f"miss their budget and the SLO allows {slo.max_misses(n)}, which leaves {slack} "
            f"({100 * slack / n:.2f}%) for queueing to spend; near the answer the attainment moves by noise, so "
            f"rates (or engine counts) far apart can score alike: compare policies at a looser SLO")


# ---------------------------------------------------------------------- searches

Steps = Generator[list[Point], list[PointResult], Any]


def _base_rps(requests: Sequence[Request]) -> float:
    window = requests[-1].arrival_time_s - requests[0].arrival_time_s if requests else 0.0
    return len(requests) / window if window > 0 else float("nan")


@dataclass
class RateSearch:
    """A rate search, as data (see :func:`search_rate` for the parameters); :meth:`steps` is the
    algorithm as a generator that yields points to evaluate and receives their results."""

    scenario: Scenario
    workload: WorkloadSpec | str
    policy: PolicyPair
    slo: SLO = field(default_factory=SLO)
    rate_min: float = RATE_MIN
    rate_max: float = RATE_MAX
    start: float = 1.0
    tol: float = RATE_TOL
    max_evals: int = MAX_EVALS
    seed: int = 0
    options: SimOptions = field(default_factory=SimOptions)
    early_stop: bool = True
    width: int = 1
    check_floor: bool = True

    def __post_init__(self) -> None:
        if not (0 < self.rate_min <= self.start <= self.rate_max and math.isfinite(self.rate_max)):
            raise ValueError(f"rate bounds must satisfy 0 < rate_min <= start <= rate_max < inf, got "
                             f"{self.rate_min}, {self.start}, {self.rate_max}")
        if not (0 < self.tol < 1):
            raise ValueError(f"tol must be in (0, 1), got {self.tol}")
        if self.max_evals < 1:
            raise ValueError(f"max_evals must be >= 1, got {self.max_evals}")

    @property
    def label(self) -> str:
        return self.policy.label

    def point(self, f: float) -> Point:
        return Point(self.scenario, self.workload, self.policy, f, self.slo, self.seed, self.options,
                     self.early_stop, (("search", "rate"), ("policy", self.label)))

    def steps(self) -> Steps:
        requests = load_workload(self.workload)
        base = _base_rps(requests)
        points: list[PointResult] = []
        notes: list[str] = []
        floor = None

        def result(status: str, lo: float | None, hi: float | None, reason: str = "") -> RateSearchResult:
            best = next((p for p in points if lo is not None and p.point.rate_scale == lo and p.meets), None)
            # the rate of the requests simulated at the answer, not lo x the whole trace's mean rate
            # (17-29% too high when --duration-s simulates a calmer first window)
            rps = best.offered_rps if best is not None and math.isfinite(best.offered_rps) else \
                (lo * base if lo is not None else None)
            return RateSearchResult(self.label, self.scenario.name, self.scenario.num_gpus, self.slo, status, lo,
                                    rps, (lo, hi), best, points, floor, reason, notes, base)

        if self.check_floor:
            floor = zero_load_floor(self.scenario, requests, self.slo, self.options.perf_factory)
            if not floor.meets:
                return result("unreachable", None, None, floor.reason)
            note = thin_headroom_note(floor, self.slo)
            if note:
                notes.append(note)
        lo: float | None = None  # highest rate that met the SLO (below hi)
        hi: float | None = None  # lowest rate that missed it
        k = max(1, self.width)
        while True:
            if lo is not None and hi is not None:
                if hi / lo <= 1 + self.tol:
                    return result("found", lo, hi)
                cands = [lo * (hi / lo) ** (j / (k + 1)) for j in range(1, k + 1)]
            elif lo is not None:
                if lo >= self.rate_max:
                    return result("above_bounds", lo, None, f"the SLO still holds at the upper bound, rate scale "
                                  f"{self.rate_max:g} ({self.rate_max * base:.3g} req/s); raise the upper bound")
                cands = sorted({min(lo * 2.0 ** j, self.rate_max) for j in range(1, k + 1)})
            elif hi is not None:
                if hi <= self.rate_min:
                    return result("below_bounds", None, hi, f"the SLO fails even at the lower bound, rate scale "
                                  f"{self.rate_min:g} ({self.rate_min * base:.3g} req/s), though the zero-load floor "
                                  f"allows it; lower the bound")
                cands = sorted({max(hi / 2.0 ** j, self.rate_min) for j in range(1, k + 1)})
            else:
                cands = sorted({min(max(self.start * 2.0 ** s, self.rate_min), self.rate_max)
                                for s in [0, 1, -1, 2, -2, 3, -3][:k]})
            budget = self.max_evals - len(points)
            if budget <= 0:
                return result("max_evals", lo, hi, f"stopped after {self.max_evals} evaluations")
            cands = cands[:budget]
            got = yield [self.point(f) for f in cands]
            points.extend(got)
            for r in got:
                if r.error:
                    return result("error", lo, hi, f"rate scale {r.point.rate_scale:g}: {r.error}")
            for r in sorted(got, key=lambda r: r.point.rate_scale):
                f = r.point.rate_scale
                if r.meets:
                    if hi is not None and f >= hi:
                        notes.append(f"non-monotone: met the SLO at rate scale {f:.4g} above a miss at {hi:.4g}")
                    elif lo is None or f > lo:
                        lo = f
                else:
                    if lo is not None and f <= lo:
                        notes.append(f"non-monotone: missed the SLO at rate scale {f:.4g} below a pass at {lo:.4g}")
                    elif hi is None or f < hi:
                        hi = f


def at_limit_note(counts: dict[str, int], pools_at_max: Sequence[str]) -> str:
    """The note of a GPU answer with a pool at its search maximum: fewer GPUs may meet the SLO
    with more engines in that pool and fewer in another, outside the searched bounds."""
    flags = " and ".join(f"--max-{p}-engines" for p in pools_at_max)
    which = ", ".join(f"{counts[p]} {p} engines" for p in pools_at_max)
    return (f"at the limit: the answer's {which} {'is' if len(pools_at_max) == 1 else 'are'} the most searched; "
            f"raise {flags} (a pair beyond it may need fewer GPUs)")


def _pools(sc: Scenario) -> list[str]:
    return ["prefill", "decode"] if sc.disaggregated else ["mixed"]


@dataclass
class GpuSearch:
    """A GPU search, as data (see :func:`search_gpus`); :meth:`steps` is the algorithm."""

    scenario: Scenario
    workload: WorkloadSpec | str
    policy: PolicyPair
    slo: SLO = field(default_factory=SLO)
    rate_scale: float = 1.0
    max_engines: dict[str, int] | None = None
    max_evals: int = MAX_EVALS
    seed: int = 0
    options: SimOptions = field(default_factory=SimOptions)
    early_stop: bool = True
    width: int = 1
    check_floor: bool = True

    def __post_init__(self) -> None:
        bounds = {p: max(4 * getattr(self.scenario, p).num_engines, 8) for p in _pools(self.scenario)}
        for p, n in (self.max_engines or {}).items():
            if p not in bounds:
                raise ValueError(f"max_engines: scenario {self.scenario.name!r} has no {p} pool")
            if n is None:
                continue
            if n < 1:
                raise ValueError(f"max_engines: {p} must be >= 1, got {n}")
            bounds[p] = int(n)
        self.max_engines = bounds
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            raise ValueError(f"rate_scale must be a finite number > 0, got {self.rate_scale}")

    @property
    def label(self) -> str:
        return self.policy.label

    def point(self, counts: dict[str, int]) -> Point:
        sc = self.scenario.with_pools(**{f"{p}_engines": n for p, n in counts.items()})
        return Point(sc, self.workload, self.policy, self.rate_scale, self.slo, self.seed, self.options,
                     self.early_stop, (("search", "gpus"), ("policy", self.label),
                                       *((f"{p}_engines", n) for p, n in sorted(counts.items()))))

    def _gpus(self, counts: dict[str, int]) -> int:
        return sum(getattr(self.scenario, p).dp_ranks * getattr(self.scenario, p).gpus_per_rank * n
                   for p, n in counts.items())

    def steps(self) -> Steps:
        requests = load_workload(self.workload)
        assert self.max_engines is not None
        mx = dict(self.max_engines)
        points: list[PointResult] = []
        notes: list[str] = []
        floor = None
        k = max(1, self.width)

        def result(status: str, counts: dict[str, int] | None, reason: str = "", best: PointResult | None = None
                   ) -> GpuSearchResult:
            c = counts or {}
            return GpuSearchResult(self.label, self.scenario.name, self.slo, self.rate_scale, status,
                                   c.get("prefill"), c.get("decode"), c.get("mixed"),
                                   self._gpus(c) if counts else None, best, points, floor, reason, notes, mx)

        if self.check_floor:
            floor = zero_load_floor(self.scenario, requests, self.slo, self.options.perf_factory)
            if not floor.meets:
                return result("unreachable", None, floor.reason)
            note = thin_headroom_note(floor, self.slo)
            if note:
                notes.append(note)

        # phase 1: per pool, the fewest engines with every other pool at its maximum
        pools = _pools(self.scenario)
        state = {p: [0, None] for p in pools}  # [largest failing count, smallest passing count]
        verdicts: dict[tuple, PointResult] = {}

        def key(counts: dict[str, int]) -> tuple:
            return tuple(counts[p] for p in pools)

        while True:
            batch: list[dict[str, int]] = []
            for p in pools:
                bad, good = state[p]
                top = mx[p] if good is None else good
                if good is not None and good - bad <= 1:
                    continue
                if good is None:
                    # the maximum first (is the pool able at all?), with k-1 points below it
                    cands = sorted({top, *(max(1, round(top * j / k)) for j in range(1, k))})
                else:
                    cands = sorted({bad + max(1, round((good - bad) * j / (k + 1))) for j in range(1, k + 1)} - {good})
                cands = [c for c in cands if bad < c <= top]
                for c in cands:
                    counts = {q: mx[q] for q in pools} | {p: c}
                    if key(counts) not in verdicts and counts not in batch:
                        batch.append(counts)
            if not batch:
                break
            budget = self.max_evals - len(points)
            if budget <= 0:
                return result("max_evals", None, f"stopped after {self.max_evals} evaluations")
            got = yield [self.point(c) for c in batch[:budget]]
            points.extend(got)
            for c, r in zip(batch, got):
                if r.error:
                    return result("error", None, f"{c}: {r.error}")
                verdicts[key(c)] = r
            for p in pools:
                others_max = {q: mx[q] for q in pools if q != p}
                for (kk), r in verdicts.items():
                    counts = dict(zip(pools, kk))
                    if any(counts[q] != others_max[q] for q in others_max):
                        continue
                    c = counts[p]
                    if r.meets:
                        state[p][1] = c if state[p][1] is None else min(state[p][1], c)
                    else:
                        state[p][0] = max(state[p][0], c)
                if state[p][1] is not None and state[p][0] >= state[p][1]:
                    notes.append(f"non-monotone in {p} engines: a miss at {state[p][0]} above a pass at {state[p][1]}")
                    state[p][0] = state[p][1] - 1
                if state[p][1] is None and state[p][0] >= mx[p]:
                    return result("above_bounds", None, f"the SLO fails with {mx[p]} {p} engines (the maximum searched) "
                                  f"and every other pool at its maximum; raise the maximum")
        corner = {p: state[p][1] for p in pools}
        # phase 2: pairs at or above the corner, cheapest first
        heap: list[tuple[int, tuple]] = [(self._gpus(corner), key(corner))]
        queued = {key(corner)}
        while heap:
            batch_keys = [heapq.heappop(heap)[1] for _ in range(min(k, len(heap)))]
            todo = [kk for kk in batch_keys if kk not in verdicts]
            if todo:
                budget = self.max_evals - len(points)
                if budget <= 0:
                    return result("max_evals", None, f"stopped after {self.max_evals} evaluations")
                todo = todo[:budget]
                got = yield [self.point(dict(zip(pools, kk))) for kk in todo]
                points.extend(got)
                for kk, r in zip(todo, got):
                    if r.error:
                        return result("error", None, f"{dict(zip(pools, kk))}: {r.error}")
                    verdicts[kk] = r
            passing = [kk for kk in batch_keys if kk in verdicts and verdicts[kk].meets]
            if passing:
                best = min(passing, key=lambda kk: (self._gpus(dict(zip(pools, kk))), kk))
                at_max = [p for p, n in zip(pools, best) if n >= mx[p]]
                if at_max:  # an answer at the search's maximum may be the maximum, not the need
                    notes.append(at_limit_note(dict(zip(pools, best)), at_max))
                # the answer's neighbours, whatever the search evaluated on its way (which depends on
                # its width), then every evaluated pair: the monotonicity verdict (issue 24 item 7)
                near = [kk for kk in neighbours(best, [mx[p] for p in pools]) if kk not in verdicts]
                budget = self.max_evals - len(points)
                checked = near[:max(0, budget)]
                if checked:
                    got = yield [self.point(dict(zip(pools, kk))) for kk in checked]
                    points.extend(got)
                    for kk, r in zip(checked, got):
                        if r.error:
                            return result("error", None, f"{dict(zip(pools, kk))}: {r.error}")
                        verdicts[kk] = r
                notes.append(monotonicity_note(pools, best, {kk: r.meets for kk, r in verdicts.items()},
                                               [mx[p] for p in pools], unchecked=near[len(checked):]))
                return result("found", dict(zip(pools, best)), best=verdicts[best])
            for kk in batch_keys:
                for i, p in enumerate(pools):
                    nxt = list(kk)
                    nxt[i] += 1
                    nk = tuple(nxt)
                    if nxt[i] <= mx[p] and nk not in queued:
                        queued.add(nk)
                        heapq.heappush(heap, (self._gpus(dict(zip(pools, nk))), nk))
        return result("above_bounds", None, "no pair of engine counts within the maxima meets the SLO")


def neighbours(counts: tuple[int, ...], maxima: Sequence[int]) -> list[tuple[int, ...]]:
    """The engine counts one engine away from ``counts`` in one pool, within ``[1, maximum]``:
    for each pool one fewer, then one more (pools in order)."""
    out = []
    for i, n in enumerate(counts):
        for m in (n - 1, n + 1):
            if 1 <= m <= maxima[i]:
                out.append((*counts[:i], m, *counts[i + 1:]))
    return out


def monotonicity_note(pools: Sequence[str], answer: tuple[int, ...], verdicts: dict[tuple[int, ...], bool],
                      maxima: Sequence[int], unchecked: Sequence[tuple[int, ...]] = ()) -> str:
    """One line saying what a GPU search checked of its assumption that the SLO verdict is monotone
    in each pool (more engines never turn a pass into a miss), and what it found.

    Checked: every pair of evaluated points ``a <= b`` (in every pool) where ``a`` meets the SLO
    and ``b`` misses it, and the answer's neighbours (:func:`neighbours`), which the search
    evaluates whatever its width: a neighbour with one engine fewer that meets says the answer is not
    the fewest; one with an engine more that misses says the answer is on a noisy edge. Counts not
    evaluated are not known: the line says how many points the verdict rests on.

    Args:
        pools: pool names, the order of the count tuples.
        answer: the search's answer (engine counts per pool).
        verdicts: ``counts -> meets`` of every evaluated point.
        maxima: the search's maximum per pool.
        unchecked: neighbours left unevaluated (the evaluation budget ran out).
    """
    def fmt(kk: tuple[int, ...]) -> str:
        return " + ".join(f"{n} {p}" for p, n in zip(pools, kk))

    found = [(a, b) for a, ma in verdicts.items() if ma for b, mb in verdicts.items()
             if not mb and a != b and all(x <= y for x, y in zip(a, b))]
    found.sort(key=lambda ab: (sum(ab[1]) - sum(ab[0]), ab))
    near = neighbours(answer, maxima)
    fewer_pass = [kk for kk in near if sum(kk) < sum(answer) and verdicts.get(kk) is True]
    scope = (f"checked {len(verdicts)} evaluated points pairwise and the answer's {len(near) - len(unchecked)} "
             f"neighbours (one engine more or fewer per pool)")
    if unchecked:
        scope += f"; {len(unchecked)} neighbours not evaluated (--max-evals reached): {', '.join(map(fmt, unchecked))}"
    if not found and not fewer_pass:
        return f"monotone as far as checked: {scope}; counts never evaluated are assumed to follow"
    parts = [f"{fmt(b)} engines miss the SLO where {fmt(a)} meet it" for a, b in found[:3]]
    parts += [f"{fmt(kk)} engines also meet it (fewer than the answer)" for kk in fewer_pass if
              not any(kk == a for a, _ in found[:3])]
    more = f" (and {len(found) - 3} more pairs)" if len(found) > 3 else ""
    return (f"non-monotone: {'; '.join(parts)}{more}; the answer assumes more engines never hurt, so it may not be "
            f"the fewest (simulation noise, or a policy that degrades with more engines); {scope}")


# ---------------------------------------------------------------------- driver


def run_searches(searches: Sequence[RateSearch | GpuSearch], executor: Executor,
                 on_point: Callable[[RateSearch | GpuSearch, PointResult], None] | None = None,
                 on_done: Callable[[RateSearch | GpuSearch, Any], None] | None = None) -> list[Any]:
    """Run ``searches`` concurrently on ``executor``; returns their results in the given order.

    Each search's ``width`` (points per round) is raised to share the executor's free slots:
    ``max(width, slots // len(searches))``, at most 4. A point whose future raises (a worker died
    and its retries were spent) becomes an error result of its search, never a silent gap.
    ``on_point(search, result)`` is called for every point as it completes (progress bars), and
    ``on_done(search, answer)`` once per search as soon as it has its answer (so a progress bar can
    stop that search's clock while others run on).
    """
    share = max(1, min(4, executor.slots // max(1, len(searches))))
    for s in searches:
        s.width = max(s.width, share)
    gens = [s.steps() for s in searches]
    results: list[Any] = [None] * len(searches)
    pending: dict[cf.Future, tuple[int, int]] = {}
    batches: dict[int, list[PointResult | None]] = {}
    batch_points: dict[int, list[Point]] = {}

    def advance(i: int, sent: list[PointResult] | None) -> None:
        try:
            pts = next(gens[i]) if sent is None else gens[i].send(sent)
        except StopIteration as stop:
            results[i] = stop.value
            if on_done is not None:
                on_done(searches[i], stop.value)
            return
        batches[i] = [None] * len(pts)
        batch_points[i] = pts
        for j, pt in enumerate(pts):
            pending[executor.submit(pt)] = (i, j)

    for i in range(len(gens)):
        advance(i, None)
    while pending:
        done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
        for fut in done:
            i, j = pending.pop(fut)
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001 - the worker died after its retries
                res = error_result(batch_points[i][j], f"{type(e).__name__}: {e}")
            batches[i][j] = res
            if on_point is not None:
                on_point(searches[i], res)
            if all(r is not None for r in batches[i]):
                advance(i, batches.pop(i))  # type: ignore[arg-type]
    return results


def _prepare(scenario: Scenario | str, workload: WorkloadSpec | Sequence[Request] | None, policy: str | PolicyPair,
             decode_policy: str | None) -> tuple[Scenario, WorkloadSpec | str, dict[str, list[Request]], PolicyPair]:
    sc = load_scenario(scenario) if isinstance(scenario, str) else scenario
    inline: dict[str, list[Request]] = {}
    if workload is None:
        ref: WorkloadSpec | str = WorkloadSpec()
    elif isinstance(workload, WorkloadSpec):
        ref = workload
    else:
        reqs = list(workload)
        if not reqs:
            raise ValueError("the workload has no requests")
        ref = f"inline:{uuid.uuid4().hex}"
        inline[ref] = reqs
        register_workload(ref, reqs)
    return sc, ref, inline, parse_policy(policy, decode_policy)


def _run_one(search: RateSearch | GpuSearch, inline: dict, executor: Executor | None, jobs: int) -> Any:
    if executor is not None:
        executor.add_workloads(inline)
        return run_searches([search], executor)[0]
    with make_executor("process", jobs=jobs, workloads=inline, modules=search.policy.modules) as ex:
        return run_searches([search], ex)[0]


def search_rate(
    scenario: Scenario | str,
    workload: WorkloadSpec | Sequence[Request] | None = None,
    policy: str | PolicyPair = "cache_aware",
    *,
    decode_policy: str | None = None,
    slo: SLO = SLO(),
    rate_min: float = RATE_MIN,
    rate_max: float = RATE_MAX,
    start: float = 1.0,
    tol: float = RATE_TOL,
    max_evals: int = MAX_EVALS,
    seed: int = 0,
    options: SimOptions = SimOptions(),
    early_stop: bool = True,
    executor: Executor | None = None,
    jobs: int = 1,
) -> RateSearchResult:
    """The highest rate scale at which ``policy`` meets ``slo`` on ``scenario`` (see the module
    docstring for the algorithm, bounds and tolerance).

    Args:
        scenario: a :class:`~sim.scenario.Scenario` or a preset name / scenario file.
        workload: a :class:`~sim.search.point.WorkloadSpec`, a request list (arrival times at rate scale
            1), or None for the embedded trace with the CLI's defaults (3 s batch spreading).
        policy: ``"name"`` or ``"name:param=value,..."`` or a :class:`~sim.search.point.PolicyPair`.
        decode_policy: the decode pool's policy in the same form (None = ``policy``).
        slo: the SLO (:class:`~sim.search.point.SLO`; default 90% of requests TTFT <= 2 s, TPOT <= 100 ms).
        rate_min / rate_max: search bounds, rate scales (0 < rate_min <= start <= rate_max).
        start: the first rate scale tried.
        tol: relative tolerance: the search stops when ``hi / lo <= 1 + tol``.
        max_evals: most simulations.
        seed: router seed of every point.
        options: router options (index mode, tiers, perf model).
        early_stop: cut failing points once the SLO is provably missed (same verdicts, faster).
        executor: where points run (default: ``jobs`` local processes; ``jobs=1``: this process).

    Returns:
        A :class:`RateSearchResult`; ``rate_scale`` and ``rate_rps`` are the answer.

    Raises:
        ValueError: bad bounds, an unknown scenario or policy, an empty workload.
    """
    sc, ref, inline, spec = _prepare(scenario, workload, policy, decode_policy)
    search = RateSearch(sc, ref, spec, slo, rate_min, rate_max, start, tol, max_evals, seed, options, early_stop)
    return _run_one(search, inline, executor, jobs)


def search_gpus(
    scenario: Scenario | str,
    workload: WorkloadSpec | Sequence[Request] | None = None,
    policy: str | PolicyPair = "cache_aware",
    *,
    decode_policy: str | None = None,
    slo: SLO = SLO(),
    rate_scale: float = 1.0,
    max_engines: dict[str, int] | None = None,
    max_evals: int = MAX_EVALS,
    seed: int = 0,
    options: SimOptions = SimOptions(),
    early_stop: bool = True,
    executor: Executor | None = None,
    jobs: int = 1,
) -> GpuSearchResult:
    """The fewest engines per pool (prefill and decode together, or mixed) with which ``policy``
    meets ``slo`` at ``rate_scale`` (see the module docstring for the algorithm).

    Args:
        max_engines: ``{"prefill": N, "decode": M}`` or ``{"mixed": N}`` upper bounds (default
            ``max(4 x the scenario's count, 8)`` per pool).
        Others: as for :func:`search_rate`.

    Returns:
        A :class:`GpuSearchResult`; ``prefill_engines``/``decode_engines`` (or ``mixed_engines``)
        and ``num_gpus`` are the answer.

    Raises:
        ValueError: bad bounds, an unknown scenario or policy, an empty workload.
    """
    sc, ref, inline, spec = _prepare(scenario, workload, policy, decode_policy)
    search = GpuSearch(sc, ref, spec, slo, rate_scale, max_engines, max_evals, seed, options, early_stop)
    return _run_one(search, inline, executor, jobs)
