"""Pure transforms of request lists: they return new lists and never mutate their input.

:class:`~balancer.types.Request` is frozen, so transforms that change a field build new
requests with :func:`dataclasses.replace`; unchanged requests are shared, not copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from balancer.types import Request

from ._checks import check_positive_float

__all__ = ["scale_rate", "spread_batches", "take_slice"]


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Speed a trace up by ``factor``: every ``arrival_time_s`` is divided by ``factor``.

    ``factor = 2`` doubles the request rate (halves every time and every gap); ``0.5`` halves
    it. Lengths and hashes are unchanged.

    Args:
        requests: requests, any order (kept).
        factor: rate multiplier (finite, > 0).

    Returns:
        New list of the same length and order.

    Raises:
        ValueError: ``factor`` <= 0 or not finite.
    """
    factor = check_positive_float(factor, "factor")
    return [replace(r, arrival_time_s=r.arrival_time_s / factor) for r in requests]


def take_slice(
    requests: Sequence[Request],
    start: int = 0,
    count: int | None = None,
    *,
    start_s: float | None = None,
    duration_s: float | None = None,
) -> list[Request]:
    """Select part of a trace by time window, then by position.

    First, if ``start_s`` or ``duration_s`` is given, keep the requests with
    ``start_s <= arrival_time_s < start_s + duration_s`` (``start_s`` defaults to the earliest
    arrival, ``duration_s`` to +inf). Then keep ``count`` requests (all if ``None``) from
    position ``start`` of what is left. Arrival times are *not* re-based: a slice from the middle
    of a trace still starts at its original time (a simulator just starts idle until then).

    Args:
        requests: requests, any order (kept).
        start: index of the first request kept, after time filtering (>= 0).
        count: number of requests kept (>= 0), or ``None`` for all the rest.
        start_s: window start in seconds on the trace's clock.
        duration_s: window length in seconds (> 0).

    Returns:
        New list, a sub-sequence of ``requests`` (the same objects, in the same order).

    Raises:
        ValueError: ``start`` < 0, ``count`` < 0, ``duration_s`` <= 0, or a non-finite
            ``start_s``.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(f"count must be None or an int >= 0, got {count!r}")
    selected: list[Request] = list(requests)
    if start_s is not None or duration_s is not None:
        if start_s is None:  # a duration alone counts from the earliest arrival
            lo = min((r.arrival_time_s for r in selected), default=0.0)
        elif not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s!r}")
        else:
            lo = float(start_s)
        hi = math.inf if duration_s is None else lo + check_positive_float(duration_s, "duration_s")
        selected = [r for r in selected if lo <= r.arrival_time_s < hi]
    stop = None if count is None else start + count
    return selected[start:stop]


def spread_batches(
    requests: Sequence[Request],
    window_s: float,
    seed: int,
    *,
    include_singletons: bool = True,
) -> list[Request]:
    """Undo timestamp quantisation: spread requests sharing a timestamp over ``[t, t + window_s)``.

    The Mooncake conversation trace records arrivals in batches about 3 s apart (90% of
    inter-arrival gaps are 0), which is a burst no real frontend sees. This draws, for each
    group of requests with the same ``arrival_time_s = t``, independent ``Uniform[0, window_s)``
    offsets, sorts them and assigns them in the group's original order, so order within a batch
    is kept and the batch is spread uniformly over the window. ``window_s = 3.0`` matches the
    Mooncake batch spacing.

    With ``include_singletons`` (default), a request alone at its timestamp is moved too, since
    in a quantised trace its true arrival is equally uncertain; set it to ``False`` to move only
    groups of two or more.

    Args:
        requests: requests, any order; groups are formed by exact equality of arrival times.
        window_s: spread window in seconds (> 0).
        seed: seed of the ``numpy.random.Generator``; same input and seed give the same output.
        include_singletons: also move requests whose timestamp no other request shares.

    Returns:
        New list sorted by the new arrival time (stable: ties keep input order); request ids,
        lengths and hashes unchanged.

    Raises:
        ValueError: ``window_s`` <= 0 or not finite.
    """
    window_s = check_positive_float(window_s, "window_s")
    rng = np.random.default_rng(seed)
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.arrival_time_s, []).append(i)
    new_times = [r.arrival_time_s for r in requests]
    for t, members in groups.items():  # insertion order: deterministic for a given input
        if len(members) == 1 and not include_singletons:
            continue
        offsets = np.sort(rng.random(len(members))) * window_s
        for i, off in zip(members, offsets.tolist(), strict=True):
            # Float rounding can make t + off == t + window_s for large t; stay inside the window.
            new_times[i] = min(t + off, math.nextafter(t + window_s, -math.inf))
    order = sorted(range(len(new_times)), key=new_times.__getitem__)
    return [
        requests[i] if new_times[i] == requests[i].arrival_time_s else replace(requests[i], arrival_time_s=new_times[i])
        for i in order
    ]
