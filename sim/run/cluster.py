"""Builds a simulated cluster from a :class:`~sim.scenario.Scenario` and runs a workload through it.

The balancer's :class:`~balancer.router.Router` routes every request at its arrival time, and the
simulator calls exactly the router's hooks with ``now = env.now``:

    arrive -> router.route -> prefill rank queue -> (chunked) prefill -> router.on_prefill_done
    -> KV transfer (bytes / link bandwidth) -> decode rank admission (KV capacity) -> first token
    (router.on_first_token) -> decode steps -> finish (router.on_finished)

With a long-prompt pool (``scenario.long_prefill``) a request of at least
``long_prompt_threshold_tokens`` prompt tokens is routed among that pool's prefill ranks and any
other among the prefill pool's: the one router is asked with ``exclude_engines`` set to the other
pool's engines, so every routing policy works across both pools unchanged.

In aggregated mode a mixed rank prefills, emits the first token at the end of prefill and
decodes in place. A PD request with one output token finishes when its KV transfer completes
(the prefill produced its only token). Every transition is timestamped in
:class:`~sim.run.records.RequestRecords`.

KV transfer prefill -> decode moves only the prompt blocks the decode rank's HBM prefix cache
does not hold when the prefill finishes: ``latency + (prompt_tokens - min(held_blocks *
block_size, prompt_tokens)) * kv_bytes_per_token / bandwidth``. A decode rank caches a prompt's
blocks when the sequence finishes (its freed KV stays as evictable prefix cache, as in vLLM /
SGLang); blocks of sequences still running are not matched (conservative), and a block matched at
transfer start is assumed to stay until admission.

KV tiers (``scenario.host_tier`` / ``scenario.shared_store``): see :mod:`sim.run.engine.tiers`.
HBM capacity per rank is ``pool.kv_capacity_tokens`` or the perf model's
``kv_capacity_tokens_per_rank`` (GPU memory x usable fraction minus weights and activation
reserve, divided by KV bytes per token; MLA latent for DeepSeek-V3). Bytes per block =
``kv_bytes_per_token * block_size``.

Router index modes: ``"approximate"`` (default) gives the router nothing but its own decisions;
``"events"`` makes every simulated cache publish its changes as KV events with a ``medium``
(HBM stores and evictions of every rank, host-tier writes and evictions, shared-store writes and
evictions), as engines with KV events do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from balancer.config import PolicySpec
from balancer.deadline_admission import AdmissionConfig
from balancer.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORE, BlockRemoved, BlockStored
from balancer.policies import Policy
from balancer.types import ReplicaId, Request, Role, TtftSlo
from sim.run.admission import admit, check_block_size
from sim.run.deadline_gate import GateProcesses, SimAdmission, default_priority, default_tenant
from sim.run.engine.hit_checkpoints import HitCheckpoints
from sim.run.engine.rank import DecodeSeq, PrefillJob, Rank, blocks_for
from sim.run.engine.step_group import StepGroup
from sim.run.engine.tiers import HOST, STORE, HostTier, RankTiers, SharedStore, TierStats
from sim.models.hardware import get_hardware
from sim.models.presets import get_model
from sim.perf.base import PerfModel
from sim.run.pool_perf import build_perf
from sim.perf.roofline import RooflinePerf
from sim.run.records import MAX_LOAD_SAMPLES, LoadSamples, RequestRecords
from sim.run.router_config import RankCacheBlocks, RouterFactory, router_config_for, router_factory
from sim.scenario import PoolConfig, Scenario, tier_capacity_blocks

_MEDIUM = {"hbm": MEDIUM_GPU, HOST: MEDIUM_CPU, STORE: MEDIUM_STORE}


@dataclass
class RankInfo:
    """Static description of a simulated rank (for reports)."""

    replica: ReplicaId
    role: Role
    kv_capacity_tokens: int


@dataclass
class SimResult:
    """Everything one run produced."""

    scenario: Scenario
    prefill_policy: str
    decode_policy: str
    seed: int
    requests: Sequence[Request]
    records: RequestRecords
    ranks: list[RankInfo]
    samples: LoadSamples
    rank_prefill_tokens: np.ndarray
    rank_decode_tokens: np.ndarray
    num_steps: int
    num_waits: int
    wall_s: float
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.prefill_policy == self.decode_policy or not self.scenario.disaggregated:
            return self.decode_policy
        return f"{self.prefill_policy}+{self.decode_policy}"


def hit_checkpoints_for(scenario: Scenario, pool: PoolConfig, perf: PerfModel) -> HitCheckpoints:
    """The retained-window checkpoints of one rank of ``pool`` (``pool.prefix_cache_retention_interval_tokens``
    set): EAGLE/MTP speculation (per-step MTP verification in the perf model, or a ``[speculative]``
    table without a separate draft model) needs one sliding-window block of the model past a hit's
    end (:mod:`sim.run.engine.hit_checkpoints`)."""
    ret = pool.prefix_cache_retention_interval_tokens
    eagle = perf.verify_tokens_per_seq > 1 or (  # PerfModel declares it
        scenario.speculative is not None and scenario.speculative.draft_model is None)
    peek = get_model(scenario.model).sliding_window_block_tokens if eagle else 0
    return HitCheckpoints(scenario.block_size, None if ret == "dense" else ret, min(peek, scenario.block_size))

class Cluster:
    """A simulated PD (or aggregated) cluster wired to a router.

    Args:
        scenario: the cluster.
        router_factory: makes the router once the ranks are known; called with their KV cache
            sizes (:class:`sim.run.router_config.RankCacheBlocks`, for an ``"auto"`` index bound).
            Tests pass their own; :func:`simulate` builds one (:func:`sim.run.router_config.router_factory`).
        perf_factory: ``(scenario, pool) -> PerfModel``; the roofline by default.
        kv_events: publish every cache change to ``router.on_kv_event`` (the router's events
            mode); default: when the router's ``index_mode`` is ``"events"``.
        record_iterations: keep per-rank step records by class (:meth:`StepGroup.iteration_times`).

    Closed-loop workloads (:mod:`sim.run.closed_loop`) use :meth:`begin_dynamic`, :meth:`submit` and
    the completion hook :attr:`on_request_finished` ``(index, now_s)`` instead of :meth:`run`.
    """

    def __init__(
        self,
        scenario: Scenario,
        router_factory: RouterFactory,
        perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = build_perf,
        kv_events: bool | None = None,
        record_iterations: bool = False,
    ) -> None:
        self.scenario = scenario
        #: called as ``(request index, now_s)`` when a request finishes (closed-loop drivers)
        self.on_request_finished: Callable[[int, float], None] | None = None
        self.env = simpy.Environment()
        self.tier_stats = TierStats()
        self.store: SharedStore | None = None
        ss = scenario.shared_store
        block_bytes_of: dict[str, int] = {}
        self.ranks: list[Rank] = []
        self.groups: list[StepGroup] = []
        self._group_of: list[StepGroup] = []
        self._perf_of: list[PerfModel] = []
        self._by_replica: dict[ReplicaId, Rank] = {}
        pools = (
            [("prefill", Role.PREFILL, scenario.prefill), ("decode", Role.DECODE, scenario.decode)]
            if scenario.disaggregated
            else [("mixed", Role.MIXED, scenario.mixed)]
        )
        if scenario.long_prefill is not None:
            pools.append(("long-prefill", Role.PREFILL, scenario.long_prefill))
        #: engines of the prefill pool / the long-prompt pool (each request excludes the other's)
        self._short_engines: frozenset[str] = frozenset()
        self._long_engines: frozenset[str] = frozenset()
        first_capacity_blocks: int | None = None
        largest_capacity_blocks = 0
        # hybrid-KV models (DeepSeek-V4): a prefix hit is a multiple of the full-attention groups' block
        hit_multiple = get_model(scenario.model).prefix_hit_multiple_tokens
        for name, role, pool in pools:
            assert pool is not None
            perf = perf_factory(scenario, pool)
            cap_tokens = pool.kv_capacity_tokens or perf.kv_capacity_tokens_per_rank
            cap_blocks = max(1, cap_tokens // scenario.block_size)
            if first_capacity_blocks is None:
                first_capacity_blocks = cap_blocks
            largest_capacity_blocks = max(largest_capacity_blocks, cap_blocks)
            block_bytes = perf.kv_bytes_per_token * scenario.block_size
            block_bytes_of[name] = block_bytes
            if ss is not None and self.store is None and role is not Role.DECODE:
                self.store = SharedStore(
                    self.env, tier_capacity_blocks(ss.capacity_bytes, ss.capacity_blocks, block_bytes),
                    ss.ttl_s, dict(ss.class_ttl_s), ss.read_bandwidth_bytes_per_s, ss.write_bandwidth_bytes_per_s,
                    ss.engine_read_bandwidth_bytes_per_s, ss.engine_write_bandwidth_bytes_per_s)
            host_cfg = scenario.host_tier_of(pool)
            for e in range(pool.num_engines):
                engine_ranks = []
                for d in range(pool.dp_ranks):
                    rep = ReplicaId(f"{name}-{e}", d)
                    rank = Rank(rep, len(self.ranks), role, cap_blocks, scenario.block_size,
                                pool.max_prefill_tokens, pool.max_decode_batch,
                                share_prompt_blocks=scenario.kv_accounting == "shared")
                    rank.hit_multiple_tokens = hit_multiple
                    # vLLM scheduler options of the pool and MTP verification (off by default)
                    rank.max_num_seqs = pool.max_num_seqs
                    rank.max_chunk_tokens = pool.max_chunk_tokens
                    rank.verify_tokens_per_seq = perf.verify_tokens_per_seq
                    rank.decode_tokens_per_step = perf.decode_tokens_per_step
                    if pool.prefix_cache_retention_interval_tokens is not None:
                        rank.hit_checkpoints = hit_checkpoints_for(scenario, pool, perf)
                    self.ranks.append(rank)
                    self._perf_of.append(perf)
                    self._by_replica[rep] = rank
                    engine_ranks.append(rank)
                if role is not Role.DECODE and (host_cfg is not None or self.store is not None):
                    for d, rank in enumerate(engine_ranks):
                        host = None
                        if host_cfg is not None:
                            cap = tier_capacity_blocks(host_cfg.capacity_bytes, host_cfg.capacity_blocks, block_bytes)
                            host = HostTier(self.env, None if cap is None else cap // pool.dp_ranks,
                                            host_cfg.bandwidth_bytes_per_s / pool.dp_ranks)
                        rank.tiers = RankTiers(
                            self.env, rank.index, f"{name}-{e}", host, self.store, perf,
                            group_size=pool.dp_ranks if perf.ep_synchronous else 1,
                            position=d if perf.ep_synchronous else 0, block_size=scenario.block_size,
                            block_bytes=block_bytes, max_prefill_tokens=pool.max_prefill_tokens,
                            fetch_rule=scenario.kv_fetch_rule, stats=self.tier_stats)
                        rank.tiers.on_ready = lambda job, now, idx=rank.index: self._on_fetched(idx, job, now)
                groups = [engine_ranks] if perf.ep_synchronous else [[r] for r in engine_ranks]
                for members in groups:
                    g = StepGroup(self.env, members, perf,
                                  on_prefill_done=self._on_prefill_done,
                                  on_decode_admitted=self._on_decode_admitted,
                                  on_decode_finished=self._on_decode_finished,
                                  fast_forward=scenario.fast_forward,
                                  prefill_schedule_interval=pool.prefill_schedule_interval,
                                  record_iterations=record_iterations)
                    self.groups.append(g)
                    self._group_of.extend(g for _ in members)
                if scenario.long_prefill is not None and role is Role.PREFILL:
                    if name == "long-prefill":
                        self._long_engines |= {f"{name}-{e}"}
                    else:
                        self._short_engines |= {f"{name}-{e}"}
        self.router = router_factory(RankCacheBlocks(first_capacity_blocks, largest_capacity_blocks))
        for rank in self.ranks:
            self.router.add_replica(rank.replica, rank.role, rank.kv_capacity_blocks * scenario.block_size)
        self.kv_events = (self.router.index_mode != "approximate") if kv_events is None else kv_events
        if self.kv_events:
            for rank in self.ranks:
                rank.kv_listener = self._publish
                if rank.tiers is not None:
                    rank.tiers.listener = self._publish
        self.records: RequestRecords | None = None
        #: deadline admission (:class:`sim.run.deadline_gate.SimAdmission`) between arrival and routing, or None
        self.admission: Any = None
        self._requests: Sequence[Request] = ()
        self._index_of: dict[str, int] = {}
        self._done: simpy.Event | None = None

    # ------------------------------------------------------------------ running
    def run(self, requests: Sequence[Request], progress: Callable[[int, int], None] | None = None) -> RequestRecords:
        """Simulate ``requests`` (sorted by arrival) to completion; returns the records.

        Raises:
            ValueError: unsorted arrivals or duplicate request ids.
            RuntimeError: the simulation stalled with unfinished requests (a modelling bug).
        """
        n = len(requests)
        arrivals = np.fromiter((r.arrival_time_s for r in requests), dtype=np.float64, count=n)
        if n and np.any(np.diff(arrivals) < 0):
            raise ValueError("requests must be sorted by arrival_time_s")
        self._requests = requests
        self._index_of = {r.request_id: i for i, r in enumerate(requests)}
        if len(self._index_of) != n:
            raise ValueError("duplicate request ids in workload")
        rec = self.records = RequestRecords(n)
        rec.arrival_s[:] = arrivals
        rec.prompt_tokens[:] = [r.prompt_tokens for r in requests]
        rec.output_tokens[:] = [r.output_tokens for r in requests]
        self._done = self.env.event()
        if self.admission is not None:
            self.admission.start(requests)
        if n == 0:
            return rec
        duration = float(arrivals[-1] - arrivals[0]) if n > 1 else 1.0
        interval = self.scenario.sample_interval_s or max(duration / 400.0, 1e-3)
        self.samples = LoadSamples(interval)
        self.env.process(self._arrivals())
        self.env.process(self._sampler(interval))
        chunks = 200
        horizon = float(arrivals[-1])
        for k in range(1, chunks + 1):
            until = horizon * k / chunks
            if until > self.env.now:
                self.env.run(until=until)
            if progress is not None:
                progress(rec.num_finished, n)
        try:
            self.env.run(until=self._done)
        except RuntimeError as e:
            # a stall is simpy's RuntimeError raised while handling its EmptySchedule (the event
            # queue ran dry before the last request finished); any other error (a policy's
            # PolicyError, a modelling bug) is raised as it is, not called a stall
            if not isinstance(e.__context__, simpy.core.EmptySchedule):
                raise
            missing = np.flatnonzero(np.isnan(rec.finish_s))
            raise RuntimeError(f"simulation stalled with {len(missing)} unfinished requests (first: "
                               f"{[requests[i].request_id for i in missing[:5]]})") from e
        if progress is not None:
            progress(rec.num_finished, n)
        return rec

    def begin_dynamic(self, capacity: int, sample_interval_s: float = 10.0) -> RequestRecords:
        """Closed-loop mode: records for up to ``capacity`` requests, submitted one by one at the
        current simulated time with :meth:`submit` (no arrival list). Returns the records (they
        grow by doubling up to ``capacity`` rows; rows beyond the submitted requests stay unused,
        read :attr:`records` again after the run).

        Raises:
            ValueError: ``capacity`` < 1."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._requests = []
        self._index_of = {}
        self._capacity = capacity
        self.records = RequestRecords(min(capacity, 1024))
        self._done = self.env.event()
        self.samples = LoadSamples(sample_interval_s)
        return self.records

    def submit(self, req: Request) -> int:
        """Route ``req`` now (``env.now``; its ``arrival_time_s`` should equal it) and queue it on
        its rank; returns its row in the records.

        Raises:
            RuntimeError: not in dynamic mode, or the records' capacity is used up.
            ValueError: a duplicate request id."""
        rec = self.records
        if rec is None or not isinstance(self._requests, list):
            raise RuntimeError("submit() needs begin_dynamic() first")
        i = len(self._requests)
        if i >= rec.num_requests:
            if i >= self._capacity:
                raise RuntimeError(f"more than {self._capacity} requests submitted (the capacity given to begin_dynamic)")
            rec.grow(min(self._capacity, 2 * rec.num_requests))
        if req.request_id in self._index_of:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self._index_of[req.request_id] = i
        self._requests.append(req)
        rec.arrival_s[i] = self.env.now
        rec.prompt_tokens[i] = req.prompt_tokens
        rec.output_tokens[i] = req.output_tokens
        self.dispatch(i, req, self.env.now)
        return i

    def _arrivals(self):  # noqa: ANN202
        env = self.env
        rec = self.records
        assert rec is not None
        for i, req in enumerate(self._requests):
            delay = req.arrival_time_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            if self.admission is not None:  # held, shed or dispatched by the deadline gate
                self.admission.on_arrival(i, req, env.now)
            else:
                self.dispatch(i, req, env.now)

    @property
    def requests(self) -> Sequence[Request]:
        """The workload of the current run."""
        return self._requests

    def dispatch(self, i: int, req: Request, now: float) -> None:
        """Route request ``i`` now and queue it at its prefill (or mixed) rank."""
        rec = self.records
        assert rec is not None
        router = self.router
        if self._long_engines:  # the same router and policies, restricted to the request's pool
            exclude = self._short_engines if req.prompt_tokens >= self.scenario.long_prompt_threshold_tokens \
                else self._long_engines
            route = router.route(req, now, exclude_engines=exclude)
        else:
            route = router.route(req, now)
        rec.num_routed += 1
        job = PrefillJob(i, req.prompt_tokens, req.output_tokens, req.block_hashes, req.traffic_class)
        if route.prefill is not None:
            rank = self._by_replica[route.prefill]
            rec.router_matched_tokens[i] = route.prefill_matched_tokens
            rec.decode_rank[i] = self._by_replica[route.decode].index
        else:
            rank = self._by_replica[route.decode]
            rec.router_matched_tokens[i] = route.decode_matched_tokens
            rec.decode_rank[i] = rank.index
        rec.prefill_rank[i] = rank.index
        rank.enqueue_prefill(job)
        self._group_of[rank.index].notify()

    def on_shed(self, i: int, now: float) -> None:
        """Request ``i`` was shed by the deadline gate: it ends unanswered by the engines."""
        rec = self.records
        rec.num_shed += 1
        if rec.num_finished + rec.num_shed == rec.num_requests and not self._done.triggered:
            self._done.succeed()

    def _sampler(self, interval: float):  # noqa: ANN202
        env = self.env
        ranks = self.ranks
        s = self.samples
        horizon = self._requests[-1].arrival_time_s
        while not self._done.triggered:
            if env.now > horizon and not any(r.prefill_queue or r.running or r.decode_waiting for r in ranks):
                return  # nothing left to sample; lets a stalled run end instead of sampling forever
            s.times_s.append(env.now)
            s.prefill_queued_tokens.append(np.array([r.queued_prefill_tokens for r in ranks], dtype=np.int64))
            s.decode_running.append(np.array([len(r.running) for r in ranks], dtype=np.int64))
            s.decode_kv_tokens.append(np.array([r.running_kv_tokens for r in ranks], dtype=np.int64))
            if len(s.times_s) >= MAX_LOAD_SAMPLES:  # the run outlasts the arrivals by far
                s.thin()  # drops the sample just taken (odd index): the next one is `interval` away
                yield env.timeout(interval)
                interval = s.interval_s
                continue
            yield env.timeout(interval)

    # ------------------------------------------------------------------ engine callbacks
    def _publish(self, medium: str, stored: bool, block_hashes, rank_index: int) -> None:  # noqa: ANN001
        """A simulated cache changed: the KV event the engine would publish, to the router."""
        event = (BlockStored if stored else BlockRemoved)(tuple(block_hashes), medium=_MEDIUM[medium])
        self.router.on_kv_event(self.ranks[rank_index].replica, event, self.env.now)

    def _on_fetched(self, rank_index: int, job: PrefillJob, now: float) -> None:
        self._group_of[rank_index].notify()

    def transfer_tokens(self, job: PrefillJob, decode: Rank) -> int:
        """Prompt tokens to move to ``decode``: those whose blocks its HBM prefix cache lacks."""
        held = decode.cache.match(job.block_hashes)
        return job.prompt_tokens - min(held * decode.block_size, job.prompt_tokens)

    def _on_prefill_done(self, rank: Rank, job: PrefillJob, now: float) -> None:
        rec = self.records
        i = job.index
        req_id = self._requests[i].request_id
        rec.cached_tokens[i] = job.cached_tokens
        rec.hbm_hit_tokens[i] = job.hbm_tokens
        rec.host_hit_tokens[i] = job.host_tokens
        rec.store_hit_tokens[i] = job.store_tokens
        if job.fetch_start_s >= 0:
            rec.fetch_start_s[i] = job.fetch_start_s
            rec.fetch_end_s[i] = job.fetch_end_s
        rec.prefill_start_s[i] = job.start_s
        rec.prefill_end_s[i] = now
        if rank.tiers is not None:
            rank.tiers.on_prefill_done(job)
        self.router.on_prefill_done(req_id, now)
        if self.admission is not None:  # the prefill backlog shrank: the gate may dispatch
            self.admission.drain(now)
        if rank.role is Role.PREFILL:
            d_idx = int(rec.decode_rank[i])
            nbytes = self.transfer_tokens(job, self.ranks[d_idx]) * self._perf_of[rank.index].kv_bytes_per_token
            rec.transfer_bytes[i] = nbytes
            dt = self.scenario.kv_transfer_latency_s + nbytes / self.scenario.kv_transfer_bandwidth_bytes_per_s
            ev = self.env.timeout(dt)
            ev.callbacks.append(lambda _ev, i=i, job=job, d_idx=d_idx: self._on_transfer_done(i, job, d_idx))
            return
        # aggregated (or decode-only) path: the last prefill chunk produced the first token
        rec.first_token_s[i] = now
        self.router.on_first_token(req_id, now)
        if rank.start_decode_local(job, job.output_tokens - 1) is None:
            self._finish(i, now)

    def _on_transfer_done(self, i: int, job: PrefillJob, d_idx: int) -> None:
        now = self.env.now
        rec = self.records
        rec.transfer_end_s[i] = now
        if job.output_tokens <= 1:
            rec.first_token_s[i] = now
            self.router.on_first_token(self._requests[i].request_id, now)
            self._finish(i, now)
            return
        rank = self.ranks[d_idx]
        reserved = blocks_for(job.prompt_tokens + job.output_tokens, rank.block_size)
        rank.enqueue_decode(DecodeSeq(i, job.prompt_tokens + 1, job.output_tokens - 1, reserved, job.block_hashes))
        self._group_of[d_idx].notify()

    def _on_decode_admitted(self, rank: Rank, seq: DecodeSeq, now: float) -> None:
        # PD: the prefill's token is streamed once the decode rank holds the sequence.
        self.records.first_token_s[seq.index] = now
        self.router.on_first_token(self._requests[seq.index].request_id, now)

    def _on_decode_finished(self, rank: Rank, seq: DecodeSeq, now: float) -> None:
        self._finish(seq.index, now)

    def _finish(self, i: int, now: float) -> None:
        rec = self.records
        if not np.isnan(rec.finish_s[i]):
            raise RuntimeError(f"request {self._requests[i].request_id} finished twice")
        rec.finish_s[i] = now
        rec.num_finished += 1
        self.router.on_finished(self._requests[i].request_id, now, int(rec.output_tokens[i]))
        if self.admission is not None:
            self.admission.drain(now)
        if rec.num_finished + rec.num_shed == rec.num_requests and not self._done.triggered:
            self._done.succeed()
        if self.on_request_finished is not None:
            self.on_request_finished(i, now)


def simulate(
    scenario: Scenario,
    requests: Sequence[Request],
    prefill_policy: str | Policy = "round_robin",
    decode_policy: str | Policy | None = None,
    *,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = build_perf,
    index_mode: str = "approximate",
    router_tiers: bool = True,
    tier_weights: dict[str, float] | None = None,
    router_wrapper: Callable[[RouterFactory], RouterFactory] | None = None,
    ttft_slo: TtftSlo | None = None,
    admission: AdmissionConfig | None = None,
    tenant_of: Callable[[Request], str] | None = None,
    priority_of: Callable[[Request], str | None] | None = None,
    admission_processes: GateProcesses | None = None,
) -> SimResult:
    """Run ``requests`` through ``scenario`` with the given policies (``decode_policy`` defaults
    to ``prefill_policy``). Deterministic for a given ``(scenario, requests, policies, seed)``.

    ``index_mode``: the router's prefix-index mode; ``"events"`` makes the simulated caches publish
    KV events (see :class:`Cluster`). ``router_tiers``: when the scenario has KV tiers, give the
    router views of them (host tier per replica, shared store; ``False`` = HBM only).
    ``tier_weights``: the router's weights of lower-tier hits (default
    :data:`balancer.config.DEFAULT_TIER_WEIGHTS`). The router gets the scenario's cost model
    (:func:`sim.run.router_cost.cost_model_for`) for cost-based policies, and ``ttft_slo`` (the TTFT
    budget SLO-aware policies route against, ``None``: SLO-blind). ``router_wrapper``: turns the router factory
    into another one with the same interface (e.g. several routers splitting the traffic,
    :mod:`sim.experiments.k_routers`). ``admission``: deadline admission between arrival and
    routing (:mod:`sim.run.deadline_gate`; ``None``, the default: every request is routed at arrival),
    with ``tenant_of`` / ``priority_of`` naming a request's tenant and class;
    ``admission_processes``: one queue per router process of ``pdlb serve --processes N``
    (:class:`sim.run.deadline_gate.GateProcesses`; default one)."""
    decode_policy = prefill_policy if decode_policy is None else decode_policy
    check_block_size(requests, scenario.block_size)
    config = router_config_for(scenario, seed=seed, index_mode=index_mode, router_tiers=router_tiers,
                               tier_weights=tier_weights, ttft_slo=ttft_slo, perf_factory=perf_factory)
    make_router = router_factory(scenario, config, _spec_or_policy(prefill_policy), _spec_or_policy(decode_policy))

    t0 = time.perf_counter()
    cluster = Cluster(scenario, router_wrapper(make_router) if router_wrapper else make_router, perf_factory)
    requests, rejected = admit_to(cluster, requests)
    if admission is not None:
        cluster.admission = SimAdmission(cluster, admission, tenant_of or default_tenant,
                                         priority_of or default_priority, config.cost_model, admission_processes)
    records = cluster.run(requests, progress)
    wall = time.perf_counter() - t0
    if cluster.router.load.num_in_flight != 0:
        raise RuntimeError(f"router still counts {cluster.router.load.num_in_flight} requests in flight")
    name = lambda p: p if isinstance(p, str) else p.name  # noqa: E731
    return SimResult(
        scenario=scenario,
        prefill_policy=name(prefill_policy),
        decode_policy=name(decode_policy),
        seed=seed,
        requests=requests,
        records=records,
        ranks=[RankInfo(r.replica, r.role, r.kv_capacity_blocks * scenario.block_size) for r in cluster.ranks],
        samples=cluster.samples if len(requests) else LoadSamples(1.0),
        rank_prefill_tokens=np.array([r.total_prefill_tokens for r in cluster.ranks], dtype=np.int64),
        rank_decode_tokens=np.array([r.total_decode_tokens for r in cluster.ranks], dtype=np.int64),
        num_steps=sum(g.num_steps for g in cluster.groups),
        num_waits=sum(g.num_waits for g in cluster.groups),
        wall_s=wall,
        extra={**({"tiers": cluster.tier_stats} if scenario.has_kv_tiers else {}),
               **({"rejected": rejected} if rejected else {}),
               **({"admission": cluster.admission.finish()} if cluster.admission is not None else {}),
               "step_imbalance": step_imbalance(cluster.groups)},
    )


def admit_to(cluster: Cluster, requests: Sequence[Request]) -> tuple[list[Request], dict[str, int]]:
    """The requests ``cluster`` accepts at arrival and counts of the refused ones by reason
    (:func:`sim.run.admission.admit` with the scenario's ``max_model_len`` and its ranks' KV
    capacities): refused requests are never simulated, as real engines refuse them."""
    scenario = cluster.scenario
    cap = {role: max((r.kv_capacity_blocks * scenario.block_size for r in cluster.ranks if r.role in roles), default=0)
           for role, roles in (("decode", (Role.DECODE, Role.MIXED)), ("prefill", (Role.PREFILL,)))}
    return admit(requests, scenario.effective_max_model_len, cap["decode"],
                 cap["prefill"] if scenario.disaggregated else None)


def step_imbalance(groups: Sequence[StepGroup]) -> dict[str, float]:
    """Sums over the step groups of more than one rank (wide-EP engines) of their imbalance
    counters (:class:`~sim.run.engine.step_group.StepGroup`), keyed ``{prefill,decode}_{busy,imbalance,wait}_s``
    (prefill: steps with prefill work, on prefill or mixed engines; decode: decode-only steps)."""
    out = {f"{k}_{m}_s": 0.0 for k in ("prefill", "decode") for m in ("busy", "imbalance", "wait")}
    for g in groups:
        if len(g.ranks) < 2:
            continue
        for key in out:
            out[key] += getattr(g, key)
    return out


def _spec_or_policy(policy: str | Policy) -> PolicySpec | Policy:
    return PolicySpec.parse(policy) if isinstance(policy, str) else policy
