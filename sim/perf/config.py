"""Per-scenario settings of the roofline perf model (the ``[perf]`` table of a scenario file).

Every field defaults to the roofline's built-in value, so a scenario without ``perf`` gets exactly
the model it always had. :func:`sim.run.pool_perf.roofline_for_pool` builds the engine model of one pool
with them. This module imports nothing above the perf models (the scenario embeds it).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from sim.perf.roofline import MAX_STEP_OVERHEAD_S, MIN_EFFICIENCY, RooflineSettings

__all__ = ["MAX_STEP_OVERHEAD_S", "MIN_EFFICIENCY", "PerfConfig"]

#: The ``[perf]`` settings that are not the roofline's: they change the model and the hardware
#: instead. Listed after ``tbo_overhead_s``, where the table has always had them (a scenario's
#: dump keeps its order).
_MODEL_AND_HARDWARE: dict[str, Any] = {
    "fp8_weights": (bool | None, None),
    "gpus_per_node": (int | None, Field(None, ge=1)),
}
_AFTER = "tbo_overhead_s"


class _PerfConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # as the scenario models

    def roofline_settings(self) -> RooflineSettings:
        """These settings as the roofline takes them (every field but ``fp8_weights`` and
        ``gpus_per_node``, which change the model and the hardware instead)."""
        return RooflineSettings(**{f.name: getattr(self, f.name) for f in fields(RooflineSettings)})


def _perf_fields() -> dict[str, Any]:
    """The model's fields: each :class:`~sim.perf.roofline.RooflineSettings` field with its type,
    bounds and default, and :data:`_MODEL_AND_HARDWARE` after ``tbo_overhead_s``."""
    hints = get_type_hints(RooflineSettings, include_extras=True)
    out: dict[str, Any] = {}
    for f in fields(RooflineSettings):
        out[f.name] = (hints[f.name], f.default)
        if f.name == _AFTER:
            out.update(_MODEL_AND_HARDWARE)
    return out


class PerfConfig(create_model("_PerfFields", __base__=_PerfConfigBase, __module__=__name__,  # type: ignore[misc]
                              **_perf_fields())):
    """Roofline settings of a scenario (see :mod:`sim.perf.roofline` for the formulas).

    The fields are :class:`~sim.perf.roofline.RooflineSettings`' (names, types, bounds and defaults
    written there once) plus ``fp8_weights`` and ``gpus_per_node``; unknown keys are refused.

    Attributes:
        mfu / mbu: fraction of tensor-core peak / HBM bandwidth reached by a whole step.
        step_overhead_s: fixed cost per step (scheduler, sampling, launch gaps), seconds.
        comm_efficiency: fraction of NVLink / NIC peak reached by MoE dispatch/combine.
        comm_overlap: fraction of dispatch/combine hidden behind compute when ``tbo`` is off.
        kv_cache_fraction / activation_reserve_bytes: GPU memory budget for weights + KV, and the
            part of it kept for activations (bytes per GPU).
        tbo: two-micro-batch overlap (DeepSeek day-6 overview; SGLang ``--enable-two-batch-overlap``):
            step = max(compute, comm) + ``tbo_overhead_s`` instead of compute + comm; the weights
            are streamed once per micro-batch.
        tbo_overhead_s: extra seconds per step for the split (pipeline fill, two launches).
        fp8_weights: ``True`` stores/streams linear weights as FP8 (1 byte per parameter) and runs
            linear layers at the FP8 peak, ``False`` BF16 (2 bytes); ``None`` keeps the model's own.
        gpus_per_node: GPUs per NVLink domain; ``None`` keeps the hardware's (8 for HGX).
        ep_ll_nvlink: decode (low-latency) dispatch/combine sends copies to experts on the own node
            over NVLink and only off-node copies over the NIC; ``False`` = pure-RDMA low-latency
            kernels (DeepEP's original design), every copy over the NIC.
        tbo_phases: under ``tbo``, each layer is four phases (one micro-batch's attention / MoE against
            the other's combine / dispatch) instead of max(compute, comm); see ``sim.perf.roofline``.
        comm_efficiency_normal: fraction of link peak reached by normal-mode (prefill) dispatch/combine;
            ``None`` = ``comm_efficiency``.
        prefill_comm_sm_fraction: fraction of SMs normal-mode kernels hold while TBO overlaps them with
            compute (prefill compute time x 1/(1 - f)); 0 = none.
        ep_imbalance_prefill / ep_imbalance_decode: a fixed max/mean expert load of the busiest GPU
            (>= 1), scaling its routed-expert compute and dispatch/combine time.
        eplb_physical_experts: expert slots of an EP group after EPLB (routed + redundant experts,
            e.g. 288 = 256 + 32); sets the max/mean load of every step from the placement, the EP size
            and the step's tokens (:func:`sim.perf.imbalance.eplb_imbalance`); ``None`` = off. Excludes
            the fixed factors.
        eplb_residual_std: the placement's relative error per slot (default derived from
            TensorRT-LLM's measured loads, :data:`sim.perf.imbalance.EPLB_RESIDUAL_STD`).
    """
