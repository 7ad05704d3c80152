"""Analytic roofline step-latency model for dense (TP) and wide-EP MoE (DP attention) engines.

Engine layout: ``num_dp_ranks`` DP ranks of ``gpus_per_rank`` GPUs each (TP inside a rank).

* Dense model / non-EP engine: each rank holds the whole model sharded ``tp = gpus_per_rank`` ways
  and steps alone (``ep_synchronous=False``).
* Wide-EP MoE engine (``ep_synchronous=True``, DeepSeek-style DP attention): every rank holds the
  *dense* part (attention, dense FFN layers, shared experts, router, LM head; sharded over its
  ``tp`` GPUs) and computes it for its own tokens; the routed experts are sharded over all
  ``G = num_dp_ranks * gpus_per_rank`` GPUs and process the tokens of *all* ranks; tokens travel to
  their experts and back (dispatch/combine all-to-all). All ranks step together.

Time of one step, per GPU, with ``roof(F, B) = max(F / (peak * mfu), B / (hbm_bw * mbu))``::

    rank_r   = roof(dense FLOPs + attention FLOPs of rank r,  dense weights read + KV read + KV written)
    moe      = roof(T * expert_flops_per_token / G,           touched routed-expert bytes / G)
    comm     = max_r(tokens_r / tp) * copies * hidden * (dispatch + combine bytes) * moe_layers / link_bw
    step     = max_r(rank_r [+ moe_r for a non-EP MoE rank]) + moe + (1 - comm_overlap) * comm + overhead

where ``T`` is the token count of the whole step group. Details:

* Linear FLOPs run at the weight dtype's tensor-core peak (FP8 for DeepSeek-V3, BF16 for Llama);
  attention (query, key) FLOPs at the BF16 peak. Prefill pairs use the model's prefill formulation
  (non-absorbed MHA for MLA), decode pairs (= ``decode_ctx_tokens``) the absorbed one.
* KV read: decode context tokens, plus the cached prefix of prefill chunks. The ``PerfModel``
  interface does not carry that prefix, so unless ``prefill_cached_tokens`` is passed it is
  recovered from ``pairs = c*p + c*(c+1)/2`` as ``p = pairs/c - (c+1)/2`` (exact for one chunk per
  rank, an underestimate for several; negligible either way, prefill is compute-bound).
  KV written: one token per prefill token and per decode sequence.
* Per-GPU KV share: GQA heads split over TP (``1/min(tp, kv_heads)``); the MLA latent has a single
  "head", so every TP GPU of a rank reads and stores all of it.
* Routed experts touched per step: under uniform routing an expert is hit by at least one of ``T``
  tokens with probability ``1 - (1 - k/E)^T``; only touched experts are streamed (all of them at
  any realistic EP batch; matters for small non-EP decode batches).
* Dispatch/combine (EP only): each token goes to ``topk`` experts, FP8 out (1 byte per hidden
  element, DeepEP FP8 dispatch) and BF16 back (2 bytes, BF16 combine), every MoE layer. The most
  loaded rank's link is the bottleneck (it sends the most). Two DeepEP modes, chosen per step the
  way SGLang's ``--deepep-mode auto`` does:

  - decode-only steps, *low-latency* kernels: all ``topk`` copies point-to-point over the scale-out
    NIC (DeepEP's "logical" low-latency bandwidth counts all copies: 39-46 GB/s of a 50 GB/s CX7 at
    EP8-256 on H800, hence ``comm_efficiency=0.8``);
  - steps with any prefill, *normal* kernels: one copy per distinct remote node over the NIC
    (node-limited routing caps the nodes), then NVLink forwarding; time = max(NIC, NVLink).

  Within one node everything goes over NVLink. With ``ep_ll_nvlink=True`` decode kernels also
  send copies for experts on the own node over NVLink and only the off-node ones over the NIC
  (:func:`ep_dispatch_combine_bytes`; time = max(NVLink, NIC)); the default is DeepEP's original
  pure-RDMA low-latency design.
* Two-micro-batch overlap (``tbo=True``; DeepSeek day-6 overview: "a dual-batch overlap strategy
  to hide communication cost"; SGLang ``--enable-two-batch-overlap``): the step is split into two
  micro-batches whose compute and dispatch/combine interleave, so

      step = max(rank + moe, comm) + tbo_overhead_s + overhead          (instead of the sum)

  where each micro-batch streams the weights again: the weight-read part of the rank and MoE
  memory terms counts twice (KV reads do not: each micro-batch reads its own sequences). With
  ``tbo=False``, ``comm_overlap`` hides a fixed fraction of ``comm`` instead (default 0).
* Opt-in wide-EP terms (all off by default, so existing configurations are unchanged; sources in
  docs/validate.md and the presets):

  - ``tbo_phases``: under TBO a layer is four phases, each one micro-batch's compute segment against
    the other's transfer (SGLang's ``[attention] yield [dispatch, MoE] yield [combine]`` schedule):
    ``max(a, c) + max(a, d) + max(e, d) + max(e, c)`` with ``a = rank/2``, ``e = moe/2``,
    ``d = DISPATCH_SHARE * comm/2``, ``c = (1 - DISPATCH_SHARE) * comm/2`` (dispatch FP8 = 1/3 of
    the bytes). It is >= the perfect-overlap max and <= the sum.
  - ``comm_efficiency_normal``: link fraction of the normal (prefill) kernels (DeepEP: 44/47 GB/s of
    ~50 at EP32); ``None`` = ``comm_efficiency``.
  - ``prefill_comm_sm_fraction`` ``f``: under TBO, normal-mode kernels hold ``f`` of the SMs, so a
    prefill step's ``rank`` and ``moe`` times are divided by ``1 - f`` (decode kernels hold none).
  - ``ep_imbalance_prefill`` / ``ep_imbalance_decode``: a fixed max/mean expert load ``gamma`` on
    the busiest GPU of prefill / decode-only steps.
  - ``eplb_physical_experts`` (with ``eplb_residual_std``): ``gamma`` of each step from the expert
    placement after EPLB and the step's own tokens (:func:`sim.perf.imbalance.eplb_imbalance`: EP
    size, slots per GPU, tokens per dispatch, i.e. per micro-batch under TBO; sourced from TensorRT-LLM's
    measured per-rank loads). Excludes the fixed factors.

  ``gamma`` scales the token-proportional part of the routed-expert roofline
  (``max(gamma * T * flops / peak, streamed weight bytes / bw)``: the busiest GPU computes more
  tokens but streams the same slots) and the dispatch/combine traffic (it receives ``gamma`` times
  the mean copies and sends them back).
* TP collectives (dense engines with ``gpus_per_rank > 1``) are ignored.
* Context-parallel ranks (``context_parallel=True``, a pool's ``context_parallel``): the
  ``gpus_per_rank`` GPUs split prompts by sequence instead of sharding weights: linear and
  attention compute and the KV are divided by them, each GPU holds and streams the whole dense
  part, and a prefill step's compute is ``max(compute, (new + cached tokens) * kv_bytes_per_token *
  (cp - 1) / cp / (nvlink_bw * comm_efficiency))``: ring attention passes every other GPU's KV
  shard of the chunk and its cached prefix around the ring while attention runs (ring attention,
  Liu et al. 2023, arXiv 2310.01889). Load imbalance of causal attention across the shards is not
  modelled (striped / zig-zag sharding balances it).
* ``ep_synchronous=False`` with ``R > 1`` returns the max over ranks (callers should evaluate each
  independent rank with ``R = 1``).

Default efficiencies (round numbers, not fitted; a later calibration replaces them):

* ``mfu = 0.5``: DeepGEMM reaches up to ~1,550 of 1,979 dense FP8 TFLOPS (78%) on large H800 GEMMs,
  FlashAttention-3 ~600-740 of 989 BF16 TFLOPS (60-75%) on H100; whole-forward-pass efficiency
  including grouped MoE GEMMs, norms, RoPE, quantisation and routing kernels is lower; 50% is the
  usual planning figure for prefill.
* ``mbu = 0.7``: decode kernels stream weights/KV at 70-90% of HBM peak (FlashMLA reports up to
  3,000 GB/s of 3,350 on H800); small kernels and launch gaps pull the whole step down to ~70%.
* ``step_overhead_s = 2 ms``: scheduler + sampling + launch/sync gaps per step with CUDA graphs
  (vLLM/SGLang decode steps of small dense models bottom out at a few ms).
* ``comm_efficiency = 0.8``: DeepEP low-latency measured vs NIC peak (above).
* ``comm_overlap = 0.0``: no dispatch/combine hidden behind compute unless ``tbo`` is on.
* ``tbo = False``, ``tbo_overhead_s = 0``, ``ep_ll_nvlink = False``: today's behaviour; scenarios opt
  in through their ``[perf]`` table (:class:`sim.perf.config.PerfConfig`).
* ``kv_cache_fraction = 0.9`` of HBM for weights + KV (SGLang ``mem_fraction_static`` style), and
  ``activation_reserve_bytes = 2 GB`` per GPU inside it for activations / CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any

import numpy as np
from numpy.typing import ArrayLike
from pydantic import Field

from sim.models import csa2
from sim.models.hardware import HardwareSpec, get_hardware
from sim.models.presets import ModelSpec, get_model
from sim.perf.imbalance import EPLB_RESIDUAL_STD, eplb_imbalance

#: default efficiency constants (see module docstring for where they come from)
DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.7
DEFAULT_STEP_OVERHEAD_S = 2e-3
DEFAULT_COMM_EFFICIENCY = 0.8
DEFAULT_COMM_OVERLAP = 0.0
DEFAULT_KV_CACHE_FRACTION = 0.9
DEFAULT_ACTIVATION_RESERVE_BYTES = 2e9
#: Lowest efficiency a scenario may set (0.1%): 1e-300 made every step take ``inf`` seconds,
#: reported as a TTFT of ``inf`` with exit status 0.
MIN_EFFICIENCY = 1e-3
#: Longest fixed cost per step a scenario may set, seconds.
MAX_STEP_OVERHEAD_S = 60.0
#: bytes per hidden element sent to an expert (FP8 dispatch) and back (BF16 combine)
DISPATCH_BYTES = 1
COMBINE_BYTES = 2
#: dispatch's share of the dispatch + combine bytes (and time: both go over the same links)
DISPATCH_SHARE = DISPATCH_BYTES / (DISPATCH_BYTES + COMBINE_BYTES)


_Efficiency = Annotated[float, Field(ge=MIN_EFFICIENCY, le=1)]
_StepSeconds = Annotated[float, Field(ge=0, le=MAX_STEP_OVERHEAD_S)]
_Fraction = Annotated[float, Field(ge=0, le=1)]
_NonNegative = Annotated[float, Field(ge=0)]
_LoadRatio = Annotated[float, Field(ge=1)]  # max/mean
_Count = Annotated[int, Field(ge=1)]


@dataclass(frozen=True)
class RooflineSettings:
    """The roofline's efficiency, overlap and expert-imbalance settings of one engine: the one
    place they are written, each with its default and the bounds a scenario may set (the
    ``Annotated`` metadata). :class:`RooflinePerf` takes them as ``settings=``; a scenario's
    ``[perf]`` table, :class:`sim.perf.config.PerfConfig`, is made from these fields (its bounds
    checked when the scenario is read) and gives them back by
    :meth:`~sim.perf.config.PerfConfig.roofline_settings`. Defaults and units: the module
    docstring; what each field does: :class:`sim.perf.config.PerfConfig`. Checked when a
    :class:`RooflinePerf` is built (``ValueError``)."""

    mfu: _Efficiency = DEFAULT_MFU
    mbu: _Efficiency = DEFAULT_MBU
    step_overhead_s: _StepSeconds = DEFAULT_STEP_OVERHEAD_S
    comm_efficiency: _Efficiency = DEFAULT_COMM_EFFICIENCY
    comm_overlap: _Fraction = DEFAULT_COMM_OVERLAP
    kv_cache_fraction: _Efficiency = DEFAULT_KV_CACHE_FRACTION
    activation_reserve_bytes: _NonNegative = DEFAULT_ACTIVATION_RESERVE_BYTES
    tbo: bool = False
    tbo_overhead_s: _StepSeconds = 0.0
    ep_ll_nvlink: bool = False
    tbo_phases: bool = False
    comm_efficiency_normal: _Efficiency | None = None
    prefill_comm_sm_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    ep_imbalance_prefill: _LoadRatio = 1.0
    ep_imbalance_decode: _LoadRatio = 1.0
    eplb_physical_experts: _Count | None = None
    eplb_residual_std: _NonNegative = EPLB_RESIDUAL_STD


def ep_dispatch_combine_bytes(
    hidden_size: int,
    experts_per_token: int,
    ep_size: int,
    gpus_per_node: int,
    *,
    dispatch_bytes: int = DISPATCH_BYTES,
    combine_bytes: int = COMBINE_BYTES,
) -> tuple[float, float]:
    """Bytes one token moves per MoE layer for expert-parallel dispatch + combine, split by link.

    Each of the ``experts_per_token`` (top-k) copies carries ``hidden_size`` elements out
    (``dispatch_bytes`` each; FP8 = 1 in DeepEP) and back (``combine_bytes``; BF16 = 2). With the
    routed experts spread uniformly over ``ep_size`` GPUs of ``gpus_per_node`` per node, a copy
    stays on the own GPU with probability ``1/ep``, goes to another GPU of the node (NVLink) with
    ``(min(ep, gpn) - 1)/ep`` and off-node (scale-out NIC) with ``1 - min(ep, gpn)/ep``.

    Returns:
        ``(nvlink_bytes, scale_out_bytes)`` per token per MoE layer.

    Hand check (DeepSeek-V3 hidden 7168, top-8, EP32 on 8-GPU nodes): a copy is 7168 * 3 =
    21,504 B; NVLink 8 * 7/32 * 21,504 = 37,632 B; NIC 8 * 24/32 * 21,504 = 129,024 B.
    """
    if min(hidden_size, experts_per_token, ep_size, gpus_per_node) < 1:
        raise ValueError("hidden_size, experts_per_token, ep_size and gpus_per_node must be >= 1")
    per_copy = float(hidden_size * (dispatch_bytes + combine_bytes))
    local = min(ep_size, gpus_per_node)
    on_node_other = (local - 1) / ep_size
    off_node = 1.0 - local / ep_size
    return experts_per_token * on_node_other * per_copy, experts_per_token * off_node * per_copy


class RooflinePerf:
    """Roofline ``PerfModel`` of one engine (step group); build it with :meth:`for_engine`."""

    def __init__(
        self,
        model: ModelSpec | str,
        hardware: HardwareSpec | str,
        *,
        num_dp_ranks: int,
        gpus_per_rank: int = 1,
        ep_synchronous: bool | None = None,
        context_parallel: bool = False,
        settings: RooflineSettings | None = None,
        **overrides: Any,
    ) -> None:
        # ``overrides``: settings by name (``mfu=0.4``) over ``settings`` (default: RooflineSettings());
        # an unknown name is a TypeError, as an unknown keyword argument
        st = replace(settings if settings is not None else RooflineSettings(), **overrides)
        #: the settings this model was built with
        self.settings = st
        self.model = get_model(model)
        self.hardware = get_hardware(hardware)
        if num_dp_ranks < 1 or gpus_per_rank < 1:
            raise ValueError("num_dp_ranks and gpus_per_rank must be >= 1")
        if not (0 < st.mfu <= 1 and 0 < st.mbu <= 1 and 0 < st.comm_efficiency <= 1):
            raise ValueError("mfu, mbu and comm_efficiency must be in (0, 1]")
        if not 0 <= st.comm_overlap <= 1:
            raise ValueError("comm_overlap must be in [0, 1]")
        if not 0 < st.kv_cache_fraction <= 1:
            raise ValueError("kv_cache_fraction must be in (0, 1]")
        if st.step_overhead_s < 0 or st.activation_reserve_bytes < 0 or st.tbo_overhead_s < 0:
            raise ValueError("step_overhead_s, tbo_overhead_s and activation_reserve_bytes must be >= 0")
        if st.comm_efficiency_normal is not None and not 0 < st.comm_efficiency_normal <= 1:
            raise ValueError("comm_efficiency_normal must be in (0, 1] (or None: same as comm_efficiency)")
        if not 0 <= st.prefill_comm_sm_fraction < 1:
            raise ValueError("prefill_comm_sm_fraction must be in [0, 1)")
        if st.ep_imbalance_prefill < 1 or st.ep_imbalance_decode < 1:
            raise ValueError("ep_imbalance_prefill and ep_imbalance_decode (max/mean load) must be >= 1")
        if st.eplb_physical_experts is not None:
            if st.ep_imbalance_prefill != 1.0 or st.ep_imbalance_decode != 1.0:
                raise ValueError("eplb_physical_experts (imbalance from the EPLB placement) excludes the fixed "
                                 "ep_imbalance_prefill / ep_imbalance_decode factors: set one or the other")
            if self.model.is_moe and st.eplb_physical_experts < self.model.num_routed_experts:
                raise ValueError(f"eplb_physical_experts ({st.eplb_physical_experts}) must be >= the model's "
                                 f"{self.model.num_routed_experts} routed experts (routed + redundant slots)")
        if st.eplb_residual_std < 0:
            raise ValueError("eplb_residual_std must be >= 0")
        m, hw = self.model, self.hardware
        self.num_dp_ranks = int(num_dp_ranks)
        self.gpus_per_rank = int(gpus_per_rank)
        self.num_gpus = self.num_dp_ranks * self.gpus_per_rank
        if ep_synchronous is None:
            ep_synchronous = m.is_moe and self.num_dp_ranks > 1
        self.ep_synchronous = bool(ep_synchronous)
        self.mfu, self.mbu = float(st.mfu), float(st.mbu)
        self.step_overhead_s = float(st.step_overhead_s)
        self.kv_cache_fraction = float(st.kv_cache_fraction)
        self.activation_reserve_bytes = float(st.activation_reserve_bytes)
        self.comm_efficiency = float(st.comm_efficiency)
        self.comm_overlap = float(st.comm_overlap)
        self.tbo = bool(st.tbo)
        self.tbo_overhead_s = float(st.tbo_overhead_s)
        self.ep_ll_nvlink = bool(st.ep_ll_nvlink)
        self.tbo_phases = bool(st.tbo_phases)
        self.comm_efficiency_normal = (self.comm_efficiency if st.comm_efficiency_normal is None
                                       else float(st.comm_efficiency_normal))
        self.prefill_comm_sm_fraction = float(st.prefill_comm_sm_fraction)
        self.ep_imbalance_prefill = float(st.ep_imbalance_prefill)
        self.ep_imbalance_decode = float(st.ep_imbalance_decode)
        self.eplb_physical_experts = None if st.eplb_physical_experts is None else int(st.eplb_physical_experts)
        self.eplb_residual_std = float(st.eplb_residual_std)
        self.kv_bytes_per_token = int(m.kv_bytes_per_token)

        tp = self.gpus_per_rank
        #: context-parallel rank: its GPUs split prompts by sequence (ring attention), not weights
        self.context_parallel = bool(context_parallel) and tp > 1
        #: GPUs the routed experts are sharded over (whole engine under EP, else the rank's TP group)
        self.expert_gpus = self.num_gpus if self.ep_synchronous else tp
        #: fraction of a token's KV one GPU of a rank stores/reads
        self.kv_gpu_share = (1.0 / tp if self.context_parallel
                             else 1.0 if (m.is_mla or m.is_compressed or m.is_csa2) else 1.0 / min(tp, m.num_kv_heads))

        # ---- per-GPU coefficients (rank-local part) ----
        lin_peak = hw.peak_flops(m.weight_bytes) * self.mfu
        attn_peak = hw.bf16_flops * self.mfu
        bw = hw.hbm_bw * self.mbu
        # seconds of compute per unit of work on one GPU of the rank
        dense_per_tok = m.dense_flops_per_token if m.is_moe else m.linear_flops_per_token
        self._c_tok = dense_per_tok / tp / lin_peak
        #: causal encoder-decoder (DeepSeek-V4.1): a prompt token runs the encoder, a replayed row the
        #: decoder (ModelSpec.prefill_* / replay_*); expert and dispatch work in decode-token units
        self._ced = m.is_ced
        #: whether a caller should pass ``prefill_cached_tokens`` to :meth:`step_time_s`: under a
        #: causal encoder-decoder the prefix sets how many chunks a rank's step holds, hence how
        #: many replay windows and rebuilt rows it pays, which the pairs alone do not tell when
        #: several prompts share the step (elsewhere the prefix is only a KV read, and omitted)
        self.wants_prefill_cached_tokens = bool(self._ced)
        self.verify_tokens_per_seq = 1  # no MTP verification (sim.run.engine.step_perf.StepClassPerf adds it)
        self.decode_tokens_per_step = 1.0
        if self._ced:
            pf_tok = m.prefill_dense_flops_per_token if m.is_moe else m.prefill_dense_flops_per_token + m.prefill_expert_flops_per_token
            rp_tok = m.replay_dense_flops_per_token if m.is_moe else m.replay_dense_flops_per_token + m.replay_expert_flops_per_token
            self._c_tok_pf, self._c_tok_rp = pf_tok / tp / lin_peak, rp_tok / tp / lin_peak
            full = m.expert_flops_per_token if m.is_moe else 1.0
            self._moe_pf = m.prefill_expert_flops_per_token / full if m.is_moe else 0.0
            self._moe_rp = m.replay_expert_flops_per_token / full if m.is_moe else 0.0
        self._c_pf_pair = m.prefill_attn_flops_per_pair / tp / attn_peak
        self._c_dec_pair = m.attn_flops_per_pair / tp / attn_peak
        #: compressed attention (DeepSeek-V4): pairs are (query, key row) of one layer, see _step
        self._sparse = m.is_compressed or m.is_csa2
        self._c_idx_pair = (m.indexer_flops_per_pair / tp / (hw.fp8_flops * self.mfu)) if self._sparse else 0.0
        if m.is_csa2:  # attention + indexer seconds (and decode KV bytes) as one set of terms each
            t = m.csa2_terms
            self._t_enc = csa2.combine((t["att_enc"], self._c_pf_pair), (t["idx_enc"], self._c_idx_pair))
            self._t_dec = csa2.combine((t["att_dec"], self._c_pf_pair), (t["idx_dec"], self._c_idx_pair))
            self._t_decode = csa2.combine((t["att"], self._c_dec_pair), (t["idx"], self._c_idx_pair))
            self._t_kv = csa2.combine((t["win"], m.swa_row_bytes / m.kv_bytes_per_token),
                                      (t["glob"], m.kv_row_bytes / m.kv_bytes_per_token),
                                      (t["idx"], m.index_row_bytes / m.kv_bytes_per_token))
        # seconds of HBM traffic
        self._m_weights = m.dense_weight_read_bytes / (1 if self.context_parallel else tp) / bw
        self._m_kv_tok = self.kv_bytes_per_token * self.kv_gpu_share / bw
        #: CP: seconds per (new or cached) prompt token of KV one GPU receives from the others
        self._cp_comm_tok = (self.kv_bytes_per_token * (tp - 1) / tp / (hw.nvlink_bw * self.comm_efficiency)
                             if self.context_parallel else 0.0)
        # ---- MoE (per GPU of the expert group) ----
        self._moe_c_tok = m.expert_flops_per_token / self.expert_gpus / lin_peak if m.is_moe else 0.0
        self._moe_m_all = m.expert_weight_bytes / self.expert_gpus / bw if m.is_moe else 0.0
        self._route_p = m.experts_per_token / m.num_routed_experts if m.is_moe else 0.0
        # ---- dispatch/combine, seconds per token sent by the busiest GPU ----
        self._comm_tok_ll = self._comm_tok_normal = 0.0
        if m.is_moe and self.ep_synchronous and self.num_gpus > 1:
            self._comm_tok_ll, self._comm_tok_normal = self._comm_per_token()
        #: expert-load imbalance from the EPLB placement (per step), only for a wide-EP MoE engine
        self._eplb = self.eplb_physical_experts is not None and m.is_moe and self.ep_synchronous
        #: extended step model (any opt-in term on): the general path in :meth:`_step_ext`
        self._extended = bool(self.tbo_phases or self.prefill_comm_sm_fraction or self._eplb
                              or self.ep_imbalance_prefill != 1.0 or self.ep_imbalance_decode != 1.0)
        #: compute slow-down of prefill steps while normal-mode kernels hold SMs (TBO only)
        self._pf_sm_slowdown = 1.0 / (1.0 - self.prefill_comm_sm_fraction) if self.tbo else 1.0

        # ---- folded constants of the step formula ----
        self._weight_reads = 2.0 if self.tbo else 1.0  # TBO: each micro-batch streams the weights
        self._m_weight_reads = self._weight_reads * self._m_weights
        self._log1p_not_routed = float(np.log1p(-self._route_p)) if self._route_p < 1 else 0.0

        self.kv_capacity_tokens_per_rank = self._kv_capacity()

    @classmethod
    def for_engine(
        cls,
        model: ModelSpec | str,
        hardware: HardwareSpec | str,
        *,
        num_dp_ranks: int,
        gpus_per_rank: int = 1,
        ep_synchronous: bool | None = None,
        context_parallel: bool = False,
        settings: RooflineSettings | None = None,
        **overrides: Any,
    ) -> RooflinePerf:
        """Roofline model of an engine of ``num_dp_ranks`` DP ranks x ``gpus_per_rank`` GPUs.

        ``model``/``hardware`` are specs or preset names. ``ep_synchronous`` defaults to
        "MoE model with more than one DP rank" (wide EP). ``settings`` (:class:`RooflineSettings`,
        default: its defaults) with ``overrides`` by name (``mfu=0.4``) over them. Raises
        ``ValueError`` if a setting is out of range or the weights do not fit in
        ``kv_cache_fraction`` of GPU memory, ``TypeError`` for an unknown setting.
        """
        return cls(model, hardware, num_dp_ranks=num_dp_ranks, gpus_per_rank=gpus_per_rank,
                   ep_synchronous=ep_synchronous, context_parallel=context_parallel, settings=settings, **overrides)

    def _comm_per_token(self) -> tuple[float, float]:
        """Seconds of dispatch+combine per token of the busiest rank: (low-latency, normal) mode."""
        m, hw = self.model, self.hardware
        elem = m.hidden_size * (DISPATCH_BYTES + COMBINE_BYTES) * m.num_moe_layers  # bytes per copy
        k, g, gpn = m.experts_per_token, self.num_gpus, hw.gpus_per_node
        nvl = hw.nvlink_bw * self.comm_efficiency
        net = hw.scale_out_bw * self.comm_efficiency
        nvl_n = hw.nvlink_bw * self.comm_efficiency_normal  # normal-mode (prefill) kernels
        net_n = hw.scale_out_bw * self.comm_efficiency_normal
        # copies leaving the GPU inside the node (experts on the other GPUs of the NVLink domain)
        nvl_s = k * (1.0 - 1.0 / min(g, gpn)) * elem / nvl
        nvl_s_n = nvl_s if nvl_n == nvl else k * (1.0 - 1.0 / min(g, gpn)) * elem / nvl_n
        nodes = -(-g // gpn)
        if nodes == 1:
            return nvl_s / self.gpus_per_rank, nvl_s_n / self.gpus_per_rank
        # low-latency kernels (decode): every top-k copy goes point-to-point over RDMA, or with
        # ep_ll_nvlink only the off-node ones (the rest over NVLink, concurrently)
        if self.ep_ll_nvlink:
            nvl_b, net_b = ep_dispatch_combine_bytes(m.hidden_size, k, g, gpn)
            ll = max(nvl_b / nvl, net_b / net) * m.num_moe_layers
        else:
            ll = k * elem / net
        # normal kernels (prefill): one copy per distinct remote node over RDMA, then NVLink
        # forwarding inside the node. Distinct nodes among k uniform picks: nodes * (1 - q),
        # q = (1 - 1/nodes)^k; the own node is one of them with probability 1 - q; node-limited
        # routing caps the distinct count at max_routed_nodes.
        q = (1.0 - 1.0 / nodes) ** k
        distinct = nodes * (1.0 - q)
        remote = (nodes - 1) * (1.0 - q)
        if m.max_routed_nodes and distinct > m.max_routed_nodes:
            remote *= m.max_routed_nodes / distinct
        normal = max(remote * elem / net_n, nvl_s_n)
        return ll / self.gpus_per_rank, normal / self.gpus_per_rank

    # ------------------------------------------------------------------ memory
    @property
    def weight_bytes_per_gpu(self) -> float:
        """Resident weight bytes on one GPU: dense part / tp (all of it under context parallelism)
        + routed experts / expert GPUs."""
        m = self.model
        return m.dense_weight_bytes / (1 if self.context_parallel else self.gpus_per_rank) + (
            m.expert_weight_bytes / self.expert_gpus if m.is_moe else 0.0)

    def _kv_capacity(self) -> int:
        hw = self.hardware
        budget = hw.hbm_bytes * self.kv_cache_fraction
        weights = self.weight_bytes_per_gpu
        free = budget - weights - self.activation_reserve_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.num_dp_ranks} x {self.gpus_per_rank} "
                f"{hw.name} (ep_synchronous={self.ep_synchronous}): {weights / 1e9:.1f} GB of weights "
                f"+ {self.activation_reserve_bytes / 1e9:.1f} GB activation reserve per GPU > "
                f"{budget / 1e9:.1f} GB ({self.kv_cache_fraction:.0%} of {hw.hbm_bytes / 1e9:.0f} GB); "
                "use more GPUs (more EP ranks / TP) or a larger GPU")
        return int(free // (self.kv_bytes_per_token * self.kv_gpu_share))

    # ------------------------------------------------------------------ latency
    def step_time_breakdown(
        self,
        prefill_tokens: ArrayLike,
        prefill_attn_pairs: ArrayLike,
        decode_seqs: ArrayLike,
        decode_ctx_tokens: ArrayLike,
        *,
        prefill_cached_tokens: ArrayLike | None = None,
        decode_tokens_per_seq: float = 1.0,
    ) -> dict[str, np.ndarray]:
        """Components of the step time (seconds, rank axis reduced, shape ``(...)``):
        ``rank`` (the slowest rank's own roofline, incl. experts for a non-EP MoE rank),
        ``moe`` (shared expert roofline, EP only), ``comm`` (dispatch/combine; after
        ``comm_overlap`` without TBO, before the max with compute under TBO),
        ``overhead`` and ``total``; plus ``rank_all`` with the per-rank times ``(..., R)``.
        ``decode_tokens_per_seq``: see :meth:`step_time_s`."""
        rank, rank_max, moe, comm, total_s = self._step(prefill_tokens, prefill_attn_pairs, decode_seqs,
                                                        decode_ctx_tokens, prefill_cached_tokens,
                                                        decode_tokens_per_seq)
        shape = np.shape(rank_max)
        return {"rank": np.asarray(rank_max), "moe": np.broadcast_to(moe, shape).copy(),
                "comm": np.broadcast_to(comm, shape).copy(),
                "overhead": np.full(shape, self.step_overhead_s), "total": np.asarray(total_s),
                "rank_all": np.asarray(rank)}

    def _step(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
              decode_ctx_tokens: ArrayLike, prefill_cached_tokens: ArrayLike | None,
              decode_tokens_per_seq: float = 1.0):  # noqa: ANN202
        """``(rank_all, rank_max, moe, comm, total)``; ``moe``/``comm`` may be the scalar 0.0.

        The simulator calls this once per step or segment, so it avoids per-call overhead: no
        re-broadcasting of inputs that already share a shape, constants folded at construction,
        and a plain-float path for one rank (same operations in the same order as the array path,
        hence the same IEEE results)."""
        f64 = np.float64
        pt = np.asarray(prefill_tokens, dtype=f64)
        pp = np.asarray(prefill_attn_pairs, dtype=f64)
        ds = np.asarray(decode_seqs, dtype=f64)
        dc = np.asarray(decode_ctx_tokens, dtype=f64)
        k_verify = float(decode_tokens_per_seq)
        if not k_verify >= 1.0:
            raise ValueError(f"decode_tokens_per_seq must be >= 1, got {decode_tokens_per_seq!r}")
        if (prefill_cached_tokens is None and pt.shape == (1,) and pp.shape == ds.shape == dc.shape == (1,)
                and not self._extended and not self._sparse and k_verify == 1.0 and not self.context_parallel):
            return self._step_one_rank(float(pt[0]), float(pp[0]), float(ds[0]), float(dc[0]))
        has_prefill = bool(pt.any())
        if prefill_cached_tokens is not None:
            pc = np.asarray(prefill_cached_tokens, dtype=f64)
        elif has_prefill:
            pos = pt > 0
            pc = np.maximum(np.where(pos, pp / np.where(pos, pt, 1.0) - (pt + 1.0) / 2.0, 0.0), 0.0)
        else:
            pc = 0.0  # no prefill: no cached prefix read
        if not (pt.shape == pp.shape == ds.shape == dc.shape and np.shape(pc) in (pt.shape, ())):
            pt, pp, ds, dc, pc = np.broadcast_arrays(pt, pp, ds, dc, pc)
        if pt.ndim == 0:
            pt, pp, ds, dc = (a.reshape(1) for a in (pt, pp, ds, dc))
            pc = np.reshape(pc, 1) if np.ndim(pc) else pc

        dtok = ds * k_verify if k_verify != 1.0 else ds  # decode tokens computed (verification: k per seq)
        tokens = pt + dtok if has_prefill else dtok  # (0 + x == x)
        if self._sparse and self.model.is_csa2:
            # tokens becomes the MoE/dispatch work in decode-token units (CED: a prompt token runs
            # only the encoder's MoE layers)
            compute, kv_tokens, tokens = self._csa2_work(pt, pp, pc, ds, dc, dtok, k_verify, has_prefill)
        elif self._sparse:
            compute, kv_tokens = self._sparse_work(pt, pp, pc, ds, dc, tokens, k_verify, has_prefill)
        else:
            dpairs = dc * k_verify if k_verify != 1.0 else dc  # each verified token attends the context
            compute = tokens * self._c_tok + pp * self._c_pf_pair + dpairs * self._c_dec_pair
            # KV is read once per sequence however many tokens it verifies
            kv_tokens = dc + pc + tokens if has_prefill or prefill_cached_tokens is not None else dc + tokens
        if self.context_parallel and has_prefill:
            # ring attention: each GPU receives the other GPUs' KV of the chunk and of the cached
            # prefix over NVLink while it computes (hidden when shorter than the compute)
            compute = np.maximum(compute, (pt + pc) * self._cp_comm_tok)
        memory = self._m_weight_reads + kv_tokens * self._m_kv_tok
        rank = np.maximum(compute, memory)

        moe = comm = 0.0
        if self.model.is_moe:
            if self.ep_synchronous:
                group_tokens = tokens.sum(axis=-1)
                gamma = self._ep_gamma(group_tokens, pt, has_prefill) if self._extended else None
                moe = self._moe_time(group_tokens, self._weight_reads, gamma)
                if pt.ndim == 1 or not has_prefill:  # prefill tokens are >= 0: any == (sum > 0)
                    per_tok = self._comm_tok_normal if has_prefill else self._comm_tok_ll
                else:
                    per_tok = np.where(pt.sum(axis=-1) > 0, self._comm_tok_normal, self._comm_tok_ll)
                comm = tokens.max(axis=-1) * per_tok
                if gamma is not None:  # the busiest GPU receives gamma x the mean copies
                    comm = comm * gamma
                if not self.tbo and self.comm_overlap:
                    comm = (1.0 - self.comm_overlap) * comm
            else:  # each rank runs its own experts on its own tokens
                rank = rank + self._moe_time(tokens, self._weight_reads)
        rank_max = rank[..., 0] if rank.shape[-1] == 1 else rank.max(axis=-1)
        if self._extended and self.ep_synchronous and self.model.is_moe:
            pf = has_prefill if (pt.ndim == 1 or not has_prefill) else pt.sum(axis=-1) > 0
            return self._step_ext(rank, rank_max, moe, comm, pf)
        if self.tbo:  # compute of one micro-batch hides the other's dispatch/combine
            total_s = np.maximum(rank_max + moe, comm) + self.tbo_overhead_s + self.step_overhead_s
        else:
            total_s = rank_max + moe + comm + self.step_overhead_s
        return rank, rank_max, moe, comm, total_s

    def _sparse_work(self, pt, pp, pc, ds, dc, tokens, k_verify, has_prefill):  # noqa: ANN001, ANN202
        """Compute seconds and KV tokens read+written of a rank under compressed attention
        (DeepSeek-V4, :meth:`ModelSpec.decode_attended_keys`).

        * Decode: a rank's ``ds`` sequences with ``dc`` context tokens in all are taken at their
          mean context ``L = dc / ds`` (the cost is concave in L, so a spread of contexts costs
          slightly less than this). Each of the ``k_verify`` tokens per sequence attends
          ``decode_attended_keys(L)`` rows and scores ``indexer_keys(L)`` indexer keys; the rows
          and keys are read once per sequence (``decode_kv_read_bytes(L)``).
        * Prefill: the rank's ``pt`` new tokens after ``pc`` cached, with ``pp`` causal pairs, are
          taken as ``m`` equal chunks of ``c`` tokens after ``p`` cached (``m c = pt``, ``m p = pc``,
          ``m (c p + c (c + 1) / 2) = pp`` determine them; one chunk when ``pc`` is recovered from the
          pairs); each attends ``prefill_attended_keys(c, p)`` rows, and the indexers score
          ``num_csa_layers / 4`` keys per causal pair; the cached prefix's compressed KV is read once
          (``pc`` tokens of ``kv_bytes_per_token``).
        * Written: ``kv_bytes_per_token`` per new token (the window row write is not counted).
        """
        m = self.model
        has_dec = bool(np.any(ds))
        att = idx = 0.0
        kv_read = pc if has_prefill else 0.0
        if has_prefill:
            # the rank's chunks as m equal chunks of c new tokens after p cached, recovered exactly
            # from pt = m c, pc = m p, pp = m (c p + c (c + 1) / 2): c = (pp/pt - 1/2) / (pc/pt + 1/2)
            safe = np.where(pt > 0, pt, 1.0)
            chunk = np.maximum((pp / safe - 0.5) / (pc / safe + 0.5), 1.0)
            chunks = np.where(pt > 0, pt / chunk, 0.0)
            att = chunks * m.prefill_attended_keys(chunk, pc / safe * chunk) * self._c_pf_pair
            idx = (m.num_csa_layers / 4.0) * pp
        if has_dec:
            L = dc / np.where(ds > 0, ds, 1.0)
            att = att + (ds * k_verify) * m.decode_attended_keys(L) * self._c_dec_pair
            idx = idx + (ds * k_verify) * m.indexer_keys(L)
            kv_read = kv_read + ds * (m.decode_kv_read_bytes(L) / self.kv_bytes_per_token)
        compute = tokens * self._c_tok + att + idx * self._c_idx_pair
        return compute, kv_read + tokens

    def _csa2_work(self, pt, pp, pc, ds, dc, dtok, k_verify, has_prefill):  # noqa: ANN001, ANN202
        """``(compute seconds, KV tokens read + written, MoE tokens)`` of a rank under CSA2 attention
        with a causal encoder-decoder (DeepSeek-V4.1, :mod:`sim.models.csa2`).

        * Prefill: the rank's ``pt`` new tokens after ``pc`` cached are taken as ``m`` equal chunks
          of ``c`` after ``p`` (recovered from ``pp`` as in :meth:`_sparse_work`). Every new token,
          and the ``rebuild_rows(c, p)`` cached ones whose window rows a prefix hit must rebuild,
          runs the encoder (``prefill_dense_flops_per_token``); each chunk replays the prompt's last
          ``replay_rows(c, p)`` rows through the decoder (``replay_dense_flops_per_token``).
          Attention rows and index keys: :meth:`ModelSpec.prefill_attended_keys` /
          :meth:`~ModelSpec.prefill_indexer_keys` of the chunk (the same rows). The cached prefix's
          global KV is read once.
        * Decode: as :meth:`_sparse_work` (mean context ``L = dc / ds``; every layer; the KV of a
          sequence read once: window rows, selected global records, scored index records).
        * MoE tokens: ``dtok + pt * prefill_expert/expert + replay rows * replay_expert/expert``
          (0.5 each for V4.1-Flash: 20 of the 40 MoE layers), which scales the expert roofline and
          the dispatch/combine bytes (both per MoE layer a token passes).
        * Written: ``kv_bytes_per_token`` per new token (window rows not counted, as for V4).
        """
        # same sums as ModelSpec.prefill_attended_keys / prefill_indexer_keys / decode_attended_keys /
        # indexer_keys / decode_kv_read_bytes, weighted by their seconds (bytes) in one pass each
        m = self.model
        has_dec = bool(np.any(ds))
        attn = 0.0
        lin = dtok * self._c_tok
        moe_tok = dtok
        kv_read = pc if has_prefill else 0.0
        if has_prefill:
            safe = np.where(pt > 0, pt, 1.0)
            chunk = np.maximum((pp / safe - 0.5) / (pc / safe + 0.5), 1.0)
            chunks = np.where(pt > 0, pt / chunk, 0.0)
            p = pc / safe * chunk
            if self._ced:
                rebuild, replay = m.rebuild_rows(chunk, p), m.replay_rows(chunk, p)
                attn = chunks * (csa2.sum_terms(self._t_enc, p - rebuild, p + chunk)
                                 + csa2.sum_terms(self._t_dec, p + chunk - replay, p + chunk))
                enc, rows = pt + chunks * rebuild, chunks * replay
                lin = lin + enc * self._c_tok_pf + rows * self._c_tok_rp
                moe_tok = moe_tok + enc * self._moe_pf + rows * self._moe_rp
            else:
                attn = chunks * csa2.sum_terms(self._t_enc, p, p + chunk)
                lin = lin + pt * self._c_tok
                moe_tok = moe_tok + pt
        if has_dec:
            L = dc / np.where(ds > 0, ds, 1.0)
            attn = attn + (ds * k_verify) * csa2.eval_terms(self._t_decode, L)
            kv_read = kv_read + ds * csa2.eval_terms(self._t_kv, L)
        return lin + attn, kv_read + pt + dtok, moe_tok

    def _step_ext(self, rank, rank_max, moe, comm, pf):  # noqa: ANN001, ANN202
        """The opt-in terms of a wide-EP step (``moe`` and ``comm`` already carry the expert-load
        imbalance, :meth:`_ep_gamma`). ``pf``: bool or bool array over the leading axes, "step has
        prefill" (normal-mode kernels)."""
        if self.tbo and self.prefill_comm_sm_fraction:
            slow = np.where(pf, self._pf_sm_slowdown, 1.0) if np.ndim(pf) else (self._pf_sm_slowdown if pf else 1.0)
            rank, rank_max, moe = rank * (slow[..., None] if np.ndim(slow) else slow), rank_max * slow, moe * slow
        if self.tbo and self.tbo_phases:
            a, e = 0.5 * rank_max, 0.5 * moe
            d, c = (0.5 * DISPATCH_SHARE) * comm, (0.5 * (1.0 - DISPATCH_SHARE)) * comm
            core = np.maximum(a, c) + np.maximum(a, d) + np.maximum(e, d) + np.maximum(e, c)
            total_s = core + self.tbo_overhead_s + self.step_overhead_s
        elif self.tbo:
            total_s = np.maximum(rank_max + moe, comm) + self.tbo_overhead_s + self.step_overhead_s
        else:
            total_s = rank_max + moe + comm + self.step_overhead_s
        return rank, rank_max, moe, comm, total_s

    def _step_one_rank(self, pt: float, pp: float, ds: float, dc: float):  # noqa: ANN202
        """:meth:`_step` for one rank (``R = 1``, no leading axes) in plain floats."""
        pc = max(pp / pt - (pt + 1.0) / 2.0, 0.0) if pt > 0 else 0.0
        tokens = pt + ds
        compute = tokens * self._c_tok + pp * self._c_pf_pair + dc * self._c_dec_pair
        memory = self._m_weight_reads + (dc + pc + tokens) * self._m_kv_tok
        rank = max(compute, memory)
        moe = comm = 0.0
        if self.model.is_moe:
            if self.ep_synchronous:
                moe = self._moe_time_one(tokens)
                comm = tokens * (self._comm_tok_normal if pt > 0 else self._comm_tok_ll)
                if not self.tbo:
                    comm = (1.0 - self.comm_overlap) * comm
            else:
                rank = rank + self._moe_time_one(tokens)
        if self.tbo:
            total_s = max(rank + moe, comm) + self.tbo_overhead_s + self.step_overhead_s
        else:
            total_s = rank + moe + comm + self.step_overhead_s
        return np.array([rank]), np.array(rank), moe, comm, np.array(total_s)

    def _moe_time(self, tokens: np.ndarray, weight_reads: float = 1.0, gamma=None) -> np.ndarray:  # noqa: ANN001
        """Routed-expert roofline on one GPU of the expert group for ``tokens`` group tokens
        (``weight_reads``: how often the touched experts are streamed, 2 under TBO; ``gamma``: the
        busiest GPU's max/mean load, scaling its compute, not the weights it streams)."""
        if self._route_p < 1:  # -expm1(x) * (w * m) == w * -expm1(x) * m: w is 1 or 2, exact
            streamed = np.expm1(tokens * self._log1p_not_routed) * (-weight_reads * self._moe_m_all)
        else:
            streamed = weight_reads * ((tokens > 0) * 1.0) * self._moe_m_all
        compute = tokens * self._moe_c_tok if gamma is None else tokens * self._moe_c_tok * gamma
        return np.maximum(compute, streamed)

    def _ep_gamma(self, group_tokens: np.ndarray, pt: np.ndarray, has_prefill: bool):  # noqa: ANN202
        """Max/mean routed load of the busiest EP GPU for steps of ``group_tokens`` tokens (shape of
        the leading axes): from the EPLB placement and the tokens of one dispatch (half the step
        under TBO) when ``eplb_physical_experts`` is set, else the fixed prefill / decode factor."""
        if self._eplb:
            m = self.model
            per_dispatch = group_tokens * 0.5 if self.tbo else group_tokens
            return eplb_imbalance(self.num_gpus, per_dispatch, num_experts=m.num_routed_experts,
                                  experts_per_token=m.experts_per_token,
                                  physical_experts=self.eplb_physical_experts, residual_std=self.eplb_residual_std)
        if pt.ndim == 1 or not has_prefill:
            return self.ep_imbalance_prefill if has_prefill else self.ep_imbalance_decode
        return np.where(pt.sum(axis=-1) > 0, self.ep_imbalance_prefill, self.ep_imbalance_decode)

    def _moe_time_one(self, tokens: float) -> float:
        """:meth:`_moe_time` of a plain float (``weight_reads`` of the engine)."""
        touched = -float(np.expm1(tokens * self._log1p_not_routed)) if self._route_p < 1 else float(tokens > 0)
        return max(tokens * self._moe_c_tok, self._weight_reads * touched * self._moe_m_all)

    def step_time_s(
        self,
        prefill_tokens: ArrayLike,
        prefill_attn_pairs: ArrayLike,
        decode_seqs: ArrayLike,
        decode_ctx_tokens: ArrayLike,
        *,
        prefill_cached_tokens: ArrayLike | None = None,
        decode_tokens_per_seq: float = 1.0,
    ) -> np.ndarray:
        """Seconds one step takes for per-rank work of shape ``(..., R)``; returns shape ``(...)``.

        ``prefill_cached_tokens`` (optional, not part of the ``PerfModel`` protocol): cached prefix
        tokens the rank's prefill chunks read; estimated from the pairs when omitted.
        ``decode_tokens_per_seq`` (>= 1, optional): tokens each decode sequence computes this step
        (speculative verification: 1 + draft length). Linear, expert and dispatch/combine work and
        attention FLOPs scale with it; KV is read once per sequence (the verified tokens of a
        sequence share its KV in one kernel).
        """
        return np.asarray(self._step(prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens,
                                     prefill_cached_tokens, decode_tokens_per_seq)[4])

    def __repr__(self) -> str:
        return (f"RooflinePerf({self.model.name}, {self.hardware.name}, dp={self.num_dp_ranks}, "
                f"tp={self.gpus_per_rank}, ep_synchronous={self.ep_synchronous}, mfu={self.mfu}, "
                f"mbu={self.mbu}, overhead={self.step_overhead_s * 1e3:g} ms, tbo={self.tbo}, "
                f"kv_capacity/rank={self.kv_capacity_tokens_per_rank} tokens)")
