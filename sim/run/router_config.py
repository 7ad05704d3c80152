"""The router of a simulated run: the one place the simulator turns a scenario and run options
into a :class:`~balancer.config.RouterConfig` (:func:`sim.run.cluster.simulate` and
:func:`sim.search.point.evaluate_point` both build their routers here).

What the scenario sets rather than the config's defaults (:mod:`balancer.config`):

- ``block_size``: the scenario's (its trace's blocks: Mooncake's are 512 tokens);
- ``pd_min_uncached_tokens``: the scenario's;
- ``index_capacity_blocks``: the scenario's, or with ``"auto"`` (its default) one rank's KV cache
  in blocks: the first pool's rank in approximate and hybrid mode; in events mode the largest
  rank's (KV events keep the view exact, and a bound below a rank's cache, decode ranks holding
  more than prefill ranks, would drop blocks that rank still holds);
- ``index_total_capacity_blocks``: none (the per-replica bound already follows the ranks' caches);
- the KV tier views (:func:`router_tier_settings`) when the scenario has tiers;
- ``cost_model``: the scenario's exact one (:func:`sim.run.router_cost.cost_model_for`), and
  ``learn_cost_model`` off (a fit of the exact model could only add noise).

Then the scenario's ``router:`` section (:attr:`sim.scenario.Scenario.router`): each setting it
gives replaces the one above (e.g. ``index_ttl_s``, ``learn_cost_model = true`` to study the
online fit, a ``cost_model`` table to study a wrong model); ``tier_weights`` only when the run
names none. Policies, index mode, seed and SLO are the run's (the section refuses them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from balancer.config import PolicySpec, RouterConfig
from balancer.policies import Policy
from balancer.router import Router
from balancer.types import TtftSlo
from sim.run.router_cost import cost_model_for
from sim.perf.base import PerfModel
from sim.run.pool_perf import build_perf
from sim.scenario import PoolConfig, Scenario, tier_capacity_blocks

__all__ = ["RankCacheBlocks", "RouterFactory", "index_capacity_blocks", "router_config_for", "router_factory",
           "router_tier_settings"]


class RankCacheBlocks(NamedTuple):
    """KV cache sizes of a cluster's ranks, in blocks, for an ``"auto"`` index bound.

    Attributes:
        first: a rank of the first pool (prefill, or mixed).
        largest: the largest rank of any pool.
    """

    first: int | None
    largest: int


#: Makes a cluster's router once its ranks are known (:class:`sim.run.cluster.Cluster`).
RouterFactory = Callable[[RankCacheBlocks], Any]


def index_capacity_blocks(scenario: Scenario, ranks: RankCacheBlocks, index_mode: str) -> int | None:
    """The router's prefix-index bound per replica for ``scenario`` (see the module docstring)."""
    cap = scenario.index_capacity_blocks
    if cap != "auto":
        return cap
    return ranks.largest if index_mode == "events" else ranks.first


def router_tier_settings(scenario: Scenario, perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = build_perf
                         ) -> dict[str, Any]:
    """:class:`~balancer.config.RouterConfig` settings that mirror the scenario's KV tiers: a host
    view per replica bounded by one rank's host capacity, a store view bounded by the store
    capacity with the store's TTL (the largest class TTL when classes differ; none if the default
    class never expires); ``{}`` without tiers."""
    pool = scenario.prefill if scenario.disaggregated else scenario.mixed
    assert pool is not None
    host_cfg = scenario.host_tier_of(pool)
    ss = scenario.shared_store
    if host_cfg is None and ss is None:
        return {}
    block_bytes = perf_factory(scenario, pool).kv_bytes_per_token * scenario.block_size
    out: dict[str, Any] = {}
    if host_cfg is not None:
        cap = tier_capacity_blocks(host_cfg.capacity_bytes, host_cfg.capacity_blocks, block_bytes)
        out.update(host_tier=True, host_index_capacity_blocks=None if cap is None else max(1, cap // pool.dp_ranks))
    if ss is not None:
        cap = tier_capacity_blocks(ss.capacity_bytes, ss.capacity_blocks, block_bytes)
        ttl = None if ss.ttl_s is None else max([ss.ttl_s, *ss.class_ttl_s.values()])
        out.update(shared_store=True, store_index_capacity_blocks=cap, store_ttl_s=ttl)
    return out


def router_config_for(
    scenario: Scenario,
    *,
    seed: int = 0,
    index_mode: str = "approximate",
    router_tiers: bool = True,
    tier_weights: Mapping[str, float] | None = None,
    ttft_slo: TtftSlo | None = None,
    perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = build_perf,
) -> RouterConfig:
    """The :class:`~balancer.config.RouterConfig` of a run on ``scenario`` (the index bound is
    set per cluster by :func:`router_factory`; policies are passed as objects there).

    Args:
        seed: the router's RNG seed.
        index_mode: the prefix index's mode.
        router_tiers: with KV tiers in the scenario, give the router views of them (``False``: HBM only).
        tier_weights: weights of lower-tier hits (``None``: the defaults).
        ttft_slo: the TTFT budget SLO-aware policies route against (``None``: SLO-blind).
        perf_factory: ``(scenario, pool) -> PerfModel`` (the scenario's cost model is fitted to it).

    Raises:
        ValueError: a bad setting (e.g. an unknown index mode or tier weight).
    """
    tiers = router_tier_settings(scenario, perf_factory) if router_tiers else {}
    section = scenario.router_settings
    if tier_weights is not None:  # the run's own weights win over the scenario's
        section.pop("tier_weights", None)
    config = RouterConfig(
        block_size=scenario.block_size, index_mode=index_mode, pd_min_uncached_tokens=scenario.pd_min_uncached_tokens,
        index_total_capacity_blocks=None, seed=seed,
        tier_weights=dict(tier_weights) if tier_weights is not None else None,
        cost_model=section["cost_model"] if "cost_model" in section else cost_model_for(scenario, perf_factory),
        learn_cost_model=False, ttft_slo=ttft_slo, **tiers)
    return config.with_(**section) if section else config


def router_factory(scenario: Scenario, config: RouterConfig, prefill_policy: Policy | PolicySpec | None = None,
                   decode_policy: Policy | PolicySpec | None = None) -> Callable[..., Router]:
    """A :data:`RouterFactory`: the router of ``config`` with these policies (objects, shared by
    every router made; specs, built anew for each; ``None``: the config's) and the scenario's
    index bound for the cluster's ranks (:func:`index_capacity_blocks`).

    The factory is called as ``make(ranks)``, or with a router's parts as keywords
    (``make(ranks, seed=..., load_sources=..., listeners=...)``: the config's seed, then
    :meth:`balancer.router.Router.from_config`'s parts), as several routers in front of one
    cluster are built (:mod:`sim.experiments.k_routers`)."""
    def make(ranks: RankCacheBlocks, *, seed: int | None = None, **parts: Any) -> Router:
        cfg = config.with_(index_capacity_blocks=index_capacity_blocks(scenario, ranks, config.index_mode),
                           **({} if seed is None else {"seed": seed}))
        return Router.from_config(cfg, prefill_policy=_built(prefill_policy), decode_policy=_built(decode_policy),
                                  **parts)
    return make


def _built(policy: Policy | PolicySpec | None) -> Policy | None:
    return policy.build() if isinstance(policy, PolicySpec) else policy
