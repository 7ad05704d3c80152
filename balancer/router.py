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
    # an engine refused it before computing it (HTTP 4xx): forget the blocks route() recorded
    router.on_rejected(route, request.block_hashes, routed_at_s, by_prefill=False)

Modes: with prefill replicas registered the router disaggregates (prefill pool + decode pool);
without, it routes to one mixed (aggregated) replica and ``Route.prefill`` is ``None``. With
``pd_min_uncached_tokens > 0`` a PD router serves short-uncached requests on the decode replica
alone (conditional disaggregation; the vLLM router skips PD below 256 uncached tokens).

Prefix index modes: ``"approximate"`` records each routed prompt on its chosen replicas (as the
SGLang and llm-d routers do); ``"events"`` trusts only KV events from engines (as Dynamo does);
``"hybrid"`` trusts KV events and, in a second index whose entries live ``speculative_ttl_s``
(default :data:`balancer.config.DEFAULT_SPECULATIVE_TTL_S`), the prompts it routed itself, so that a burst of
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
their share. On a prefill replica the external requests are priced as queued prefill tokens too
(:mod:`balancer.load`: this router's own mean pending prefill there), since engines report counts.

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
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pydantic import ValidationError

from balancer import kernels
from balancer.candidates import Candidates
from balancer.cost_model import DEFAULT_COST_MODEL, CostLearner
from balancer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, tier_of_medium
from balancer.load import LoadReport, LoadTracker
from balancer.block_index import BlockIndex
from balancer.cache_view import STORE_HOLDER, CacheView  # noqa: F401  (STORE_HOLDER re-exported)
from balancer.config import DEFAULT_TIER_WEIGHTS, INDEX_MODES, PolicySpec, RouterConfig  # noqa: F401  (DEFAULT_TIER_WEIGHTS, INDEX_MODES re-exported)
from balancer.parts import CostLearnerPart, LoadSources, RejectListener, RouteListener
from balancer.policies import Policy, SelectContext
from balancer.prefix_index import PrefixIndex
from balancer.session_forecast import SessionFacts
from balancer.replicas import Pool, ReplicaInfo, ReplicaRegistry, RequestTooLargeError, fitting, without  # noqa: F401  (ReplicaInfo, RequestTooLargeError re-exported)
from balancer.types import Choice, ReplicaId, Request, Role, Route, is_finite_seconds
from balancer.validation import format_validation_error


def _locked(fn):  # noqa: ANN001, ANN202
    """Run the method holding ``self.lock``."""
    @functools.wraps(fn)
    def locked(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        with self.lock:
            return fn(self, *args, **kwargs)
    return locked


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request (the service maps it to HTTP 503)."""


class PolicyError(RuntimeError):
    """A policy's ``select`` returned something other than a :class:`~balancer.types.Choice` of
    one of the candidates it was given (a user policy's bug; the service answers 500, ``pdlb sim``
    prints one line naming the policy). Nothing is counted for the request then."""




class Router:
    """Routes requests to prefill/decode DP ranks with pluggable policies.

    Built from a :class:`~balancer.config.RouterConfig` (every setting and its default is
    documented there): ``Router.from_config(config)``. ``Router(prefill, decode, **settings)``
    is the same with the settings given as keywords (``RouterConfig`` fields) over ``config``.

    Args:
        prefill_policy / decode_policy: a :class:`~balancer.policies.Policy` object, a spec
            (``"ep_aware:ttft_slo_s=2"``, :class:`~balancer.config.PolicySpec`), or ``None``: the
            config's. The decode policy also routes aggregated (mixed) pools.
        config: the settings (default: :class:`~balancer.config.RouterConfig`'s defaults).
        load_sources: where the load policies see comes from
            (:class:`~balancer.parts.LoadSources`: a shared own tracker, or other routers' load);
            ``None``: this router's own decisions and engine reports only.
        listeners: :class:`~balancer.parts.RouteListener` s, called in order as
            ``listener(replicas, block_hashes, now_s)`` after each decision that recorded a prompt
            (approximate and hybrid modes), e.g. to share it with other router processes.
        reject_listeners: :class:`~balancer.parts.RejectListener` s, called in order by
            :meth:`on_rejected` after this router forgot its own copy, e.g. to retract the decision
            from the router processes it was shared with.
        learner: the online cost-model fit (:class:`~balancer.parts.CostLearnerPart`) to use
            instead of the one ``config.learn_cost_model`` would make; ``None``: as the config says.
        **settings: :class:`~balancer.config.RouterConfig` fields that replace the config's.

    Raises:
        ValueError: unknown policy name or index mode, negative sizes, bad tier weights, an
            unknown setting.
        TypeError: a count that is not an integer, a ``ttft_slo`` that is not a ``TtftSlo``; a
            policy object that is not a :class:`~balancer.policies.Policy`; ``load_sources`` not a
            ``LoadSources``; a listener that is not callable; a ``learner`` without the protocol's
            methods.
    """

    def __init__(
        self,
        prefill_policy: Policy | str | PolicySpec | None = None,
        decode_policy: Policy | str | PolicySpec | None = None,
        *,
        config: RouterConfig | None = None,
        load_sources: LoadSources | None = None,
        listeners: Sequence[RouteListener] = (),
        learner: CostLearnerPart | None = None,
        reject_listeners: Sequence[RejectListener] = (),
        **settings: Any,
    ) -> None:
        if config is None or settings:
            config = _config_with(config or RouterConfig(), settings)
        self.config = config
        self.prefill_policy = _policy_of(prefill_policy, config.prefill_policy)
        self.decode_policy = _policy_of(decode_policy, config.decode_policy)
        if self.prefill_policy.uses_kernels or self.decode_policy.uses_kernels:
            kernels.compiled()  # load the compiled loops now (off: nothing), not in the first decision
        self.block_size = config.block_size
        self.index_mode = config.index_mode
        self.pd_min_uncached_tokens = config.pd_min_uncached_tokens
        #: where prompts are cached: the prefix index, the speculative index, the tier views
        self.cache = CacheView(config)
        self.speculative_ttl_s = config.speculative_ttl_s
        self.inflight_timeout_s = config.inflight_timeout_s
        self.load_report_max_age_s = config.load_report_max_age_s
        #: the lock every public method holds (re-entrant)
        self.lock = threading.RLock()
        self._reasons: dict[tuple[str, str], int] = {}
        self._matched_tokens = {"prefill": 0, "decode": 0}
        self._kv_events = {"applied": 0, "ignored": 0}
        self._reaped = 0
        self._routes_recorded = 0  # numbers each route's prefix records (Route.touch_id, on_rejected)
        #: called as ``listener(replicas, block_hashes, now_s)`` after each decision that recorded
        #: a prompt (given at construction; see :class:`~balancer.parts.RouteListener`)
        self.listeners: tuple[RouteListener, ...] = tuple(listeners)
        for fn in self.listeners:
            if not callable(fn):
                raise TypeError(f"a route listener must be callable, got {type(fn).__name__}")
        #: called by :meth:`on_rejected` (given at construction; see :class:`~balancer.parts.RejectListener`)
        self.reject_listeners: tuple[RejectListener, ...] = tuple(reject_listeners)
        for reject_fn in self.reject_listeners:
            if not callable(reject_fn):
                raise TypeError(f"a reject listener must be callable, got {type(reject_fn).__name__}")
        if load_sources is not None and not isinstance(load_sources, LoadSources):
            raise TypeError(f"load_sources must be a balancer.parts.LoadSources, got {type(load_sources).__name__}")
        if learner is not None and not isinstance(learner, CostLearnerPart):
            raise TypeError(f"learner must have model, on_dispatch, on_prefill_done, on_first_token, on_finished "
                            f"and stats (balancer.parts.CostLearnerPart), got {type(learner).__name__}")
        #: the own load tracker (its peer source, if any, bound at construction: :mod:`balancer.parts`)
        self.load = (load_sources or LoadSources()).tracker()
        #: the registered replicas and their candidate pools
        self.registry = ReplicaRegistry(self.load.slot)
        self.rng = random.Random(config.seed)
        self._decisions = {"prefill": 0, "decode": 0}
        self._now_s = -math.inf  # latest time a caller passed in (see _clock); -inf: none yet
        self._clock_regressions = 0
        self._clock_regression_max_s = 0.0
        self.cost_model = config.cost_model
        self.ttft_slo = config.ttft_slo
        learn = config.learn_cost_model
        if learn is None:  # auto: when a policy reads the model
            learn = self.prefill_policy.uses_cost_model or self.decode_policy.uses_cost_model
        if learner is None and learn:
            learner = CostLearner(config.cost_model if config.cost_model is not None else DEFAULT_COST_MODEL)
        #: online fit of the cost model (:class:`~balancer.parts.CostLearnerPart`), or None (see
        #: ``RouterConfig.learn_cost_model``)
        self.cost_learner: CostLearnerPart | None = learner
        #: the session facts (:mod:`balancer.session_forecast`) when a policy reads them, else None
        self.session_facts = _session_facts_for(self.prefill_policy, self.decode_policy)

    @classmethod
    def from_config(cls, config: RouterConfig, *, prefill_policy: Policy | None = None,
                    decode_policy: Policy | None = None, load_sources: LoadSources | None = None,
                    listeners: Sequence[RouteListener] = (), learner: CostLearnerPart | None = None,
                    reject_listeners: Sequence[RejectListener] = ()) -> Router:
        """The router of ``config`` with its parts (see :class:`Router`'s arguments and
        :mod:`balancer.parts`); ``prefill_policy`` / ``decode_policy``: policy objects to use
        instead of the config's specs (e.g. a policy class that is not registered)."""
        return cls(prefill_policy, decode_policy, config=config, load_sources=load_sources, listeners=listeners,
                   learner=learner, reject_listeners=reject_listeners)

    # the cache view's parts, by their old names (read them under ``router.lock``)
    @property
    def index(self) -> PrefixIndex:
        """The HBM prefix index (:attr:`CacheView.index`)."""
        return self.cache.index

    @property
    def speculative(self) -> PrefixIndex | None:
        """Hybrid mode: the index of the router's own routed prompts; else None."""
        return self.cache.speculative

    @property
    def host_index(self) -> BlockIndex | None:
        """Host-DRAM tier view per replica, or None."""
        return self.cache.host_index

    @property
    def store_index(self) -> BlockIndex | None:
        """Shared-store view (one holder, :data:`STORE_HOLDER`), or None."""
        return self.cache.store_index

    @property
    def tier_weights(self) -> dict[str, float]:
        """Weights of lower-tier hits (defaults filled in)."""
        return self.cache.tier_weights

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
        self.registry.add(replica, role, kv_capacity_tokens)
        self.load.add_replica(replica)
        self.cache.register(replica)  # numbered now: the index's cached pool numbers stay valid

    @contextlib.contextmanager
    def registering(self) -> Iterator[None]:
        """A batch of :meth:`add_replica` calls: the prefix index's per-replica share (with
        ``index_total_capacity_blocks``) is enforced once at the end, not once per replica (which
        walked every replica per registration: a worker of 1,024 DP ranks next to a replica holding
        a long prompt took seconds)."""
        with self.lock:
            deferring = self.cache.deferring_rebalance()
            deferring.__enter__()
        try:
            yield
        finally:
            with self.lock:
                deferring.__exit__(None, None, None)

    @_locked
    def remove_replica(self, replica: ReplicaId) -> None:
        """Unregister a DP rank: forget its cached blocks; in-flight requests stop counting on it."""
        self.registry.remove(replica)
        if self.session_facts is not None:
            self.session_facts.drop_slot(self.load.slot(replica))
        self.load.remove_replica(replica)
        self.cache.forget(replica)

    @_locked
    def set_healthy(self, replica: ReplicaId, healthy: bool) -> None:
        """Mark a DP rank (un)healthy; unhealthy ranks are not candidates but keep their state.

        Raises:
            KeyError: unknown replica.
        """
        self.registry.set_healthy(replica, healthy)

    @_locked
    def replicas(self, role: Role | None = None) -> list[ReplicaInfo]:
        """Registered replicas (of one role), sorted by engine then DP rank: copies (changing one
        changes nothing in the router; use :meth:`set_healthy` and friends)."""
        return [replace(i) for i in self.registry.sorted_infos() if role is None or i.role is role]

    @property
    def disaggregated(self) -> bool:
        """True when healthy prefill replicas exist (PD mode)."""
        return len(self.registry.pools()["prefill"].replicas) > 0

    # ------------------------------------------------------------------ decisions
    @_locked
    def candidates(self, request: Request, pool_name: str, matches: dict[ReplicaId, int] | None = None) -> Candidates:
        """The snapshot a policy sees for ``pool_name`` (``"prefill"`` or ``"decode"``)."""
        if matches is not None:
            return self._candidates(request, self.registry.pools()[pool_name], None, matches)
        spec = self.speculative.match_depths(request.block_hashes) if self.speculative is not None else None
        return self._candidates(request, self.registry.pools()[pool_name], self.index.match_depths(request.block_hashes),
                                None, spec)

    def _candidates(self, request: Request, pool: Pool, depths: np.ndarray | None,
                    matches: dict[ReplicaId, int] | None, spec_depths: np.ndarray | None = None,
                    heads: bool = True, facts: bool = True) -> Candidates:
        """:meth:`candidates` of ``pool`` from the index's per-number match depths (the hot path:
        vectorised; with ``spec_depths``, the hybrid mode's speculative index's, the larger per
        candidate) or from a ``{replica: blocks}`` dict. ``heads``: with the in-service prefill
        columns (else ``None``: for a policy that does not read them,
        :attr:`balancer.policies.Policy.prefill_head_roles`)."""
        n = len(pool.replicas)
        cache = self.cache
        if depths is not None:
            matched = cache.hbm_matches(pool.replicas, depths, spec_depths)
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
        if facts and self.session_facts is not None:  # the policy reads the session facts: add them
            inflight = load.prefill_inflight[slots]
            ret, ret_kv = self.session_facts.forecast(slots, self._now_s)
            return replace(self._candidates(request, pool, depths, matches, spec_depths, heads, False),
                           prefill_inflight=inflight, returning_requests=ret, returning_kv_tokens=ret_kv)
        num_requests, decode_kv = load.num_requests[slots], load.decode_kv_tokens[slots]
        prefill_tokens = load.prefill_tokens[slots]
        if load.peer is not None and self.uses_load():  # the other processes of one pdlb serve (shared memory)
            num_requests = num_requests + load.peer_requests[slots]
            decode_kv = decode_kv + load.peer_kv_tokens[slots]
            prefill_tokens = prefill_tokens + load.peer_prefill_tokens[slots]
        pairs = load.prefill_attn_pairs[slots]
        if load.has_external:  # engine load reports: the part of the load that is not this router's
            num_requests = num_requests + load.external_requests[slots]
            decode_kv = decode_kv + load.external_kv_tokens[slots]
            prefill_tokens = prefill_tokens + load.external_prefill_tokens[slots]
            pairs = pairs + load.external_prefill_pairs[slots]
        if not cache.has_tiers:
            tokens = matched * self.block_size
            if most * self.block_size > request.prompt_tokens:  # a partial last block may match
                tokens = np.minimum(tokens, request.prompt_tokens)
            if not heads:
                return Candidates(pool.role, pool.replicas, num_requests, prefill_tokens,
                                  decode_kv, pool.capacity, matched, tokens, self.block_size,
                                  prefill_attn_pairs=pairs)
            return Candidates(pool.role, pool.replicas, num_requests, prefill_tokens,
                              decode_kv, pool.capacity, matched, tokens, self.block_size,
                              prefill_attn_pairs=pairs,
                              prefill_head_start_s=load.prefill_head_start_s[slots],
                              prefill_head_tokens=load.prefill_head_tokens[slots],
                              prefill_head_pairs=load.prefill_head_pairs[slots])
        host, store = cache.lower_tier_matches(request.block_hashes, pool.replicas, matched)
        w = cache.tier_weights
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
            prefill_attn_pairs=pairs,
            prefill_head_start_s=load.prefill_head_start_s[slots] if heads else None,
            prefill_head_tokens=load.prefill_head_tokens[slots] if heads else None,
            prefill_head_pairs=load.prefill_head_pairs[slots] if heads else None,
        )

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
        pools = self.registry.pools()
        if not pools["decode"].replicas:
            raise NoReplicaError("no healthy decode or mixed replica")
        cache = self.cache
        cache.expire(now_s)
        spec = cache.speculative.match_depths(request.block_hashes) if cache.speculative is not None else None
        d_pool, p_pool = pools["decode"], pools["prefill"]
        if exclude_engines:
            d_pool = without(d_pool, exclude_engines)
            p_pool = without(p_pool, exclude_engines)
        # only replicas whose known KV capacity can hold the request (prompt + output on decode)
        d_pool = fitting(d_pool, request.prompt_tokens + request.output_tokens,
                               f"request {request.request_id!r} (prompt + output)")
        if p_pool.replicas:
            p_pool = fitting(p_pool, request.prompt_tokens, f"request {request.request_id!r} (prompt)")
        if self.session_facts is not None:  # its session is back: not idle (nor its own forecast) any more
            self.session_facts.on_arrival(request.session_id)
        depths = cache.index.match_depths(request.block_hashes)
        d_cands = self._candidates(request, d_pool, depths, None, spec,
                                   d_pool.role in self.decode_policy.prefill_head_roles)
        d_choice = self._select("decode", self.decode_policy, request, d_cands, now_s, d_pool.position)
        d_matched = int(d_cands.matched_tokens[d_pool.position[d_choice.replica]])
        prefill: ReplicaId | None = None
        p_choice: Choice | None = None
        p_matched = 0
        if p_pool.replicas and request.prompt_tokens - d_matched >= self.pd_min_uncached_tokens:
            p_cands = self._candidates(request, p_pool, depths, None, spec,
                                       Role.PREFILL in self.prefill_policy.prefill_head_roles)
            p_choice = self._select("prefill", self.prefill_policy, request, p_cands, now_s, p_pool.position)
            prefill = p_choice.replica
            p_matched = int(p_cands.matched_tokens[p_pool.position[prefill]])
        uncached = request.prompt_tokens - (p_matched if prefill is not None else d_matched)
        if self.cost_learner is not None:
            self.cost_learner.on_dispatch(request, now_s, d_cands, d_pool.position[d_choice.replica],
                                          p_cands if prefill is not None else None,
                                          p_pool.position[prefill] if prefill is not None else -1)
        cached = request.prompt_tokens - uncached
        self.load.on_dispatch(request.request_id, prefill, d_choice.replica, uncached, request.prompt_tokens,
                              prefill_attn_pairs=uncached * cached + uncached * (uncached + 1) / 2.0, now_s=now_s)
        if self.session_facts is not None:
            self.session_facts.on_route(request.request_id, request.session_id, self.load.slot(d_choice.replica),
                                        request.prompt_tokens, self.load.num_in_flight, self.load.is_in_flight)
        if self.load.peer is not None:
            self.load.peer.publish()
        self._matched_tokens["decode"] += d_matched
        self._matched_tokens["prefill"] += p_matched
        self._routes_recorded = touch_id = self._routes_recorded + 1
        if cache.record_routed(prefill, d_choice.replica, request.block_hashes, now_s, touch_id):
            if self.listeners and request.block_hashes:
                chosen = (d_choice.replica,) if prefill is None else (prefill, d_choice.replica)
                for listener in self.listeners:
                    listener(chosen, request.block_hashes, now_s)
        return Route(request.request_id, prefill, d_choice.replica, p_matched, d_matched, p_choice, d_choice,
                     touch_id)

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
        if self.session_facts is not None:
            self.session_facts.on_finished(request_id, now_s, num_output_tokens or 0)
        self.load.on_finished(request_id, now_s)
        if self.cost_learner is not None:
            self.cost_learner.on_finished(request_id, now_s, num_output_tokens)
        if self.load.peer is not None:
            self.load.peer.publish()

    @_locked
    def on_rejected(self, route: Route, block_hashes: tuple[int, ...], routed_at_s: float, *,
                    by_prefill: bool) -> int:
        """An engine of ``route`` refused the request before computing it (e.g. an HTTP 4xx): forget
        the prompt's blocks that :meth:`route` recorded on the replicas that will not hold them,
        which otherwise stay in the prefix index (approximate mode) and the speculative index
        (hybrid) as if cached until the LRU drops them.

        Args:
            route: what :meth:`route` returned for the request.
            block_hashes: the request's ``block_hashes`` (as routed).
            routed_at_s: the ``now_s`` given to :meth:`route` (the time its records carry).
            by_prefill: the prefill replica refused (PD): the decode replica gets no KV either, so
                both forget; otherwise only the decode (or mixed) replica does (the prefill may have
                computed the prompt already).

        Each replica keeps the blocks it matched when routed (``ceil(matched_tokens /
        block_size)``, at least its index depth then) and any block touched again since this
        route recorded it (another request routed there meanwhile, at a later or the same
        ``now_s``: told apart by the route's ``touch_id``; a peer's decision or a KV event too).
        A ``route`` without a ``touch_id`` (built by the caller) compares times only: a block
        another request touched at the same ``now_s`` is dropped too. Events mode: nothing to forget
        (the engines' own events are the truth). Returns the blocks dropped. Then each of
        ``reject_listeners`` is called as ``listener(replicas, block_hashes, routed_at_s, forgotten)``
        (``replicas`` as the route listeners got them, prefill first; ``forgotten``: ``(replica,
        kept_blocks)`` per replica that forgets), so that router processes the decision was shared
        with forget it too (:meth:`forget_recorded`, by time: the records they got carry no touch
        id); a broker's peers keep their copy.
        """
        bs = self.block_size
        targets = [(route.decode, route.decode_matched_tokens)]
        if by_prefill and route.prefill is not None:
            targets.append((route.prefill, route.prefill_matched_tokens))
        n = 0
        forgotten = tuple((rep, -(-matched // bs)) for rep, matched in targets)
        for rep, kept in forgotten:
            n += self.cache.forget_routed(rep, block_hashes, kept, routed_at_s, route.touch_id)
        if self.reject_listeners and block_hashes:
            chosen = (route.decode,) if route.prefill is None else (route.prefill, route.decode)
            for listener in self.reject_listeners:
                listener(chosen, block_hashes, routed_at_s, forgotten)
        return n

    @_locked
    def forget_recorded(self, replica: ReplicaId, block_hashes: tuple[int, ...], touched_s: float) -> int:
        """Approximate mode: forget those of ``block_hashes`` on ``replica`` whose last touch in the
        prefix index was at ``touched_s`` exactly (what :meth:`record_routed` recorded then, and
        nothing touched since): another router process's retraction of a prompt an engine refused
        (:meth:`on_rejected` there). Returns the blocks dropped (0: unknown replica, other modes)."""
        if replica not in self.registry or not block_hashes:
            return 0
        return self.cache.forget_routed(replica, block_hashes, 0, touched_s)

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
        if replica not in self.registry:
            self._kv_events["ignored"] += 1
            return
        now_s = self._default_now(now_s)
        applied = self.cache.apply_kv_event(replica, event, now_s)
        self._kv_events["applied" if applied else "ignored"] += 1

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
        info = self.registry.get(replica)
        if info is None:
            return
        self.load.on_report(replica, report, info.kv_capacity_tokens, now_s, prefill_queue=info.role is Role.PREFILL)

    def uses_load(self) -> bool:
        """Whether a policy that decides reads the candidates' load (:attr:`Policy.uses_load`):
        the decode policy, and the prefill policy while prefill replicas are registered (a router
        of mixed replicas never runs it); when none does, the candidates carry only this router's
        own load (other processes' is not read)."""
        if self.decode_policy.uses_load:
            return True
        return self._prefill_decides() and self.prefill_policy.uses_load

    def uses_prefix_index(self) -> bool:
        """Whether a policy that decides reads prefix matches (:attr:`Policy.uses_prefix_index`):
        the decode policy, and the prefill policy while prefill replicas are registered."""
        return policies_use_prefix_index(self.prefill_policy, self.decode_policy, self._prefill_decides())

    def _prefill_decides(self) -> bool:
        """Whether prefill replicas are registered (healthy or not), so the prefill policy runs."""
        return self.registry.prefill_registered()

    @_locked
    def record_routed(self, replicas: Collection[ReplicaId], block_hashes: tuple[int, ...], now_s: float) -> float:
        """Approximate mode: record a prompt another router (process) routed to ``replicas``, as
        :meth:`route` records its own (prefix index only; unknown replicas are ignored). Returns the
        time it was recorded at, which :meth:`forget_recorded` takes: ``now_s`` when it is later
        than every time this router has seen, else the next float after the latest one (see the
        module docstring, "Clock"), so that it never shares its time with a record of this router's
        own made before it (a retraction by time would take that one's blocks too).

        Raises:
            ValueError: ``now_s`` is not a finite number.
        """
        latest = self._now_s
        now_s = self._clock(now_s)
        if now_s <= latest:
            now_s = self._now_s = math.nextafter(latest, math.inf)
        self.cache.record_peer_routed([r for r in replicas if r in self.registry], block_hashes, now_s)
        return now_s

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
            "replicas": len(self.registry),
            "healthy_replicas": sum(1 for i in self.registry if i.healthy),
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
        with self.lock:  # the prefix indexes pickle themselves flat (PrefixIndex.to_flat)
            # listeners and the peer source belong to this process (LoadTracker drops its peer)
            return {k: v for k, v in self.__dict__.items() if k not in ("lock", "listeners", "reject_listeners")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        for key in ("index", "speculative"):  # snapshots that stored the flat form themselves
            if isinstance(state.get(key), dict):
                state[key] = PrefixIndex.from_flat(state[key])
        if "cache" not in state:  # snapshots from before the cache view part: its indexes were the router's
            cache = CacheView.__new__(CacheView)
            cache.index_mode = state["index_mode"]
            cache.index, cache.speculative = state.pop("index"), state.pop("speculative")
            cache.host_index, cache.store_index = state.pop("host_index"), state.pop("store_index")
            cache.tier_weights = state.pop("tier_weights")
            cache.has_tiers = cache.host_index is not None or cache.store_index is not None
            state["cache"] = cache
        state.setdefault("_clock_regressions", 0)  # snapshots from before the clock counters
        state.setdefault("_clock_regression_max_s", 0.0)
        state.setdefault("_routes_recorded", 0)  # snapshots from before route touch ids
        if "_replicas" in state:  # snapshots from before the registry part
            registry = ReplicaRegistry(state["load"].slot)
            for info in state.pop("_replicas").values():
                registry.add(info.replica, info.role, info.kv_capacity_tokens)
                registry.set_healthy(info.replica, info.healthy)
            state["registry"] = registry
        state.pop("on_routed", None)  # snapshots from before the listeners part
        if "session_facts" not in state:  # snapshots from before the session facts: start them empty
            state["session_facts"] = _session_facts_for(state["prefill_policy"], state["decode_policy"])
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self.listeners = ()
        self.reject_listeners = ()


def _session_facts_for(prefill_policy: Policy, decode_policy: Policy) -> SessionFacts | None:
    """The session facts part when either policy reads them (the longer horizon), else None."""
    horizons = [h for h in (prefill_policy.session_facts, decode_policy.session_facts) if h is not None]
    return SessionFacts(max(horizons)) if horizons else None


def _config_with(config: RouterConfig, settings: Mapping[str, Any]) -> RouterConfig:
    """``config`` with ``settings`` (RouterConfig fields) applied; one-line errors.

    Raises:
        ValueError: an unknown setting or a bad value (the field's own message).
        TypeError: a count that is not an integer, a ``ttft_slo`` that is not a ``TtftSlo``.
    """
    unknown = sorted(set(settings) - set(RouterConfig.model_fields))
    if unknown:
        raise TypeError(f"Router got unknown setting(s) {', '.join(unknown)}; valid: {', '.join(RouterConfig.model_fields)}")
    try:
        return config.with_(**settings)
    except ValidationError as e:
        wrong_type = any(isinstance((err.get("ctx") or {}).get("error"), TypeError) for err in e.errors())
        raise (TypeError if wrong_type else ValueError)(format_validation_error(e, None, RouterConfig)) from None


def policies_use_prefix_index(prefill_policy: Policy, decode_policy: Policy, prefill_decides: bool) -> bool:
    """Whether a policy that decides reads prefix matches (:attr:`Policy.uses_prefix_index`): the
    decode policy, or the prefill policy when ``prefill_decides`` (prefill replicas registered).
    :meth:`Router.uses_prefix_index` of a router; a service asks it before building its router
    (whether to build the parts that share routed prompts)."""
    return decode_policy.uses_prefix_index or (prefill_decides and prefill_policy.uses_prefix_index)


def _policy_of(given: Policy | str | PolicySpec | None, spec: PolicySpec) -> Policy:
    """The policy object: ``given`` itself, built from its spec, or the config's ``spec``'s.

    Raises:
        TypeError: ``given`` is an object that is not a :class:`~balancer.policies.Policy` (whose
            class declares what the policy reads: ``uses_load``, ``uses_prefix_index``, ...).
    """
    if given is None:
        return spec.build()
    if isinstance(given, str):
        return PolicySpec.parse(given).build()
    if isinstance(given, PolicySpec):
        return given.build()
    if not isinstance(given, Policy):
        raise TypeError(f"a policy must be a balancer.Policy (a subclass declares what it reads), "
                        f"got {type(given).__name__}")
    return given
