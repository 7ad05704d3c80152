"""Per-layer geometry of DeepSeek-V4.1 CSA2 attention and its causal encoder-decoder (CED) split,
for :class:`sim.models.spec.ModelSpec` (``attention="csa2"``).

CSA2 (TensorRT-LLM ``_torch/attention/backends/sparse/csa2/README.md`` and
``_torch/configs/deepseek_v41.py``, NVIDIA/TensorRT-LLM; DeepSeek's ``inference/model.py`` cited there):

* every layer attends its raw sliding window, the latest ``sliding_window`` tokens (one private
  SWA row per token per layer);
* a layer with ``compress_ratio r > 0`` also attends ``index_topk`` rows of a *shared* global KV
  cache: only the ``kv_source_layers`` own one (one row per ``r`` tokens of their own ratio; ratio
  1 is unpooled), the layers after a source read that source's rows;
* only the ``index_source_layers`` score keys (an FP4 MQA over the source's index keys) and pick
  the top-k; the layers between them reuse the selection. Index sources after the candidate
  source score only its published candidate pool (``candidate_topk_blocks * candidate_block_size``
  positions).

Counts are functions of the context ``L`` of one query, sums of terms ``count * min(cap, slope * L)``
(piecewise linear), so a prefill chunk's sum over its positions has a closed form (trapezoid rule,
as :meth:`ModelSpec.prefill_attended_keys` does for V4). Rows are counted fractionally (``L / r``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Terms", "attended_terms", "combine", "eval_terms", "indexer_terms", "kv_source_of", "sum_terms"]

#: ``((count, cap, slope), ...)``: the function ``L -> sum(count * min(cap, slope * L))``; cap may be inf
Terms = tuple[tuple[float, float, float], ...]


def kv_source_of(compress_ratios: Sequence[int], sources: Iterable[int]) -> tuple[int | None, ...]:
    """For each layer, the latest source layer at or before it (None before the first one, or for a
    layer with ratio 0, which has no long-range path)."""
    src = set(sources)
    out: list[int | None] = []
    last: int | None = None
    for i, r in enumerate(compress_ratios):
        if i in src:
            last = i
        out.append(last if r else None)
    return tuple(out)


def _merge(raw: list[tuple[float, float, float]]) -> Terms:
    acc: dict[tuple[float, float], float] = {}
    for count, cap, slope in raw:
        if count:
            acc[(cap, slope)] = acc.get((cap, slope), 0.0) + count
    return tuple((n, cap, slope) for (cap, slope), n in sorted(acc.items()))


def combine(*weighted: tuple[Terms, float]) -> Terms:
    """The terms of ``sum(weight * f_terms)`` (e.g. seconds: pairs x seconds per pair + keys x
    seconds per key), merged so that one evaluation covers them all."""
    return _merge([(n * w, cap, slope) for terms, w in weighted for n, cap, slope in terms])


def attended_terms(compress_ratios: Sequence[int], kv_sources: Sequence[int], *, sliding_window: int,
                   index_topk: int, layers: Iterable[int], window: bool = True, global_rows: bool = True) -> Terms:
    """(query, key row) pairs of one query over ``layers``: ``min(L, sliding_window)`` window rows per
    layer (``window``) plus, for a layer with ratio > 0, ``min(index_topk, L / r_src)`` rows of its KV
    source's global cache (``global_rows``; ``r_src`` is the source's own ratio)."""
    src = kv_source_of(compress_ratios, kv_sources)
    raw: list[tuple[float, float, float]] = []
    for i in layers:
        if window:
            raw.append((1.0, float(sliding_window), 1.0))
        if global_rows and compress_ratios[i] and src[i] is not None:
            raw.append((1.0, float(index_topk), 1.0 / compress_ratios[src[i]]))
    return _merge(raw)


def indexer_terms(compress_ratios: Sequence[int], kv_sources: Sequence[int], index_sources: Sequence[int], *,
                  candidate_source: int | None, candidate_tokens: int, layers: Iterable[int]) -> Terms:
    """Index keys one query scores over ``layers``: each index source scores all ``L / r_src`` keys of
    its KV source, or, after the candidate source, ``min(candidate_tokens, L / r_src)``."""
    src = kv_source_of(compress_ratios, kv_sources)
    idx = set(index_sources)
    raw: list[tuple[float, float, float]] = []
    for i in layers:
        if i in idx and src[i] is not None:
            slope = 1.0 / compress_ratios[src[i]]
            capped = candidate_source is not None and i > candidate_source and candidate_tokens > 0
            raw.append((1.0, float(candidate_tokens) if capped else math.inf, slope))
    return _merge(raw)


#: stands in for an infinite cap (a context no sequence reaches), keeping the integral finite
_NO_CAP = 1e18


@functools.lru_cache(maxsize=64)
def _arrays(terms: Terms) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(count, cap, slope, cap / slope)`` as arrays over the terms (infinite caps -> ``_NO_CAP``)."""
    n = np.array([t[0] for t in terms], dtype=np.float64)
    cap = np.array([min(t[1], _NO_CAP) for t in terms], dtype=np.float64)
    slope = np.array([t[2] for t in terms], dtype=np.float64)
    return n, cap, slope, cap / slope


def eval_terms(terms: Terms, ctx_tokens):  # noqa: ANN001, ANN201 (float or ndarray)
    """``sum(count * min(cap, slope * L))`` at ``L = ctx_tokens`` (float in, float out)."""
    L = np.asarray(ctx_tokens, dtype=np.float64)
    if not terms:
        out = 0.0 * L
    else:
        n, cap, slope, _ = _arrays(terms)
        out = np.minimum(cap, slope * L[..., None]) @ n
    return out if np.ndim(out) else float(out)


def _integral(terms: Terms, x):  # noqa: ANN001, ANN202
    """Antiderivative of :func:`eval_terms` from 0 (x >= 0), shape of ``x``."""
    n, cap, slope, x0 = _arrays(terms)
    x = x[..., None]
    return np.where(x <= x0, 0.5 * slope * x * x, cap * (x - 0.5 * x0)) @ n


def sum_terms(terms: Terms, start, end):  # noqa: ANN001, ANN201
    """``sum_{j = start+1}^{end} f(j)`` of the terms' function ``f`` by the trapezoid rule on its
    integral, ``F(end) - F(start) + (f(end) - f(start)) / 2`` (exact where ``f`` is linear between
    the two ends; ``end >= start >= 0``)."""
    a = np.asarray(start, dtype=np.float64)
    b = np.asarray(end, dtype=np.float64)
    if not terms:
        out = 0.0 * (a + b)
    else:
        out = (_integral(terms, b) - _integral(terms, a)
               + 0.5 * (np.asarray(eval_terms(terms, b)) - np.asarray(eval_terms(terms, a))))
    return out if np.ndim(out) else float(out)
