"""Serving economics: revenue per GPU-hour and cost per million tokens from a price sheet.

Units: prices in USD per million tokens (``_usd_per_mtok``), throughput in tokens per second per
GPU (``_tokens_per_s``, averaged over *all* GPUs of a deployment, prefill and decode alike), GPU
cost and revenue in USD per GPU-hour (``_usd_per_gpu_hour``).

Formulas (``k = 3600 s/h / 1e6 tokens/Mtok = 0.0036``; per GPU ``hit``, ``miss``, ``out`` tokens/s;
prices ``p_hit``, ``p_miss``, ``p_out``; period factor ``f``)::

    revenue_usd_per_gpu_hour = k * f * (hit * p_hit + miss * p_miss + out * p_out)
    f = 1 (list), 1 - d (valley: off-peak discount d), 1 - d * H / 24 (blended: H off-peak hours a day,
        traffic spread evenly over the day)
    cost_usd_per_mtok        = gpu_hour_cost_usd / (k * tokens_per_s)        (tokens: all, or output only)
    cost profit margin       = revenue / cost - 1                           (DeepSeek's "545%")

With ``h`` the input cache-hit rate and ``r`` input tokens per output token, the revenue per
million *output* tokens including their share of input is ``p_eff = r * (h * p_hit + (1 - h) *
p_miss) + p_out``, so revenue is linear in the output rate and the required load inverts it::

    required output tokens/s per GPU = target / (k * f * p_eff)
    required r                       = (target / (k * f * out) - p_out) / (h * p_hit + (1 - h) * p_miss)

A *balanced* PD deployment sizes the prefill pool to the decode pool: with ``o_d`` output tokens/s
per decode GPU and ``c_p`` input tokens/s per prefill GPU (hits included), ``N_p * c_p = r * N_d *
o_d``, and the revenue per GPU of the whole deployment is ::

    revenue = k * f * p_eff / (1 / o_d + r / c_p)       ->  ceiling k * f * p_eff * c_p / r  (o_d -> inf)

Source of the check values: DeepSeek's V3/R1 inference-system overview (open-infra-index,
202502OpenSourceWeek, day 6): 608B input tokens/day, 56.3% cache hit, 168B output, $2 per
H800-hour, 226.75 nodes on average, $87,072 cost and $562,027 theoretical revenue a day at R1
prices, 545% cost profit margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from sim.pricing.sheets import Period, PriceSheet, _check_fraction, _check_nonneg


#: USD per GPU-hour per (token/s per GPU at 1 USD per Mtok): 3600 s/h / 1e6 tokens per Mtok
K_HOUR_PER_MTOK = 3600.0 / 1e6
#: DeepSeek's published cost basis (H800 rental, day-6 overview)
DEFAULT_GPU_HOUR_COST_USD = 2.0


# ---------------------------------------------------------------------------- token rates
@dataclass(frozen=True)
class TokenRates:
    """Tokens per second per GPU, averaged over all GPUs of a deployment.

    ``input_hit_tokens_per_s`` prompt tokens served from the KV cache, ``input_miss_tokens_per_s``
    prompt tokens computed by prefill, ``output_tokens_per_s`` generated tokens.
    """

    input_hit_tokens_per_s: float
    input_miss_tokens_per_s: float
    output_tokens_per_s: float

    def __post_init__(self) -> None:
        for name in ("input_hit_tokens_per_s", "input_miss_tokens_per_s", "output_tokens_per_s"):
            _check_nonneg(name, getattr(self, name))

    @classmethod
    def from_mix(cls, output_tokens_per_s: float, input_per_output: float, hit_rate: float) -> TokenRates:
        """Rates for ``output_tokens_per_s`` with ``input_per_output`` prompt tokens per output token,
        a fraction ``hit_rate`` of them cache hits."""
        _check_fraction("hit_rate", hit_rate)
        _check_nonneg("input_per_output", input_per_output)
        inp = output_tokens_per_s * input_per_output
        return cls(inp * hit_rate, inp * (1.0 - hit_rate), output_tokens_per_s)

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_hit_tokens_per_s + self.input_miss_tokens_per_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.input_tokens_per_s + self.output_tokens_per_s

    @property
    def hit_rate(self) -> float:
        """Token-weighted input cache-hit rate (0 without input)."""
        i = self.input_tokens_per_s
        return self.input_hit_tokens_per_s / i if i > 0 else 0.0

    @property
    def input_per_output(self) -> float:
        """Input tokens per output token (``inf`` with input and no output, 0 with neither)."""
        if self.output_tokens_per_s > 0:
            return self.input_tokens_per_s / self.output_tokens_per_s
        return math.inf if self.input_tokens_per_s > 0 else 0.0


def revenue_usd_per_gpu_hour(rates: TokenRates, sheet: PriceSheet, period: Period = "list") -> float:
    """``k * f * (hit * p_hit + miss * p_miss + out * p_out)``, ``k = 0.0036`` (module docstring)."""
    p_hit, p_miss, p_out = sheet.prices_usd_per_mtok(period)
    return K_HOUR_PER_MTOK * (rates.input_hit_tokens_per_s * p_hit + rates.input_miss_tokens_per_s * p_miss
                              + rates.output_tokens_per_s * p_out)


def cost_usd_per_mtok(rates: TokenRates, gpu_hour_cost_usd: float,
                      basis: Literal["all", "output", "input"] = "all") -> float:
    """GPU cost per million tokens: ``gpu_hour_cost_usd / (k * tokens_per_s)``.

    ``basis``: which tokens count (``all`` = input + output, ``output``, ``input``). ``inf`` when
    that rate is zero. Raises ``ValueError`` for a negative cost or an unknown basis.
    """
    _check_nonneg("gpu_hour_cost_usd", gpu_hour_cost_usd)
    tps = {"all": rates.total_tokens_per_s, "output": rates.output_tokens_per_s,
           "input": rates.input_tokens_per_s}.get(basis)
    if tps is None:
        raise ValueError(f"unknown basis {basis!r}; valid: all, output, input")
    return gpu_hour_cost_usd / (K_HOUR_PER_MTOK * tps) if tps > 0 else math.inf


@dataclass(frozen=True)
class Economics:
    """Revenue, cost and margin of one deployment at one price sheet and period."""

    sheet: str
    period: str
    rates: TokenRates
    gpu_hour_cost_usd: float
    revenue_usd_per_gpu_hour: float
    cost_usd_per_mtok: float
    cost_usd_per_output_mtok: float
    revenue_usd_per_mtok: float

    @property
    def margin(self) -> float:
        """Cost profit margin ``revenue / cost - 1`` (DeepSeek's definition; ``inf`` at zero cost)."""
        if self.gpu_hour_cost_usd == 0:
            return math.inf
        return self.revenue_usd_per_gpu_hour / self.gpu_hour_cost_usd - 1.0


def economics(rates: TokenRates, sheet: PriceSheet, gpu_hour_cost_usd: float = DEFAULT_GPU_HOUR_COST_USD,
              period: Period = "list") -> Economics:
    """All of :func:`revenue_usd_per_gpu_hour` and :func:`cost_usd_per_mtok` at once."""
    rev = revenue_usd_per_gpu_hour(rates, sheet, period)
    tot = rates.total_tokens_per_s
    return Economics(sheet.name, period, rates, gpu_hour_cost_usd, rev,
                     cost_usd_per_mtok(rates, gpu_hour_cost_usd, "all"),
                     cost_usd_per_mtok(rates, gpu_hour_cost_usd, "output"),
                     rev / (K_HOUR_PER_MTOK * tot) if tot > 0 else 0.0)


# ---------------------------------------------------------------------------- required load
def required_output_tokens_per_s(target_usd_per_gpu_hour: float, sheet: PriceSheet, *, hit_rate: float,
                                 input_per_output: float, period: Period = "list") -> float:
    """Output tokens/s per GPU (all GPUs) that earn ``target_usd_per_gpu_hour``:
    ``target / (k * p_eff)`` with ``p_eff`` = :meth:`PriceSheet.usd_per_output_mtok`.

    Raises ``ValueError`` if the sheet earns nothing per output token (all prices zero)."""
    _check_nonneg("target_usd_per_gpu_hour", target_usd_per_gpu_hour)
    p_eff = sheet.usd_per_output_mtok(hit_rate, input_per_output, period)
    if p_eff <= 0:
        raise ValueError(f"price sheet {sheet.name!r} earns nothing per output token: no load reaches a target")
    return target_usd_per_gpu_hour / (K_HOUR_PER_MTOK * p_eff)


def required_input_per_output(target_usd_per_gpu_hour: float, sheet: PriceSheet, *, hit_rate: float,
                              output_tokens_per_s: float, period: Period = "list") -> float:
    """Input tokens per output token that earn ``target_usd_per_gpu_hour`` at ``output_tokens_per_s``
    per GPU: ``(target / (k * out) - p_out) / (h * p_hit + (1 - h) * p_miss)``.

    Returns 0.0 when the output alone earns the target. Raises ``ValueError`` when no input mix
    can (zero output rate, or free input while output falls short).
    """
    _check_nonneg("target_usd_per_gpu_hour", target_usd_per_gpu_hour)
    _check_nonneg("output_tokens_per_s", output_tokens_per_s)
    if output_tokens_per_s <= 0:
        raise ValueError("output_tokens_per_s must be > 0 to solve for the input:output ratio")
    p_out = sheet.prices_usd_per_mtok(period)[2]
    need = target_usd_per_gpu_hour / (K_HOUR_PER_MTOK * output_tokens_per_s) - p_out
    if need <= 0:
        return 0.0
    p_in = sheet.input_usd_per_mtok(hit_rate, period)
    if p_in <= 0:
        raise ValueError(f"price sheet {sheet.name!r}: input is free and output alone falls short of the target")
    return need / p_in


def balanced_revenue_usd_per_gpu_hour(sheet: PriceSheet, *, hit_rate: float, input_per_output: float,
                                      decode_output_tokens_per_s: float, prefill_input_tokens_per_s: float,
                                      period: Period = "list") -> float:
    """Revenue per GPU-hour of a PD deployment whose prefill pool is sized to its decode pool:
    ``k * p_eff / (1 / o_d + r / c_p)`` (module docstring); ``o_d`` output tokens/s per decode GPU,
    ``c_p`` input tokens/s (hits included) per prefill GPU."""
    if decode_output_tokens_per_s <= 0 or prefill_input_tokens_per_s <= 0:
        raise ValueError("decode_output_tokens_per_s and prefill_input_tokens_per_s must be > 0")
    p_eff = sheet.usd_per_output_mtok(hit_rate, input_per_output, period)
    return K_HOUR_PER_MTOK * p_eff / (1.0 / decode_output_tokens_per_s + input_per_output / prefill_input_tokens_per_s)
