"""The simulator's side of :mod:`balancer.cost_model`: a :class:`~balancer.cost_model.CostModel`
fitted to a scenario's perf models, handed to the router so cost-based policies (``ep_aware``)
price placements with the same step times the simulated engines take.

Each pool's :class:`~balancer.cost_model.EngineCost` is a least-squares fit
(:func:`balancer.cost_model.fit_step_cost`) of the pool's perf model (``perf.step_time_s``)
over random steps of the pool's step group (all DP ranks of a wide-EP engine, one rank of a dense
one; a long-prompt pool's engines get their own, by engine name); the transfer and tier-fetch costs come from the scenario's bandwidths and the model's KV
bytes per token. ``pdlb sim cost-model`` prints the result as a config table for ``pdlb serve``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from balancer.cost_model import CostModel, EngineCost, fit_step_cost
from sim.perf.base import PerfModel
from sim.perf.step_class import StepClassPerf
from sim.run.pool_perf import build_perf
from sim.scenario import PoolConfig, Scenario


def engine_cost(perf: PerfModel, pool: PoolConfig, *, running_cap: bool = False) -> EngineCost:
    """Fit one pool's engine cost to its perf model (see module docstring). ``running_cap``: a
    decode or mixed pool, whose ranks run at most ``max_num_seqs`` sequences (vLLM) and decode at
    most ``max_decode_batch`` (the simulated rank's two limits): the smaller is the cost model's
    ``max_num_seqs``. The pool's vLLM per-request chunk limit (``max_chunk_tokens``) and prefill
    cadence (``prefill_schedule_interval``) become ``request_chunk_tokens`` and
    ``prefill_schedule_interval`` (:mod:`balancer.prefill_cadence`). A perf model whose steps
    each gain several output tokens per decoding sequence (``perf.decode_tokens_per_step`` > 1:
    MTP verified on every step, :class:`sim.perf.step_class.StepClassPerf`) gives its
    ``decode_tokens_per_step``; a mean-field speculative model (:class:`sim.perf.spec.SpecDecodePerf`)
    already prices a step per accepted token and gives 1. A perf model with an eager-step floor
    (:class:`sim.perf.step_class.StepClassPerf` ``eager_floor_s`` > 0) gives it as
    ``prefill_step_floor_s`` (the floor where some rank decodes: a mixed pool's prefill steps run
    beside decoding ranks)."""
    ep = bool(perf.ep_synchronous) and pool.dp_ranks > 1
    cost = fit_step_cost(perf.step_time_s, pool.dp_ranks if ep else 1, pool.max_prefill_tokens,
                         max_decode_batch=pool.max_decode_batch, ep_synchronous=ep)
    if running_cap:
        cap = pool.max_decode_batch if pool.max_num_seqs is None else min(pool.max_num_seqs, pool.max_decode_batch)
        cost = replace(cost, max_num_seqs=int(cap))
    if pool.max_chunk_tokens is not None or pool.prefill_schedule_interval != 1:
        cost = replace(cost, request_chunk_tokens=pool.max_chunk_tokens,
                       prefill_schedule_interval=pool.prefill_schedule_interval)
    tau = float(perf.decode_tokens_per_step)
    if tau != 1.0:
        cost = replace(cost, decode_tokens_per_step=tau)
    floor = perf.eager_floor_s if isinstance(perf, StepClassPerf) else 0.0  # the one perf model with a floor
    if floor > 0.0:  # the steps with prefill while ranks decode (a mixed pool's, under load)
        cost = replace(cost, prefill_step_floor_s=floor)
    return cost


def cost_model_for(scenario: Scenario, perf_factory: Callable[[Scenario, PoolConfig], PerfModel] | None = None
                   ) -> CostModel:
    """The :class:`CostModel` of ``scenario`` (``perf_factory`` defaults to the simulator's
    :func:`sim.run.pool_perf.build_perf`). Deterministic."""
    if perf_factory is None:
        perf_factory = build_perf
    if scenario.disaggregated:
        assert scenario.prefill is not None and scenario.decode is not None
        p_perf = perf_factory(scenario, scenario.prefill)
        d_perf = perf_factory(scenario, scenario.decode)
        prefill, decode = engine_cost(p_perf, scenario.prefill), engine_cost(d_perf, scenario.decode, running_cap=True)
        pool, kv_bytes = scenario.prefill, p_perf.kv_bytes_per_token
    else:
        assert scenario.mixed is not None
        m_perf = perf_factory(scenario, scenario.mixed)
        decode = engine_cost(m_perf, scenario.mixed, running_cap=True)
        prefill = decode
        pool, kv_bytes = scenario.mixed, m_perf.kv_bytes_per_token
    kw: dict[str, float] = {
        "transfer_latency_s": scenario.kv_transfer_latency_s,
        "transfer_s_per_token": kv_bytes / scenario.kv_transfer_bandwidth_bytes_per_s,
    }
    host = scenario.host_tier_of(pool)
    if host is not None:  # the engine's host bandwidth is shared by its DP ranks
        kw["host_fetch_s_per_token"] = kv_bytes * pool.dp_ranks / host.bandwidth_bytes_per_s
    if scenario.shared_store is not None:
        kw["store_fetch_s_per_token"] = kv_bytes * pool.dp_ranks / scenario.shared_store.engine_read_bandwidth_bytes_per_s
    engines: dict[str, EngineCost] = {}
    long_pool = scenario.long_prefill
    if scenario.disaggregated and long_pool is not None:  # its engines are named like the cluster's
        long_cost = engine_cost(perf_factory(scenario, long_pool), long_pool)
        engines = {f"long-prefill-{e}": long_cost for e in range(long_pool.num_engines)}
    return CostModel(prefill=prefill, decode=decode, engines=engines, **kw)


# ---------------------------------------------------------------------- pdlb sim cost-model
def to_toml(model: CostModel, scenario_name: str, overrides: list[str] | None = None) -> str:
    """``model`` as a ``[cost_model]`` TOML table that ``pdlb serve --cost-model FILE`` (or a
    service config file's ``cost_model`` key) reads back; ``overrides`` (``--set`` texts) are
    named in the header comment."""
    sets = "".join(f" --set {o}" for o in overrides or [])
    lines = [f"# pdlb cost model fitted to scenario {scenario_name!r}{sets} (pdlb sim cost-model)", "[cost_model]"]
    d = model.to_dict()

    def emit(prefix: str, table: dict) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}")
        for k, v in table.items():
            if isinstance(v, dict):
                emit(f"{prefix}.{k}" if prefix else f"cost_model.{k}", v)

    scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
    for k, v in scalars.items():
        lines.append(f"{k} = {v!r}")
    for k, v in d.items():
        if isinstance(v, dict):
            emit(f"cost_model.{k}", v)
    return "\n".join(lines) + "\n"
