"""One simulation point: ``(scenario, workload, policies, rate scale, seed)`` -> its summary and SLO verdict.

Capacity searches (:mod:`sim.search.capacity`) and sweeps (:mod:`sim.search.sweep`) are made of points; an
executor (:mod:`sim.search.executor`) evaluates them in this process, a process pool or on Ray. Everything
here is plain, picklable data so that a point can travel to another process:

- :class:`WorkloadSpec` names a trace and how it is cut (limit, duration, batch spreading); a
  worker reads it once and keeps it (:func:`load_workload`).
- :class:`PolicyPair` is a prefill and a decode policy with parameters, parsed from the command
  line form ``name:param=value,param=value`` (:func:`parse_policy`), plus the modules that
  register user policies (``--policy-module``), imported wherever the point runs.
- :class:`SLO` states the service level: an attainment target over per-request TTFT and TPOT
  budgets (the TTFT budget may grow with prompt length), or percentile targets.
- :func:`evaluate_point` runs one point and returns a :class:`PointResult`.

Rate scaling compresses time: at rate scale ``f`` every arrival time of the (cut) workload is
divided by ``f`` (:func:`sim.workload.scale_rate`), so the same requests arrive ``f`` times as
fast. The offered rate is ``num_requests / arrival_window_s`` (:mod:`sim.run.metrics`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balancer.config import PolicySpec
from balancer.policies import Policy
from balancer.router import Router
from balancer.types import Request, TtftSlo
from sim.run.pool_perf import build_perf
from sim.run.router_config import RankCacheBlocks, router_config_for, router_factory
from sim.scenario import PoolConfig, Scenario

# ---------------------------------------------------------------------- SLO


@dataclass(frozen=True)
class SLO:
    """A service-level objective on TTFT and TPOT.

    Per request ``i`` the TTFT budget is ``ttft_s + ttft_per_1k_prompt_tokens_s * prompt_tokens_i
    / 1000`` (0 by default: a flat budget); the TPOT budget is ``tpot_s`` (requests with one output
    token have no TPOT and need only the TTFT budget; an unfinished request meets nothing).

    Two forms, as users state them:

    - attainment (``percentile is None``, the default; DistServe's form): at least ``attainment``
      of the requests meet both budgets, e.g. 90% of requests with TTFT <= 2 s and TPOT <= 100 ms;
    - percentile (``percentile = p``): the p-th percentile of ``ttft_i / budget_i`` is <= 1 and
      the p-th percentile of TPOT is <= ``tpot_s`` (with a flat budget: TTFT p99 <= ``ttft_s``
      and TPOT p99 <= ``tpot_s``); ``attainment`` is then not used. Percentiles are numpy's
      linear interpolation, as in :mod:`sim.run.metrics`.

    Raises:
        ValueError: a non-positive budget, ``attainment`` outside (0, 1], ``percentile`` outside
            (0, 100].
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    attainment: float = 0.9
    percentile: float | None = None
    ttft_per_1k_prompt_tokens_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name} must be a finite number > 0, got {v!r}")
        if not (0 < self.attainment <= 1):
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment!r}")
        if self.percentile is not None and not (0 < self.percentile <= 100):
            raise ValueError(f"SLO percentile must be in (0, 100], got {self.percentile!r}")
        if not (math.isfinite(self.ttft_per_1k_prompt_tokens_s) and self.ttft_per_1k_prompt_tokens_s >= 0):
            raise ValueError(f"SLO ttft_per_1k_prompt_tokens_s must be >= 0, got {self.ttft_per_1k_prompt_tokens_s!r}")

    def ttft_slo(self) -> TtftSlo:
        """The TTFT budget as the router takes it (:class:`balancer.types.TtftSlo`)."""
        return TtftSlo(self.ttft_s, self.ttft_per_1k_prompt_tokens_s)

    def ttft_budget_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Per-request TTFT budget in seconds, shape of ``prompt_tokens``."""
        return self.ttft_slo().budget_s(np.asarray(prompt_tokens, dtype=np.float64))

    def describe(self) -> str:
        """E.g. ``"90% of requests TTFT<=2s & TPOT<=100ms"`` or ``"TTFT p99<=2s & TPOT p99<=100ms"``."""
        ttft = f"{self.ttft_s:g}s"
        if self.ttft_per_1k_prompt_tokens_s:
            ttft += f"+{self.ttft_per_1k_prompt_tokens_s:g}s/1k prompt tokens"
        tpot = f"{1e3 * self.tpot_s:g}ms"
        if self.percentile is not None:
            return f"TTFT p{self.percentile:g}<={ttft} & TPOT p{self.percentile:g}<={tpot}"
        return f"{100 * self.attainment:g}% of requests TTFT<={ttft} & TPOT<={tpot}"

    def max_misses(self, n: int) -> int:
        """Most requests of ``n`` that may miss their budget with the SLO still met (a bound
        used to stop a hopeless run early; exact for the attainment form). For the percentile
        form: with ``m`` values above the target, the interpolated p-th percentile exceeds it once
        ``m >= n - floor(p / 100 * (n - 1))``, so ``n - floor(...) - 1`` misses may still pass."""
        if n == 0:
            return 0
        if self.percentile is None:
            return n - math.ceil(self.attainment * n - 1e-9)
        return n - math.floor(self.percentile / 100.0 * (n - 1)) - 1

    def verdict(self, ttft_s: np.ndarray, tpot_s: np.ndarray, prompt_tokens: np.ndarray) -> dict[str, Any]:
        """SLO figures of one run: ``meets`` (bool), ``attainment`` (fraction of requests meeting
        both budgets), ``num_ok`` and, for the percentile form, ``ttft_ratio_pctl`` (the p-th
        percentile of TTFT / budget) and ``tpot_pctl_s``. NaN TTFT (unfinished) misses."""
        n = len(ttft_s)
        budget = self.ttft_budget_s(prompt_tokens)
        with np.errstate(invalid="ignore"):
            ok_ttft = ttft_s <= budget
            ok_tpot = np.where(np.isnan(tpot_s), True, tpot_s <= self.tpot_s)
        ok = ok_ttft & ok_tpot
        out: dict[str, Any] = {"num_ok": int(ok.sum()), "attainment": float(ok.mean()) if n else float("nan")}
        if self.percentile is None:
            out["meets"] = bool(n and out["num_ok"] >= math.ceil(self.attainment * n - 1e-9))
            return out
        ratio = np.where(np.isnan(ttft_s), np.inf, ttft_s / budget)
        tp = tpot_s[~np.isnan(tpot_s)]
        out["ttft_ratio_pctl"] = float(np.percentile(ratio, self.percentile)) if n else float("nan")
        out["tpot_pctl_s"] = float(np.percentile(tp, self.percentile)) if len(tp) else 0.0
        out["meets"] = bool(n and out["ttft_ratio_pctl"] <= 1.0 and out["tpot_pctl_s"] <= self.tpot_s)
        return out


# ---------------------------------------------------------------------- policies


def import_policy_modules(modules: Sequence[str]) -> None:
    """Import user modules whose ``@register`` decorators add policies (``--policy-module``).

    A module is looked up on ``sys.path`` with the current directory added (as ``python -m``
    does), so ``mypkg/mypolicy.py`` next to where ``pdlb`` runs is found, in this process and
    in local worker processes (they share the directory). Ray workers elsewhere need the module
    installed, or on ``PYTHONPATH`` through Ray's ``runtime_env``.

    Raises:
        ValueError: a module cannot be imported (the message names it and the import error).
    """
    if modules:
        import os
        import sys

        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported the same way
            raise ValueError(f"--policy-module {mod}: cannot import: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class PolicyPair:
    """The policies of a run: a prefill and a decode :class:`~balancer.config.PolicySpec`
    (``decode`` None = the prefill one), plus the modules that register user policies.

    Attributes:
        prefill / decode: the specs (a spec's text form is taken too: ``PolicyPair("least_load")``).
        modules: modules to import before building (user policies registered there).
    """

    prefill: PolicySpec
    decode: PolicySpec | None = None
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prefill, PolicySpec):
            object.__setattr__(self, "prefill", PolicySpec.parse(self.prefill))
        if self.decode is not None and not isinstance(self.decode, PolicySpec):
            object.__setattr__(self, "decode", PolicySpec.parse(self.decode))

    @property
    def decode_spec(self) -> PolicySpec:
        """The decode pool's spec (the prefill one when ``decode`` is None)."""
        return self.prefill if self.decode is None else self.decode

    @property
    def label(self) -> str:
        """``cache_aware``, ``cache_aware(cache_threshold=0.5)``, ``kv_cost+least_load`` ..."""
        return self.prefill.label if self.decode is None else f"{self.prefill.label}+{self.decode.label}"

    def build(self) -> tuple[Policy, Policy]:
        """The (prefill, decode) policy objects (two objects, also when they are one spec);
        imports :attr:`modules` first.

        Raises:
            ValueError: unknown policy or parameter, or a module that does not import.
        """
        import_policy_modules(self.modules)
        return self.prefill.build(), self.decode_spec.build()


def parse_policy(text: str | PolicyPair, decode: str | None = None, modules: Sequence[str] = ()) -> PolicyPair:
    """``"cache_aware:cache_threshold=0.5,balance_abs=8"`` -> :class:`PolicyPair` (values typed by
    the parameters' defaults, :meth:`balancer.config.PolicySpec.parse`); ``decode`` in the same
    form, None = the prefill policy. A :class:`PolicyPair` passes through (with ``modules`` added).

    Raises:
        ValueError: unknown policy (lists the valid ones), unknown parameter (lists the accepted
            ones), a value of the wrong type, or the policy's own check failing.
    """
    import_policy_modules(modules)
    if isinstance(text, PolicyPair):
        return dataclasses.replace(text, modules=tuple(dict.fromkeys((*text.modules, *modules))))
    prefill = PolicySpec.parse(text)
    dspec = None if decode is None else PolicySpec.parse(decode)
    return PolicyPair(prefill, None if dspec == prefill else dspec, tuple(modules))


# ---------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class WorkloadSpec:
    """A trace and how it is cut; every point of a search or sweep scales this same workload.

    Steps, in order (those of ``pdlb sim run``, :func:`sim.workload.loader.read_trace_cut`): read
    ``trace`` (None = the embedded Mooncake conversation trace) in ``format``; keep the first
    ``limit`` requests; spread requests sharing a timestamp over ``spread_s`` seconds (seeded by
    ``seed``; Mooncake logs arrivals in ~3 s batches) -- :meth:`read`, once per process; then per
    point scale the rate and keep the requests arriving in the first ``duration_s`` seconds of the
    scaled trace (:meth:`at_rate`). ``duration_s`` is so the simulated arrival window at every
    rate: a search judges each rate on the same length of load (a higher rate on more requests).
    Without ``duration_s`` every rate sees the same requests.

    ``warmup_s`` (seconds of scaled arrivals, default 0): the requests of the first ``warmup_s``
    seconds are simulated first, to fill the prefix caches and queues, and are not judged; the SLO,
    goodput and offered rate are those of the requests after them (the ``duration_s`` window then
    starts after the warm-up: ``warmup_s + duration_s`` seconds are simulated).
    """

    trace: str | None = None
    format: str = "auto"
    limit: int | None = None
    duration_s: float | None = None
    spread_s: float = 3.0
    seed: int = 0
    warmup_s: float = 0.0

    @property
    def label(self) -> str:
        return self.trace or "embedded:mooncake_conversation.jsonl.gz"

    def read(self) -> list[Request]:
        """The workload before rate scaling and ``duration_s`` (see the class docstring).

        Raises:
            ValueError: unknown format, an undetectable format, an empty trace.
            FileNotFoundError: no such trace file.
            sim.workload.TraceFormatError: a malformed line (names file and line).
        """
        from sim.workload.loader import read_trace_cut

        requests, _ = read_trace_cut(self.trace, self.format, limit=self.limit, spread_s=self.spread_s, seed=self.seed)
        return requests

    def at_rate(self, requests: Sequence[Request], rate_scale: float) -> list[Request]:
        """``requests`` (from :meth:`read`) at ``rate_scale``, cut to ``duration_s`` seconds of
        scaled arrivals (:func:`sim.workload.loader.scale_and_cut`)."""
        from sim.workload.loader import scale_and_cut

        window = None if self.duration_s is None else self.duration_s + self.warmup_s
        return scale_and_cut(list(requests), rate_scale, window)

    def measured(self, requests: Sequence[Request]) -> np.ndarray:
        """Boolean mask over ``requests`` (from :meth:`at_rate`): those judged, arriving at least
        ``warmup_s`` seconds after the first."""
        arr = np.fromiter((r.arrival_time_s for r in requests), dtype=np.float64, count=len(requests))
        return arr - arr[0] >= self.warmup_s if len(arr) else np.zeros(0, dtype=bool)


#: Workloads a process has read or been handed, by key (bounded: a worker holds at most a few).
_WORKLOADS: dict[object, list[Request]] = {}
_MAX_CACHED_WORKLOADS = 4


def register_workload(key: str | WorkloadSpec, requests: Sequence[Request]) -> None:
    """Make an in-memory workload available to :func:`load_workload` under ``key`` in this process
    (executors call it in their workers with the parent's requests). A :class:`WorkloadSpec` key
    holds the spec's requests as :meth:`WorkloadSpec.read` gives them (Ray ships a trace read
    once by the driver this way); points naming the spec still cut them per rate."""
    _remember(key, list(requests))


def _remember(key: object, requests: list[Request]) -> None:
    if key not in _WORKLOADS and len(_WORKLOADS) >= _MAX_CACHED_WORKLOADS:
        _WORKLOADS.pop(next(iter(_WORKLOADS)))
    _WORKLOADS[key] = requests


def load_workload(workload: WorkloadSpec | str) -> list[Request]:
    """The requests of a spec (read once per process, then cached) or of a registered key.

    Raises:
        KeyError: an in-memory key that was not registered in this process.
        ValueError / FileNotFoundError: see :meth:`WorkloadSpec.read`.
    """
    if isinstance(workload, str):
        if workload not in _WORKLOADS:
            raise KeyError(f"workload {workload!r} was not registered in this process")
        return _WORKLOADS[workload]
    if workload not in _WORKLOADS:
        _remember(workload, workload.read())
    return _WORKLOADS[workload]


# ---------------------------------------------------------------------- points


@dataclass(frozen=True)
class SimOptions:
    """Router options of a run (the CLI's ``--index-mode``, ``--no-router-tiers``, ``--tier-weights``).

    ``perf_factory``: ``(scenario, pool) -> PerfModel`` (default: the roofline,
    :func:`sim.run.pool_perf.build_perf`); must be a module-level callable to travel to other processes.
    ``route_slo``: give the router the point's TTFT budget (:meth:`SLO.ttft_slo`), so SLO-aware
    policies (``ep_aware``) route against the SLO being judged; ``False``: SLO-blind routing.
    """

    index_mode: str = "approximate"
    router_tiers: bool = True
    tier_weights: tuple[tuple[str, float], ...] | None = None
    perf_factory: Callable[[Scenario, PoolConfig], Any] | None = None
    route_slo: bool = True


@dataclass(frozen=True)
class Point:
    """One simulation to run.

    Attributes:
        scenario: the cluster (engine counts already applied).
        workload: a :class:`WorkloadSpec` or the key of a registered in-memory workload.
        policy: the policies.
        rate_scale: arrival-rate multiplier (> 0).
        slo: judged against this SLO.
        seed: the router's RNG seed.
        options: router options.
        early_stop: stop the simulation once more requests have provably missed the SLO than it
            allows (:meth:`SLO.max_misses`); the result then has ``stopped_early`` and only SLO
            figures. Used by searches, where a failing point needs no more than its verdict.
        tag: free-form labels carried to the result (search id, sweep parameters).
        save_dir: write the run's per-request CSV and summary there (sweeps' ``--per-point``).
    """

    scenario: Scenario
    workload: WorkloadSpec | str
    policy: PolicyPair
    rate_scale: float = 1.0
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    options: SimOptions = field(default_factory=SimOptions)
    early_stop: bool = False
    tag: tuple[tuple[str, object], ...] = ()
    save_dir: str | None = None


@dataclass
class PointResult:
    """What one point gave.

    Attributes:
        point: the point.
        meets: the SLO holds (``point.slo``).
        attainment: fraction of requests meeting both budgets (an upper bound when
            ``stopped_early``).
        goodput_rps: SLO-meeting requests per second of the arrival window (:mod:`sim.run.metrics`;
            with the SLO's own budgets; NaN when stopped early).
        offered_rps: requests / arrival window at this rate scale.
        num_requests, num_gpus, prefill_engines, decode_engines, mixed_engines: sizes.
        ttft_p99_s / tpot_p99_s / ttft_mean_s: latency figures (NaN when stopped early).
        stopped_early: the run was cut once the SLO was provably missed.
        summary: :func:`sim.run.metrics.summarize` of a complete run (``None`` when stopped early).
        verdict: :meth:`SLO.verdict` figures.
        wall_s: seconds the simulation took.
        error: the exception text if the point failed (then ``meets`` is False).
    """

    point: Point
    meets: bool
    attainment: float
    goodput_rps: float
    offered_rps: float
    num_requests: int
    num_gpus: int
    prefill_engines: int | None
    decode_engines: int | None
    mixed_engines: int | None
    ttft_p99_s: float = float("nan")
    tpot_p99_s: float = float("nan")
    ttft_mean_s: float = float("nan")
    stopped_early: bool = False
    summary: dict[str, Any] | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.num_gpus if self.num_gpus else float("nan")


def _pool_sizes(sc: Scenario) -> dict[str, int | None]:
    return {f"{p}_engines": (getattr(sc, p).num_engines if getattr(sc, p) is not None else None)
            for p in ("prefill", "decode", "mixed")}


class _Stop(Exception):
    """Raised from the progress hook to end a run whose SLO is already lost."""


def _make_router_factory(point: Point, prefill: Policy, decode: Policy) -> Callable[[RankCacheBlocks], Router]:
    """The router factory of ``point``: the settings simulate() gives its router (both build
    them with :mod:`sim.run.router_config`)."""
    opts = point.options
    config = router_config_for(point.scenario, seed=point.seed, index_mode=opts.index_mode,
                               router_tiers=opts.router_tiers,
                               tier_weights=dict(opts.tier_weights) if opts.tier_weights is not None else None,
                               ttft_slo=point.slo.ttft_slo() if opts.route_slo else None,
                               perf_factory=opts.perf_factory or build_perf)
    return router_factory(point.scenario, config, prefill, decode)


def _misses_so_far(rec: Any, now: float, budget: np.ndarray, tpot_s: float, judged: np.ndarray | None = None) -> int:
    """Requests that have provably missed the SLO by ``now``: TTFT over budget (first token
    late, or still missing past its deadline), or TPOT over budget (finished, or already
    slower than the budget allows for its remaining tokens)."""
    arrived = rec.arrival_s <= now
    first = rec.first_token_s
    with np.errstate(invalid="ignore", divide="ignore"):
        late = np.where(np.isnan(first), arrived & (now - rec.arrival_s > budget), first - rec.arrival_s > budget)
        multi = rec.output_tokens > 1
        end = np.where(np.isnan(rec.finish_s), now, rec.finish_s)
        slow = multi & ~np.isnan(first) & ((end - first) / np.maximum(rec.output_tokens - 1, 1) > tpot_s)
    if judged is not None:  # warm-up requests are not judged
        slow = slow & judged
    return int(np.count_nonzero(late | slow))


def _result_of(cluster: Any, point: Point, requests: list[Request], records: Any, prefill: Policy,
               decode: Policy, wall_s: float) -> Any:
    """The :class:`sim.run.cluster.SimResult` of a cluster run to completion (as simulate() builds it)."""
    from sim.run.cluster import RankInfo, SimResult

    sc = point.scenario
    return SimResult(
        scenario=sc, prefill_policy=prefill.name, decode_policy=decode.name, seed=point.seed,
        requests=requests, records=records,
        ranks=[RankInfo(r.replica, r.role, r.kv_capacity_blocks * sc.block_size) for r in cluster.ranks],
        samples=cluster.samples,
        rank_prefill_tokens=np.array([r.total_prefill_tokens for r in cluster.ranks], dtype=np.int64),
        rank_decode_tokens=np.array([r.total_decode_tokens for r in cluster.ranks], dtype=np.int64),
        num_steps=sum(g.num_steps for g in cluster.groups), num_waits=sum(g.num_waits for g in cluster.groups),
        wall_s=wall_s, extra={"tiers": cluster.tier_stats} if sc.has_kv_tiers else {})


def evaluate_point(point: Point) -> PointResult:
    """Run one point; never raises for a failing simulation (``error`` is set instead), so one bad
    point cannot take a sweep down. Raises only for bad input that no point could run with
    (unknown policy, unreadable trace)."""
    from sim.run.cluster import Cluster, admit_to, simulate
    from sim.run.metrics import per_request, summarize
    from sim.workload import scale_rate

    base = load_workload(point.workload)
    if isinstance(point.workload, WorkloadSpec):  # rate scale, then duration_s in simulated time
        requests = point.workload.at_rate(base, point.rate_scale)
        judged = point.workload.measured(requests)
    else:  # a registered in-memory workload: already cut
        requests = scale_rate(base, point.rate_scale) if point.rate_scale != 1.0 else list(base)
        judged = np.ones(len(requests), dtype=bool)
    prefill, decode = point.policy.build()
    sc = point.scenario
    warm = not judged.all()
    judged_reqs = [r for r, j in zip(requests, judged) if j] if warm else requests
    n = len(judged_reqs)  # the requests judged (after the warm-up)
    window = judged_reqs[-1].arrival_time_s - judged_reqs[0].arrival_time_s if n else 0.0
    offered = n / window if window > 0 else float("nan")
    sizes = _pool_sizes(sc)
    common = dict(point=point, offered_rps=offered, num_requests=n, num_gpus=sc.num_gpus, **sizes)
    slo = point.slo
    t0 = time.perf_counter()
    try:
        if not point.early_stop:
            kw: dict[str, Any] = {}
            if point.options.perf_factory is not None:
                kw["perf_factory"] = point.options.perf_factory
            res = simulate(sc, requests, prefill, decode, seed=point.seed, index_mode=point.options.index_mode,
                           router_tiers=point.options.router_tiers,
                           tier_weights=dict(point.options.tier_weights) if point.options.tier_weights else None,
                           ttft_slo=slo.ttft_slo() if point.options.route_slo else None, **kw)
        else:
            cluster = Cluster(sc, _make_router_factory(point, prefill, decode), point.options.perf_factory or build_perf)
            # refused at arrival as simulate() refuses them; each one
            # is a miss spent before the run starts
            admitted, rejected = admit_to(cluster, requests)
            num_rejected = sum(admit_to(cluster, judged_reqs)[1].values()) if warm else sum(rejected.values())
            budget = slo.ttft_budget_s(np.fromiter((r.prompt_tokens for r in admitted), dtype=np.float64,
                                                   count=len(admitted)))
            if warm:  # warm-up requests never count as misses: an infinite budget
                t_first = requests[0].arrival_time_s + point.workload.warmup_s  # type: ignore[union-attr]
                budget = np.where([r.arrival_time_s >= t_first for r in admitted], budget, np.inf)
            allowed = slo.max_misses(n) - num_rejected
            misses = [num_rejected]

            def check(done: int, total: int) -> None:
                rec = cluster.records
                m = num_rejected + _misses_so_far(rec, cluster.env.now, budget, slo.tpot_s, budget < np.inf)
                if m > allowed + num_rejected:
                    misses[0] = m
                    raise _Stop

            try:
                if allowed < 0:
                    raise _Stop
                records = cluster.run(admitted, check)
            except _Stop:
                wall = time.perf_counter() - t0
                return PointResult(meets=False, attainment=1.0 - misses[0] / n, goodput_rps=float("nan"),
                                   stopped_early=True, verdict={"misses_at_stop": misses[0], "allowed_misses":
                                                                slo.max_misses(n), "num_rejected": num_rejected},
                                   wall_s=wall, **common)
            res = _result_of(cluster, point, admitted, records, prefill, decode, time.perf_counter() - t0)
            if rejected:
                res.extra["rejected"] = rejected
    except Exception as e:  # noqa: BLE001 - reported in the table, never silently dropped
        return PointResult(meets=False, attainment=float("nan"), goodput_rps=float("nan"),
                           error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0, **common)
    wall = time.perf_counter() - t0
    d = per_request(res)
    num_rejected = sum(res.extra.get("rejected", {}).values())
    ttft_s, tpot_s, prompt = d["ttft_s"], d["tpot_s"], res.records.prompt_tokens
    if warm:  # judge the requests after the warm-up only
        t_first = requests[0].arrival_time_s + point.workload.warmup_s  # type: ignore[union-attr]
        keep = res.records.arrival_s >= t_first
        ttft_s, tpot_s, prompt = ttft_s[keep], tpot_s[keep], prompt[keep]
        num_rejected = n - int(keep.sum())
    # a request rejected at arrival never gets a first token: it misses (NaN TTFT), among n
    miss = np.full(num_rejected, np.nan)
    verdict = slo.verdict(np.concatenate([ttft_s, miss]), np.concatenate([tpot_s, miss]),
                          np.concatenate([prompt, np.ones(num_rejected, dtype=np.int64)]))
    summary = summarize(res, slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
    summary["wall_s"] = wall
    if point.save_dir is not None:
        from pathlib import Path

        from sim.run.report import write_results

        write_results(Path(point.save_dir), [res], [summary], {"tag": dict(point.tag), "rate_scale": point.rate_scale},
                      plots=False)
    if warm:
        verdict["warmup_requests"] = len(requests) - n
        pct = lambda x: float(np.percentile(x[~np.isnan(x)], 99)) if np.any(~np.isnan(x)) else float("nan")  # noqa: E731
        lat = {"ttft_p99_s": pct(ttft_s), "tpot_p99_s": pct(tpot_s),
               "ttft_mean_s": float(np.nanmean(ttft_s)) if np.any(~np.isnan(ttft_s)) else float("nan")}
    else:
        lat = {"ttft_p99_s": summary["ttft_s"]["p99"], "tpot_p99_s": summary["tpot_s"]["p99"],
               "ttft_mean_s": summary["ttft_s"]["mean"]}
    return PointResult(meets=verdict["meets"], attainment=verdict["attainment"],
                       goodput_rps=verdict["num_ok"] / window if window > 0 else float("nan"),
                       summary=summary, verdict=verdict, wall_s=wall, **lat, **common)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"ttft_s": {"p99": 1.0}}`` -> ``{"ttft_s.p99": 1.0}`` (dotted keys, depth-first)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def point_row(r: PointResult, *, summary: bool = True) -> dict[str, Any]:
    """One flat table row of a point: its parameters (``tag`` entries first, then policy, rate
    scale, seed, engine counts), the SLO figures and, with ``summary``, every summary metric of
    a complete run as dotted keys (``ttft_s.p99``, ``kv.hit_rate.hbm`` ...)."""
    p = r.point
    row: dict[str, Any] = {k: v for k, v in p.tag}
    row |= {
        "scenario": p.scenario.name, "policy": p.policy.label, "rate_scale": p.rate_scale, "seed": p.seed,
        "prefill_engines": r.prefill_engines, "decode_engines": r.decode_engines, "mixed_engines": r.mixed_engines,
        "num_gpus": r.num_gpus, "num_requests": r.num_requests, "offered_rps": r.offered_rps,
        "slo": p.slo.describe(), "meets_slo": r.meets, "attainment": r.attainment, "goodput_rps": r.goodput_rps,
        "goodput_rps_per_gpu": r.goodput_per_gpu, "ttft_p99_s": r.ttft_p99_s, "tpot_p99_s": r.tpot_p99_s,
        "stopped_early": r.stopped_early, "wall_s": r.wall_s, "error": r.error or "",
    }
    if summary and r.summary is not None:
        skip = {"policy", "scenario", "seed", "num_requests", "num_gpus", "wall_s", "goodput_rps"}
        row |= {f"summary.{k}": v for k, v in flatten(r.summary).items() if k not in skip}
    return row


def error_result(point: Point, error: str) -> PointResult:
    """The result of a point whose evaluation never returned (its worker died, its task failed
    after retries): ``meets`` False, figures NaN, ``error`` set, so it shows in every table."""
    sizes = _pool_sizes(point.scenario)
    return PointResult(point=point, meets=False, attainment=float("nan"), goodput_rps=float("nan"),
                       offered_rps=float("nan"), num_requests=0, num_gpus=point.scenario.num_gpus, error=error, **sizes)
