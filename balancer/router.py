"""The embeddable router: picks a prefill and a decode DP rank per request.

:class:`Router` is the one policy core shared by the simulator and the live service. It holds
the replica registry, the prefix index (:mod:`balancer.prefix_index`) and the load tracker
(:mod:`balancer.load`); policies (:mod:`balancer.policies`) only read snapshots it builds. It
does no I/O and reads no clock: every method takes ``now_s`` from the caller
(``time.monotonic()`` in the service, ``env.now`` in the simulator).

Life of a request::

    route = router.route(request, now_s)             # counts load at dispatch, records the prefix
    router.on_prefill_done(request.request_id, now_s)  # prefill replica finished (PD)
    router.on_first_token(request.request_id, now_s)   # first output token (aggregated: prefill done)
    router.on_finished(request.request_id, now_s)      # releases everything left

Modes: with prefill replicas registered the router disaggregates (prefill pool + decode pool);
without, it routes to one mixed (aggregated) replica and ``Route.prefill`` is ``None``. With
``pd_min_uncached_tokens > 0`` a PD router serves short-uncached requests on the decode replica
alone (conditional disaggregation; the vLLM router skips PD below 256 uncached tokens).

Prefix index modes: ``"approximate"`` records each routed prompt on its chosen replicas (as the
SGLang and llm-d routers do); ``"events"`` trusts only KV events from engines (as Dynamo does);
``"hybrid"`` trusts KV events and, in a second index whose entries live ``speculative_ttl_s``
(default :data:`DEFAULT_SPECULATIVE_TTL_S`), the prompts it routed itself, so that a burst of
sibling requests lands together before the engine has announced the first one's blocks (Dynamo's
predicted blocks, the vLLM router's speculative entries); a replica's match is the larger of the
two.

Clock: every ``now_s`` must be a finite number of seconds (``ValueError`` otherwise: a NaN or an
infinity would poison TTLs, the LRU order and the load tracker's timings for good). Times are
expected not to go backwards; one that does (earlier than the latest ``now_s`` any method was
given) is taken as that latest time and counted in :meth:`Router.metrics`
(``clock_regressions``, and ``clock_regression_max_s``, the largest step back). A gateway
whose threads read ``time.monotonic()`` before taking the router's lock passes times slightly
out of order in the normal course of things; refusing those would fail real requests, while
clamping keeps the prefix index's timestamps non-decreasing, which its TTL expiry and LRU order
assume. A large ``clock_regression_max_s`` points at a caller mixing clocks.

Thread safety: every public method takes the router's lock (a ``threading.RLock``), so a gateway
may call ``route`` on one thread and ``on_kv_event`` / ``on_load_report`` on others. Reads of the
attributes (``router.index``, ``router.load``) are not locked: take ``router.lock`` around them.

Engine load reports (:meth:`Router.on_load_report`, e.g. scraped from the engines' Prometheus
metrics): a report says how many requests the engine runs and queues and how full its KV cache
is, counting every router's traffic. The router keeps the part of it that is not its own
(``reported - own count at report time``, floored at 0) as *external* load on that replica and
adds it to its own counters in every snapshot until the next report or until the report is
older than ``load_report_max_age_s``; so several independent routers see the whole load, not
their share.

Warm starts: :meth:`Router.snapshot` / :meth:`Router.restore` (or plain ``pickle``) save and load
the whole state (replicas, prefix index, load, RNG); the prefix index is written flat, so a deep
index does not hit Python's recursion limit.

Lower KV tiers (optional; off by default, and then nothing below changes any decision): with
``host_tier=True`` a :class:`~balancer.block_index.BlockIndex` records each replica's host-DRAM tier (blocks
arrive from any position of a prompt, so not the prefix tree), with
``shared_store=True`` a third one with a single pseudo holder (:data:`STORE_HOLDER`) records the
cluster-wide store. Events mode feeds them from KV events by ``medium``
(:func:`balancer.kv_events.tier_of_medium`); approximate mode inserts each routed prompt into the
prefill (or mixed) replica's host view and into the store view (with ``store_ttl_s``, e.g. the
store's TTL). For each candidate the router then computes, in blocks: ``hbm`` = its HBM match;
``host`` = consecutive blocks after those in its host tier; ``store`` = consecutive blocks after
both in the store; and hands policies the effective match
``matched_blocks = hbm + w_host * host + w_store * store`` (``tier_weights``; default host 0.75
as Dynamo weights host hits, store 0.5 since a store fetch crosses the network), with the
per-tier columns on :class:`~balancer.candidates.Candidates`. Policies therefore work unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import pickle
import random
import threading
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from balancer.candidates import Candidates
from balancer.cost_model import DEFAULT_COST_MODEL, CostLearner, CostModel, placement_features
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.load import LoadReport, LoadTracker
from balancer.policies import Policy, SelectContext
from balancer.policies.spec import build_policy
from balancer.block_index import BlockIndex
from balancer.prefix_index import PrefixIndex
from balancer.types import Choice, ReplicaId, Request, Role, Route, TtftSlo, checked_count, checked_ttl_s, is_finite_seconds


def _locked(fn):  # noqa: ANN001, ANN202
    """Run the method holding ``self.lock``."""
    @functools.wraps(fn)
    def locked(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        with self.lock:
            return fn(self, *args, **kwargs)
    return locked


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request (the service maps it to HTTP 503)."""


class RequestTooLargeError(ValueError):
    """The request cannot fit any candidate replica's KV capacity (the service maps it to 400)."""


class PolicyError(RuntimeError):
    """A policy's ``select`` returned something other than a :class:`~balancer.types.Choice` of
    one of the candidates it was given (a user policy's bug; the service answers 500, ``pdlb sim``
    prints one line naming the policy). Nothing is counted for the request then."""


@dataclass(slots=True)
class ReplicaInfo:
    """Static facts about a registered replica."""

    replica: ReplicaId
    role: Role
    kv_capacity_tokens: int = 0
    healthy: bool = True


@dataclass(slots=True)
class _Pool:
    replicas: tuple[ReplicaId, ...]
    slots: np.ndarray
    capacity: np.ndarray
    position: dict[ReplicaId, int]
    role: Role
    min_capacity: int = 0  # smallest known (> 0) KV capacity in tokens; 0: none known


INDEX_MODES = ("approximate", "events", "hybrid")
#: Default lifetime of the hybrid mode's own routed-prompt entries: long enough for an engine to
#: prefill and announce a prompt under load, short enough not to outlive its real cache entry.
DEFAULT_SPECULATIVE_TTL_S = 5.0
#: Default prefix-index bound per replica: 262,144 blocks (134M tokens at 512-token blocks, more
#: than any GPU's HBM holds), so an embedded router never grows without bound.
DEFAULT_INDEX_CAPACITY_BLOCKS = 262_144
#: Default weights of lower-tier hits relative to an HBM hit (1.0): Dynamo's KV router weighs host
#: (CPU) hits at 0.75 of device hits; a shared-store hit pays a network fetch, so 0.5.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"host": 0.75, "store": 0.5}
#: The pseudo replica that holds the shared store's blocks in the router's store view.
STORE_HOLDER = ReplicaId("shared-store", 0)


class Router:
    """Routes requests to prefill/decode DP ranks with pluggable policies.

    Args:
        prefill_policy / decode_policy: a :class:`~balancer.policies.Policy`, a registered name, or a
            spec with parameters (``"ep_aware:ttft_slo_s=2"``, :func:`balancer.policies.spec.build_policy`).
            The decode policy also routes aggregated (mixed) pools.
        block_size: tokens per KV block of the requests' ``block_hashes``.
        index_capacity_blocks: prefix-index bound per replica (LRU), ``None`` = unbounded
            (default :data:`DEFAULT_INDEX_CAPACITY_BLOCKS`).
        index_ttl_s: prefix-index TTL, ``None`` = none (Dynamo's approximate mode uses 120 s).
        index_mode: ``"approximate"`` or ``"events"`` (see module docstring).
        pd_min_uncached_tokens: below this many uncached prompt tokens on the chosen decode
            replica, skip the prefill pool (0 = always disaggregate).
        seed: seed of the router's ``random.Random`` (the only randomness policies may use).
        host_tier: keep a view of each replica's host-DRAM KV tier (see module docstring).
        host_index_capacity_blocks: bound per replica of the host view (LRU), ``None`` = unbounded.
        shared_store: keep a view of a cluster-wide shared KV store.
        store_index_capacity_blocks: bound of the store view (LRU), ``None`` = unbounded.
        store_ttl_s: TTL of the store view (from last insert), ``None`` = none.
        tier_weights: ``{"host": w, "store": w}``, each in [0, 1]; missing keys take
            :data:`DEFAULT_TIER_WEIGHTS`.
        cost_model: step-time model handed to policies (``SelectContext.cost_model``) for
            cost-based policies (``ep_aware``); ``None``: none (``ep_aware`` then uses
            :data:`balancer.cost_model.DEFAULT_COST_MODEL`).
        learn_cost_model: fit the cost model online from the hooks' timestamps
            (:class:`balancer.cost_model.CostLearner`, starting from ``cost_model`` or the
            default); policies see the latest fit.
        index_total_capacity_blocks: prefix-index bound over all replicas together (each gets
            an even share when it is lower than ``index_capacity_blocks``), ``None`` = none.
        speculative_ttl_s: hybrid mode: seconds a routed prompt counts as cached on its replicas.
        inflight_timeout_s: requests still in flight this long after dispatch (their
            ``on_finished`` never came: a lost callback, a crashed caller) are released and
            counted (``metrics()["reaped_requests"]``); ``None`` (default) never reaps.
        load_report_max_age_s: engine load reports older than this stop counting (``None``: a
            report counts until the next one).
        ttft_slo: the TTFT budget to route against (:class:`balancer.types.TtftSlo`), handed to
            policies as ``SelectContext.ttft_slo``; ``None`` (default): SLO-blind routing.

    Raises:
        ValueError: unknown policy name or index mode, negative sizes, bad tier weights.
    """

    def __init__(
        self,
        prefill_policy: Policy | str = "cache_aware",
        decode_policy: Policy | str = "least_load",
        *,
        block_size: int = 512,
        index_capacity_blocks: int | None = DEFAULT_INDEX_CAPACITY_BLOCKS,
        index_ttl_s: float | None = None,
        index_mode: str = "approximate",
        pd_min_uncached_tokens: int = 0,
        seed: int = 0,
        host_tier: bool = False,
        host_index_capacity_blocks: int | None = DEFAULT_INDEX_CAPACITY_BLOCKS,
        shared_store: bool = False,
        store_index_capacity_blocks: int | None = None,
        store_ttl_s: float | None = None,
        tier_weights: Mapping[str, float] | None = None,
        cost_model: CostModel | None = None,
        learn_cost_model: bool = False,
        index_total_capacity_blocks: int | None = None,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        inflight_timeout_s: float | None = None,
        load_report_max_age_s: float | None = None,
        ttft_slo: TtftSlo | None = None,
    ) -> None:
        block_size = checked_count("block_size", block_size, 1)  # a float (16.5) or a string was taken
        if index_mode not in INDEX_MODES:
            raise ValueError(f"unknown index_mode {index_mode!r}; valid: {', '.join(INDEX_MODES)}")
        pd_min_uncached_tokens = checked_count("pd_min_uncached_tokens", pd_min_uncached_tokens, 0)
        for name, v in (("speculative_ttl_s", speculative_ttl_s), ("inflight_timeout_s", inflight_timeout_s),
                        ("load_report_max_age_s", load_report_max_age_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        index_ttl_s, store_ttl_s = checked_ttl_s("index_ttl_s", index_ttl_s), checked_ttl_s("store_ttl_s", store_ttl_s)
        # a name, or a spec with parameters ("ep_aware:ttft_slo_s=2"), as on the command line
        self.prefill_policy = build_policy(prefill_policy) if isinstance(prefill_policy, str) else prefill_policy
        self.decode_policy = build_policy(decode_policy) if isinstance(decode_policy, str) else decode_policy
        self.block_size = block_size
        self.index_mode = index_mode
        self.pd_min_uncached_tokens = pd_min_uncached_tokens
        # events mode removes single blocks (BlockRemoved): keep the prefix tree's block map
        self.index = PrefixIndex(index_capacity_blocks, index_ttl_s, block_map=index_mode != "approximate",
                                 total_capacity_blocks=index_total_capacity_blocks)
        #: hybrid mode: the router's own routed prompts, for speculative_ttl_s; else None
        self.speculative = PrefixIndex(index_capacity_blocks, speculative_ttl_s) if index_mode == "hybrid" else None
        self.speculative_ttl_s = speculative_ttl_s
        self.inflight_timeout_s = inflight_timeout_s
        self.load_report_max_age_s = load_report_max_age_s
        #: the lock every public method holds (re-entrant)
        self.lock = threading.RLock()
        self._reasons: dict[tuple[str, str], int] = {}
        self._matched_tokens = {"prefill": 0, "decode": 0}
        self._kv_events = {"applied": 0, "ignored": 0}
        self._reaped = 0
        #: approximate mode: called as ``on_routed(replicas, block_hashes, now_s)`` after each
        #: decision recorded a prompt (e.g. to share it with other router processes); or None
        self.on_routed: Any = None
        weights = dict(DEFAULT_TIER_WEIGHTS)
        for k, w in (tier_weights or {}).items():
            if k not in DEFAULT_TIER_WEIGHTS:
                raise ValueError(f"unknown tier {k!r} in tier_weights; valid: {', '.join(DEFAULT_TIER_WEIGHTS)}")
            if not 0.0 <= float(w) <= 1.0:
                raise ValueError(f"tier_weights[{k!r}] must be in [0, 1], got {w}")
            weights[k] = float(w)
        self.tier_weights = weights
        #: host-DRAM tier view per replica, or None
        self.host_index = BlockIndex(host_index_capacity_blocks, index_ttl_s) if host_tier else None
        #: shared-store view (one holder, STORE_HOLDER), or None
        self.store_index = BlockIndex(store_index_capacity_blocks, store_ttl_s) if shared_store else None
        self.load = LoadTracker()
        self.rng = random.Random(seed)
        self._replicas: dict[ReplicaId, ReplicaInfo] = {}
        self._prefill_registered = False  # any prefill replica registered (set with the pools)
        self._pools: dict[str, _Pool] | None = None
        self._decisions = {"prefill": 0, "decode": 0}
        self._now_s = -math.inf  # latest time a caller passed in (see _clock); -inf: none yet
        self._clock_regressions = 0
        self._clock_regression_max_s = 0.0
        self.cost_model = cost_model
        if ttft_slo is not None and not isinstance(ttft_slo, TtftSlo):
            raise TypeError(f"ttft_slo must be a balancer.TtftSlo or None, got {type(ttft_slo).__name__}")
        self.ttft_slo = ttft_slo
        #: online fit of the cost model, or None (see ``learn_cost_model``)
        self.cost_learner: CostLearner | None = (
            CostLearner(cost_model if cost_model is not None else DEFAULT_COST_MODEL) if learn_cost_model else None)

    # ------------------------------------------------------------------ clock
    def _clock(self, now_s: float) -> float:
        """``now_s`` checked and made non-decreasing (see the module docstring, "Clock"): the
        latest time seen so far, which ``now_s`` becomes when it is later, else that latest time
        (counted as a clock regression).

        Raises:
            ValueError: ``now_s`` is not a finite number (NaN, an infinity, a bool, a string).
        """
        latest = self._now_s
        if type(now_s) is float and -math.inf < latest <= now_s < math.inf:  # the usual case (no -inf yet: a first call takes the slow path)
            self._now_s = now_s
            return now_s
        if not is_finite_seconds(now_s):
            raise ValueError(f"now_s must be a finite number of seconds, got {now_s!r}")
        now_s = float(now_s)
        if now_s >= latest:
            self._now_s = now_s
            return now_s
        self._clock_regressions += 1
        self._clock_regression_max_s = max(self._clock_regression_max_s, latest - now_s)
        return latest

    def _default_now(self, now_s: float | None) -> float:
        """``now_s`` through :meth:`_clock`, or when ``None`` the latest time seen (0.0 before any)."""
        if now_s is not None:
            return self._clock(now_s)
        return self._now_s if self._now_s > -math.inf else 0.0

    # ------------------------------------------------------------------ registry
    @_locked
    def add_replica(self, replica: ReplicaId, role: Role | str, kv_capacity_tokens: int = 0) -> None:
        """Register a DP rank of ``role`` holding ``kv_capacity_tokens`` of KV (0: unknown).

        Re-registering a replica already registered with the same role is allowed and is an
        update, not a restart (e.g. a gateway re-applying its worker list after a config reload
        or a health flap): the replica takes the ``kv_capacity_tokens`` given (0 makes it
        unknown again) and is marked healthy; its in-flight load and its cached prefix blocks are
        kept. To start a replica afresh (an engine restarted with an empty cache), call
        :meth:`remove_replica` first.

        Raises:
            TypeError: ``replica`` is not a :class:`~balancer.types.ReplicaId`.
            ValueError: unknown role, negative ``dp_rank`` or ``kv_capacity_tokens``, or the
                replica is already registered with another role (nothing changes then; a role
                change is :meth:`remove_replica` then ``add_replica``).
        """
        if not isinstance(replica, ReplicaId) or not isinstance(replica.engine, str) \
                or not isinstance(replica.dp_rank, int):
            raise TypeError(f"replica must be a ReplicaId(engine: str, dp_rank: int), got {replica!r}")
        if replica.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {replica.dp_rank} for {replica}")
        if kv_capacity_tokens < 0:
            raise ValueError(f"kv_capacity_tokens must be >= 0 (0 = unknown), got {kv_capacity_tokens} for {replica}")
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(f"unknown role {role!r}; valid: {', '.join(r.value for r in Role)}") from None
        info = self._replicas.get(replica)
        if info is not None and info.role is not role:
            raise ValueError(f"{replica} is already registered as {info.role.value}, not {role.value} "
                             f"(remove_replica it first to change its role)")
        self._replicas[replica] = ReplicaInfo(replica, role, int(kv_capacity_tokens), True)
        self.load.add_replica(replica)
        self.index.register(replica)  # numbered now: the index's cached pool numbers stay valid
        if self.speculative is not None:
            self.speculative.register(replica)
        self._pools = None

    @contextlib.contextmanager
    def registering(self) -> Iterator[None]:
        """A batch of :meth:`add_replica` calls: the prefix index's per-replica share (with
        ``index_total_capacity_blocks``) is enforced once at the end, not once per replica (which
        walked every replica per registration: a worker of 1,024 DP ranks next to a replica holding
        a long prompt took seconds)."""
        indexes = [i for i in (self.index, self.speculative) if i is not None]
        with self.lock:
            for i in indexes:
                i.defer_rebalance = True
        try:
            yield
        finally:
            with self.lock:
                for i in indexes:
                    i.defer_rebalance = False
                    i.rebalance()

    @_locked
    def remove_replica(self, replica: ReplicaId) -> None:
        """Unregister a DP rank: forget its cached blocks; in-flight requests stop counting on it."""
        if replica not in self._replicas:
            raise KeyError(f"unknown replica {replica}")
        del self._replicas[replica]
        self.load.remove_replica(replica)
        self.index.clear(replica)
        if self.speculative is not None:
            self.speculative.clear(replica)
        if self.host_index is not None:
            self.host_index.clear(replica)
        self._pools = None

    @_locked
    def set_healthy(self, replica: ReplicaId, healthy: bool) -> None:
        """Mark a DP rank (un)healthy; unhealthy ranks are not candidates but keep their state.

        Raises:
            KeyError: unknown replica.
        """
        info = self._replicas.get(replica)
        if info is None:
            raise KeyError(f"unknown replica {replica}")
        info.healthy = healthy
        self._pools = None

    @_locked
    def replicas(self, role: Role | None = None) -> list[ReplicaInfo]:
        """Registered replicas (of one role), sorted by engine then DP rank: copies (changing one
        changes nothing in the router; use :meth:`set_healthy` and friends)."""
        return [replace(i) for i in self._sorted_infos() if role is None or i.role is role]

    def _sorted_infos(self) -> list[ReplicaInfo]:
        return sorted(self._replicas.values(), key=lambda i: (i.replica.engine, i.replica.dp_rank))

    @property
    def disaggregated(self) -> bool:
        """True when healthy prefill replicas exist (PD mode)."""
        return len(self._get_pools()["prefill"].replicas) > 0

    def _get_pools(self) -> dict[str, _Pool]:
        if self._pools is None:
            self._prefill_registered = any(i.role is Role.PREFILL for i in self._replicas.values())
            healthy = [i for i in self._sorted_infos() if i.healthy]
            prefill = [i for i in healthy if i.role is Role.PREFILL]
            decode = [i for i in healthy if i.role in (Role.DECODE, Role.MIXED)]
            self._pools = {"prefill": self._make_pool(prefill, Role.PREFILL),
                           "decode": self._make_pool(decode, decode[0].role if decode else Role.DECODE)}
        return self._pools

    def _make_pool(self, infos: list[ReplicaInfo], role: Role) -> _Pool:
        reps = tuple(i.replica for i in infos)
        return _Pool(
            replicas=reps,
            slots=np.array([self.load.slot(r) for r in reps], dtype=np.int64),
            capacity=np.array([i.kv_capacity_tokens for i in infos], dtype=np.int64),
            position={r: k for k, r in enumerate(reps)},
            role=role,
            min_capacity=min((i.kv_capacity_tokens for i in infos if i.kv_capacity_tokens > 0), default=0),
        )

    @staticmethod
    def _fitting(pool: _Pool, need_tokens: int, what: str) -> _Pool:
        """``pool`` less the replicas whose known KV capacity is below ``need_tokens`` (unknown
        capacity, 0, counts as fitting); ``pool`` itself when all fit (the usual case, O(1)).

        Raises:
            RequestTooLargeError: no replica of a non-empty pool fits.
        """
        if not pool.min_capacity or need_tokens <= pool.min_capacity:
            return pool
        keep = [k for k, c in enumerate(pool.capacity.tolist()) if c == 0 or c >= need_tokens]
        if not keep and pool.replicas:
            raise RequestTooLargeError(f"{what} needs {need_tokens} tokens of KV; the largest {pool.role.value} "
                                       f"replica holds {int(pool.capacity.max())}")
        take = np.array(keep, dtype=np.intp)
        reps = tuple(pool.replicas[k] for k in keep)
        cap = pool.capacity[take]
        return _Pool(reps, pool.slots[take], cap, {r: i for i, r in enumerate(reps)}, pool.role,
                     min((c for c in cap.tolist() if c > 0), default=0))

    # ------------------------------------------------------------------ decisions
    @_locked
    def candidates(self, request: Request, pool_name: str, matches: dict[ReplicaId, int] | None = None) -> Candidates:
        """The snapshot a policy sees for ``pool_name`` (``"prefill"`` or ``"decode"``)."""
        if matches is not None:
            return self._candidates(request, self._get_pools()[pool_name], None, matches)
        spec = self.speculative.match_depths(request.block_hashes) if self.speculative is not None else None
        return self._candidates(request, self._get_pools()[pool_name], self.index.match_depths(request.block_hashes),
                                None, spec)

    @staticmethod
    def _gather(index: PrefixIndex, pool: _Pool, depths: np.ndarray) -> np.ndarray:
        """Per candidate of ``pool``, its depth in ``depths`` (an index's per-number match depths)."""
        n = len(pool.replicas)
        nums = index.numbers(pool.replicas)
        if not n or not len(depths):
            return np.zeros(n, dtype=np.int64)
        if nums[nums.argmin()] >= 0:  # every candidate has a number (the steady state)
            return depths[nums]
        return np.where(nums >= 0, depths[np.maximum(nums, 0)], 0)

    def _candidates(self, request: Request, pool: _Pool, depths: np.ndarray | None,
                    matches: dict[ReplicaId, int] | None, spec_depths: np.ndarray | None = None) -> Candidates:
        """:meth:`candidates` of ``pool`` from the index's per-number match depths (the hot path:
        vectorised; with ``spec_depths``, the hybrid mode's speculative index's, the larger per
        candidate) or from a ``{replica: blocks}`` dict."""
        n = len(pool.replicas)
        if depths is not None:
            matched = self._gather(self.index, pool, depths)
            if spec_depths is not None and self.speculative is not None:
                matched = np.maximum(matched, self._gather(self.speculative, pool, spec_depths))
            most = len(request.block_hashes)  # bound: a depth never exceeds the prompt's blocks
        else:
            matched = np.zeros(n, dtype=np.int64)
            position = pool.position
            for r, k in (matches or {}).items():
                pos = position.get(r)
                if pos is not None:
                    matched[pos] = k
            most = int(matched.max()) if n else 0  # most blocks any candidate matches
        slots = pool.slots
        load = self.load
        num_requests, decode_kv = load.num_requests[slots], load.decode_kv_tokens[slots]
        prefill_tokens = load.prefill_tokens[slots]
        if load.peer is not None and self.uses_load():  # the other processes of one pdlb serve (shared memory)
            num_requests = num_requests + load.peer_requests[slots]
            decode_kv = decode_kv + load.peer_kv_tokens[slots]
            prefill_tokens = prefill_tokens + load.peer_prefill_tokens[slots]
        if load.has_external:  # engine load reports: the part of the load that is not this router's
            num_requests = num_requests + load.external_requests[slots]
            decode_kv = decode_kv + load.external_kv_tokens[slots]
        if self.host_index is None and self.store_index is None:
            tokens = matched * self.block_size
            if most * self.block_size > request.prompt_tokens:  # a partial last block may match
                tokens = np.minimum(tokens, request.prompt_tokens)
            return Candidates(pool.role, pool.replicas, num_requests, prefill_tokens,
                              decode_kv, pool.capacity, matched, tokens, self.block_size,
                              prefill_attn_pairs=load.prefill_attn_pairs[slots],
                              prefill_head_start_s=load.prefill_head_start_s[slots],
                              prefill_head_tokens=load.prefill_head_tokens[slots],
                              prefill_head_pairs=load.prefill_head_pairs[slots])
        host, store = self._lower_tier_matches(request.block_hashes, pool.replicas, matched)
        w = self.tier_weights
        effective = matched + w["host"] * host + w["store"] * store
        tokens = np.minimum(np.rint(effective * self.block_size).astype(np.int64), request.prompt_tokens)
        return Candidates(
            role=pool.role,
            replicas=pool.replicas,
            num_requests=num_requests,
            prefill_tokens=prefill_tokens,
            decode_kv_tokens=decode_kv,
            kv_capacity_tokens=pool.capacity,
            matched_blocks=effective,
            matched_tokens=tokens,
            block_size=self.block_size,
            hbm_blocks=matched, host_blocks=host, store_blocks=store,
            prefill_attn_pairs=load.prefill_attn_pairs[slots],
            prefill_head_start_s=load.prefill_head_start_s[slots],
            prefill_head_tokens=load.prefill_head_tokens[slots],
            prefill_head_pairs=load.prefill_head_pairs[slots],
        )

    def _lower_tier_matches(self, block_hashes: tuple[int, ...], replicas: tuple[ReplicaId, ...],
                            hbm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per replica (shape ``(n,)``, int64): consecutive blocks after its HBM match held in its
        host tier, and consecutive blocks after both held in the shared store. Cost: one index
        match per distinct HBM depth and per distinct host depth (few), not per replica."""
        n = len(replicas)
        host = np.zeros(n, dtype=np.int64)
        store = np.zeros(n, dtype=np.int64)
        nb = len(block_hashes)
        if self.host_index is not None and nb:
            for d in np.unique(hbm).tolist():
                if d >= nb:
                    continue
                ks = np.flatnonzero(hbm == d)
                got = self.host_index.match(block_hashes[d:], [replicas[k] for k in ks.tolist()])
                if got:
                    pos = {r: k for k, r in zip(ks.tolist(), (replicas[k] for k in ks.tolist()))}
                    for r, m in got.items():
                        host[pos[r]] = m
        if self.store_index is not None and nb:
            depth = hbm + host
            for d in np.unique(depth).tolist():
                if d < nb:
                    store[depth == d] = self.store_index.match_replica(STORE_HOLDER, block_hashes[d:])
        return host, store

    @staticmethod
    def _without(pool: _Pool, exclude_engines: Collection[str]) -> _Pool:
        """``pool`` less the replicas whose engine is in ``exclude_engines``, built per call (the
        cached pools stay as they are); ``pool`` itself when that removes none or all of them."""
        keep = [k for k, r in enumerate(pool.replicas) if r.engine not in exclude_engines]
        if not keep or len(keep) == len(pool.replicas):
            return pool
        take = np.array(keep, dtype=np.intp)
        reps = tuple(pool.replicas[k] for k in keep)
        cap = pool.capacity[take]
        return _Pool(reps, pool.slots[take], cap, {r: i for i, r in enumerate(reps)}, pool.role,
                     min((c for c in cap.tolist() if c > 0), default=0))

    def _select(self, pool_name: str, policy: Policy, request: Request, cands: Candidates, now_s: float,
                position: Mapping[ReplicaId, int]) -> Choice:
        learner = self.cost_learner
        ctx = SelectContext(self.rng, now_s, self._decisions[pool_name],
                            learner.model if learner is not None else self.cost_model, self.ttft_slo)
        choice = policy.select(request, cands, ctx)
        if type(choice) is not Choice and not isinstance(choice, Choice):  # a user policy's bug, named
            raise PolicyError(f"policy {policy.name!r} ({pool_name} pool) returned {type(choice).__name__} "
                              f"{choice!r:.80} for request {request.request_id!r}, not a balancer.Choice")
        if choice.replica not in position:  # was a KeyError (or a request counted on an unknown rank)
            raise PolicyError(f"policy {policy.name!r} ({pool_name} pool) chose {choice.replica!r} for request "
                              f"{request.request_id!r}, which is not one of its {len(cands)} candidates")
        self._decisions[pool_name] += 1
        key = (pool_name, choice.reason)
        self._reasons[key] = self._reasons.get(key, 0) + 1
        return choice

    def route(self, request: Request, now_s: float, exclude_engines: Collection[str] = ()) -> Route:
        """Pick the replicas for ``request`` and count it on them (dispatch).

        Args:
            request: the request (``block_hashes`` of ``block_size``-token blocks).
            now_s: the caller's clock, seconds.
            exclude_engines: engine names (:attr:`ReplicaId.engine`, the worker URL in the
                service) to avoid, e.g. the workers that already failed this client request:
                a retry must not land on the same dead worker again just because its load went
                back to 0 (``least_load``) or its prefix is cached there (``cache_aware``). In
                each pool (prefill, decode) the candidates omit the DP ranks of these engines,
                unless that leaves the pool empty: then the whole pool stays (trying the same
                worker again beats a 503). Any collection with ``in``; empty (default): the
                cached pools are used as they are, at no extra cost.

        With prefill replicas registered but none healthy, the request is served by its decode
        replica alone (``Route.prefill`` is ``None``), as in an aggregated deployment; callers
        whose decode engines cannot prefill should check ``Route.prefill`` (or
        :attr:`disaggregated`) before dispatching.

        Replicas registered with a KV capacity (``kv_capacity_tokens`` > 0) are candidates only
        if they can hold the request: the prompt on a prefill replica, prompt + output on a
        decode or mixed one.

        ``now_s`` earlier than the latest time the router was given is taken as that latest time
        and counted (see the module docstring, "Clock").

        Raises:
            NoReplicaError: no healthy decode (or mixed) replica.
            RequestTooLargeError: no candidate's KV capacity can hold the request.
            PolicyError: a policy returned something other than a ``Choice`` of one of its
                candidates.
            ValueError: the request id is already in flight; ``now_s`` is not a finite number; the
                request carries more block hashes than its prompt has ``block_size``-token blocks
                (``ceil(prompt_tokens / block_size)``: hashes made at another block size, or a
                prompt length that is not the hashed prompt's). Nothing is counted then.
        """
        with self.lock:
            return self._route(request, now_s, exclude_engines)

    def _route(self, request: Request, now_s: float, exclude_engines: Collection[str]) -> Route:
        nb = len(request.block_hashes)
        if nb and (nb - 1) * self.block_size >= request.prompt_tokens:  # nb > ceil(prompt / block_size)
            most = -(-request.prompt_tokens // self.block_size)
            raise ValueError(f"request {request.request_id!r} carries {nb} block hashes, but its prompt of "
                             f"{request.prompt_tokens} tokens has at most {most} blocks of {self.block_size} tokens "
                             f"(block hashes made at another block size, or a wrong prompt_tokens?)")
        now_s = self._clock(now_s)
        if self.inflight_timeout_s is not None:
            self._reaped += self.load.reap(now_s - self.inflight_timeout_s)
        if self.load.has_external and self.load_report_max_age_s is not None:
            self.load.expire_reports(now_s - self.load_report_max_age_s)
        if self.load.is_in_flight(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already in flight")
        if self.load.peer is not None and self.uses_load():  # no policy reads load: nothing to refresh
            self.load.peer.refresh()
        pools = self._get_pools()
        if not pools["decode"].replicas:
            raise NoReplicaError("no healthy decode or mixed replica")
        if self.index.ttl_s is not None:
            self.index.expire(now_s)
            if self.host_index is not None:
                self.host_index.expire(now_s)
        if self.store_index is not None and self.store_index.ttl_s is not None:
            self.store_index.expire(now_s)
        spec = None
        if self.speculative is not None:
            self.speculative.expire(now_s)
            spec = self.speculative.match_depths(request.block_hashes)
        d_pool, p_pool = pools["decode"], pools["prefill"]
        if exclude_engines:
            d_pool = self._without(d_pool, exclude_engines)
            p_pool = self._without(p_pool, exclude_engines)
        # only replicas whose known KV capacity can hold the request (prompt + output on decode)
        d_pool = self._fitting(d_pool, request.prompt_tokens + request.output_tokens,
                               f"request {request.request_id!r} (prompt + output)")
        if p_pool.replicas:
            p_pool = self._fitting(p_pool, request.prompt_tokens, f"request {request.request_id!r} (prompt)")
        depths = self.index.match_depths(request.block_hashes)
        d_cands = self._candidates(request, d_pool, depths, None, spec)
        d_choice = self._select("decode", self.decode_policy, request, d_cands, now_s, d_pool.position)
        d_matched = int(d_cands.matched_tokens[d_pool.position[d_choice.replica]])
        prefill: ReplicaId | None = None
        p_choice: Choice | None = None
        p_matched = 0
        if p_pool.replicas and request.prompt_tokens - d_matched >= self.pd_min_uncached_tokens:
            p_cands = self._candidates(request, p_pool, depths, None, spec)
            p_choice = self._select("prefill", self.prefill_policy, request, p_cands, now_s, p_pool.position)
            prefill = p_choice.replica
            p_matched = int(p_cands.matched_tokens[p_pool.position[prefill]])
        uncached = request.prompt_tokens - (p_matched if prefill is not None else d_matched)
        if self.cost_learner is not None:
            self._record_features(request, now_s, d_cands, d_pool.position[d_choice.replica],
                                  p_cands if prefill is not None else None,
                                  p_pool.position[prefill] if prefill is not None else -1)
        cached = request.prompt_tokens - uncached
        self.load.on_dispatch(request.request_id, prefill, d_choice.replica, uncached, request.prompt_tokens,
                              prefill_attn_pairs=uncached * cached + uncached * (uncached + 1) / 2.0, now_s=now_s)
        if self.load.peer is not None:
            self.load.peer.publish()
        self._matched_tokens["decode"] += d_matched
        self._matched_tokens["prefill"] += p_matched
        if self.speculative is not None:
            if prefill is not None:
                self.speculative.insert(prefill, request.block_hashes, now_s)
            self.speculative.insert(d_choice.replica, request.block_hashes, now_s)
        if self.index_mode == "approximate":
            if prefill is not None:
                self.index.insert(prefill, request.block_hashes, now_s)
            self.index.insert(d_choice.replica, request.block_hashes, now_s)
            if self.host_index is not None:  # the replica that computes the prompt gets it
                self.host_index.insert(prefill if prefill is not None else d_choice.replica,
                                       request.block_hashes, now_s)
            if self.store_index is not None:
                self.store_index.insert(STORE_HOLDER, request.block_hashes, now_s)
            if self.on_routed is not None and request.block_hashes:
                self.on_routed((d_choice.replica,) if prefill is None else (prefill, d_choice.replica),
                               request.block_hashes, now_s)
        return Route(request.request_id, prefill, d_choice.replica, p_matched, d_matched, p_choice, d_choice)

    def _record_features(self, request: Request, now_s: float, d_cands: Candidates, d_pos: int,
                         p_cands: Candidates | None, p_pos: int) -> None:
        """Learning path: the chosen placement's cost-model features, for the online fit."""
        learner = self.cost_learner
        assert learner is not None
        model = learner.model
        out = float(request.output_tokens)
        d_name = d_cands.replicas[d_pos].engine
        d_eng = model.engine(d_name, "decode")
        px, dx = placement_features(request.prompt_tokens, out, d_cands, d_pos, d_eng)
        learner.on_decode_dispatch(request.request_id, dx, d_name)
        if p_cands is not None:
            p_name = p_cands.replicas[p_pos].engine
            p_eng = model.engine(p_name, "prefill")
            px, _ = placement_features(request.prompt_tokens, out, p_cands, p_pos, p_eng)
            learner.on_prefill_dispatch(request.request_id, px, now_s, "prefill", p_name)
        elif d_cands.role is Role.MIXED:
            learner.on_prefill_dispatch(request.request_id, px, now_s, "decode", d_name)
        # else: served decode-only by a PD router: not an observation of either prefill model

    # ------------------------------------------------------------------ hooks
    @_locked
    def on_prefill_done(self, request_id: str, now_s: float) -> None:
        """The prefill replica finished the request's prompt (its KV is ready to transfer).

        Raises:
            ValueError: ``now_s`` is not a finite number (see the module docstring, "Clock").
        """
        now_s = self._clock(now_s)
        self.load.on_prefill_done(request_id, now_s)
        if self.cost_learner is not None:
            self.cost_learner.on_prefill_done(request_id, now_s)
        if self.load.peer is not None:
            self.load.peer.publish()

    @_locked
    def on_first_token(self, request_id: str, now_s: float) -> None:
        """The first output token exists; implies prefill is done (aggregated or PD).

        Raises:
            ValueError: ``now_s`` is not a finite number (see the module docstring, "Clock").
        """
        now_s = self._clock(now_s)
        self.load.on_prefill_done(request_id, now_s)
        if self.cost_learner is not None:
            self.cost_learner.on_prefill_done(request_id, now_s)  # aggregated: no separate prefill hook
            self.cost_learner.on_first_token(request_id, now_s)
        if self.load.peer is not None:
            self.load.peer.publish()

    @_locked
    def on_finished(self, request_id: str, now_s: float, num_output_tokens: int | None = None) -> None:
        """The request finished, failed or was aborted: release all its load.

        Args:
            request_id: the routed request (unknown ids are ignored: released already, or reaped).
            now_s: the caller's clock, seconds.
            num_output_tokens: output tokens the request produced (>= 0; 0 when it failed or was
                aborted before its first token), for the online cost fit; ``None``: not known.

        Raises:
            ValueError: ``now_s`` is not a finite number, or ``num_output_tokens`` is not ``None``
                or an integer >= 0. Nothing is released then: call again with valid values.
        """
        if num_output_tokens is not None and (isinstance(num_output_tokens, bool) or not isinstance(
                num_output_tokens, numbers.Integral) or num_output_tokens < 0):
            raise ValueError(f"request {request_id!r}: num_output_tokens must be an integer >= 0 or None, "
                             f"got {num_output_tokens!r}")
        now_s = self._clock(now_s)
        self.load.on_finished(request_id, now_s)
        if self.cost_learner is not None:
            self.cost_learner.on_decode_finished(request_id, now_s, num_output_tokens)
        if self.load.peer is not None:
            self.load.peer.publish()

    @_locked
    def on_kv_event(self, replica: ReplicaId, event: KvEvent, now_s: float | None = None) -> None:
        """Apply an engine's KV cache event to the prefix index (exact cache state).

        ``now_s`` defaults to the latest time passed to :meth:`route` (TTL expiry assumes the
        index's timestamps never go backwards). Events for unknown replicas are ignored (a
        replica may publish before it is registered). The event's ``medium`` picks the view:
        HBM (the prefix index), the replica's host tier, or the shared store (the replica is
        then only the publisher); events for a tier the router does not track are ignored.

        Raises:
            TypeError: not a KV event. ValueError: ``now_s`` given and not a finite number, an
                unknown medium, or an HBM ``BlockStored``
                whose blocks neither start at a prompt's first block nor name their parent
                block, detected when its first block is already indexed elsewhere (see
                :class:`~balancer.prefix_index.PrefixIndex`).
        """
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"unknown KV event {event!r}")
        if replica not in self._replicas:
            self._kv_events["ignored"] += 1
            return
        now_s = self._default_now(now_s)
        tier = tier_of_medium(event.medium)
        index = self.index if tier == "hbm" else (self.host_index if tier == "host" else self.store_index)
        if index is None:
            self._kv_events["ignored"] += 1
            return
        holder = STORE_HOLDER if tier == "store" else replica
        self._kv_events["applied"] += 1
        if isinstance(event, BlockStored):
            index.insert(holder, event.block_hashes, now_s, parent_block_hash=event.parent_block_hash)
        elif isinstance(event, BlockRemoved):
            index.remove(holder, event.block_hashes)
        else:
            index.clear(holder)
            if isinstance(index, PrefixIndex):  # keep its number: cached pool numbers stay valid
                index.register(holder)

    @_locked
    def on_load_report(self, replica: ReplicaId, report: LoadReport, now_s: float | None = None) -> None:
        """An engine's own view of its load (e.g. scraped Prometheus metrics; see the module
        docstring): the part beyond this router's own count is kept as external load.

        Args:
            replica: the DP rank the report is about (unknown replicas are ignored).
            report: running and waiting requests and KV cache usage (0..1) on the engine.
            now_s: the caller's clock (default: the latest time passed to :meth:`route`).

        Raises:
            TypeError: ``report`` is not a :class:`~balancer.load.LoadReport`.
            ValueError: ``now_s`` given and not a finite number.
        """
        if not isinstance(report, LoadReport):
            raise TypeError(f"report must be a LoadReport, got {type(report).__name__}")
        now_s = self._default_now(now_s)
        info = self._replicas.get(replica)
        if info is None:
            return
        self.load.on_report(replica, report, info.kv_capacity_tokens, now_s)

    def uses_load(self) -> bool:
        """Whether a policy that decides reads the candidates' load (:attr:`Policy.uses_load`):
        the decode policy, and the prefill policy while prefill replicas are registered (a router
        of mixed replicas never runs it); when none does, the candidates carry only this router's
        own load (other processes' is not read)."""
        if getattr(self.decode_policy, "uses_load", True):
            return True
        return self._prefill_decides() and getattr(self.prefill_policy, "uses_load", True)

    def uses_prefix_index(self) -> bool:
        """Whether a policy that decides reads prefix matches (:attr:`Policy.uses_prefix_index`):
        the decode policy, and the prefill policy while prefill replicas are registered."""
        if getattr(self.decode_policy, "uses_prefix_index", True):
            return True
        return self._prefill_decides() and getattr(self.prefill_policy, "uses_prefix_index", True)

    def _prefill_decides(self) -> bool:
        """Whether prefill replicas are registered (healthy or not), so the prefill policy runs."""
        self._get_pools()
        return self._prefill_registered

    @_locked
    def record_routed(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> None:
        """Approximate mode: record a prompt another router (process) routed to ``replicas``, as
        :meth:`route` records its own (prefix index only; unknown replicas are ignored).

        Raises:
            ValueError: ``now_s`` is not a finite number.
        """
        now_s = self._clock(now_s)
        if self.index_mode != "approximate":
            return
        for rep in replicas:
            if rep in self._replicas:
                self.index.insert(rep, block_hashes, now_s)

    # ------------------------------------------------------------------ state
    @_locked
    def metrics(self) -> dict[str, Any]:
        """Counters for a gateway's own metrics (a fresh dict; values are plain numbers):
        ``decisions`` ``{pool: {reason: n}}``, ``matched_tokens`` ``{pool: prefix tokens the
        chosen replicas were believed to hold, summed}``, ``index_blocks`` (held, per replica,
        summed), ``index_unique_blocks``, ``speculative_blocks`` (hybrid), ``in_flight``,
        ``reaped_requests``, ``kv_events`` ``{"applied", "ignored"}``, ``replicas`` (registered),
        ``healthy_replicas``, ``clock_regressions`` (calls whose ``now_s`` went backwards and was
        clamped, see the module docstring) and ``clock_regression_max_s`` (the largest such step,
        seconds); with ``learn_cost_model``, ``cost_learning``: the online fit's
        observations, rejected timings by fit and reason, resets and pending records
        (:meth:`balancer.cost_model.CostLearner.stats`)."""
        decisions: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        for (pool, reason), n in self._reasons.items():
            decisions[pool][reason] = n
        return {
            "decisions": decisions,
            "matched_tokens": dict(self._matched_tokens),
            "index_blocks": self.index.num_blocks(),
            "index_unique_blocks": self.index.num_unique_blocks(),
            "speculative_blocks": self.speculative.num_blocks() if self.speculative is not None else 0,
            "in_flight": self.load.num_in_flight,
            "reaped_requests": self._reaped,
            "kv_events": dict(self._kv_events),
            "replicas": len(self._replicas),
            "healthy_replicas": sum(1 for i in self._replicas.values() if i.healthy),
            "clock_regressions": self._clock_regressions,
            "clock_regression_max_s": self._clock_regression_max_s,
            **({"cost_learning": self.cost_learner.stats()} if self.cost_learner is not None else {}),
        }

    @_locked
    def snapshot(self) -> bytes:
        """The router's whole state (replicas, prefix index, load, RNG, counters) as bytes, for a
        warm start with :meth:`restore`. A pickle: restore only snapshots you wrote."""
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def restore(data: bytes) -> Router:
        """A new router: the one saved by :meth:`snapshot` (its policies are the saved objects).
        Use it as ``router = Router.restore(data)``: it does not change the router it is called on.
        The snapshot is a pickle: restore only snapshots you made.

        Raises:
            TypeError: ``data`` is not a router snapshot (including bytes that do not unpickle).
        """
        try:
            obj = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - truncated or foreign bytes: UnpicklingError, EOFError, ...
            raise TypeError(f"not a Router snapshot ({type(e).__name__}: {e})"[:300]) from None
        if not isinstance(obj, Router):
            raise TypeError(f"not a Router snapshot (got {type(obj).__name__})")
        return obj

    def __getstate__(self) -> dict[str, Any]:
        with self.lock:
            state = {k: v for k, v in self.__dict__.items() if k not in ("lock", "_pools", "index", "speculative", "on_routed")}
            state["index"] = _flat_index(self.index)
            state["speculative"] = _flat_index(self.speculative) if self.speculative is not None else None
            return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["index"] = _unflat_index(state["index"])
        if state["speculative"] is not None:
            state["speculative"] = _unflat_index(state["speculative"])
        state.setdefault("_clock_regressions", 0)  # snapshots from before the clock counters
        state.setdefault("_clock_regression_max_s", 0.0)
        state.setdefault("_prefill_registered", False)  # recomputed with the pools
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self._pools = None
        self.on_routed = None


_RESTORE_HOLDER = ReplicaId("\x00pdlb-restore", 0)


def _flat_index(ix: PrefixIndex) -> dict[str, Any]:
    """A :class:`PrefixIndex` as flat lists (no linked structure for ``pickle`` to recurse into):
    its runs parent-first ``[(parent run number or -1, blocks)]``, each replica's LRU order
    ``[(run number, time)]`` oldest first, and the replica numbers. Reads the index's internals
    (the tree and the LRU lists), which it leaves unchanged."""
    runs: list[tuple[int, tuple[int, ...]]] = []
    number: dict[int, int] = {}
    stack = [(ix._root, -1)]
    while stack:
        node, parent = stack.pop()
        for child in node.children.values():
            number[id(child)] = len(runs)
            runs.append((parent, child.blocks))
            stack.append((child, number[id(child)]))
    lru: list[tuple[ReplicaId, int, list[tuple[int, float]]]] = []
    for rep, rs in ix._state.items():
        order = []
        e = rs.head.next
        while e is not rs.head:
            order.append((number[id(e.node)], e.time))
            e = e.next
        lru.append((rep, rs.num, order))
    lru.sort(key=lambda t: t[1])
    return {"capacity_blocks": ix.capacity_blocks, "ttl_s": ix.ttl_s, "block_map": ix._node_of is not None,
            "runs": runs, "lru": lru}


def _unflat_index(flat: dict[str, Any]) -> PrefixIndex:
    """The :class:`PrefixIndex` :func:`_flat_index` wrote, rebuilt through its public methods:
    replicas numbered in their old order, the tree laid out under a temporary holder, each
    replica's runs inserted in its LRU order with their times, then the holder cleared."""
    ix = PrefixIndex(None, flat["ttl_s"], block_map=True)
    runs = flat["runs"]
    for rep, _num, _order in flat["lru"]:
        ix.register(rep)
    paths: list[tuple[int, ...]] = []
    has_child = [False] * len(runs)
    for parent, blocks in runs:
        paths.append((paths[parent] if parent >= 0 else ()) + blocks)
        if parent >= 0:
            has_child[parent] = True
    for k, path in enumerate(paths):
        if not has_child[k]:
            ix.insert(_RESTORE_HOLDER, path, 0.0)
    for rep, _num, order in flat["lru"]:
        for k, t in order:
            parent, blocks = runs[k]
            ix.insert(rep, blocks, t, parent_block_hash=runs[parent][1][-1] if parent >= 0 else None)
    ix.clear(_RESTORE_HOLDER)
    ix.capacity_blocks = flat["capacity_blocks"]
    if not flat["block_map"]:
        ix._node_of = None  # as saved: the block map is built again on first use
    return ix
