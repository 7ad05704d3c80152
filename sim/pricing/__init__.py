"""Serving economics: revenue per GPU-hour and cost per million tokens from an API price sheet.

Modules, by concern:

- :mod:`sim.pricing.sheets`: the :class:`PriceSheet` model (USD per 1M tokens: input cache hit /
  miss, output; off-peak discount and period factor) and loading shipped sheets
  (``sim/data/prices/*.toml``) or user ``.toml``/``.yaml``/``.json`` files.
- :mod:`sim.pricing.revenue`: :class:`TokenRates`, the revenue, cost and margin formulas and the
  required-load solvers; its docstring holds the formulas, units and DeepSeek's check values.
- :mod:`sim.pricing.throughput`: analytic steady-state throughput of a PD scenario from the perf
  model (:func:`steady_state`).
- :mod:`sim.pricing.measured`: measured throughput of simulation runs (:func:`rates_from_summary`,
  :func:`simulate_rates`).
- :mod:`sim.pricing.analysis`: the $38 analysis (:func:`target_table`,
  :func:`operating_point_table`, :func:`revenue_grid`, :func:`implied_fleet_gpus`).
- :mod:`sim.pricing.report`: rich and Markdown tables and the revenue heatmap PNG.

Throughput comes from a price-independent place: a simulation summary (:func:`rates_from_summary`,
the measured input/output tokens and prefix hit rate over all GPUs), or the perf model at steady
state (:func:`steady_state`).

Every public name is re-exported here, so ``from sim.pricing import ...`` works for all of them.
"""

from __future__ import annotations

from sim.pricing.analysis import (
    DEEPINFER_DECODE_BATCH_PER_RANK,
    DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ,
    DEEPINFER_TARGET_USD_PER_GPU_HOUR,
    DEEPINFER_TOKENS_PER_DAY,
    OperatingPointRow,
    TargetRow,
    implied_fleet_gpus,
    operating_point_table,
    revenue_grid,
    target_table,
)
from sim.pricing.measured import load_summaries, rates_from_summary, simulate_rates
from sim.pricing.report import (
    economics_table,
    operating_point_markdown,
    plot_revenue_heatmaps,
    sheets_table,
    target_markdown,
    target_rows_table,
)
from sim.pricing.revenue import (
    DEFAULT_GPU_HOUR_COST_USD,
    K_HOUR_PER_MTOK,
    Economics,
    TokenRates,
    balanced_revenue_usd_per_gpu_hour,
    cost_usd_per_mtok,
    economics,
    required_input_per_output,
    required_output_tokens_per_s,
    revenue_usd_per_gpu_hour,
)
from sim.pricing.sheets import PERIODS, Period, PriceSheet, load_price_sheet, load_price_sheets, shipped_price_sheets
from sim.pricing.throughput import (
    SteadyState,
    decode_step_s,
    prefill_capacity_tokens_per_s_per_gpu,
    prefill_input_tokens_per_s_per_rank,
    steady_state,
)

__all__ = [
    # sheets
    "PERIODS", "Period", "PriceSheet", "load_price_sheet", "load_price_sheets", "shipped_price_sheets",
    # revenue
    "DEFAULT_GPU_HOUR_COST_USD", "K_HOUR_PER_MTOK", "Economics", "TokenRates", "balanced_revenue_usd_per_gpu_hour",
    "cost_usd_per_mtok", "economics", "required_input_per_output", "required_output_tokens_per_s",
    "revenue_usd_per_gpu_hour",
    # throughput
    "SteadyState", "decode_step_s", "prefill_capacity_tokens_per_s_per_gpu", "prefill_input_tokens_per_s_per_rank",
    "steady_state",
    # measured
    "load_summaries", "rates_from_summary", "simulate_rates",
    # analysis
    "DEEPINFER_DECODE_BATCH_PER_RANK", "DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ", "DEEPINFER_TARGET_USD_PER_GPU_HOUR",
    "DEEPINFER_TOKENS_PER_DAY", "OperatingPointRow", "TargetRow", "implied_fleet_gpus", "operating_point_table",
    "revenue_grid", "target_table",
    # report
    "economics_table", "operating_point_markdown", "plot_revenue_heatmaps", "sheets_table", "target_markdown",
    "target_rows_table",
]
