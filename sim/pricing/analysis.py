"""The $38 analysis: what load, input cache-hit rate and input:output ratio earn a target
revenue per GPU-hour on a PD scenario.

Published operating point (DeepInfer, SIMULATORS.md): "$38 revenue per GPU-hour at valley
pricing", "230 tok/s decode per sequence", "~60 sequences per rank", "155 trillion tokens a day
across the cluster". :func:`target_table` solves for the load at each sheet x hit rate x ratio,
:func:`operating_point_table` for the ratio at a fixed decode load, :func:`revenue_grid`
tabulates steady-state revenue (the heatmap's data) and :func:`implied_fleet_gpus` cross-checks
the fleet size. Formulas (``k``, ``f``, ``p_eff``, the balanced split): :mod:`sim.pricing.revenue`;
prefill capacity and steady state: :mod:`sim.pricing.throughput`. Revenue in USD per GPU-hour,
rates in tokens/s per GPU, batches in decode sequences per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sim.perf.base import PerfModel
from sim.pricing.revenue import (
    K_HOUR_PER_MTOK,
    balanced_revenue_usd_per_gpu_hour,
    required_input_per_output,
    required_output_tokens_per_s,
    revenue_usd_per_gpu_hour,
)
from sim.pricing.sheets import Period, PriceSheet, _check_nonneg
from sim.pricing.throughput import _default_perf, prefill_capacity_tokens_per_s_per_gpu, steady_state
from sim.scenario import PoolConfig, Scenario


#: "$38 revenue per GPU-hour at valley pricing" (DeepInfer, SIMULATORS.md)
DEEPINFER_TARGET_USD_PER_GPU_HOUR = 38.0
#: "230 tok/s decode per sequence" (DeepInfer, SIMULATORS.md)
DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ = 230.0
#: "155 trillion tokens a day across the cluster" (DeepInfer, SIMULATORS.md)
DEEPINFER_TOKENS_PER_DAY = 155e12
#: "~60 sequences per rank" (DeepInfer's speculative-verification operating point, SIMULATORS.md)
DEEPINFER_DECODE_BATCH_PER_RANK = 60


def _check_positive(**values: float) -> None:
    """Raise ValueError ``"<name> must be a finite number > 0, got <v>"`` for the first value that
    is not (a zero target or speed would divide by zero below)."""
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


# ---------------------------------------------------------------------------- the target analysis
@dataclass(frozen=True)
class TargetRow:
    """What it takes to earn ``target_usd_per_gpu_hour`` at one (sheet, hit rate, ratio).

    ``fixed_*``: on the scenario's own GPU split; ``balanced_*``: prefill pool resized to the
    decode pool. Batches are decode sequences per rank at ``tokens_per_s_per_seq``.
    """

    sheet: str
    illustrative: bool
    hit_rate: float
    input_per_output: float
    prompt_tokens: int
    usd_per_mtok: float
    required_output_tokens_per_s_per_gpu: float
    fixed_batch_per_rank: float
    fixed_prefill_load: float
    fixed_feasible: bool
    balanced_batch_per_rank: float
    balanced_prefill_gpus_per_decode_gpu: float
    balanced_ceiling_usd_per_gpu_hour: float
    kv_batch_limit: int
    max_batch_per_rank: int


def target_table(scenario: Scenario, sheets: Iterable[PriceSheet], hit_rates: Iterable[float],
                 ratios: Iterable[float], *, target_usd_per_gpu_hour: float = DEEPINFER_TARGET_USD_PER_GPU_HOUR,
                 period: Period = "valley", output_tokens: int = 1000,
                 tokens_per_s_per_seq: float = DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ, kv_link: bool = True,
                 perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = _default_perf) -> list[TargetRow]:
    """For each sheet x hit rate x input:output ratio ``r``: the load that earns the target.

    * required output tokens/s per GPU over all ``N = N_p + N_d`` GPUs:
      :func:`required_output_tokens_per_s`;
    * fixed split: decode batch per rank ``B = out * N / (decode ranks * tokens_per_s_per_seq)``;
      prefill load = required input tokens/s
      / prefill capacity (:func:`prefill_capacity_tokens_per_s_per_gpu`, prompts of
      ``r * output_tokens`` tokens); feasible iff
      ``B <= max_decode_batch``, ``B <= KV limit`` and prefill load <= 1;
    * balanced split: ``1 / o_d = k * f * p_eff / target - r / c_p`` (:mod:`sim.pricing.revenue`) per decode
      GPU, ``B = o_d * gpus_per_rank / tokens_per_s_per_seq`` (``inf`` above the ceiling
      ``k * f * p_eff * c_p / r``), prefill GPUs per decode GPU ``r * o_d / c_p``.
    """
    pp, dp = scenario.prefill, scenario.decode
    if pp is None or dp is None:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; the target analysis needs prefill and decode pools")
    _check_positive(target_usd_per_gpu_hour=target_usd_per_gpu_hour, tokens_per_s_per_seq=tokens_per_s_per_seq,
                    output_tokens=output_tokens)
    pperf, dperf = perf_factory(scenario, pp), perf_factory(scenario, dp)
    kv_cap = dp.kv_capacity_tokens or dperf.kv_capacity_tokens_per_rank
    n, n_dr = scenario.num_gpus, dp.num_ranks
    rows = []
    cap_cache: dict[tuple[int, float], float] = {}
    for sheet in sheets:
        for h in hit_rates:
            for r in ratios:
                _check_nonneg("input:output ratio", r)
                prompt = max(1, int(round(r * output_tokens)))
                key = (prompt, h)
                if key not in cap_cache:
                    cap_cache[key] = prefill_capacity_tokens_per_s_per_gpu(scenario, pperf, prompt, h,
                                                                           kv_link=kv_link)[0]
                c_p = cap_cache[key]  # input tokens/s per prefill GPU
                out = required_output_tokens_per_s(target_usd_per_gpu_hour, sheet, hit_rate=h,
                                                   input_per_output=r, period=period)
                b_fixed = out * n / (n_dr * tokens_per_s_per_seq)
                load = r * out * n / (pp.num_gpus * c_p)
                b_kv = int(kv_cap // (prompt + output_tokens))
                p_eff = sheet.usd_per_output_mtok(h, r, period)
                inv = K_HOUR_PER_MTOK * p_eff / target_usd_per_gpu_hour - r / c_p
                o_d = 1.0 / inv if inv > 0 else math.inf
                rows.append(TargetRow(
                    sheet=sheet.name, illustrative=sheet.illustrative, hit_rate=h, input_per_output=r,
                    prompt_tokens=prompt, usd_per_mtok=sheet.usd_per_mtok(h, r, period),
                    required_output_tokens_per_s_per_gpu=out,
                    fixed_batch_per_rank=b_fixed, fixed_prefill_load=load,
                    fixed_feasible=b_fixed <= min(dp.max_decode_batch, b_kv) and load <= 1.0,
                    balanced_batch_per_rank=o_d * dp.gpus_per_rank / tokens_per_s_per_seq,
                    balanced_prefill_gpus_per_decode_gpu=r * o_d / c_p,
                    balanced_ceiling_usd_per_gpu_hour=K_HOUR_PER_MTOK * p_eff * c_p / r if r > 0 else math.inf,
                    kv_batch_limit=b_kv, max_batch_per_rank=dp.max_decode_batch,
                ))
    return rows


@dataclass(frozen=True)
class OperatingPointRow:
    """Input:output ratio that earns the target at a given decode load (see :func:`operating_point_table`)."""

    sheet: str
    hit_rate: float
    batch_per_rank: int
    output_tokens_per_s_per_gpu: float
    fixed_input_per_output: float
    fixed_prefill_load: float
    balanced_input_per_output: float
    balanced_prefill_gpus_per_decode_gpu: float


def operating_point_table(scenario: Scenario, sheets: Iterable[PriceSheet], hit_rates: Iterable[float], *,
                          batch_per_rank: int = DEEPINFER_DECODE_BATCH_PER_RANK,
                          tokens_per_s_per_seq: float = DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ,
                          target_usd_per_gpu_hour: float = DEEPINFER_TARGET_USD_PER_GPU_HOUR,
                          period: Period = "valley", output_tokens: int = 1000, kv_link: bool = True,
                          max_ratio: float = 256.0,
                          perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = _default_perf,
                          ) -> list[OperatingPointRow]:
    """At a fixed decode load (``batch_per_rank`` x ``tokens_per_s_per_seq`` per decode rank), the
    input:output ratio ``r`` that earns the target, for each sheet x hit rate.

    * fixed split: ``out = decode ranks * B * speed / N`` per GPU over the scenario's ``N`` GPUs;
      ``r`` = :func:`required_input_per_output`; prefill load = ``r * out * N / (N_p * c_p(r))``
      (> 1: the scenario's prefill pool cannot feed it);
    * balanced split: the smallest ``r`` on a log grid up to ``max_ratio`` (1% steps) whose
      :func:`balanced_revenue_usd_per_gpu_hour` reaches the target (``inf`` if none), and the prefill
      GPUs per decode GPU it needs, ``r * o_d / c_p(r)``.

    ``c_p(r)``: :func:`prefill_capacity_tokens_per_s_per_gpu` for prompts of ``r * output_tokens``.
    """
    pp, dp = scenario.prefill, scenario.decode
    if pp is None or dp is None:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; needs prefill and decode pools")
    _check_positive(target_usd_per_gpu_hour=target_usd_per_gpu_hour, tokens_per_s_per_seq=tokens_per_s_per_seq,
                    output_tokens=output_tokens, batch_per_rank=batch_per_rank)
    pperf = perf_factory(scenario, pp)
    o_d = batch_per_rank * tokens_per_s_per_seq / dp.gpus_per_rank  # output tokens/s per decode GPU
    out = dp.num_ranks * batch_per_rank * tokens_per_s_per_seq / scenario.num_gpus
    grid = np.concatenate([[0.0], np.exp(np.arange(np.log(0.01), np.log(max_ratio) + 1e-9, np.log(1.01)))])
    cache: dict[tuple[int, float], float] = {}

    def c_p(r: float, h: float) -> float:
        prompt = max(1, int(round(r * output_tokens)))
        if (prompt, h) not in cache:
            cache[(prompt, h)] = prefill_capacity_tokens_per_s_per_gpu(scenario, pperf, prompt, h, kv_link=kv_link)[0]
        return cache[(prompt, h)]

    rows = []
    for sheet in sheets:
        for h in hit_rates:
            r_fixed = required_input_per_output(target_usd_per_gpu_hour, sheet, hit_rate=h,
                                                output_tokens_per_s=out, period=period)
            load = r_fixed * out * scenario.num_gpus / (pp.num_gpus * c_p(r_fixed, h)) if r_fixed > 0 else 0.0
            r_bal = math.inf
            for r in grid:
                rev = balanced_revenue_usd_per_gpu_hour(sheet, hit_rate=h, input_per_output=float(r), period=period,
                                                        decode_output_tokens_per_s=o_d,
                                                        prefill_input_tokens_per_s=c_p(float(r), h))
                if rev >= target_usd_per_gpu_hour:
                    r_bal = float(r)
                    break
            rows.append(OperatingPointRow(
                sheet=sheet.name, hit_rate=h, batch_per_rank=batch_per_rank, output_tokens_per_s_per_gpu=out,
                fixed_input_per_output=r_fixed, fixed_prefill_load=load, balanced_input_per_output=r_bal,
                balanced_prefill_gpus_per_decode_gpu=(r_bal * o_d / c_p(r_bal, h)) if math.isfinite(r_bal) else math.inf,
            ))
    return rows


def revenue_grid(scenario: Scenario, sheet: PriceSheet, hit_rates: Sequence[float], ratios: Sequence[float], *,
                 period: Period = "valley", output_tokens: int = 1000, decode_batch_per_rank: int | None = None,
                 tokens_per_s_per_seq: float | None = DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ, kv_link: bool = True,
                 split: Literal["fixed", "balanced"] = "fixed",
                 perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = _default_perf) -> np.ndarray:
    """Revenue per GPU-hour, shape ``(len(hit_rates), len(ratios))``, of :func:`steady_state` at
    each (hit rate, ratio) (prompt = ``r * output_tokens``): on the scenario's own GPU split
    (``fixed``), or with the prefill pool resized to the decode pool (``balanced``,
    :func:`balanced_revenue_usd_per_gpu_hour` with the steady state's per-GPU capacities)."""
    if split not in ("fixed", "balanced"):
        raise ValueError(f"split must be 'fixed' or 'balanced', got {split!r}")
    out = np.empty((len(hit_rates), len(ratios)))
    for i, h in enumerate(hit_rates):
        for j, r in enumerate(ratios):
            ss = steady_state(scenario, prompt_tokens=max(1, int(round(r * output_tokens))),
                              output_tokens=output_tokens, hit_rate=h, decode_batch_per_rank=decode_batch_per_rank,
                              decode_tokens_per_s_per_seq=tokens_per_s_per_seq, kv_link=kv_link,
                              perf_factory=perf_factory)
            if split == "fixed":
                out[i, j] = revenue_usd_per_gpu_hour(ss.rates, sheet, period)
            else:
                out[i, j] = balanced_revenue_usd_per_gpu_hour(
                    sheet, hit_rate=h, input_per_output=ss.input_per_output, period=period,
                    decode_output_tokens_per_s=ss.decode_output_tokens_per_s / ss.num_decode_gpus,
                    prefill_input_tokens_per_s=ss.prefill_input_tokens_per_s / ss.num_prefill_gpus)
    return out


def implied_fleet_gpus(sheet: PriceSheet, *, tokens_per_day: float, hit_rate: float, input_per_output: float,
                       target_usd_per_gpu_hour: float, period: Period = "valley") -> float:
    """GPUs a fleet serving ``tokens_per_day`` (input + output) would have if it earned exactly
    ``target_usd_per_gpu_hour``: ``tokens_per_day / 1e6 * usd_per_mtok / (target * 24)``."""
    _check_positive(target_usd_per_gpu_hour=target_usd_per_gpu_hour)
    return tokens_per_day / 1e6 * sheet.usd_per_mtok(hit_rate, input_per_output, period) / (target_usd_per_gpu_hour * 24.0)
