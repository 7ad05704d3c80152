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

Throughput comes from a price-independent place: a simulation summary (:func:`rates_from_summary`,
the measured input/output tokens and prefix hit rate over all GPUs), or the perf model at steady
state (:func:`steady_state`).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sim.perf.base import PerfModel, causal_attn_pairs
from sim.scenario import PoolConfig, Scenario

#: USD per GPU-hour per (token/s per GPU at 1 USD per Mtok): 3600 s/h / 1e6 tokens per Mtok
K_HOUR_PER_MTOK = 3600.0 / 1e6
#: DeepSeek's published cost basis (H800 rental, day-6 overview)
DEFAULT_GPU_HOUR_COST_USD = 2.0
#: "$38 revenue per GPU-hour at valley pricing" (DeepInfer, SIMULATORS.md)
DEEPINFER_TARGET_USD_PER_GPU_HOUR = 38.0
#: "230 tok/s decode per sequence" (DeepInfer, SIMULATORS.md)
DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ = 230.0
#: "155 trillion tokens a day across the cluster" (DeepInfer, SIMULATORS.md)
DEEPINFER_TOKENS_PER_DAY = 155e12
DEFAULT_SCENARIO = "deepinfer-sm100"

Period = Literal["list", "valley", "blended"]
PERIODS: tuple[str, ...] = ("list", "valley", "blended")


def _hhmm_minutes(s: str) -> int:
    h, sep, m = s.partition(":")
    if not sep or not (h.isdigit() and m.isdigit()) or not (0 <= int(h) < 24 and 0 <= int(m) < 60):
        raise ValueError(f"time {s!r} is not HH:MM (00:00-23:59, UTC)")
    return int(h) * 60 + int(m)


class PriceSheet(BaseModel):
    """An API price list: USD per million tokens for input cache hits, cache misses and output,
    plus an optional off-peak ("valley") discount.

    Attributes:
        name: label (shipped sheets: the file name without ``.toml``).
        source: where the numbers come from (a document and date); required.
        effective_date: first day the prices applied (``YYYY-MM-DD``), empty if illustrative.
        illustrative: True for made-up sheets (shown as such in tables).
        currency: always ``"USD"``; prices are per 1,000,000 tokens.
        input_cache_hit_usd_per_mtok: prompt tokens served from the provider's KV (context) cache.
        input_cache_miss_usd_per_mtok: prompt tokens computed by prefill.
        output_usd_per_mtok: generated tokens.
        offpeak_discount: fraction off all three prices in the off-peak window (0.5 = half price).
        offpeak_start_utc / offpeak_end_utc: the window, ``HH:MM`` UTC; may wrap midnight
            (``16:30`` -> ``00:30`` is 8 h). Both required iff the discount is > 0.

    Raises:
        pydantic.ValidationError (a ``ValueError``): negative prices, a cache-hit price above the
        cache-miss price, a discount outside [0, 1), a malformed or missing off-peak window.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    source: str = Field(min_length=1)
    effective_date: str = ""
    illustrative: bool = False
    currency: Literal["USD"] = "USD"
    input_cache_hit_usd_per_mtok: float = Field(ge=0)
    input_cache_miss_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)
    offpeak_discount: float = Field(0.0, ge=0, lt=1)
    offpeak_start_utc: str | None = None
    offpeak_end_utc: str | None = None

    @field_validator("offpeak_start_utc", "offpeak_end_utc")
    @classmethod
    def _check_time(cls, v: str | None) -> str | None:
        if v is not None:
            _hhmm_minutes(v)
        return v

    @model_validator(mode="after")
    def _check(self) -> PriceSheet:
        if self.input_cache_hit_usd_per_mtok > self.input_cache_miss_usd_per_mtok:
            raise ValueError(f"input_cache_hit_usd_per_mtok ({self.input_cache_hit_usd_per_mtok}) is above "
                             f"input_cache_miss_usd_per_mtok ({self.input_cache_miss_usd_per_mtok})")
        window = (self.offpeak_start_utc, self.offpeak_end_utc)
        if self.offpeak_discount > 0 and None in window:
            raise ValueError("offpeak_discount > 0 needs offpeak_start_utc and offpeak_end_utc (HH:MM UTC)")
        if (window[0] is None) != (window[1] is None):
            raise ValueError("give both offpeak_start_utc and offpeak_end_utc, or neither")
        if window[0] is not None and window[0] == window[1]:
            raise ValueError("the off-peak window is empty (start == end)")
        return self

    @property
    def offpeak_hours_per_day(self) -> float:
        """Length of the off-peak window in hours (0 without one); wraps midnight."""
        if self.offpeak_start_utc is None or self.offpeak_end_utc is None:
            return 0.0
        a, b = _hhmm_minutes(self.offpeak_start_utc), _hhmm_minutes(self.offpeak_end_utc)
        return ((b - a) % (24 * 60)) / 60.0

    def is_offpeak(self, utc_minutes_of_day: float) -> bool:
        """Whether minute ``utc_minutes_of_day`` (0 <= m < 1440, UTC) is in the off-peak window."""
        if self.offpeak_start_utc is None or self.offpeak_end_utc is None:
            return False
        a, b = _hhmm_minutes(self.offpeak_start_utc), _hhmm_minutes(self.offpeak_end_utc)
        m = utc_minutes_of_day % 1440
        return a <= m < b if a < b else (m >= a or m < b)

    def factor(self, period: Period) -> float:
        """Multiplier on list prices: ``list`` 1, ``valley`` ``1 - d`` (only where the sheet has an
        off-peak window; else 1), ``blended`` ``1 - d * H / 24`` (traffic even over the day)."""
        if period == "list":
            return 1.0
        if period == "valley":
            return 1.0 - self.offpeak_discount
        if period == "blended":
            return 1.0 - self.offpeak_discount * self.offpeak_hours_per_day / 24.0
        raise ValueError(f"unknown price period {period!r}; valid: {', '.join(PERIODS)}")

    def prices_usd_per_mtok(self, period: Period = "list") -> tuple[float, float, float]:
        """``(cache hit, cache miss, output)`` in USD per million tokens for ``period``."""
        f = self.factor(period)
        return (f * self.input_cache_hit_usd_per_mtok, f * self.input_cache_miss_usd_per_mtok,
                f * self.output_usd_per_mtok)

    def input_usd_per_mtok(self, hit_rate: float, period: Period = "list") -> float:
        """Mean input price at cache-hit rate ``hit_rate``: ``h * p_hit + (1 - h) * p_miss``."""
        _check_fraction("hit_rate", hit_rate)
        p_hit, p_miss, _ = self.prices_usd_per_mtok(period)
        return hit_rate * p_hit + (1.0 - hit_rate) * p_miss

    def usd_per_output_mtok(self, hit_rate: float, input_per_output: float, period: Period = "list") -> float:
        """``p_eff = r * (h * p_hit + (1 - h) * p_miss) + p_out``: revenue per million output
        tokens including the ``r`` input tokens each one brings."""
        _check_nonneg("input_per_output", input_per_output)
        return input_per_output * self.input_usd_per_mtok(hit_rate, period) + self.prices_usd_per_mtok(period)[2]

    def usd_per_mtok(self, hit_rate: float, input_per_output: float, period: Period = "list") -> float:
        """Mean revenue per million tokens of any kind: ``p_eff / (1 + r)``."""
        return self.usd_per_output_mtok(hit_rate, input_per_output, period) / (1.0 + input_per_output)


def _check_fraction(name: str, x: float) -> None:
    if not (0.0 <= x <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def _check_nonneg(name: str, x: float) -> None:
    if not (x >= 0.0) or math.isinf(x):
        raise ValueError(f"{name} must be a finite number >= 0, got {x}")


# ---------------------------------------------------------------------------- loading sheets
def _prices_dir():  # noqa: ANN202  (a Traversable)
    return resources.files("sim") / "data" / "prices"


def shipped_price_sheets() -> list[str]:
    """Names of the price sheets shipped in ``sim/data/prices`` (sorted)."""
    return sorted(p.name[:-5] for p in _prices_dir().iterdir() if p.name.endswith(".toml"))


def _parse_sheet(text: str, suffix: str, label: str) -> PriceSheet:
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"{label}: unknown price sheet file type {suffix!r} (use .toml, .yaml or .json)")
        if not isinstance(data, dict):
            raise ValueError(f"{label}: a price sheet must be a table of fields, got {type(data).__name__}")
        return PriceSheet.model_validate(data)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: {e}") from e
    except ValidationError as e:
        raise ValueError(f"{label}: invalid price sheet: {e}") from e


def load_price_sheet(name_or_path: str | Path) -> PriceSheet:
    """A shipped sheet by name (:func:`shipped_price_sheets`) or a ``.toml``/``.yaml``/``.json`` file.

    Raises:
        ValueError: unknown name (the message lists the shipped sheets), unreadable or invalid
            file (the message starts with the file name; TOML/YAML errors carry the line).
    """
    key = str(name_or_path)
    shipped = _prices_dir() / f"{key}.toml"
    if "/" not in key and shipped.is_file():
        return _parse_sheet(shipped.read_text(), ".toml", f"sim/data/prices/{key}.toml")
    path = Path(key)
    if not path.is_file():
        raise ValueError(f"unknown price sheet {key!r}: not a shipped sheet ({', '.join(shipped_price_sheets())}) "
                         f"nor a file")
    return _parse_sheet(path.read_text(), path.suffix, str(path))


def load_price_sheets(spec: str | Sequence[str] | None) -> list[PriceSheet]:
    """Comma-separated names/files (or a list); ``None``, ``""`` or ``"all"``: every shipped sheet."""
    if spec is None or spec == "" or spec == "all":
        items = shipped_price_sheets()
    elif isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = list(spec)
    return [load_price_sheet(s) for s in items]


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


# ---------------------------------------------------------------------------- from a simulation
_SUMMARY_KEYS = ("input_tokens_per_s_per_gpu", "output_tokens_per_s_per_gpu", "prefix_hit_rate")


def rates_from_summary(summary: dict[str, Any], label: str = "summary") -> TokenRates:
    """Per-GPU rates of a :func:`sim.metrics.summarize` row: the run's input tokens (split by its
    token-weighted prefix hit rate) and output tokens over the makespan, divided by all of the
    scenario's GPUs. Raises ``ValueError`` naming ``label`` and the missing/invalid key."""
    for k in _SUMMARY_KEYS:
        v = summary.get(k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{label}: key {k!r} is missing or not a finite number >= 0 (got {v!r})")
    h = float(summary["prefix_hit_rate"])
    _check_fraction(f"{label}: prefix_hit_rate", h)
    inp = float(summary["input_tokens_per_s_per_gpu"])
    return TokenRates(inp * h, inp * (1.0 - h), float(summary["output_tokens_per_s_per_gpu"]))


def load_summaries(path: str | Path) -> list[dict[str, Any]]:
    """The run summaries of a results ``summary.json`` (``{"runs": [...]}``), a list of summaries
    or one summary. Raises ``ValueError`` naming the file on bad JSON or no runs."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{path}: no such file") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    runs = data.get("runs") if isinstance(data, dict) and "runs" in data else data
    if isinstance(runs, dict):
        runs = [runs]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{path}: expected a summary, a list of summaries or {{'runs': [...]}}")
    for i, r in enumerate(runs):
        rates_from_summary(r, f"{path} run {i}")  # validate now, with the file name
    return runs


def simulate_rates(scenario: Scenario, requests: Sequence, policy: str = "cache_aware", *, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> tuple[TokenRates, dict[str, Any]]:
    """Simulate ``requests`` on ``scenario`` with ``policy`` (both pools) and return the measured
    per-GPU rates and the run summary. The rates are the *delivered* throughput of that workload
    (its offered load unless the cluster saturates); scale the arrival rate to load the cluster."""
    from sim.cluster import simulate
    from sim.metrics import summarize

    s = summarize(simulate(scenario, requests, policy, seed=seed, progress=progress))
    return rates_from_summary(s, f"simulation of {scenario.name}"), s


# ---------------------------------------------------------------------------- analytic steady state
def _default_perf(scenario: Scenario, pool: PoolConfig) -> PerfModel:
    from sim.cluster import build_perf

    return build_perf(scenario, pool)


def decode_step_s(perf: PerfModel, dp_ranks: int, batch_per_rank: int, ctx_tokens: float) -> float:
    """One decode step of an engine whose ``dp_ranks`` ranks each run ``batch_per_rank`` sequences
    of mean KV length ``ctx_tokens`` (no prefill), from ``perf.step_time_s``."""
    r = dp_ranks if perf.ep_synchronous else 1
    z = np.zeros(r)
    return float(perf.step_time_s(z, z, np.full(r, float(batch_per_rank)),
                                  np.full(r, float(batch_per_rank) * ctx_tokens)))


def prefill_input_tokens_per_s_per_rank(perf: PerfModel, pool: PoolConfig, prompt_tokens: int,
                                        hit_rate: float) -> float:
    """Prompt tokens (cached + computed) one prefill rank finishes per second at steady state.

    Each prompt of ``prompt_tokens`` has ``cached = floor(h * L)`` tokens hit (at least one computed,
    as engines recompute the last token). If the computed part ``c`` fits the rank's chunk budget,
    a step packs ``n = budget // c`` prompts (``pt = n*c``, pairs ``n * causal_attn_pairs(c, cached)``);
    otherwise one prompt is chunked over several steps. All ranks of an EP engine carry the same
    work. Rate = prompt tokens finished / seconds of the steps that finish them.
    """
    _check_fraction("hit_rate", hit_rate)
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be >= 1")
    budget = pool.max_prefill_tokens
    cached = min(int(hit_rate * prompt_tokens), prompt_tokens - 1)
    new = prompt_tokens - cached
    r = pool.dp_ranks if perf.ep_synchronous else 1

    def step(pt: float, pairs: float) -> float:
        return float(perf.step_time_s(np.full(r, pt), np.full(r, pairs), np.zeros(r), np.zeros(r)))

    if new <= budget:
        n = budget // new
        return n * prompt_tokens / step(n * new, n * float(causal_attn_pairs(new, cached)))
    total_s, done = 0.0, cached
    while done < prompt_tokens:
        c = min(budget, prompt_tokens - done)
        total_s += step(c, float(causal_attn_pairs(c, done)))
        done += c
    return prompt_tokens / total_s


def prefill_capacity_tokens_per_s_per_gpu(scenario: Scenario, perf: PerfModel, prompt_tokens: int, hit_rate: float,
                                           *, kv_link: bool = True) -> tuple[float, str]:
    """Prompt tokens (hits included) per second one prefill GPU sustains, and what limits it.

    ``compute``: :func:`prefill_input_tokens_per_s_per_rank` / ``gpus_per_rank``. ``kv link``
    (when ``kv_link``): the whole prompt's KV, hits included, leaves the prefill GPU for the decode
    pool over its NIC, ``kv_transfer_bandwidth_bytes_per_s / kv_bytes_per_token`` tokens/s (one
    link of the scenario's bandwidth per GPU; an assumption: a design where decode reads cached KV
    straight from a shared store would not pay it)."""
    pool = scenario.prefill
    if pool is None:
        raise ValueError(f"scenario {scenario.name!r} has no prefill pool")
    compute = prefill_input_tokens_per_s_per_rank(perf, pool, prompt_tokens, hit_rate) / pool.gpus_per_rank
    if not kv_link:
        return compute, "compute"
    link = scenario.kv_transfer_bandwidth_bytes_per_s / perf.kv_bytes_per_token
    return (compute, "compute") if compute <= link else (link, "kv link")


@dataclass(frozen=True)
class SteadyState:
    """Analytic steady-state throughput of a PD scenario (see :func:`steady_state`).

    Cluster-wide rates in tokens/s; ``rates`` per GPU over all GPUs.
    """

    scenario: str
    num_prefill_gpus: int
    num_decode_gpus: int
    prompt_tokens: int
    output_tokens: int
    hit_rate: float
    decode_batch_per_rank: int
    decode_batch_kv_limit: int
    decode_step_s: float
    decode_tokens_per_s_per_seq: float
    decode_output_tokens_per_s: float
    prefill_input_tokens_per_s: float
    prefill_limit: str
    output_tokens_per_s: float
    bottleneck: str
    rates: TokenRates

    @property
    def input_per_output(self) -> float:
        return self.prompt_tokens / self.output_tokens

    @property
    def num_gpus(self) -> int:
        return self.num_prefill_gpus + self.num_decode_gpus


def steady_state(scenario: Scenario, *, prompt_tokens: int, output_tokens: int, hit_rate: float,
                 decode_batch_per_rank: int | None = None, decode_tokens_per_s_per_seq: float | None = None,
                 kv_link: bool = True,
                 perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = _default_perf) -> SteadyState:
    """Per-GPU throughput of a PD scenario at steady state, from the perf model (no simulation).

    Every request has ``prompt_tokens`` in (a fraction ``hit_rate`` cached) and ``output_tokens``
    out, so ``r = prompt_tokens / output_tokens``. Decode: each rank runs ``B`` sequences of mean
    KV length ``ctx = prompt + output / 2``; ``B`` = ``decode_batch_per_rank`` (default the pool's
    ``max_decode_batch``) capped by KV capacity ``floor(kv_capacity / ctx)``. Per-sequence speed is
    ``1 / decode_step_s`` from the perf model, or ``decode_tokens_per_s_per_seq`` when given (e.g.
    a published figure). Decode capacity ``O_d = decode ranks * B * speed``; prefill capacity
    ``I_p = prefill GPUs * prefill_capacity_tokens_per_s_per_gpu`` (compute or, with ``kv_link``,
    the KV link). Sustained output ``O = min(O_d, I_p / r)`` (``bottleneck`` says which), input
    ``r * O``.

    Not modelled: KV transfer and cache-load time, queueing (this is the saturated rate),
    speculative decoding unless folded into ``decode_tokens_per_s_per_seq``.

    Raises:
        ValueError: an aggregated scenario, or non-positive token counts / batch.
    """
    if not scenario.disaggregated:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; the steady-state model needs prefill and "
                         f"decode pools")
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt_tokens and output_tokens must be >= 1")
    _check_fraction("hit_rate", hit_rate)
    pp, dp = scenario.prefill, scenario.decode
    assert pp is not None and dp is not None
    b_req = dp.max_decode_batch if decode_batch_per_rank is None else int(decode_batch_per_rank)
    if b_req < 1:
        raise ValueError("decode_batch_per_rank must be >= 1")
    dperf = perf_factory(scenario, dp)
    ctx = prompt_tokens + output_tokens / 2.0
    cap = dp.kv_capacity_tokens or dperf.kv_capacity_tokens_per_rank
    b_kv = int(cap // (prompt_tokens + output_tokens))  # a sequence reserves its final length
    b = max(0, min(b_req, b_kv))
    step = decode_step_s(dperf, dp.dp_ranks, max(b, 1), ctx)
    speed = decode_tokens_per_s_per_seq if decode_tokens_per_s_per_seq is not None else 1.0 / step
    o_d = dp.num_ranks * b * speed
    pperf = perf_factory(scenario, pp)
    c_p, limit = prefill_capacity_tokens_per_s_per_gpu(scenario, pperf, prompt_tokens, hit_rate, kv_link=kv_link)
    i_p = pp.num_gpus * c_p
    r = prompt_tokens / output_tokens
    o = min(o_d, i_p / r)
    n = scenario.num_gpus
    return SteadyState(
        scenario=scenario.name, num_prefill_gpus=pp.num_gpus, num_decode_gpus=dp.num_gpus,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, hit_rate=hit_rate,
        decode_batch_per_rank=b, decode_batch_kv_limit=b_kv, decode_step_s=step,
        decode_tokens_per_s_per_seq=speed, decode_output_tokens_per_s=o_d, prefill_input_tokens_per_s=i_p,
        prefill_limit=limit,         output_tokens_per_s=o, bottleneck="decode" if o_d <= i_p / r else "prefill",
        rates=TokenRates.from_mix(o / n, r, hit_rate),
    )


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
    * balanced split: ``1 / o_d = k * f * p_eff / target - r / c_p`` (module docstring) per decode
      GPU, ``B = o_d * gpus_per_rank / tokens_per_s_per_seq`` (``inf`` above the ceiling
      ``k * f * p_eff * c_p / r``), prefill GPUs per decode GPU ``r * o_d / c_p``.
    """
    pp, dp = scenario.prefill, scenario.decode
    if pp is None or dp is None:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; the target analysis needs prefill and decode pools")
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


#: "~60 sequences per rank" (DeepInfer's speculative-verification operating point, SIMULATORS.md)
DEEPINFER_DECODE_BATCH_PER_RANK = 60


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


def operating_point_markdown(rows: Sequence[OperatingPointRow]) -> str:
    """:func:`operating_point_table` rows as Markdown."""
    head = ("| sheet | hit | out tok/s/GPU | fixed split: in:out needed | fixed: prefill load "
            "| balanced: in:out needed | balanced: P GPUs per D GPU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.sheet} | {100 * r.hit_rate:.1f}% | {r.output_tokens_per_s_per_gpu:,.0f} "
                     f"| {r.fixed_input_per_output:.2f} | {r.fixed_prefill_load:.2f} "
                     f"| {r.balanced_input_per_output:.2f} | {r.balanced_prefill_gpus_per_decode_gpu:.3f} |")
    return "\n".join(lines)


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
    return tokens_per_day / 1e6 * sheet.usd_per_mtok(hit_rate, input_per_output, period) / (target_usd_per_gpu_hour * 24.0)


# ---------------------------------------------------------------------------- tables, plot, CLI
DEFAULT_HIT_RATES = (0.563, 0.8, 0.9, 0.96)
DEFAULT_RATIOS = (1.0, 2.0, 3.6, 8.0, 16.0, 32.0)


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from e
    if not vals:
        raise ValueError(f"{what}: no values in {text!r}")
    return vals


def _fmt_batch(b: float) -> str:
    return "inf" if math.isinf(b) else f"{b:.0f}"


def sheets_table(sheets: Sequence[PriceSheet]):  # noqa: ANN201  (rich.table.Table)
    """Rich table of price sheets: list and valley prices, window, source."""
    from rich.table import Table

    t = Table(title="price sheets (USD per 1M tokens)")
    for c in ("sheet", "hit", "miss", "output", "valley hit/miss/out", "off-peak UTC", "source"):
        t.add_column(c, justify="left" if c in ("sheet", "source", "off-peak UTC") else "right",
                     overflow="fold")
    for s in sheets:
        v = s.prices_usd_per_mtok("valley")
        window = f"{s.offpeak_start_utc}-{s.offpeak_end_utc} (-{100 * s.offpeak_discount:.0f}%)" \
            if s.offpeak_discount > 0 else "none"
        t.add_row(s.name + (" [yellow](illustrative)[/]" if s.illustrative else ""),
                  f"{s.input_cache_hit_usd_per_mtok:g}", f"{s.input_cache_miss_usd_per_mtok:g}",
                  f"{s.output_usd_per_mtok:g}", f"{v[0]:g}/{v[1]:g}/{v[2]:g}", window, s.source)
    return t


def economics_table(rows: Sequence[tuple[str, Economics]], title: str):  # noqa: ANN201
    """Rich table: one row per (label, economics)."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("run", "sheet", "period", "hit rate", "in tok/s/GPU", "out tok/s/GPU", "in:out",
              "$/GPU-h", "$/M tok", "cost $/M tok", "cost $/M out", "margin"):
        t.add_column(c, justify="left" if c in ("run", "sheet", "period") else "right")
    for label, e in rows:
        t.add_row(label, e.sheet, e.period, f"{100 * e.rates.hit_rate:.1f}%", f"{e.rates.input_tokens_per_s:,.0f}",
                  f"{e.rates.output_tokens_per_s:,.0f}", f"{e.rates.input_per_output:.2f}",
                  f"{e.revenue_usd_per_gpu_hour:.2f}", f"{e.revenue_usd_per_mtok:.4f}",
                  f"{e.cost_usd_per_mtok:.4f}", f"{e.cost_usd_per_output_mtok:.3f}", f"{100 * e.margin:.1f}%")
    return t


def target_rows_table(rows: Sequence[TargetRow], title: str):  # noqa: ANN201
    """Rich table of :func:`target_table` rows."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("sheet", "hit", "in:out", "$/M tok", "out tok/s/GPU", "fixed B/rank", "fixed P load",
              "ok", "bal. B/rank", "bal. P/D GPUs", "ceiling $/h"):
        t.add_column(c, justify="left" if c == "sheet" else "right", no_wrap=c == "sheet")
    for r in rows:
        t.add_row(r.sheet, f"{100 * r.hit_rate:.1f}%", f"{r.input_per_output:g}", f"{r.usd_per_mtok:.4f}",
                  f"{r.required_output_tokens_per_s_per_gpu:,.0f}", _fmt_batch(r.fixed_batch_per_rank),
                  f"{r.fixed_prefill_load:.2f}", "[green]yes[/]" if r.fixed_feasible else "[red]no[/]",
                  _fmt_batch(r.balanced_batch_per_rank), f"{r.balanced_prefill_gpus_per_decode_gpu:.3f}",
                  f"{r.balanced_ceiling_usd_per_gpu_hour:,.0f}")
    return t


def target_markdown(rows: Sequence[TargetRow]) -> str:
    """The :func:`target_rows_table` as Markdown (for docs)."""
    head = ("| sheet | hit | in:out | $/M tok | out tok/s/GPU | fixed: batch/rank | fixed: prefill load | ok "
            "| balanced: batch/rank | balanced: P per D GPU | ceiling $/GPU-h |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.sheet} | {100 * r.hit_rate:.1f}% | {r.input_per_output:g} | {r.usd_per_mtok:.4f} "
                     f"| {r.required_output_tokens_per_s_per_gpu:,.0f} | {_fmt_batch(r.fixed_batch_per_rank)} "
                     f"| {r.fixed_prefill_load:.2f} | {'yes' if r.fixed_feasible else 'no'} "
                     f"| {_fmt_batch(r.balanced_batch_per_rank)} | {r.balanced_prefill_gpus_per_decode_gpu:.3f} "
                     f"| {r.balanced_ceiling_usd_per_gpu_hour:,.0f} |")
    return "\n".join(lines)


def plot_revenue_heatmaps(path: str | Path, grids: Sequence[tuple[PriceSheet, np.ndarray]],
                          hit_rates: Sequence[float], ratios: Sequence[float], *, target_usd_per_gpu_hour: float,
                          title: str, row_labels: Sequence[str] = ("",)) -> Path:
    """Heatmap panels of revenue per GPU-hour (rows hit rate, columns input:output), values in the
    cells, cells at or above the target outlined. ``grids`` holds ``len(row_labels)`` figure rows of
    one panel per sheet each (row-major). Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    nrows = len(row_labels)
    n = len(grids) // nrows
    fig, axes = plt.subplots(nrows, n, figsize=(3.2 * n + 1.2, 3.0 * nrows + 0.8), squeeze=False,
                             constrained_layout=True)
    vmax = min(max(float(np.nanmax(g)) for _, g in grids), 4 * target_usd_per_gpu_hour) or 1.0
    im = None
    for k, (ax, (sheet, g)) in enumerate(zip(axes.ravel(), grids, strict=True)):
        im = ax.imshow(g, origin="lower", cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
        ax.set_yticks(range(len(hit_rates)), [f"{100 * h:.0f}%" for h in hit_rates])
        ax.set_xlabel("input:output tokens")
        label = row_labels[k // n]
        ax.set_title((f"{label}: " if label else "") + sheet.name + (" (illustr.)" if sheet.illustrative else ""),
                     fontsize=8)
        for i in range(g.shape[0]):
            for j in range(g.shape[1]):
                v = g[i, j]
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 * vmax else "white")
                if v >= target_usd_per_gpu_hour:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    for row in axes:
        row[0].set_ylabel("input cache-hit rate")
    fig.colorbar(im, ax=axes.ravel().tolist(), label="revenue $/GPU-h (colour clipped)")
    fig.suptitle(f"{title}\nred outline: >= ${target_usd_per_gpu_hour:g}/GPU-h", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_price_parser(simsub) -> None:  # noqa: ANN001  (argparse subparsers)
    """Register ``pdlb sim price``."""
    import argparse

    p = simsub.add_parser(
        "price", help="revenue per GPU-hour and cost per million tokens from a price sheet",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serving economics from an API price sheet (USD per 1M tokens: input cache hit / miss, output, "
                    "off-peak discount) and a GPU-hour cost.\n\n"
                    "  default          what load and hit rate earn --target $/GPU-h on --scenario (analytic, "
                    "no simulation)\n"
                    "  --from-summary   price the measured throughput of simulation runs (results/*/summary.json)\n"
                    "  --simulate       simulate --scenario on a trace, then price its measured throughput\n\n"
                    f"Shipped sheets: {', '.join(shipped_price_sheets())}. See docs/pricing.md.")
    p.add_argument("--prices", default="all", metavar="NAME|FILE[,...]",
                   help="price sheets: shipped names or .toml/.yaml/.json files, comma-separated (default: all shipped)")
    p.add_argument("--period", default="valley", choices=PERIODS,
                   help="list prices, valley (off-peak) prices, or blended over the day (default valley)")
    p.add_argument("--gpu-hour-cost", type=float, default=DEFAULT_GPU_HOUR_COST_USD, metavar="USD",
                   help=f"GPU cost per hour for cost per 1M tokens and margin (default {DEFAULT_GPU_HOUR_COST_USD:g}, "
                        "DeepSeek's H800 basis)")
    p.add_argument("--scenario", default=DEFAULT_SCENARIO, metavar="NAME|FILE",
                   help=f"PD scenario preset or file (default {DEFAULT_SCENARIO})")
    p.add_argument("--target", type=float, default=DEEPINFER_TARGET_USD_PER_GPU_HOUR, metavar="USD",
                   help=f"target revenue per GPU-hour (default {DEEPINFER_TARGET_USD_PER_GPU_HOUR:g}, DeepInfer)")
    p.add_argument("--hit-rate", default=",".join(f"{h:g}" for h in DEFAULT_HIT_RATES), metavar="H[,...]",
                   help="input cache-hit rates to tabulate (default %(default)s)")
    p.add_argument("--ratio", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), metavar="R[,...]",
                   help="input:output token ratios to tabulate (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=1000, metavar="N",
                   help="output tokens per request; prompt = ratio x N (default 1000)")
    p.add_argument("--tok-s-per-seq", type=float, default=DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ, metavar="TPS",
                   help=f"decode tokens/s per sequence (default {DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ:g}, DeepInfer)")
    p.add_argument("--roofline-decode", action="store_true",
                   help="take decode speed from the perf model instead of --tok-s-per-seq (heatmap and steady state)")
    p.add_argument("--published-batch", type=int, default=DEEPINFER_DECODE_BATCH_PER_RANK, metavar="B",
                   help="decode sequences per rank of the operating-point table (default %(default)s, DeepInfer's "
                        "'~60 sequences per rank')")
    p.add_argument("--decode-batch", type=int, metavar="B",
                   help="decode sequences per rank for the heatmap (default: the scenario's max_decode_batch)")
    p.add_argument("--no-kv-link", action="store_true",
                   help="do not cap prefill by its NIC sending every prompt's KV to decode")
    p.add_argument("--png", type=Path, metavar="PATH", help="write the revenue heatmap PNG here")
    p.add_argument("--markdown", action="store_true", help="also print the target table as Markdown")
    src = p.add_argument_group("measured throughput")
    src.add_argument("--from-summary", type=Path, metavar="SUMMARY.json",
                     help="price the runs of a results summary.json (pdlb sim run/compare)")
    src.add_argument("--simulate", action="store_true", help="simulate --scenario on a trace and price it")
    src.add_argument("--trace", metavar="PATH", help="trace for --simulate (default: the embedded Mooncake trace)")
    src.add_argument("--limit", type=int, default=2000, metavar="N", help="first N requests for --simulate (default 2000)")
    src.add_argument("--rate-scale", type=float, default=1.0, metavar="F", help="arrival-rate multiplier for --simulate")
    src.add_argument("--policy", default="cache_aware", help="routing policy for --simulate (default cache_aware)")
    src.add_argument("--seed", type=int, default=0, help="seed for --simulate (default 0)")
    src.add_argument("--quiet", action="store_true", help="no progress bar")


def _price_runs(console, labelled_rates: Sequence[tuple[str, TokenRates]], sheets: Sequence[PriceSheet],
                args) -> None:  # noqa: ANN001
    rows = [(label, economics(rates, s, args.gpu_hour_cost, args.period))
            for label, rates in labelled_rates for s in sheets]
    console.print(economics_table(rows, f"measured throughput priced at {args.period} prices, "
                                        f"GPU ${args.gpu_hour_cost:g}/h"))


def run_price(args, console) -> int:  # noqa: ANN001
    """Run ``pdlb sim price`` (see :func:`add_price_parser`). Returns the exit status."""
    from sim.scenario import load_scenario

    sheets = load_price_sheets(args.prices)
    hits = _floats(args.hit_rate, "--hit-rate")
    ratios = _floats(args.ratio, "--ratio")
    for h in hits:
        _check_fraction("--hit-rate", h)
    _check_nonneg("--gpu-hour-cost", args.gpu_hour_cost)
    # read (and check) the summaries before printing anything: a missing file is one error line
    runs = load_summaries(args.from_summary) if args.from_summary is not None else None
    console.print(sheets_table(sheets))
    if runs is not None:
        _price_runs(console, [(f"{r.get('scenario', '?')}/{r.get('policy', i)}",
                               rates_from_summary(r, f"{args.from_summary} run {i}")) for i, r in enumerate(runs)],
                    sheets, args)
        return 0
    scenario = load_scenario(args.scenario)
    if args.simulate:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from sim.workload import read_trace, scale_rate, spread_batches, take_slice

        reqs = read_trace(args.trace, "auto")
        if args.limit:
            reqs = take_slice(reqs, 0, args.limit)
        reqs = spread_batches(reqs, 3.0, seed=args.seed)
        if args.rate_scale != 1.0:
            reqs = scale_rate(reqs, args.rate_scale)
        with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=args.quiet) as prog:
            task = prog.add_task("sim", total=len(reqs))
            rates, summary = simulate_rates(scenario, reqs, args.policy, seed=args.seed,
                                            progress=lambda d, t: prog.update(task, completed=d))
        console.print(f"{scenario.name}: {len(reqs)} requests, makespan {summary['makespan_s']:.0f} s, "
                      f"{scenario.num_gpus} GPUs, prefix hit {100 * summary['prefix_hit_rate']:.1f}%")
        _price_runs(console, [(f"{scenario.name}/{args.policy}", rates)], sheets, args)
        return 0

    kv_link = not args.no_kv_link
    speed = None if args.roofline_decode else args.tok_s_per_seq
    pp, dp = scenario.prefill, scenario.decode
    if pp is None or dp is None:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; pdlb sim price needs prefill and decode pools")
    console.print(f"[bold]{scenario.name}[/]: {scenario.description} ({pp.num_gpus} prefill + {dp.num_gpus} decode "
                  f"GPUs, {dp.num_ranks} decode ranks)")
    rows = target_table(scenario, sheets, hits, ratios, target_usd_per_gpu_hour=args.target, period=args.period,
                        output_tokens=args.output_tokens, tokens_per_s_per_seq=args.tok_s_per_seq, kv_link=kv_link)
    console.print(target_rows_table(rows, f"what earns ${args.target:g}/GPU-h at {args.period} prices "
                                          f"({args.tok_s_per_seq:g} tok/s per sequence, "
                                          f"{args.output_tokens} output tokens per request)"))
    from rich.table import Table

    if args.markdown:
        console.print(target_markdown(rows), markup=False, highlight=False, soft_wrap=True)
    ops = operating_point_table(scenario, sheets, hits, batch_per_rank=args.published_batch,
                                tokens_per_s_per_seq=args.tok_s_per_seq, target_usd_per_gpu_hour=args.target,
                                period=args.period, output_tokens=args.output_tokens, kv_link=kv_link)
    ot = Table(title=f"at {args.published_batch} sequences per rank x {args.tok_s_per_seq:g} tok/s: the input:output "
                     f"ratio that earns ${args.target:g}/GPU-h ({args.period} prices)")
    for c in ("sheet", "hit", "out tok/s/GPU", "fixed: in:out", "fixed: P load", "balanced: in:out",
              "balanced: P/D GPUs"):
        ot.add_column(c, justify="left" if c == "sheet" else "right", no_wrap=c == "sheet")
    for o in ops:
        ot.add_row(o.sheet, f"{100 * o.hit_rate:.1f}%", f"{o.output_tokens_per_s_per_gpu:,.0f}",
                   f"{o.fixed_input_per_output:.2f}",
                   f"[red]{o.fixed_prefill_load:.2f}[/]" if o.fixed_prefill_load > 1 else f"{o.fixed_prefill_load:.2f}",
                   f"{o.balanced_input_per_output:.2f}", f"{o.balanced_prefill_gpus_per_decode_gpu:.3f}")
    console.print(ot)
    if args.markdown:
        console.print(operating_point_markdown(ops), markup=False, highlight=False, soft_wrap=True)
    batch = args.decode_batch or dp.max_decode_batch
    ss = steady_state(scenario, prompt_tokens=int(round(ratios[0] * args.output_tokens)),
                      output_tokens=args.output_tokens, hit_rate=hits[-1], decode_batch_per_rank=batch,
                      decode_tokens_per_s_per_seq=speed, kv_link=kv_link)
    roof = steady_state(scenario, prompt_tokens=ss.prompt_tokens, output_tokens=args.output_tokens,
                        hit_rate=hits[-1], decode_batch_per_rank=batch, kv_link=kv_link)
    console.print(f"perf model at decode batch {ss.decode_batch_per_rank}/rank, context "
                  f"{ss.prompt_tokens + args.output_tokens / 2:.0f}: decode step {1e3 * roof.decode_step_s:.1f} ms "
                  f"= {roof.decode_tokens_per_s_per_seq:.0f} tok/s per sequence (published: "
                  f"{DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ:g}); prefill {ss.prefill_input_tokens_per_s / pp.num_gpus:,.0f} "
                  f"input tok/s per GPU at {100 * hits[-1]:.0f}% hit ({ss.prefill_limit}-bound)")
    grids = {split: [(s, revenue_grid(scenario, s, hits, ratios, period=args.period, output_tokens=args.output_tokens,
                                      decode_batch_per_rank=batch, tokens_per_s_per_seq=speed, kv_link=kv_link,
                                      split=split)) for s in sheets]
             for split in ("fixed", "balanced")}
    from rich.table import Table

    speed_txt = "perf-model" if speed is None else f"{speed:g} tok/s"
    split_txt = {"fixed": f"{pp.num_gpus} prefill + {dp.num_gpus} decode GPUs",
                 "balanced": "prefill pool sized to the decode pool"}
    for split, gs in grids.items():
        t = Table(title=f"revenue $/GPU-h, {split_txt[split]}, decode batch <= {batch}/rank ({speed_txt} per "
                        f"sequence), {args.period} prices")
        t.add_column("sheet", no_wrap=True)
        t.add_column("hit", justify="right")
        for r in ratios:
            t.add_column(f"in:out {r:g}", justify="right")
        for s, g in gs:
            for i, h in enumerate(hits):
                t.add_row(s.name if i == 0 else "", f"{100 * h:.1f}%",
                          *[(f"[green]{v:.1f}[/]" if v >= args.target else f"{v:.1f}") for v in g[i]])
        console.print(t)
    h_pub = 0.96
    ft = Table(title=f"cross-check: {DEEPINFER_TOKENS_PER_DAY / 1e12:g}T tokens/day at {100 * h_pub:.0f}% hit "
                     f"earning ${args.target:g}/GPU-h implies a fleet of")
    ft.add_column("sheet")
    for r in ratios:
        ft.add_column(f"in:out {r:g}", justify="right")
    for s in sheets:
        ft.add_row(s.name, *[f"{implied_fleet_gpus(s, tokens_per_day=DEEPINFER_TOKENS_PER_DAY, hit_rate=h_pub, input_per_output=r, target_usd_per_gpu_hour=args.target, period=args.period):,.0f} GPUs" for r in ratios])
    console.print(ft)
    if args.png:
        out = plot_revenue_heatmaps(args.png, grids["fixed"] + grids["balanced"], hits, ratios,
                                    target_usd_per_gpu_hour=args.target, row_labels=(f"{pp.num_gpus}P+{dp.num_gpus}D",
                                                                                     "balanced"),
                                    title=f"{scenario.name}: revenue per GPU-hour at {args.period} prices, decode "
                                          f"batch <= {batch}/rank, {speed_txt} per sequence")
        console.print(f"wrote {out}")
    return 0
