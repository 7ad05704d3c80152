"""Shared helpers of pdlb's plots (``pdlb sim run/compare`` figures, capacity searches, sweeps).

- :func:`pyplot`: ``matplotlib.pyplot`` on the Agg backend (files only; no display needed).
- :func:`plain_log_ticks`: decimal tick labels on a log axis (``0.6``, ``2``, ``10``), where
  matplotlib's default prints ``6×10^-1`` and ``2×10^0`` on a range of less than a few decades.
"""

from __future__ import annotations

import math
from typing import Any

#: Mantissas of the minor ticks labelled on a log axis spanning between 0.4 and 1 decade (all of
#: 2..9 below 0.4 decades; none above 1 decade, where the decades' labels suffice): the
#: thresholds of matplotlib's own ``LogFormatter(minor_thresholds=(1, 0.4))``.
_SOME_MINOR = frozenset({2, 3, 5})


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the Agg backend selected (importing matplotlib lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain(y: float) -> str:
    """``0.6``, ``2``, ``10``, ``1e+04``: ``{:g}`` of the tick value rounded to 6 significant digits
    (a log locator's ``0.6000000000000001`` prints ``0.6``)."""
    return f"{float(f'{y:.6g}'):g}"


def plain_log_ticks(axis: Any) -> None:
    """Label the ticks of a log-scale ``axis`` (``ax.yaxis`` / ``ax.xaxis``) in plain decimals.

    Major ticks (the decades) are always labelled. Minor ticks are labelled by the span of the
    view, as matplotlib's default does (so labels do not crowd): all of them below 0.4 decades,
    those of mantissa 2, 3 and 5 up to 1 decade, none above.
    """
    from matplotlib.ticker import FuncFormatter

    def minor(y: float, _pos: int | None) -> str:
        lo, hi = sorted(axis.get_view_interval())
        if not (y > 0 and lo > 0 and hi > lo):
            return ""
        decades = math.log10(hi / lo)
        if decades > 1:
            return ""
        mantissa = round(y / 10 ** math.floor(math.log10(y) + 1e-9))
        return _plain(y) if decades < 0.4 or mantissa in _SOME_MINOR else ""

    axis.set_major_formatter(FuncFormatter(lambda y, _pos: _plain(y) if y > 0 else ""))
    axis.set_minor_formatter(FuncFormatter(minor))
