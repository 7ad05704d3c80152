"""``pdlb sim validate --agentx-440246``: the closed-loop simulator against AgentX point 440246.

Point 440246 (DeepSeek-V4-Pro on 8 B200, TP1 DP8 EP8, vLLM, vllm-router consistent hashing, MTP,
64 agentic lanes for 3,600 s) publishes throughput, TTFT, ITL and request latency percentiles and,
through ai-dynamo/aisimulate's reproduction, per-rank iteration times by step class; the figures
and their sources are ``sim/data/measured/agentx_440246.json``. :func:`run_rows` simulates the point
(:func:`sim.agentic_sim.simulate_agentic`, with :mod:`sim.workload.agentic`'s fitted lanes and
:mod:`balancer.policies.dp_consistent_hash`'s ring) and compares every figure; pass = within
+-15% (:data:`sim.validate.TOLERANCE`).

What is fitted and what is held out (the ``role`` column):

* ``calibration``: decode-only iteration p50 (31.15 ms) and mixed iteration p50 (160 ms): the
  two roofline deratings (:data:`sim.agentic_sim.DEFAULT_EFFICIENCY_SCALE` for decode-only
  steps, :data:`sim.agentic_sim.DEFAULT_PREFILL_EFFICIENCY_SCALE` for prefill-bearing ones);
* ``fitted``: the workload's mean input tokens, mean output tokens (generator parameters fitted to
  the published request statistics, :mod:`sim.workload.agentic`);
* ``linked``: completed requests and the throughputs: the lanes' think time is derived by Little's
  law from the published completed requests and mean latency, so these match iff the simulated
  latency does (they are not independent of the latency rows);
* ``held out``: TTFT, ITL, request latency percentiles, the GPU prefix-hit rate, and the
  prefill-only / mixed iteration times and the decode-only p90.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sim.validate import TOLERANCE

DATA_PATH = Path(__file__).parent / "data" / "measured" / "agentx_440246.json"

#: (key, label, published metric name in the data file or ``iter:<class>:<pct>``, simulated
#: metric name in :meth:`RunResult.metrics`, unit scale for display, role)
ROWS: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("total-tput-per-gpu", "total throughput, tok/s/GPU", "tput_per_gpu", "tput_per_gpu", "tok/s", "linked"),
    ("output-tput-per-gpu", "output throughput, tok/s/GPU", "output_tput_per_gpu", "output_tput_per_gpu", "tok/s", "linked"),
    ("requests", "completed measured requests", "total_requests_completed", "total_requests_completed", "", "linked"),
    ("mean-input", "mean input tokens/request", "mean_input_tokens", "mean_input_tokens", "tok", "fitted"),
    ("mean-output", "mean output tokens/request", "mean_output_tokens_actual", "mean_output_tokens_actual", "tok", "fitted"),
    ("gpu-hit", "GPU prefix-cache hit rate", "server_gpu_cache_hit_rate", "server_gpu_cache_hit_rate", "", "held out"),
    ("ttft-mean", "TTFT mean", "mean_ttft", "mean_ttft", "s", "held out"),
    ("ttft-p50", "TTFT p50", "median_ttft", "median_ttft", "s", "held out"),
    ("ttft-p90", "TTFT p90", "p90_ttft", "p90_ttft", "s", "held out"),
    ("ttft-p95", "TTFT p95", "p95_ttft", "p95_ttft", "s", "held out"),
    ("itl-mean", "ITL mean", "mean_itl", "mean_itl", "ms", "held out"),
    ("itl-p50", "ITL p50", "median_itl", "median_itl", "ms", "held out"),
    ("itl-p90", "ITL p90", "p90_itl", "p90_itl", "ms", "held out"),
    ("itl-p95", "ITL p95", "p95_itl", "p95_itl", "ms", "held out"),
    ("e2e-mean", "request latency mean", "mean_e2el", "mean_e2el", "s", "held out"),
    ("e2e-p50", "request latency p50", "median_e2el", "median_e2el", "s", "held out"),
    ("e2e-p90", "request latency p90", "p90_e2el", "p90_e2el", "s", "held out"),
    ("e2e-p95", "request latency p95", "p95_e2el", "p95_e2el", "s", "held out"),
    ("iter-prefill-p50", "iteration, prefill-only p50", "iter:prefill_only:p50", "prefill_only_p50_ms", "ms", "held out"),
    ("iter-prefill-p90", "iteration, prefill-only p90", "iter:prefill_only:p90", "prefill_only_p90_ms", "ms", "held out"),
    ("iter-decode-p50", "iteration, decode-only p50", "iter:decode_only:p50", "decode_only_p50_ms", "ms", "calibration"),
    ("iter-decode-p90", "iteration, decode-only p90", "iter:decode_only:p90", "decode_only_p90_ms", "ms", "held out"),
    ("iter-mixed-p50", "iteration, mixed p50", "iter:mixed:p50", "mixed_p50_ms", "ms", "calibration"),
    ("iter-mixed-p90", "iteration, mixed p90", "iter:mixed:p90", "mixed_p90_ms", "ms", "held out"),
)


def load_published(path: Path = DATA_PATH) -> dict:
    """The published figures of point 440246 (the JSON data file, with its provenance)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def published_value(data: dict, name: str) -> float:
    """A published figure by its row name (``iter:<class>:<pct>`` reads the iteration times, ms)."""
    if name.startswith("iter:"):
        _, cls, pct = name.split(":")
        return float(data["iteration_times_ms"][cls][pct])
    return float(data["reference"][name])


@dataclass(frozen=True)
class AgentxRow:
    key: str
    label: str
    published: float
    simulated: float
    unit: str
    role: str

    @property
    def error(self) -> float:
        return self.simulated / self.published - 1.0

    @property
    def verdict(self) -> str:
        return "pass" if abs(self.error) <= TOLERANCE else "fail"


def rows_from_metrics(metrics: dict[str, float], data: dict | None = None) -> list[AgentxRow]:
    """Pair simulated metrics (:meth:`sim.agentic_sim.RunResult.metrics`) with the published ones.
    ITL values are shown in ms (both sides converted)."""
    data = data or load_published()
    out = []
    for key, label, pub, sim_name, unit, role in ROWS:
        p, s = published_value(data, pub), float(metrics[sim_name])
        if unit == "ms" and not pub.startswith("iter:"):
            p, s = p * 1e3, s * 1e3
        out.append(AgentxRow(key, label, p, s, unit, role))
    return out


def run_rows(duration_s: float | None = None, seed: int = 0) -> tuple[list[AgentxRow], dict[str, float]]:
    """Simulate point 440246 (``duration_s`` measured seconds, default the published 3,600) and
    compare. About a minute of CPU for the full hour."""
    from sim.agentic_sim import simulate_agentic
    from sim.workload.agentic import AgenticWorkloadConfig
    wl = AgenticWorkloadConfig() if duration_s is None else AgenticWorkloadConfig(duration_s=duration_s)
    m = simulate_agentic(wl, seed=seed).metrics()
    return rows_from_metrics(m), m


def print_rows(rows: list[AgentxRow], console) -> None:  # noqa: ANN001
    """The table ``pdlb sim validate --agentx-440246`` prints, and its summary line."""
    from rich.table import Table
    t = Table(title=f"AgentX 440246 (DeepSeek-V4-Pro, 8 B200, vLLM DP8/EP8): simulated vs published "
                    f"(pass = within +-{TOLERANCE:.0%})")
    for col, just in (("figure", "left"), ("key", "left"), ("published", "right"), ("simulated", "right"),
                      ("error", "right"), ("verdict", "center"), ("role", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        fmt = "{:,.0f}" if abs(r.published) >= 100 else "{:.3g}" if abs(r.published) < 1 else "{:.2f}"
        t.add_row(r.label, r.key, fmt.format(r.published) + (f" {r.unit}" if r.unit else ""),
                  fmt.format(r.simulated) + (f" {r.unit}" if r.unit else ""), f"{100 * r.error:+.1f}%",
                  "[green]pass[/]" if r.verdict == "pass" else "[red]FAIL[/]", r.role)
    console.print(t)
    held = [r for r in rows if r.role == "held out"]
    console.print(f"{sum(r.verdict == 'pass' for r in held)} of {len(held)} held-out figures within "
                  f"+-{TOLERANCE:.0%}; {sum(r.verdict == 'pass' for r in rows)} of {len(rows)} rows in all "
                  "(fitted: mean input/output tokens; calibration: decode-only and mixed p50; linked to the latency "
                  "through the think time: requests and throughput)", markup=False)


def plot_rows(rows: list[AgentxRow], path: str | Path, title: str = "AgentX 440246: simulated vs published") -> Path:
    """Write a PNG: each row's simulated / published ratio (log scale) with the +-15% band, markers
    by role. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    colors = {"held out": "tab:blue", "calibration": "tab:green", "fitted": "tab:gray", "linked": "tab:orange"}
    fig, ax = plt.subplots(figsize=(11, 5))
    x = range(len(rows))
    for i, r in zip(x, rows):
        ax.scatter(i, r.simulated / r.published, color=colors[r.role], marker="o" if r.verdict == "pass" else "x", s=40)
    ax.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="tab:green", alpha=0.12, label=f"+-{TOLERANCE:.0%}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_yticks([0.4, 0.6, 0.8, 1.0, 1.25, 1.5])
    ax.set_yticklabels(["0.4", "0.6", "0.8", "1.0", "1.25", "1.5"])
    ax.set_xticks(list(x), [r.key for r in rows], rotation=70, ha="right", fontsize=8)
    ax.set_ylabel("simulated / published")
    for role, c in colors.items():
        ax.scatter([], [], color=c, label=role)
    ax.legend(fontsize=8, ncol=5, loc="lower left")
    ax.set_title(title + " (x: outside +-15%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
