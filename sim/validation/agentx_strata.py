"""Per-request prompt-cache strata: where an agentic replay's uncached tokens fall, request by request.

Point 440246 publishes one hit rate for the hour; it does not say how the misses are spread over
the requests (a few cold prompts or many small tails), which is what decides the TTFT median. A
sibling AgentX point does: ai-dynamo/aisimulate's reproduction of point 440845 (DeepSeek-V4-Pro on
8 B300, SGLang, 32 lanes) replays the *same* corpus (``semianalysis_cc_traces_weka_062126``) with
the same client rules (aiperf's agentic replay, ``ignore_eos``, first-turn-prefix cache busting)
and publishes, per measured request, the bucket of its uncached prompt tokens and of its reuse
(``sim/data/measured/agentx_440845_request_strata.json``, with provenance). Its token-weighted
reuse is 0.9687, 440246's theoretical hit rate, so its strata are close to the corpus' own.

This module buckets any set of requests the same way (the edges of aisimulate's
``analyze_requests.py``: uncached ``0``, ``<=8K`` (<= 8,192), ``(8K,32K]``, ``(32K,128K]``,
``(128K,256K]``, ``>256K``; reuse ``0%``, ``(0,90%)``, ``[90,99%)``, ``[99,100%)``, ``100%``)
and compares a simulated run (:func:`result_strata`) or the workload generator's own requests
(:func:`generator_strata`, reuse of the previous prompt with an unbounded cache) with the
published buckets (:func:`compare_strata`). It is a check of the workload's structure, not a
validation row: the engine, lane count and hardware differ between the two points.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.run.closed_loop import ClosedLoopResult
    from sim.workload.agentic import AgenticWorkloadConfig

__all__ = ["UNCACHED_BUCKETS", "REUSE_BUCKETS", "STRATA_PATH", "uncached_bucket", "reuse_bucket", "request_strata",
           "load_strata_440845", "StrataRow", "compare_strata", "generator_strata", "result_strata", "print_strata",
           "plot_strata"]

STRATA_PATH = Path(__file__).parent.parent / "data" / "measured" / "agentx_440845_request_strata.json"

#: uncached-token buckets of aisimulate's ``analyze_requests.py`` (upper edges 8,192, 32,768,
#: 131,072, 262,144 tokens, inclusive; ``0`` = a fully cached prompt)
UNCACHED_BUCKETS: tuple[str, ...] = ("0", "<=8K", "(8K,32K]", "(32K,128K]", "(128K,256K]", ">256K")
#: reuse (cached / prompt) buckets of the same script
REUSE_BUCKETS: tuple[str, ...] = ("0%", "(0,90%)", "[90,99%)", "[99,100%)", "100%")
#: bound on the requests one call buckets (every input-driven allocation is bounded)
MAX_REQUESTS = 10_000_000


def uncached_bucket(uncached_tokens: float) -> str:
    """The uncached-token bucket of one request (``0`` only when nothing is uncached)."""
    v = uncached_tokens
    if v == 0:
        return "0"
    return ("<=8K" if v <= 8192 else "(8K,32K]" if v <= 32768 else "(32K,128K]" if v <= 131072
            else "(128K,256K]" if v <= 262144 else ">256K")


def reuse_bucket(reuse: float) -> str:
    """The reuse bucket of one request, ``reuse`` = cached / prompt tokens in [0, 1]."""
    return ("0%" if reuse == 0 else "(0,90%)" if reuse < 0.9 else "[90,99%)" if reuse < 0.99
            else "[99,100%)" if reuse < 1 else "100%")


def request_strata(input_tokens: np.ndarray | list[float], cached_tokens: np.ndarray | list[float]) -> dict:
    """Bucket requests by uncached tokens (``input - cached``) and by reuse (``cached / input``).

    Args:
        input_tokens: prompt tokens per request, shape (n,), each > 0.
        cached_tokens: the prompt's cached tokens per request, shape (n,), in [0, input].

    Returns:
        ``{"total": {...}, "uncached": {bucket: {...}}, "reuse": {bucket: {...}}}`` where every
        ``{...}`` has ``requests``, ``prompt_tokens`` and ``uncached_tokens`` (sums); empty buckets
        are left out, as in the published file.

    Raises:
        ValueError: different lengths, no request, more than 10,000,000, a prompt <= 0, a cached
        count outside [0, prompt], or a value that is not finite."""
    p = np.asarray(input_tokens, dtype=float).ravel()
    c = np.asarray(cached_tokens, dtype=float).ravel()
    if len(p) != len(c):
        raise ValueError(f"request_strata: {len(p)} prompts but {len(c)} cached counts")
    if not 0 < len(p) <= MAX_REQUESTS:
        raise ValueError(f"request_strata: 1..{MAX_REQUESTS:,} requests, got {len(p):,}")
    if not (np.isfinite(p).all() and np.isfinite(c).all()):
        raise ValueError("request_strata: prompt and cached tokens must be finite")
    if (p <= 0).any() or (c < 0).any() or (c > p).any():
        raise ValueError("request_strata: every prompt > 0 and every cached count in [0, prompt]")
    u = p - c

    def sums(mask: np.ndarray) -> dict:
        return {"requests": int(mask.sum()), "prompt_tokens": float(p[mask].sum()),
                "uncached_tokens": float(u[mask].sum())}

    ub = np.array([uncached_bucket(x) for x in u])
    rb = np.array([reuse_bucket(x) for x in c / p])
    return {"total": sums(np.ones(len(p), dtype=bool)),
            "uncached": {b: sums(ub == b) for b in UNCACHED_BUCKETS if (ub == b).any()},
            "reuse": {b: sums(rb == b) for b in REUSE_BUCKETS if (rb == b).any()}}


def load_strata_440845(case: str = "off", path: Path = STRATA_PATH) -> dict:
    """The published strata of AgentX 440845's reproduction (``case`` ``"off"``: FPM off, job
    4209414; ``"on"``: FPM on), in :func:`request_strata`'s shape plus TTFT p50/p90 in ms.

    Raises:
        KeyError: an unknown case."""
    with open(path, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    if case not in cases:
        raise KeyError(f"no case {case!r} (have {sorted(cases)})")
    return cases[case]


@dataclass(frozen=True)
class StrataRow:
    """One bucket, published vs simulated: the share of requests in it, their mean uncached tokens
    and the share of all uncached tokens they carry (shares in [0, 1]). A side without a request in
    the bucket has shares 0 and means NaN (printed ``-``)."""

    dimension: str
    bucket: str
    published_share: float
    simulated_share: float
    published_mean_uncached: float
    simulated_mean_uncached: float
    published_uncached_share: float
    simulated_uncached_share: float
    published_mean_prompt: float
    simulated_mean_prompt: float


def compare_strata(simulated: dict, published: dict | None = None) -> list[StrataRow]:
    """Rows of :class:`StrataRow`, uncached buckets then reuse buckets, for every bucket either
    side has (a missing bucket counts as 0 requests). ``published`` defaults to 440845's FPM-off
    case."""
    published = published or load_strata_440845()
    out = []
    for dim, buckets in (("uncached", UNCACHED_BUCKETS), ("reuse", REUSE_BUCKETS)):
        for b in buckets:
            s, p = simulated[dim].get(b), published[dim].get(b)
            if s is None and p is None:
                continue

            def parts(d: dict | None, total: dict) -> tuple[float, float, float, float]:
                if d is None or d["requests"] == 0:  # shares 0; the mean of no request is undefined, not 0 tokens
                    return 0.0, math.nan, 0.0, math.nan
                return (d["requests"] / total["requests"], d["uncached_tokens"] / d["requests"],
                        d["uncached_tokens"] / total["uncached_tokens"] if total["uncached_tokens"] else 0.0,
                        d["prompt_tokens"] / d["requests"])
            ps, pm, pu, pp = parts(p, published["total"])
            ss, sm, su, sp = parts(s, simulated["total"])
            out.append(StrataRow(dim, b, ps, ss, pm, sm, pu, su, pp, sp))
    return out


def generator_strata(config: "AgenticWorkloadConfig", requests_per_lane: int = 200) -> dict:
    """:func:`request_strata` of the generator's requests (``requests_per_lane`` from every lane,
    warm-up excluded) with the cache a server could give: the previous *prompt* of the same
    trajectory (``Turn.server_reusable_tokens``), unbounded, no block rounding; a trajectory's first
    replayed turn is cold (cache-busted).

    Raises:
        ValueError: ``requests_per_lane`` outside 1..100,000."""
    from sim.workload.agentic import measured_turns
    if not 1 <= requests_per_lane <= 100_000:
        raise ValueError(f"requests_per_lane must be in 1..100000, got {requests_per_lane}")
    inp, cached = [], []
    for t in measured_turns(config, requests_per_lane):
        inp.append(t.input_tokens)
        cached.append(min(t.server_reusable_tokens, t.input_tokens))
    return request_strata(inp, cached)


def result_strata(result: "ClosedLoopResult") -> dict:
    """:func:`request_strata` of a closed-loop run's measured requests (their prompt and the
    cached tokens the simulated server gave them)."""
    r = result.requests
    return request_strata(r[:, 3], r[:, 5])


def print_strata(rows: list[StrataRow], console, title: str) -> None:  # noqa: ANN001
    """A table of :func:`compare_strata`'s rows (shares in %, tokens rounded), laid out as
    docs/validate.md shows it: each figure ``published / simulated`` in one column, so that the
    table fits 120 columns (a file or pipe gets 160: the nine separate columns it had wrapped the
    bucket labels there); the labels never wrap; ``-`` for the mean of an empty bucket."""
    from rich.table import Table

    def tokens(v: float) -> str:  # '-': the mean of a bucket with no request on that side
        return "-" if math.isnan(v) else f"{v:,.0f}"
    cells = [(f"{r.dimension} {r.bucket}" + (" (cold)" if (r.dimension, r.bucket) == ("reuse", "0%") else ""),
              f"{100 * r.published_share:.1f}% / {100 * r.simulated_share:.1f}%",
              f"{tokens(r.published_mean_prompt)} / {tokens(r.simulated_mean_prompt)}",
              f"{tokens(r.published_mean_uncached)} / {tokens(r.simulated_mean_uncached)}",
              f"{100 * r.published_uncached_share:.1f}% / {100 * r.simulated_uncached_share:.1f}%") for r in rows]
    t = Table(title=title)
    heads = ("bucket", "requests, 440845 / sim", "mean prompt, 440845 / sim", "mean uncached, 440845 / sim",
             "share of uncached tokens, 440845 / sim")
    for k, head in enumerate(heads):  # a header may wrap, a cell not (min_width: its longest cell)
        t.add_column(head, justify="left" if k == 0 else "right",
                     min_width=max((len(c[k]) for c in cells), default=len(head)))
    for c in cells:
        t.add_row(*c)
    console.print(t)


def plot_strata(runs: dict[str, dict], path: str | Path, published: dict | None = None) -> Path:
    """Write a PNG: per bucket, the share of requests (left) and the share of uncached tokens
    (right) of AgentX 440845's published strata and of each run in ``runs`` (label ->
    :func:`request_strata` result). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    published = published or load_strata_440845()
    path = Path(path)
    series = {"440845 (published)": published, **runs}
    buckets = [("uncached", b) for b in UNCACHED_BUCKETS[1:]] + [("reuse", b) for b in REUSE_BUCKETS[:-1]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    width = 0.8 / len(series)
    for k, (label, s) in enumerate(series.items()):
        rows = {(r.dimension, r.bucket): r for r in compare_strata(s, published)}
        req = [100 * rows[b].simulated_share if b in rows else 0.0 for b in buckets]
        unc = [100 * rows[b].simulated_uncached_share if b in rows else 0.0 for b in buckets]
        x = [i + (k - (len(series) - 1) / 2) * width for i in range(len(buckets))]
        axes[0].bar(x, req, width, label=label)
        axes[1].bar(x, unc, width, label=label)
    for ax, what in zip(axes, ("% of requests", "% of uncached prompt tokens")):
        ax.set_xticks(range(len(buckets)), [f"{d}: {b}" for d, b in buckets], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(what)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle("Where the uncached prompt tokens fall, request by request (AgentX 440845's strata vs simulated 440246)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
