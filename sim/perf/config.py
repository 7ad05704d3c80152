"""Per-scenario settings of the roofline perf model (the ``[perf]`` table of a scenario file).

Every field defaults to the roofline's built-in value, so a scenario without ``perf`` gets exactly
the model it always had. :func:`sim.run.pool_perf.roofline_for_pool` builds the engine model of one pool
with them. This module imports nothing above the perf models (the scenario embeds it).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sim.perf.imbalance import EPLB_RESIDUAL_STD
from sim.perf.roofline import (
    RooflineSettings,
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_COMM_EFFICIENCY,
    DEFAULT_COMM_OVERLAP,
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_MBU,
    DEFAULT_MFU,
    DEFAULT_STEP_OVERHEAD_S,
)

#: Lowest efficiency accepted (0.1%): 1e-300 made every step take ``inf`` seconds, reported as a
#: TTFT of ``inf`` with exit status 0.
MIN_EFFICIENCY = 1e-3
#: Longest fixed cost per step accepted, seconds.
MAX_STEP_OVERHEAD_S = 60.0


class PerfConfig(BaseModel):
    """Roofline settings of a scenario (see :mod:`sim.perf.roofline` for the formulas).

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

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # as the scenario models

    mfu: float = Field(DEFAULT_MFU, ge=MIN_EFFICIENCY, le=1)
    mbu: float = Field(DEFAULT_MBU, ge=MIN_EFFICIENCY, le=1)
    step_overhead_s: float = Field(DEFAULT_STEP_OVERHEAD_S, ge=0, le=MAX_STEP_OVERHEAD_S)
    comm_efficiency: float = Field(DEFAULT_COMM_EFFICIENCY, ge=MIN_EFFICIENCY, le=1)
    comm_overlap: float = Field(DEFAULT_COMM_OVERLAP, ge=0, le=1)
    kv_cache_fraction: float = Field(DEFAULT_KV_CACHE_FRACTION, ge=MIN_EFFICIENCY, le=1)
    activation_reserve_bytes: float = Field(DEFAULT_ACTIVATION_RESERVE_BYTES, ge=0)
    tbo: bool = False
    tbo_overhead_s: float = Field(0.0, ge=0, le=MAX_STEP_OVERHEAD_S)
    fp8_weights: bool | None = None
    gpus_per_node: int | None = Field(None, ge=1)
    ep_ll_nvlink: bool = False
    tbo_phases: bool = False
    comm_efficiency_normal: float | None = Field(None, ge=MIN_EFFICIENCY, le=1)
    prefill_comm_sm_fraction: float = Field(0.0, ge=0, lt=1)
    ep_imbalance_prefill: float = Field(1.0, ge=1)
    ep_imbalance_decode: float = Field(1.0, ge=1)
    eplb_physical_experts: int | None = Field(None, ge=1)
    eplb_residual_std: float = Field(EPLB_RESIDUAL_STD, ge=0)

    def roofline_settings(self) -> RooflineSettings:
        """These settings as the roofline takes them (every field but ``fp8_weights`` and
        ``gpus_per_node``, which change the model and the hardware instead)."""
        return RooflineSettings(**{f: getattr(self, f) for f in RooflineSettings.__dataclass_fields__})
