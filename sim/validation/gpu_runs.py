"""Replay measured GPU runs of a real engine in the simulator (issue 23 part 2).

``bench/gpu_engine_run.py`` served random-weight models of real architectures with transformers'
continuous-batching server (2 engines on one H200, behind ``pdlb serve`` with ``round_robin``),
drove them with the openai client at several request rates and logged every engine step. The
compact records it leads to are shipped in ``sim/data/gpu_runs/<model>.json.gz`` (made by
:func:`compact`). This module

1. fits a step-time model of the engine (:class:`EngineStepPerf`) on measured engine steps: for
   each compared rate, the steps of the probe burst and of the other rates
   (:func:`held_out_profile`), with their measured spread around the fit drawn per step;
2. simulates every rate phase with the measured arrivals and token counts on a mixed pool that
   schedules as the engine does (decode first, then FIFO chunked prefill within the engine's
   ``max_batch_tokens``; KV capacity = the engine's blocks), with ``round_robin`` as pdlb served;
3. compares TTFT and TPOT p50/p90 with what the client measured (:func:`compare`), the rows of
   ``pdlb sim validate`` whose keys start with ``gpu-``.

Measured TTFT is the client's: send to the first chunk with content (not the role-only chunk);
TPOT = (last content chunk - first) / (content chunks - 1). Simulated: arrival to the end of the
step that finishes the prompt, and (finish - first token) / (output tokens - 1).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from sim.validation.tolerance import TOLERANCE

RUNS_DIR = Path(__file__).resolve().parent.parent / "data" / "gpu_runs"
#: step-model features, in the order of :attr:`EngineStepPerf.coef`
FEATURES = ("const_s", "prefill_step_s", "per_prefill_token_s", "per_attn_pair_s", "per_decode_seq_s",
            "per_decode_ctx_token_s", "per_query_x_kv_s")
#: the default phases of :func:`fit_step_model` (the probe: a burst sent at once, not a compared rate)
PROFILE_PHASES = ("probe",)
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
#: simulations per phase (seeds of the drawn step-time spread); percentiles are averaged over them
SEEDS = 5


# ----------------------------------------------------------------------------- records
def step_work(q: list[int], kv: list[int]) -> tuple[int, float, int, int]:
    """One logged step's work: ``(prefill_tokens, attn_pairs, decode_seqs, decode_ctx_tokens)``.

    A scheduled request with ``q = 1`` query token is a decode (its ``kv`` cached tokens plus the
    new one are attended to); one with ``q > 1`` is a prefill chunk of ``q`` tokens after ``kv``
    cached ones, ``q * kv + q (q + 1) / 2`` pairs (:func:`sim.perf.base.causal_attn_pairs`).
    Hand check: q = [3, 1, 1], kv = [2, 10, 20] -> (3, 12.0, 2, 32)."""
    pt, pairs, ds, dc = 0, 0.0, 0, 0
    for qi, ki in zip(q, kv):
        if qi == 1:
            ds += 1
            dc += ki + 1
        else:
            pt += qi
            pairs += qi * ki + qi * (qi + 1) / 2.0
    return pt, pairs, ds, dc


def match_prefill_ends(raw: dict) -> dict[tuple[str, int], float]:
    """When each request's prompt finished, from the engines' step logs: ``{(phase, i): t1}``.

    Requests are taken in the order they were sent; each gets the earliest not yet taken step
    (either engine) that started after it was sent and holds a prefill chunk ending its prompt
    (``q > 1`` and ``kv + q`` = the prompt tokens the engine reported in ``usage``). The step's
    ``t1`` is when the engine handed the first generated token to its server. On the Llama run the
    client's first content chunk came 2-8 ms (p50 per rate) after that ``t1``."""
    ends = []
    for eng in raw["engines"]:
        for t0, t1, q, kv, *_ in eng["steps"]:
            ends.extend((t0, t1, qi + ki) for qi, ki in zip(q, kv) if qi > 1)
    ends.sort()
    taken: set[int] = set()
    out: dict[tuple[str, int], float] = {}
    for p in raw["phases"]:
        for q in sorted((q for q in p["requests"] if "usage" in q and "sent" in q), key=lambda q: q["sent"]):
            for j, (t0, t1, tot) in enumerate(ends):
                if j not in taken and t0 >= q["sent"] - 1e-3 and tot == q["usage"][0]:
                    taken.add(j)
                    out[(p["name"], q["i"])] = t1
                    break
    return out


def compact(raw: dict) -> dict:
    """The committed form of one raw ``gpu_run_<model>.json.gz`` (``bench/gpu_engine_run.py``):
    the engine configs, per step ``[t0, wall_s, prefill_tokens, attn_pairs, decode_seqs,
    decode_ctx_tokens, decode_fast_path]`` and per request ``[sent, first, last, content_chunks, prompt_tokens,
    completion_tokens, prefill_end]`` (times in seconds from the run's first step, ``None`` where a
    request failed; ``prefill_end`` from :func:`match_prefill_ends`), plus pdlb's TTFT histogram
    deltas per phase."""
    t_ref = min(e["steps"][0][0] for e in raw["engines"] if e["steps"])
    prefill_end = match_prefill_ends(raw)
    r = lambda x: round(x - t_ref, 6)  # noqa: E731
    engines = []
    for e in raw["engines"]:
        steps = []
        for t0, t1, q, kv, *fast in e["steps"]:
            pt, pairs, ds, dc = step_work(q, kv)
            steps.append([r(t0), round(t1 - t0, 6), pt, pairs, ds, dc, int(bool(fast and fast[0]))])
        engines.append({"config": e["config"][-1] if e["config"] else {}, "steps": steps})
    phases = []
    for p in raw["phases"]:
        reqs = []
        for q in p["requests"]:
            ok = "first" in q and "error" not in q and "usage" in q
            end = prefill_end.get((p["name"], q["i"]))
            reqs.append([r(q["sent"]) if "sent" in q else None,
                         r(q["first"]) if ok else None, r(q["last"]) if ok else None,
                         q.get("chunks", 0), (q.get("usage") or [q.get("prompt_tokens", 0), 0])[0],
                         (q.get("usage") or [0, 0])[1], None if end is None else r(end)])
        hb, ha = p.get("pdlb_ttft_before", {}), p.get("pdlb_ttft_after", {})
        pdlb = None
        if "count" in hb and "count" in ha and ha["count"] > hb["count"]:
            pdlb = {"count": ha["count"] - hb["count"], "sum_s": ha["sum"] - hb["sum"]}
        phases.append({"name": p["name"], "rate_rps": p["rate_rps"], "requests": reqs, "pdlb_ttft": pdlb})
    m = raw["model"]
    return {"model": {"name": m["name"], "params": m["params"], "config": m["config"]},
            "environment": {k: v for k, v in raw.get("environment", {}).items()},
            "capacity_rps": raw.get("capacity_rps"), "pdlb_cmd": raw.get("pdlb_cmd"),
            "engine_cmd": raw["engines"][0].get("cmd"), "engines": engines, "phases": phases}


def load_run(model: str, runs_dir: Path | None = None) -> dict:
    """The shipped compact record of ``model`` (``sim/data/gpu_runs/<model>.json.gz``).

    Raises:
        ValueError: no such record (the message lists the shipped ones)."""
    runs_dir = RUNS_DIR if runs_dir is None else runs_dir
    path = runs_dir / f"{model}.json.gz"
    if not path.is_file():
        have = sorted(p.name.removesuffix(".json.gz") for p in runs_dir.glob("*.json.gz"))
        raise ValueError(f"no GPU run record {path.name}; shipped: {', '.join(have) or 'none'}")
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def shipped_models(runs_dir: Path | None = None) -> list[str]:
    runs_dir = RUNS_DIR if runs_dir is None else runs_dir
    return sorted(p.name.removesuffix(".json.gz") for p in runs_dir.glob("*.json.gz"))


# ----------------------------------------------------------------------------- step model
def features(prefill_tokens: ArrayLike, attn_pairs: ArrayLike, decode_seqs: ArrayLike,
             decode_ctx_tokens: ArrayLike) -> np.ndarray:
    """Design matrix ``[..., 7]``: 1, prefill present (0/1), prefill tokens ``T``, attention pairs,
    decode sequences ``B``, decode context tokens ``C``, and ``(T + B) (C + T)``: the query rows
    times the KV rows of the whole batch, which is what attention with a dense mask over the packed
    batch computes (transformers' ``paged|sdpa`` varlen path builds one ``[queries, keys]`` mask
    per step)."""
    pt = np.asarray(prefill_tokens, dtype=np.float64)
    pa = np.asarray(attn_pairs, dtype=np.float64)
    ds = np.asarray(decode_seqs, dtype=np.float64)
    dc = np.asarray(decode_ctx_tokens, dtype=np.float64)
    pt, pa, ds, dc = np.broadcast_arrays(pt, pa, ds, dc)
    return np.stack([np.ones_like(pt), (pt > 0).astype(np.float64), pt, pa, ds, dc, (pt + ds) * (dc + pt)], axis=-1)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (Lawson-Hanson active set; small problems).

    Hand check: a = [[1, 0], [0, 1]], b = [2, -1] -> [2, 0]."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # columns of very different magnitude (1 vs attention pairs ~1e6)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(10 * n):
        w = a.T @ (b - a @ x)
        cand = ~passive & (w > 1e-12 * max(1.0, float(np.abs(w).max(initial=0.0))))
        if not cand.any():
            break
        passive[np.argmax(np.where(cand, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            den = x[neg] - z[neg]
            alpha = float(np.min(np.where(den > 0, x[neg] / np.where(den > 0, den, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale


@dataclass(frozen=True)
class EngineStepPerf:
    """A measured engine's step time (a :class:`sim.perf.base.PerfModel`), linear in the step's work:

    ``t = c0 + c1 [prefill in the step] + c2 T + c3 P + c4 B + c5 C + c6 (T + B)(C + T)`` seconds
    for ``T`` prefill tokens, ``P`` attention pairs, ``B`` decode sequences and ``C`` decode
    context tokens on the rank (coefficients >= 0, :func:`fit_step_model`). Each rank is its own step group."""

    coef: tuple[float, ...]
    kv_capacity_tokens_per_rank: int
    kv_bytes_per_token: int = 131072
    ep_synchronous: bool = False
    wants_prefill_cached_tokens: ClassVar[bool] = False
    verify_tokens_per_seq: ClassVar[int] = 1
    decode_tokens_per_step: ClassVar[float] = 1.0
    #: fit quality on the profile steps: {"steps", "mape", "r2"}
    fit: dict = field(default_factory=dict, compare=False)
    #: measured / fitted time of every profile step; when given, each simulated step's time is the
    #: fitted one times a ratio drawn from these (a bootstrap of the measured spread), seeded
    residuals: tuple[float, ...] = field(default=(), compare=False)
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def mean_step_time_s(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
                         decode_ctx_tokens: ArrayLike) -> np.ndarray:
        """The fitted step time (no drawn spread), shape ``(...)``."""
        t = features(prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens) @ np.asarray(self.coef)
        return np.max(t, axis=-1)

    def step_time_s(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
                    decode_ctx_tokens: ArrayLike) -> np.ndarray:
        t = self.mean_step_time_s(prefill_tokens, prefill_attn_pairs, decode_seqs, decode_ctx_tokens)
        if self.residuals:
            t = t * self._rng.choice(np.asarray(self.residuals), size=np.shape(t))
        return t


def profile_steps(run: dict, phases: tuple[str, ...] = PROFILE_PHASES) -> tuple[np.ndarray, np.ndarray]:
    """Work rows ``[n, 4]`` and wall times ``[n]`` of the steps of every engine that fall inside
    the time window of the named phases (from the first send to the last content chunk)."""
    windows = []
    for p in run["phases"]:
        if p["name"] in phases:
            sent = [q[0] for q in p["requests"] if q[0] is not None]
            last = [q[2] for q in p["requests"] if q[2] is not None]
            if sent and last:
                windows.append((min(sent), max(last)))
    if not windows:
        raise ValueError(f"none of the phases {phases} is in the record")
    rows, times = [], []
    for e in run["engines"]:
        for t0, wall, pt, pairs, ds, dc, *_ in e["steps"]:
            if any(lo <= t0 <= hi for lo, hi in windows):
                rows.append((pt, pairs, ds, dc))
                times.append(wall)
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4), np.asarray(times, dtype=np.float64)


def fit_step_model(run: dict, phases: tuple[str, ...] = PROFILE_PHASES, *, spread: bool = False,
                   seed: int = 0) -> EngineStepPerf:
    """Fit :class:`EngineStepPerf` to the steps logged during ``phases`` (non-negative least
    squares on the step times in seconds, so that the fitted mean step is the measured mean)."""
    w, t = profile_steps(run, phases)
    if len(t) < len(FEATURES):
        raise ValueError(f"{len(t)} profile steps, need at least {len(FEATURES)}")
    x = features(w[:, 0], w[:, 1], w[:, 2], w[:, 3])
    coef = nnls(x, t)
    pred = x @ coef
    r2 = 1.0 - float(np.sum((pred - t) ** 2) / np.sum((t - t.mean()) ** 2))
    cfg = run["engines"][0]["config"]
    cap = int(cfg["num_blocks"]) * int(cfg["block_size"])
    return EngineStepPerf(tuple(float(c) for c in coef), kv_capacity_tokens_per_rank=cap,
                          fit={"steps": int(len(t)), "mape": float(np.mean(np.abs(pred / t - 1))), "r2": r2},
                          residuals=tuple(float(x) for x in t / pred) if spread else (), seed=seed)


# ----------------------------------------------------------------------------- replay
def _q(v: np.ndarray, p: float) -> float:
    v = v[np.isfinite(v)]
    return float(np.percentile(v, 100 * p)) if len(v) else math.nan


def first_token_s(q: list) -> float | None:
    """When a request's first generated token reached the client (run clock, seconds).

    The first content chunk, when the stream has one content chunk per completion token. The
    transformers server sends one content chunk more than the completion tokens for the Qwen3-MoE
    model (seen on every request of that run: it arrives 10-30 ms after the request, before the
    prompt's prefill step has ended, so it is no generated token); then the end of the engine step
    that finished the prompt (``prefill_end``) stands for it, without the 2-8 ms the Llama run's
    chunks took from there to the client."""
    if q[1] is None:
        return None
    if q[3] == q[5]:
        return q[1]
    return q[6] if len(q) > 6 and q[6] is not None and q[3] == q[5] + 1 else None


def measured_samples(phase: dict) -> dict[str, np.ndarray]:
    """Per-request TTFT and TPOT (seconds) of the phase, as :func:`measured_metrics` reads them."""
    ttft, tpot = [], []
    for q in phase["requests"]:
        f = first_token_s(q)
        if f is None:
            continue
        ttft.append(f - q[0])
        if q[5] > 1:
            tpot.append((q[2] - f) / (q[5] - 1))
    return {"ttft": np.array(ttft), "tpot": np.array(tpot)}


def measured_ci(phase: dict, metric: str, *, level: float = 0.9, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of a measured percentile (``metric`` as in :data:`METRICS`): the
    requests are resampled with replacement ``draws`` times; returns the central ``level`` range."""
    kind, pct = metric.split("_p")
    v = measured_samples(phase)[kind]
    rng = np.random.default_rng(seed)
    boots = np.percentile(rng.choice(v, size=(draws, len(v))), float(pct), axis=1)
    return float(np.percentile(boots, 50 * (1 - level))), float(np.percentile(boots, 50 * (1 + level)))


def measured_metrics(phase: dict) -> dict[str, float]:
    """TTFT / TPOT p50 and p90 (seconds) of the phase's requests as the client measured them
    (first token as :func:`first_token_s`; TPOT = (last chunk - first token) / (completion tokens - 1))."""
    v = measured_samples(phase)
    ttft_a, tpot_a = v["ttft"], v["tpot"]
    return {"ttft_p50": _q(ttft_a, .5), "ttft_p90": _q(ttft_a, .9), "tpot_p50": _q(tpot_a, .5),
            "tpot_p90": _q(tpot_a, .9)}


def scenario_for(run: dict):
    """A mixed pool shaped as the served engines: one rank per engine, the engine's token budget
    per step, request limit and KV blocks, its block size."""
    from sim.scenario import PoolConfig, Scenario

    cfg = run["engines"][0]["config"]
    name = run["model"]["name"]
    model = "qwen3-30b-a3b" if name.startswith("qwen3-30b-a3b") else "llama-3.1-8b"
    pool = PoolConfig(num_engines=len(run["engines"]), dp_ranks=1, max_prefill_tokens=int(cfg["max_batch_tokens"]),
                      max_decode_batch=int(cfg["max_requests_per_batch"]),
                      kv_capacity_tokens=int(cfg["num_blocks"]) * int(cfg["block_size"]))
    return Scenario(name=f"gpu-run-{name}", model=model, hardware="h200", block_size=int(cfg["block_size"]),
                    mixed=pool, index_capacity_blocks=None)


def simulate_phase(run: dict, phase: dict, perf: EngineStepPerf, policy: str = "round_robin") -> dict[str, float]:
    """Simulate one phase's requests (measured send times, prompt and completion tokens) and
    return the simulated TTFT / TPOT p50 and p90 in seconds."""
    from balancer.types import Request
    from sim.run.cluster import simulate
    from sim.run.metrics import per_request

    ok = sorted((q for q in phase["requests"] if q[1] is not None and q[5] >= 1), key=lambda q: q[0])
    t0 = ok[0][0]
    reqs = [Request(request_id=f"r{i}", arrival_time_s=q[0] - t0, prompt_tokens=int(q[4]),
                    max_output_tokens=int(q[5]), expected_output_tokens=int(q[5])) for i, q in enumerate(ok)]
    res = simulate(scenario_for(run), reqs, policy, perf_factory=lambda sc, pool: perf)
    pr = per_request(res)
    return {"ttft_p50": _q(pr["ttft_s"], .5), "ttft_p90": _q(pr["ttft_s"], .9),
            "tpot_p50": _q(pr["tpot_s"], .5), "tpot_p90": _q(pr["tpot_s"], .9)}


@dataclass(frozen=True)
class PhaseComparison:
    model: str
    phase: str
    rate_rps: float
    requests: int
    measured: dict[str, float]
    simulated: dict[str, float]
    #: pdlb's mean TTFT (its metric) and the client's mean over the same phase, seconds (None: not read)
    pdlb_ttft_mean_s: float | None
    client_ttft_mean_s: float

    def error(self, metric: str) -> float:
        return self.simulated[metric] / self.measured[metric] - 1.0


def rate_phases(run: dict) -> list[dict]:
    return [p for p in run["phases"] if p["name"].startswith("rate")]


def held_out_profile(run: dict, phase: str) -> tuple[str, ...]:
    """The phases whose steps make the profile for simulating ``phase``: the probe burst and every
    other rate phase (leave-one-phase-out: the compared phase's own steps are never fitted; the
    warm-up is left out, its first steps build the engine's cache)."""
    return ("probe",) + tuple(p["name"] for p in rate_phases(run) if p["name"] != phase)


@lru_cache(maxsize=8)
def compare(model: str, seeds: int = SEEDS) -> tuple[PhaseComparison, ...]:
    """Every rate phase of the shipped ``model`` run: measured vs simulated (cached).

    Each phase is simulated ``seeds`` times with the step model fitted on
    :func:`held_out_profile` and its measured spread (seeds 0 .. seeds - 1); the simulated
    percentiles are the means over the seeds."""
    run = load_run(model)
    out = []
    for p in rate_phases(run):
        ok = [q for q in p["requests"] if q[1] is not None]
        sims = [simulate_phase(run, p, fit_step_model(run, held_out_profile(run, p["name"]), spread=True, seed=s))
                for s in range(seeds)]
        sim_mean = {k: float(np.mean([x[k] for x in sims])) for k in METRICS}
        pd = p.get("pdlb_ttft")
        out.append(PhaseComparison(model, p["name"], float(p["rate_rps"]), len(ok), measured_metrics(p), sim_mean,
                                   None if not pd else pd["sum_s"] / pd["count"],
                                   float(np.mean([q[1] - q[0] for q in ok]))))
    return tuple(out)


@dataclass(frozen=True)
class Row:
    """One ``pdlb sim validate --gpu-runs`` row: a metric of one rate phase, measured vs simulated."""

    model: str
    phase: str
    rate_rps: float
    requests: int
    metric: str
    measured_s: float
    simulated_s: float
    #: 90% bootstrap interval of the measured percentile (its sampling error over the phase's requests)
    measured_ci_s: tuple[float, float] = (math.nan, math.nan)

    @property
    def error(self) -> float:
        return self.simulated_s / self.measured_s - 1.0

    @property
    def verdict(self) -> str:
        return "pass" if abs(self.error) <= TOLERANCE else "fail"


def rows(models: list[str] | None = None) -> list[Row]:
    """Every metric of every rate phase of the shipped runs (or ``models``)."""
    out = []
    for m in models or shipped_models():
        phases = {p["name"]: p for p in load_run(m)["phases"]}
        for c in compare(m):
            out.extend(Row(m, c.phase, c.rate_rps, c.requests, k, c.measured[k], c.simulated[k],
                           measured_ci(phases[c.phase], k)) for k in METRICS)
    return out


def print_rows(console, models: list[str] | None = None) -> list[Row]:
    """Print the ``--gpu-runs`` table, the fitted step models and the summary line; returns the rows."""
    from rich.table import Table

    rs = rows(models)
    t = Table(title=f"simulator vs a real engine on one H200 (transformers {_env_value('transformers')} continuous "
                    f"batching, 2 engines behind pdlb serve; pass = within +-{TOLERANCE:.0%})")
    for col, just in (("model", "left"), ("rate", "right"), ("req", "right"), ("metric", "left"),
                      ("measured ms", "right"), ("90% CI", "right"), ("simulated ms", "right"), ("error", "right"),
                      ("±15%", "center")):
        t.add_column(col, justify=just)
    for r in rs:
        mark = "[green]pass[/]" if r.verdict == "pass" else "[red]FAIL[/]"
        t.add_row(r.model, f"{r.rate_rps:.2f}/s", str(r.requests), r.metric.replace("_", " "),
                  f"{r.measured_s * 1e3:,.1f}", f"{r.measured_ci_s[0] * 1e3:,.0f}-{r.measured_ci_s[1] * 1e3:,.0f}",
                  f"{r.simulated_s * 1e3:,.1f}", f"{100 * r.error:+.1f}%", mark)
    console.print(t)
    for m in models or shipped_models():
        run = load_run(m)
        for p in rate_phases(run):
            perf = fit_step_model(run, held_out_profile(run, p["name"]))
            coef = ", ".join(f"{n} {c:.3g}" for n, c in zip(FEATURES, perf.coef) if c > 0)
            console.print(f"{m} {p['name']}: step model fitted on {perf.fit['steps']} steps of "
                          f"{'+'.join(held_out_profile(run, p['name']))} (MAPE {perf.fit['mape']:.1%}): {coef}",
                          markup=False)
    n = sum(r.verdict == "pass" for r in rs)
    console.print(f"{n} of {len(rs)} GPU-run figures within +-{TOLERANCE:.0%} (each rate simulated with a step model "
                  f"fitted on the other phases' steps, their measured spread drawn, mean of {SEEDS} seeds)",
                  markup=False)
    return rs


def plot(path: str | Path, models: list[str] | None = None) -> Path:
    """Measured vs simulated (ms) for every row, one panel per metric, with the +-15% band; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = rows(models)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    markers = {m: mk for m, mk in zip(sorted({r.model for r in rs}), "os^v")}
    for ax, metric in zip(axes, METRICS):
        sel = [r for r in rs if r.metric == metric]
        hi = 1.25 * max(max(r.measured_ci_s[1], r.simulated_s) for r in sel) * 1e3
        xs = np.array([0.0, hi])
        ax.fill_between(xs, xs * (1 - TOLERANCE), xs * (1 + TOLERANCE), color="0.9", label="±15%")
        ax.plot(xs, xs, color="0.5", lw=0.8)
        for m, mk in markers.items():
            pts = [r for r in sel if r.model == m]
            x = np.array([r.measured_s for r in pts]) * 1e3
            lo = x - np.array([r.measured_ci_s[0] for r in pts]) * 1e3
            up = np.array([r.measured_ci_s[1] for r in pts]) * 1e3 - x
            ax.errorbar(x, [r.simulated_s * 1e3 for r in pts], xerr=[lo, up], fmt=mk, capsize=2, label=m)
            for r in pts:
                ax.annotate(f"{r.rate_rps:.1f}/s", (r.measured_s * 1e3, r.simulated_s * 1e3), fontsize=7,
                            xytext=(3, -9), textcoords="offset points")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_title(metric.replace("_", " "))
        ax.set_xlabel("measured ms (90% bootstrap interval)")
        ax.set_ylabel("simulated ms")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("pdlb's simulator vs transformers continuous batching on one H200 (2 engines behind pdlb serve)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _env_value(key: str) -> str:
    for m in shipped_models():
        v = load_run(m).get("environment", {}).get(key)
        if v:
            return str(v)
    return "?"


def main(argv: list[str] | None = None) -> int:
    """``python -m sim.validation.gpu_runs compact RAW.json.gz OUT.json.gz`` | ``python -m sim.validation.gpu_runs report``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sim.validation.gpu_runs", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compact", help="raw bench/gpu_engine_run.py output -> committed record")
    c.add_argument("raw")
    c.add_argument("out")
    rp = sub.add_parser("report", help="measured vs simulated for the shipped runs (as pdlb sim validate --gpu-runs)")
    rp.add_argument("--plot", metavar="PNG", help="also draw measured vs simulated into this file")
    a = ap.parse_args(argv)
    if a.cmd == "compact":
        with gzip.open(a.raw, "rt") as fh:
            raw = json.load(fh)
        with gzip.open(a.out, "wt", compresslevel=9) as fh:
            json.dump(compact(raw), fh, separators=(",", ":"))
        return 0
    from rich.console import Console

    print_rows(Console(width=160))
    if a.plot:
        print(f"wrote {plot(a.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
