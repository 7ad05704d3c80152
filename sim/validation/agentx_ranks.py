"""AgentX 440246 per DP rank: prefill-only records against idle seconds, capture and simulation.

The capture (vLLM forward-pass metrics, aisimulate job 4228930; ``fpm_capture.records_per_rank`` of
``sim/data/measured/agentx_440246.json``) counts, per rank, the records of each class and the
"no scheduled requests" records. The FPM patch (aisimulate ``native-fpm.patch``, vLLM PR 52061 at
996fed4) says what those are:

* a record is emitted only from ``EngineCore.step`` for an iteration with scheduled tokens
  (``ForwardPassMetricsEmitter.begin_iteration`` returns early when ``total_num_scheduled_tokens``
  is 0); a DP rank with no request runs its dummy batches outside ``step`` (vLLM's DP busy loop),
  so idle ranks' padding steps leave no record of any class;
* the "no scheduled requests" records are the publisher's heartbeats: ``ZmqForwardPassMetricsPublisher``
  sends an empty record after every ``FPM_HEARTBEAT_INTERVAL_SECONDS`` = 1 s without one. So a
  rank's no-request count is about its idle seconds (plus a part common to every rank: before the
  load and after the drain).

So across ranks, prefill-only records against idle seconds tell two mechanisms apart:

* a rank with few lanes both idles (all its lanes think) and prefills alone (none of its lanes
  decodes): across ranks the two rise together (a positive correlation);
* a phase in which some ranks have finished their work and wait while the others still prefill
  with nothing decoding (a warm-up followed by a barrier): one rank's idle second is another's
  prefill-only steps (a negative correlation, slope -1 / the step time).

:func:`rank_spread` gives the correlation, the fitted slope (records per idle second) and the
max / min ratio of the per-rank prefill-only records; :func:`capture_rank_spread` gives them for the
capture. ``bench/agentx_rank_spread.py`` runs the simulator's variants against it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["capture_rank_records", "rank_spread", "capture_rank_spread", "simulated_rank_records"]

#: the capture's record classes per rank, in ``fpm_capture.records_per_rank``
CAPTURE_CLASSES = ("prefill_only", "decode_only", "mixed", "no_requests")


def capture_rank_records(path: Path | None = None) -> dict[str, np.ndarray]:
    """The capture's records per DP rank and class (``{class: (8,) int}``, ranks 0..7; the
    ``no_requests`` class is the 1 s heartbeats, i.e. idle seconds). Source: aisimulate
    ``job-4228930-comparison.json`` ``fpm.per_rank`` (commit 2bc0da0), as transcribed in
    ``sim/data/measured/agentx_440246.json``.

    Raises:
        ValueError: the file has no per-rank records or a rank is missing."""
    from sim.validation.agentx import DATA_PATH, load_published
    per = load_published(path or DATA_PATH).get("fpm_capture", {}).get("records_per_rank")
    if not per:
        raise ValueError("no fpm_capture.records_per_rank in the published file")
    ranks = sorted(per, key=int)
    if [int(r) for r in ranks] != list(range(len(ranks))):
        raise ValueError(f"ranks {ranks}: expected 0..{len(ranks) - 1}")
    return {c: np.array([int(per[r][c]) for r in ranks], dtype=np.int64) for c in CAPTURE_CLASSES}


def rank_spread(prefill_only: np.ndarray, idle_s: np.ndarray, mixed: np.ndarray | None = None) -> dict[str, float]:
    """Across ranks (arrays of equal length >= 2): ``corr`` (Pearson, prefill-only records against
    idle seconds; NaN where either is constant), ``slope`` (least-squares records per idle second),
    ``max_min`` (largest over smallest prefill-only count; inf if the smallest is 0),
    ``no_decode_share`` (prefill-only over prefill-only + mixed records, all ranks; with ``mixed``).

    Raises:
        ValueError: shapes differ or fewer than 2 ranks."""
    po = np.asarray(prefill_only, dtype=np.float64)
    idle = np.asarray(idle_s, dtype=np.float64)
    if po.shape != idle.shape or po.ndim != 1 or len(po) < 2:
        raise ValueError(f"need two 1-d arrays of the same length >= 2, got {po.shape} and {idle.shape}")
    flat = np.ptp(po) == 0 or np.ptp(idle) == 0
    out = {"corr": float("nan") if flat else float(np.corrcoef(po, idle)[0, 1]),
           "slope": float("nan") if np.ptp(idle) == 0 else float(np.polyfit(idle, po, 1)[0]),
           "max_min": float(po.max() / po.min()) if po.min() > 0 else float("inf")}
    if mixed is not None:
        mx = np.asarray(mixed, dtype=np.float64)
        if mx.shape != po.shape:
            raise ValueError(f"mixed has shape {mx.shape}, expected {po.shape}")
        total = po.sum() + mx.sum()
        out["no_decode_share"] = float(po.sum() / total) if total > 0 else float("nan")
    return out


def capture_rank_spread(path: Path | None = None) -> dict[str, float]:
    """:func:`rank_spread` of the capture (idle seconds = its heartbeat records)."""
    r = capture_rank_records(path)
    return rank_spread(r["prefill_only"], r["no_requests"], r["mixed"])


def simulated_rank_records(result, warmup_only: bool = False) -> dict[str, np.ndarray]:  # noqa: ANN001
    """A closed-loop run's (:class:`sim.run.closed_loop.ClosedLoopResult`) records per rank and
    class like :func:`capture_rank_records`, with ``idle_s`` (seconds without work, from the first
    send to the end of the run) in place of the heartbeats. ``warmup_only``: up to the opening of
    the measured window (idle seconds up to that instant)."""
    steps = result.warmup_rank_class_steps if warmup_only else result.rank_class_steps
    active = result.warmup_rank_active_s if warmup_only else result.rank_active_s
    span = result.measure_start_s if warmup_only else result.end_s
    return {"prefill_only": steps[:, 0].copy(), "decode_only": steps[:, 1].copy(), "mixed": steps[:, 2].copy(),
            "idle_s": np.maximum(0.0, span - active)}
