#!/usr/bin/env python3
"""Benchmark: the online cost-model fit (:class:`balancer.cost_model.OnlineFit`) on timings with
absurd ones mixed in: time per observation and how far the learned model predicts from the truth.

Timings come from a known linear prefill model (``y = x . TRUE``, times a lognormal noise factor
``--noise``); a share ``--outliers`` of them is replaced by a stalled engine's (10x, 30x, 1000x),
a timing of a tiny request (/20), NaN, +inf, negative or zero. Same-run baseline: the same class
with its screens off (no residual gate, no warm-up screen, no restarts), which is what the learner
did before (non-finite and negative timings dropped, the rest fitted). Prints microseconds per
observation and the mean |prediction / truth - 1| on 500 fresh placements, with ratios.

    .venv/bin/python bench/cost_learner.py [--n 20000] [--outliers 0.1] [--noise 0.05]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.cost_model import OnlineFit  # noqa: E402
from pdlb_cli.arg_types import nonnegative_float, positive_int, seed_int, share  # noqa: E402
from pdlb_cli.args import ArgumentParser  # noqa: E402

TRUE = np.array([0.01, 1e-4, 1e-9, 2e-5])  # overhead s, s/token, s/attention pair, s/group token


def stream(n: int, outliers: float, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.column_stack([rng.integers(1, 5, n), rng.uniform(0, 3e4, n), rng.uniform(0, 5e8, n),
                         rng.uniform(0, 2e5, n)]).astype(np.float64)
    Y = X @ TRUE * np.exp(rng.normal(0.0, noise, n))
    bad = np.flatnonzero(rng.random(n) < outliers)
    kind = rng.choice(["x10", "x30", "x1000", "fast", "nan", "inf", "neg", "zero"], len(bad))
    for i, k in zip(bad, kind):
        Y[i] = {"x10": Y[i] * 10, "x30": Y[i] * 30, "x1000": Y[i] * 1000, "fast": Y[i] / 20, "nan": math.nan,
                "inf": math.inf, "neg": -Y[i], "zero": 0.0}[k]
    return X, Y


def run(make, X: np.ndarray, Y: np.ndarray, test: np.ndarray, noise: float) -> tuple[float, float, dict]:
    best = math.inf
    for _ in range(3):
        fit = make()
        t0 = time.perf_counter()
        for x, y in zip(X, Y):
            fit.observe(x, float(y))
        best = min(best, time.perf_counter() - t0)
    fit.refit()
    mean_truth = math.exp(noise**2 / 2) * (test @ TRUE)  # least squares fits the mean timing
    err = float(np.abs(test @ fit.coef / mean_truth - 1.0).mean())
    return best / len(Y) * 1e6, err, dict(fit.rejected)


def build_parser() -> argparse.ArgumentParser:
    """The options; a bad value is one ``error: argument --X: ...`` line and exit status 2 (review R7:
    ``--n 0`` / ``-5`` and ``--noise -1`` ended in tracebacks, ``--outliers 2`` or ``nan`` ran)."""
    ap = ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--n", type=positive_int, default=20_000, help="observations (default 20,000)")
    ap.add_argument("--outliers", type=share, default=0.10, help="share of absurd timings, in [0, 1) (default 0.1)")
    ap.add_argument("--noise", type=nonnegative_float, default=0.05,
                    help="lognormal sigma of good timings, >= 0 (default 0.05)")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the timings (default 0)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    X, Y = stream(a.n, a.outliers, a.noise, a.seed)
    test = stream(500, 0.0, 0.0, a.seed + 1)[0]
    prior = 2 * TRUE
    base_us, base_err, _ = run(lambda: OnlineFit(prior, gate_ratio=1e300, warmup=0, reset_after=0), X, Y, test, a.noise)
    us, err, rejected = run(lambda: OnlineFit(prior), X, Y, test, a.noise)
    print(f"{a.n:,} observations, {a.outliers:.0%} absurd, noise sigma {a.noise}; prior 2x off")
    print(f"{'fit':<28}{'us/obs':>10}{'mean |pred err|':>18}")
    print(f"{'screens off (baseline)':<28}{base_us:>10.2f}{base_err:>18.2%}")
    print(f"{'robust (default)':<28}{us:>10.2f}{err:>18.2%}")
    print(f"ratio robust/baseline: time {us / base_us:.2f}x, error {err / base_err:.2g}x; rejected {rejected}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
