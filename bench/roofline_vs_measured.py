#!/usr/bin/env python3
"""Roofline step times against a measured GPU profile (``bench/gpu_profile.py``).

For every row of the profile (default: the shipped H200 / Llama-3.1-8B table) it prints the measured
time, the roofline's time (``RooflinePerf.for_engine(model, hardware, num_dp_ranks=1)`` with its
default constants unless ``--mfu/--mbu/--overhead-ms`` are given) and the error
``(roofline - measured) / measured``, then the mean absolute percentage error (MAPE) of prefill and
decode rows separately.

It also reports what the data would justify, without changing the roofline: the roofline time is
``max(C / mfu, M / mbu) + overhead``, where ``C`` (compute seconds at 100% of peak) and ``M`` (HBM
seconds at 100% of bandwidth) are read off the roofline itself by evaluating it at extreme
efficiencies (``mbu -> 1e-6`` isolates ``M``, ``mfu -> 1e-6`` isolates ``C``). From those it prints the
efficiency each row achieved (``C / measured`` for compute-bound prefill, ``M / measured`` for decode)
and grid-searches ``mfu``, ``mbu`` and the per-step overhead for the lowest MAPE.

Usage::

    .venv/bin/python bench/roofline_vs_measured.py [--profile CSV] [--model M] [--hardware H]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sim.perf.base import causal_attn_pairs  # noqa: E402
from sim.perf.roofline import (DEFAULT_MBU, DEFAULT_MFU, DEFAULT_STEP_OVERHEAD_S,  # noqa: E402
                               RooflinePerf)
from sim.perf.table import profile_path, read_profile  # noqa: E402


def roofline_times(rows, model: str, hardware: str, **kw) -> np.ndarray:
    """Roofline seconds of each profile row (prefill rows pass their cached prefix explicitly)."""
    rf = RooflinePerf.for_engine(model, hardware, num_dp_ranks=1, **kw)
    out = []
    for r in rows:
        if r.kind == "prefill":
            t = rf.step_time_s([r.prefill_tokens], [causal_attn_pairs(r.prefill_tokens, r.cached_tokens)],
                               [0], [0], prefill_cached_tokens=[r.cached_tokens])
        else:
            t = rf.step_time_s([0], [0], [r.batch], [r.batch * r.ctx_tokens])
        out.append(float(np.asarray(t).reshape(-1)[0]))
    return np.array(out)


def compute_and_memory(rows, model: str, hardware: str) -> tuple[np.ndarray, np.ndarray]:
    """``C`` and ``M`` of each row: roofline seconds at 100% of peak FLOP/s and of HBM bandwidth."""
    m = roofline_times(rows, model, hardware, mfu=1.0, mbu=1e-6, step_overhead_s=0.0) * 1e-6
    c = roofline_times(rows, model, hardware, mfu=1e-6, mbu=1.0, step_overhead_s=0.0) * 1e-6
    return c, m


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / meas - 1.0)) * 100.0)


def fit(c, m, meas, is_pf, overheads) -> dict:
    """Grid search (mfu, mbu, overhead) for the lowest mean of the prefill and decode MAPEs."""
    mfus = np.arange(0.20, 1.0001, 0.01)
    mbus = np.arange(0.30, 1.0001, 0.01)
    best = None
    for ovh in overheads:
        t = np.maximum(c[None, None, :] / mfus[:, None, None], m[None, None, :] / mbus[None, :, None]) + ovh
        err = np.abs(t / meas - 1.0)
        pf, dec = err[..., is_pf].mean(-1), err[..., ~is_pf].mean(-1)
        score = (pf + dec) / 2
        i, j = np.unravel_index(np.argmin(score), score.shape)
        if best is None or score[i, j] < best["score"]:
            best = {"mfu": float(mfus[i]), "mbu": float(mbus[j]), "overhead_s": float(ovh),
                    "score": float(score[i, j]), "prefill_mape": float(pf[i, j] * 100),
                    "decode_mape": float(dec[i, j] * 100)}
    return best


def main(argv: list[str] | None = None) -> int:
    from pdlb_cli.arg_types import fraction, nonnegative_float
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--profile", default=None, help="profile CSV (default: the shipped one for model/hardware)")
    ap.add_argument("--mfu", type=fraction, default=DEFAULT_MFU)
    ap.add_argument("--mbu", type=fraction, default=DEFAULT_MBU)
    ap.add_argument("--overhead-ms", type=nonnegative_float, default=DEFAULT_STEP_OVERHEAD_S * 1e3,
                    help="fixed time per engine step, ms (default %(default)g; 0: none)")
    args = ap.parse_args(argv)

    path = Path(args.profile) if args.profile else profile_path(args.model, args.hardware)
    rows, header = read_profile(path)
    meas = np.array([r.time_s for r in rows])
    is_pf = np.array([r.kind == "prefill" for r in rows])
    kw = dict(mfu=args.mfu, mbu=args.mbu, step_overhead_s=args.overhead_ms / 1e3)
    rf = roofline_times(rows, args.model, args.hardware, **kw)
    c, m = compute_and_memory(rows, args.model, args.hardware)

    print(f"profile: {path}")
    for h in header[:2]:
        print(f"  {h}")
    print(f"roofline: RooflinePerf.for_engine({args.model!r}, {args.hardware!r}, num_dp_ranks=1, "
          f"mfu={args.mfu}, mbu={args.mbu}, step_overhead_s={args.overhead_ms:g} ms)\n")
    print(f"{'kind':7s} {'new':>6s} {'cached':>6s} {'batch':>5s} {'ctx':>6s} {'measured_ms':>12s} "
          f"{'roofline_ms':>12s} {'err%':>7s}  bound  {'achieved':>9s}")
    for r, t_m, t_r, ci, mi in zip(rows, meas, rf, c, m):
        bound = "comp" if ci / args.mfu > mi / args.mbu else "mem"
        eff = f"mfu {ci / t_m:.2f}" if r.kind == "prefill" else f"mbu {mi / t_m:.2f}"
        print(f"{r.kind:7s} {r.prefill_tokens:6d} {r.cached_tokens:6d} {r.batch:5d} {r.ctx_tokens:6d} "
              f"{t_m * 1e3:12.3f} {t_r * 1e3:12.3f} {100 * (t_r / t_m - 1):+7.1f}  {bound:5s}  {eff:>9s}")

    print(f"\nMAPE with these constants: prefill {mape(rf[is_pf], meas[is_pf]):.1f}%  "
          f"decode {mape(rf[~is_pf], meas[~is_pf]):.1f}%  (n = {is_pf.sum()} / {(~is_pf).sum()})")
    rf0 = roofline_times(rows, args.model, args.hardware, mfu=args.mfu, mbu=args.mbu, step_overhead_s=0.0)
    print(f"same without the per-step overhead (the profile is GPU time only): prefill "
          f"{mape(rf0[is_pf], meas[is_pf]):.1f}%  decode {mape(rf0[~is_pf], meas[~is_pf]):.1f}%")

    # ---- what the data justify
    print("\nefficiencies the data imply (roofline FLOPs / bytes over measured time):")
    big_pf = is_pf & (np.array([r.prefill_tokens for r in rows]) >= 1024)
    ach_f = c[big_pf] / meas[big_pf]
    print(f"  prefill, >= 1024 new tokens (compute-bound): mfu {ach_f.min():.2f} .. {ach_f.max():.2f}, "
          f"median {np.median(ach_f):.2f}")
    ach_b = m[~is_pf] / meas[~is_pf]
    print(f"  decode (memory-bound at every measured point): mbu {ach_b.min():.2f} .. {ach_b.max():.2f}, "
          f"median {np.median(ach_b):.2f}")
    one = np.array([r.kind == "decode" and r.batch == 1 for r in rows])
    print(f"  decode batch 1 (weights dominate): mbu {np.median(m[one] / meas[one]):.2f}")
    # marginal HBM rate of KV reads: slope of time vs total context at fixed batch
    slopes = []
    for b in sorted({r.batch for r in rows if r.kind == "decode"}):
        pts = sorted((r.batch * r.ctx_tokens, r.time_s) for r in rows if r.kind == "decode" and r.batch == b)
        if len(pts) >= 2:
            x, y = np.array(pts).T
            slopes.append((b, np.polyfit(x, y, 1)[0]))
    kvb = RooflinePerf.for_engine(args.model, args.hardware, num_dp_ranks=1).kv_bytes_per_token
    print("  decode KV streaming (slope of time vs total context per batch size): "
          + ", ".join(f"b={b}: {kvb / s / 1e12:.2f} TB/s" for b, s in slopes))

    for label, ovh in (("overhead fixed at 0 (GPU time only)", [0.0]),
                       (f"overhead fixed at {DEFAULT_STEP_OVERHEAD_S * 1e3:g} ms", [DEFAULT_STEP_OVERHEAD_S]),
                       ("overhead free, 0-3 ms", np.arange(0.0, 3.0001e-3, 0.1e-3))):
        b = fit(c, m, meas, is_pf, ovh)
        print(f"best fit, {label}: mfu {b['mfu']:.2f}, mbu {b['mbu']:.2f}, overhead {b['overhead_s'] * 1e3:.1f} ms "
              f"-> MAPE prefill {b['prefill_mape']:.1f}%, decode {b['decode_mape']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
