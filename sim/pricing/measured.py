"""Measured throughput: per-GPU token rates of simulation runs, to price with
:mod:`sim.pricing.revenue`.

A run summary (:func:`sim.run.metrics.summarize`, a row of a results ``summary.json``) carries input
and output tokens per second per GPU (``_tokens_per_s``, over the makespan, averaged over *all* of
the scenario's GPUs, prefill and decode alike) and the token-weighted prefix hit rate;
:func:`rates_from_summary` splits the input into cache hits and misses by that rate.
:func:`simulate_rates` runs the simulator first. These are *delivered* rates: the offered load
unless the cluster saturates.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sim.pricing.revenue import TokenRates
from sim.pricing.sheets import _check_fraction
from sim.scenario import Scenario


# ---------------------------------------------------------------------------- from a simulation
_SUMMARY_KEYS = ("input_tokens_per_s_per_gpu", "output_tokens_per_s_per_gpu", "prefix_hit_rate")


def rates_from_summary(summary: dict[str, Any], label: str = "summary") -> TokenRates:
    """Per-GPU rates of a :func:`sim.run.metrics.summarize` row: the run's input tokens (split by its
    token-weighted prefix hit rate) and output tokens over the makespan, divided by all of the
    scenario's GPUs. Raises ``ValueError`` naming ``label`` and the missing/invalid key, or
    saying that the run simulated nothing (every request refused at arrival: no rates at all)."""
    if summary.get("num_finished") == 0 and summary.get("num_rejected"):  # a run with no rates at all
        why = ", ".join(f"{n} over {r}" for r, n in sorted((summary.get("rejected") or {}).items()))
        raise ValueError(f"{label} ({summary.get('policy', '?')}): nothing was simulated, all "
                         f"{summary['num_rejected']} requests were refused at arrival ({why or 'rejected'}); "
                         "nothing to price")
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


def simulate_rates(scenario: Scenario, requests: Sequence, policy: Any = "cache_aware", *, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> tuple[TokenRates, dict[str, Any]]:
    """Simulate ``requests`` on ``scenario`` with ``policy`` (a name or a policy object; both
    pools) and return the measured per-GPU rates and the run summary. The rates are the
    *delivered* throughput of that workload (its offered load unless the cluster saturates);
    scale the arrival rate to load the cluster.

    Raises:
        ValueError: no requests, or none finished (all refused at arrival): nothing to price.
    """
    from sim.run.cluster import simulate
    from sim.run.metrics import summarize

    if not requests:
        raise ValueError(f"simulation of {scenario.name}: the workload has no requests; nothing to price")
    s = summarize(simulate(scenario, requests, policy, seed=seed, progress=progress))
    if not s.get("num_finished"):
        why = ", ".join(f"{n} over {r}" for r, n in sorted(s.get("rejected", {}).items()))
        raise ValueError(f"simulation of {scenario.name}: none of the {s['num_requests'] + s['num_rejected']} "
                         f"requests finished ({why or 'none ran'}; max_model_len "
                         f"{scenario.effective_max_model_len}): nothing to price")
    return rates_from_summary(s, f"simulation of {scenario.name}"), s
