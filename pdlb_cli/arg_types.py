"""argparse ``type=`` checks for numeric options, one set for every ``pdlb`` command and the
bench/ scripts: a bad value (``0`` where a count must be >= 1, a negative, NaN or infinite
duration, a share outside its range) stops the parser with ``error: argument --flag: <message>``
and exit status 2, before anything runs. Standard library only, so that the bench scripts import
it without the simulator (as :mod:`pdlb_cli.comma_lists`); :mod:`pdlb_cli.args` re-exports them.

``tests/bench/test_bench_numeric_options.py`` holds every bench/ script's numeric option to these
types: an option whose values are numbers must take one of this module's functions (or a
function made by one of its factories) as its ``type=``.
"""

from __future__ import annotations

import argparse
import math
import typing

#: Largest token count a flag takes (2^24 = 16.8M, far above any model's context; as scenarios).
MAX_FLAG_TOKENS = 1 << 24


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def int_at_least(minimum: int) -> typing.Callable[[str], int]:
    """An argparse ``type=``: an int >= ``minimum`` (the messages of :func:`positive_int`); for
    options where 0 has a meaning (``--warmup 0``: none), which their help says."""
    def parse(text: str) -> int:
        return _int_at_least(text, minimum)
    return parse


def int_between(minimum: int, maximum: int) -> typing.Callable[[str], int]:
    """An argparse ``type=``: an int in ``minimum..maximum`` (both included)."""
    def parse(text: str) -> int:
        value = _int_at_least(text, minimum)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be in {minimum}..{maximum}, got {value}")
        return value
    return parse


def positive_int(text: str) -> int:
    """An int >= 1 (request counts, engine counts, rounds, processes)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An int >= 0, for counts where 0 means "none" (the option's help says so)."""
    return _int_at_least(text, 0)


def token_count(text: str) -> int:
    """An int in [1, 2^24] (a request's tokens): larger cannot be a request any model serves."""
    value = _int_at_least(text, 1)
    if value > MAX_FLAG_TOKENS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_FLAG_TOKENS:,} tokens, got {value:,}")
    return value


def seed_int(text: str) -> int:
    """An int >= 0 (``--seed``): numpy's and the trace spreading's seeds must be non-negative, and
    without this check a negative one surfaced as numpy's bare ``expected non-negative integer``,
    naming no flag."""
    return _int_at_least(text, 0)


def port_int(text: str) -> int:
    """A TCP port in 1..65535 (``--base-port``)."""
    return int_between(1, 65535)(text)


def _float_checked(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (rates, rate factors, durations, SLOs, tolerances)."""
    return _float_checked(text, allow_zero=False)


def nonnegative_float(text: str) -> float:
    """A finite float >= 0, for values where 0 means "none" or "off" (the option's help says so)."""
    return _float_checked(text, allow_zero=True)


def fraction(text: str) -> float:
    """A number in (0, 1] (attainment targets, memory fractions); ``90%`` is accepted as 0.9."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = math.nan
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (or a percentage like 90%), got {text!r}")
    return value


def share(text: str) -> float:
    """A share in [0, 1) (``bench/cost_learner.py --outliers``: at 1 no good timing is left to fit;
    a margin of attainment: 1 leaves nothing to miss)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1), got {text!r}")
    return value


def percentile(text: str) -> float:
    """A percentile in (0, 100] (``--slo-percentile``; ``p99`` and ``99%`` are accepted as 99)."""
    t = text.strip().removeprefix("p").removesuffix("%")
    try:
        value = float(t)
    except ValueError:
        value = math.nan
    if not (0 < value <= 100):
        raise argparse.ArgumentTypeError(f"must be a percentile in (0, 100], e.g. 99, got {text!r}")
    return value
