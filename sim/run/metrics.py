"""Summary metrics of a simulation run, computed from its per-request and per-rank records.

Definitions (per request ``i``):

- TTFT = ``first_token_s - arrival_s``; E2E = ``finish_s - arrival_s``.
- TPOT = ``(finish_s - first_token_s) / (output_tokens - 1)`` for requests with > 1 output token
  (the mean inter-token latency of the request).
- Prefix hit rate (token-weighted) = ``sum(cached_tokens) / sum(prompt_tokens)``, next to the
  workload's ideal infinite-cache hit rate (:func:`sim.workload.ideal_hit_rate`).
- Throughput: tokens / makespan, makespan = last finish - first arrival; per GPU divides by the
  scenario's GPU count.
- SLO attainment: fraction of requests with TTFT <= ``slo_ttft_s`` and TPOT <= ``slo_tpot_s``
  (requests with one output token need only the TTFT SLO; unfinished requests miss it; requests
  rejected at arrival, ``num_rejected``, count among the requests and miss it).
- Goodput = SLO-meeting requests / arrival window, in requests per second; the arrival window is
  ``last arrival - first arrival`` (``arrival_window_s``; NaN when all requests arrive at once).
  Dividing by the arrival window rather than the makespan keeps goodput comparable across loads
  of one trace: at most the offered rate ``offered_rps = num_requests / arrival_window_s``, equal
  to it when every request meets the SLO, and not moved by how long an overloaded run takes to
  drain its queues (DistServe's goodput: the request rate served within the SLO).
- Load imbalance across DP ranks of a pool (max / mean): ``*_work_imbalance`` over the whole run's
  work per rank (prefill tokens computed, decode tokens generated); ``*_load_imbalance`` the
  time average of instantaneous max / mean over load samples in which the pool is busy (queued
  prefill tokens, decode KV tokens). These count queued prompts whose cached part is not known
  yet, and at light load approach the rank count (one busy rank among idle ones).
- Step imbalance (``*_step_imbalance``, what EP-synchronous steps pay for; the compare table's
  "P imb." / "D imb."): over the steps of wide-EP engines (step groups of > 1 rank), the
  time-weighted ``max_r work_r / mean_r work_r`` of the work that sets the step, counted only
  while the engine steps: uncached prompt tokens computed in steps with prefill, decode KV tokens
  attended in decode-only steps. 1 = balanced; ``R`` = one rank does all the work. 1 when there
  is no wide-EP engine. ``*_ep_wait_fraction``: the share of those steps' time the average rank
  waits for the slowest, ``sum dt (1 - mean/max) / sum dt``.
- KV tiers (:func:`kv_summary`): token-weighted hit rate per tier, ``sum(<tier>_hit_tokens) /
  sum(prompt_tokens)`` for tier in hbm / host / store, and ``miss = 1 - hbm - host - store``
  (they sum to 1; hbm + host + store = ``prefix_hit_rate``). Bytes moved: lower-tier fetches and
  write-backs (the tiers' counters) and prefill -> decode transfers (``transfer_bytes``).
- TTFT split per request: ``fetch = fetch_end - fetch_start`` (0 without a fetch), ``compute =
  prefill_end - prefill_start``, ``transfer = transfer_end - prefill_end`` (PD; 0 aggregated),
  ``queue = TTFT - fetch - compute - transfer`` (prefill queue before and after the fetch, plus
  decode admission wait); the four sum to TTFT.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from balancer.types import Role
from sim.run.cluster import SimResult
from sim.run.deadline_gate import admission_summary
from sim.workload import ideal_hit_rate

PERCENTILES = (50, 90, 99)


def _dist(x: np.ndarray) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    out = {"mean": float(x.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(x, p))
    return out


def _max_over_mean(x: np.ndarray) -> float:
    m = float(x.mean()) if len(x) else 0.0
    return float(x.max()) / m if m > 0 else 1.0


def _sampled_imbalance(samples: np.ndarray, cols: np.ndarray) -> float:
    if samples.size == 0 or len(cols) == 0:
        return 1.0
    s = samples[:, cols].astype(np.float64)
    mean = s.mean(axis=1)
    busy = mean > 0
    if not busy.any():
        return 1.0
    return float((s[busy].max(axis=1) / mean[busy]).mean())


def _step_imbalance(result: SimResult) -> dict[str, float]:
    si = result.extra.get("step_imbalance") or {}
    out = {}
    for kind in ("prefill", "decode"):
        busy = si.get(f"{kind}_busy_s", 0.0)
        out[f"{kind}_step_imbalance"] = si[f"{kind}_imbalance_s"] / busy if busy > 0 else 1.0
        out[f"{kind}_ep_wait_fraction"] = si[f"{kind}_wait_s"] / busy if busy > 0 else 0.0
    return out


def per_request(result: SimResult) -> dict[str, np.ndarray]:
    """Derived per-request columns: ``ttft_s``, ``tpot_s`` (NaN for one-token outputs), ``e2e_s``."""
    r = result.records
    ttft = r.first_token_s - r.arrival_s
    e2e = r.finish_s - r.arrival_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(r.output_tokens > 1, (r.finish_s - r.first_token_s) / (r.output_tokens - 1), np.nan)
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}


def ttft_split(result: SimResult) -> dict[str, np.ndarray]:
    """Per-request TTFT parts in seconds (see module docstring): ``queue_s``, ``fetch_s``,
    ``compute_s``, ``transfer_s``; they sum to ``ttft_s`` (NaN for unfinished requests)."""
    r = result.records
    ttft = r.first_token_s - r.arrival_s
    fetch = np.where(np.isnan(r.fetch_start_s), 0.0, r.fetch_end_s - r.fetch_start_s)
    compute = r.prefill_end_s - r.prefill_start_s
    transfer = np.where(np.isnan(r.transfer_end_s), 0.0, r.transfer_end_s - r.prefill_end_s)
    return {"queue_s": ttft - fetch - compute - transfer, "fetch_s": fetch, "compute_s": compute,
            "transfer_s": transfer}


def kv_summary(result: SimResult) -> dict[str, Any]:
    """Hit rate per tier, bytes moved per tier, TTFT split (mean, p99); JSON-friendly."""
    r = result.records
    prompt = float(r.prompt_tokens.sum())
    rate = (lambda x: float(x.sum()) / prompt) if prompt else (lambda x: 0.0)  # noqa: E731
    hbm, host, store = rate(r.hbm_hit_tokens), rate(r.host_hit_tokens), rate(r.store_hit_tokens)
    stats = result.extra.get("tiers")
    split = ttft_split(result)
    out: dict[str, Any] = {
        "tiers_configured": result.scenario.has_kv_tiers,
        "hit_rate": {"hbm": hbm, "host": host, "store": store, "miss": 1.0 - hbm - host - store},
        "bytes": {
            "host_fetch": stats.host_fetch_bytes if stats else 0.0,
            "store_fetch": stats.store_fetch_bytes if stats else 0.0,
            "host_write": stats.host_write_bytes if stats else 0.0,
            "store_write": stats.store_write_bytes if stats else 0.0,
            "pd_transfer": float(r.transfer_bytes.sum()),
        },
        "recomputed_lower_tier_blocks": stats.recompute_blocks if stats else 0,
        "ttft_split_s": {},
    }
    for name, x in split.items():
        x = x[~np.isnan(x)]
        out["ttft_split_s"][name] = {"mean": float(x.mean()) if len(x) else float("nan"),
                                     "p99": float(np.percentile(x, 99)) if len(x) else float("nan")}
    return out


def summarize(result: SimResult, *, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.1) -> dict[str, Any]:
    """The summary table row of one run (JSON-friendly)."""
    r = result.records
    n = r.num_requests
    d = per_request(result)
    makespan = float(np.nanmax(r.finish_s) - np.nanmin(r.arrival_s)) if n else 0.0
    makespan = makespan if makespan > 0 else float("nan")
    window = float(np.max(r.arrival_s) - np.min(r.arrival_s)) if n else 0.0
    window = window if window > 0 else float("nan")
    gpus = result.scenario.num_gpus
    in_tokens = int(r.prompt_tokens.sum())
    out_tokens = int(r.output_tokens.sum())
    ideal_blocks, ideal_tokens = ideal_hit_rate(result.requests, result.scenario.block_size)
    ok_ttft = d["ttft_s"] <= slo_ttft_s
    ok_tpot = np.where(np.isnan(d["tpot_s"]), True, d["tpot_s"] <= slo_tpot_s)
    ok = ok_ttft & ok_tpot
    num_rejected = sum(result.extra.get("rejected", {}).values())
    roles = [info.role for info in result.ranks]
    prefill_cols = np.array([i for i, r in enumerate(roles) if r is not Role.DECODE], dtype=np.int64)  # prefill/mixed
    decode_cols = np.array([i for i, r in enumerate(roles) if r is not Role.PREFILL], dtype=np.int64)  # decode/mixed
    smp = result.samples.as_arrays()
    return {
        "policy": result.label,
        "prefill_policy": result.prefill_policy,
        "decode_policy": result.decode_policy,
        "scenario": result.scenario.name,
        "seed": result.seed,
        "num_requests": n,
        "num_finished": int(r.num_finished),
        # refused at arrival (sim.run.admission: over max_model_len or any rank's KV), not simulated
        "num_rejected": num_rejected,
        "rejected": dict(result.extra.get("rejected", {})),
        "makespan_s": makespan,
        "arrival_window_s": window,
        "offered_rps": n / window,
        "ttft_s": _dist(d["ttft_s"]),
        "tpot_s": _dist(d["tpot_s"]),
        "e2e_s": _dist(d["e2e_s"]),
        "input_tokens_per_s": in_tokens / makespan,
        "output_tokens_per_s": out_tokens / makespan,
        "input_tokens_per_s_per_gpu": in_tokens / makespan / gpus,
        "output_tokens_per_s_per_gpu": out_tokens / makespan / gpus,
        "prefix_hit_rate": float(r.cached_tokens.sum() / in_tokens) if in_tokens else 0.0,
        "ideal_hit_rate": float(ideal_tokens),
        "ideal_hit_rate_blocks": float(ideal_blocks),
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        # a rejected request misses its SLO (left out, 278 rejections would still show 100.0%)
        "slo_attainment": float(ok.sum()) / (n + num_rejected) if n + num_rejected else float("nan"),
        "goodput_rps": float(ok.sum()) / window,
        "prefill_work_imbalance": _max_over_mean(result.rank_prefill_tokens[prefill_cols]),
        "decode_work_imbalance": _max_over_mean(result.rank_decode_tokens[decode_cols]),
        "prefill_load_imbalance": _sampled_imbalance(smp["prefill_queued_tokens"], prefill_cols),
        "decode_load_imbalance": _sampled_imbalance(smp["decode_kv_tokens"], decode_cols),
        **_step_imbalance(result),
        "num_gpus": gpus,
        "num_steps": result.num_steps,
        "events_per_request": result.num_waits / n if n else 0.0,
        "wall_s": result.wall_s,
        "kv": kv_summary(result),
        **({"admission": admission_summary(result.extra["admission"], r.arrival_s, d["ttft_s"], ok)}
           if "admission" in result.extra else {}),
    }


#: A run whose last request finishes later than this many arrival windows after the first arrival
#: measured a burst that the cluster absorbed and drained afterwards, not a rate it sustains.
BURST_MAKESPAN_RATIO = 2.0


def burst_note(num_requests: int, arrival_window_s: float | None, makespan_s: float | None) -> str:
    """Why a run's goodput is a burst's, or ``""``: goodput counts SLO-meeting requests per second
    of the arrival window, so a short trace compressed by a high rate scale (800 Azure requests at
    x64 arrive in 2.9 s, the last finishes at 13.1 s on 8 GPUs: "280 req/s") reads as a rate the
    cluster could sustain while it only absorbed the burst. A note when ``makespan_s >``
    :data:`BURST_MAKESPAN_RATIO` ``* arrival_window_s`` (the summary's fields, seconds); ``""``
    otherwise or when either is missing / NaN / 0. The one check of ``pdlb sim capacity``'s answer
    and of every ``pdlb sim sweep`` point."""
    try:
        window, makespan = float(arrival_window_s), float(makespan_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    if not (window > 0 and makespan > BURST_MAKESPAN_RATIO * window):  # False for NaN
        return ""
    return (f"the {num_requests} requests arrive over {window:.3g} s and the last finishes at {makespan:.3g} s: "
            "the cluster absorbed a burst and drained it, which is not a rate it sustains")
