"""Argument checks shared by the workload modules."""

from __future__ import annotations

import math

MAX_TRACE_TOKENS = 1 << 24
"""Largest prompt or output length a trace line may give (16.8M tokens, far above any model's
context): larger is refused as malformed, so one line cannot ask for billions of blocks or steps."""


def check_limit(limit: int | None) -> None:
    """Raise ValueError unless ``limit`` is ``None`` or an int >= 0."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")


def check_positive_int(value: int, name: str) -> int:
    """Return ``value`` if it is an int >= 1, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_positive_float(value: float, name: str) -> float:
    """Return ``float(value)`` if it is a finite number > 0, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
