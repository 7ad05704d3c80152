"""Building the perf model of one engine of a scenario's pool: the roofline with the scenario's
``[perf]`` table (:class:`sim.perf.config.PerfConfig`), wrapped for speculative decoding when it has
a ``[speculative]`` table (:class:`sim.perf.spec.SpecDecodePerf`).

On the run floor: it reads a :class:`~sim.scenario.Scenario` (the floor above the perf models),
and the run (:mod:`sim.run.cluster`, :mod:`sim.run.router_cost`), the searches and the tools build
their perf models with it; :mod:`sim.perf.config` and :mod:`sim.perf.spec` hold only the settings
the scenario embeds, so the perf floor imports nothing of the scenario.
"""

from __future__ import annotations

import dataclasses

from sim.models.hardware import get_hardware
from sim.models.presets import get_model
from sim.perf.base import PerfModel
from sim.perf.config import PerfConfig
from sim.perf.roofline import RooflinePerf
from sim.perf.spec import SpecDecodePerf
from sim.perf.step_class import StepClassPerf
from sim.scenario import PoolConfig, Scenario

__all__ = ["build_perf", "roofline_for_pool", "spec_perf_for_pool"]


def roofline_for_pool(scenario: Scenario, pool: PoolConfig, perf: PerfConfig | None = None) -> RooflinePerf:
    """Roofline model of one engine of ``pool``, with ``perf`` (default: ``scenario.perf``, else
    the built-in defaults). A scenario without ``perf`` gives the same model as
    ``RooflinePerf.for_engine(model, hardware, num_dp_ranks=..., gpus_per_rank=..., ep_synchronous=...)``.

    Raises:
        ValueError: unknown model/hardware, or the weights do not fit (see ``RooflinePerf``).
    """
    cfg = perf if perf is not None else (scenario.perf or PerfConfig())
    model = get_model(scenario.model)
    if cfg.fp8_weights is not None:
        model = dataclasses.replace(model, weight_bytes=1 if cfg.fp8_weights else 2,
                                    total_params=model.total_params, activated_params=model.activated_params)
    hardware = get_hardware(scenario.hardware)
    if cfg.gpus_per_node is not None:
        hardware = dataclasses.replace(hardware, gpus_per_node=cfg.gpus_per_node)
    return RooflinePerf.for_engine(
        model, hardware, num_dp_ranks=pool.dp_ranks, gpus_per_rank=pool.gpus_per_rank,
        ep_synchronous=pool.ep, context_parallel=pool.context_parallel, settings=cfg.roofline_settings())


def spec_perf_for_pool(base: PerfModel, scenario: Scenario, pool: PoolConfig) -> SpecDecodePerf:
    """``base`` (the pool's roofline) wrapped with the scenario's ``[speculative]`` table; a
    ``draft_model`` gets its own roofline on the pool's ranks (same hardware and ``[perf]``
    efficiencies, each DP rank stepping alone: a dense draft has no EP).

    Raises:
        ValueError: the scenario has no ``[speculative]`` table."""
    cfg = scenario.speculative
    if cfg is None:
        raise ValueError(f"scenario {scenario.name!r} has no [speculative] table")
    draft = None
    if cfg.draft_model is not None:
        dsc = scenario.model_copy(update={"model": cfg.draft_model})
        dpool = pool.model_copy(update={"ep": False})
        draft = roofline_for_pool(dsc, dpool)
    return SpecDecodePerf(base, cfg, draft)


def build_perf(scenario: Scenario, pool: PoolConfig) -> PerfModel:
    """The perf model of one engine of ``pool``: the roofline on the scenario's model and hardware,
    with the scenario's ``[perf]`` settings (TBO, FP8, calibrated efficiencies) when it has them
    (:func:`roofline_for_pool`); decode and mixed pools speculate when the scenario
    has a ``[speculative]`` table (:class:`sim.perf.spec.SpecDecodePerf`; with its ``verify =
    "every_step"``, vLLM's per-step MTP verification, :class:`sim.perf.step_class.StepClassPerf`)."""
    perf = roofline_for_pool(scenario, pool)
    spec = scenario.speculative
    if spec is not None and pool is not scenario.prefill:
        if spec.verify == "every_step":
            return StepClassPerf(perf, verify_tokens_per_seq=1 + spec.draft_tokens,
                                 decode_tokens_per_step=spec.tau(spec.draft_tokens))
        return spec_perf_for_pool(perf, scenario, pool)
    return perf
