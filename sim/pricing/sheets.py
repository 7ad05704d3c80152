"""API price sheets: the :class:`PriceSheet` model and loading shipped or user sheets.

Prices are USD per million tokens (``_usd_per_mtok``) for input cache hits (prompt tokens served
from the provider's KV cache), input cache misses (prompt tokens computed by prefill) and output,
with an optional off-peak ("valley") discount ``d`` over a daily UTC window of ``H`` hours. The
period factor on list prices (:meth:`PriceSheet.factor`)::

    f = 1 (list), 1 - d (valley: off-peak discount d), 1 - d * H / 24 (blended: H off-peak hours a day,
        traffic spread evenly over the day)

Shipped sheets live in ``sim/data/prices/*.toml`` (package data of ``sim``, found through
:mod:`importlib.resources`, so independent of this module's location); a user sheet is a
``.toml``, ``.yaml`` or ``.json`` file with the same fields. Each sheet names its ``source``.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from balancer.validation import format_validation_error, syntax_error_line


Period = Literal["list", "valley", "blended"]
PERIODS: tuple[str, ...] = ("list", "valley", "blended")


def _hhmm_minutes(s: str) -> int:
    h, sep, m = s.partition(":")
    if not sep or not (h.isdigit() and m.isdigit()) or not (0 <= int(h) < 24 and 0 <= int(m) < 60):
        raise ValueError(f"time {s!r} is not HH:MM (00:00-23:59, UTC)")
    return int(h) * 60 + int(m)


class PriceSheet(BaseModel):
    """An API price list: USD per million tokens for input cache hits, cache misses and output,
    plus an optional off-peak ("valley") discount.

    Attributes:
        name: label (shipped sheets: the file name without ``.toml``).
        source: where the numbers come from (a document and date); required.
        effective_date: first day the prices applied (``YYYY-MM-DD``), empty if illustrative.
        illustrative: True for made-up sheets (shown as such in tables).
        currency: always ``"USD"``; prices are per 1,000,000 tokens.
        input_cache_hit_usd_per_mtok: prompt tokens served from the provider's KV (context) cache.
        input_cache_miss_usd_per_mtok: prompt tokens computed by prefill.
        output_usd_per_mtok: generated tokens.
        offpeak_discount: fraction off all three prices in the off-peak window (0.5 = half price).
        offpeak_start_utc / offpeak_end_utc: the window, ``HH:MM`` UTC; may wrap midnight
            (``16:30`` -> ``00:30`` is 8 h). Both required iff the discount is > 0.

    Raises:
        pydantic.ValidationError (a ``ValueError``): negative prices, a cache-hit price above the
        cache-miss price, a discount outside [0, 1), a malformed or missing off-peak window.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    source: str = Field(min_length=1)
    effective_date: str = ""
    illustrative: bool = False
    currency: Literal["USD"] = "USD"
    input_cache_hit_usd_per_mtok: float = Field(ge=0)
    input_cache_miss_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)
    offpeak_discount: float = Field(0.0, ge=0, lt=1)
    offpeak_start_utc: str | None = None
    offpeak_end_utc: str | None = None

    @field_validator("offpeak_start_utc", "offpeak_end_utc")
    @classmethod
    def _check_time(cls, v: str | None) -> str | None:
        if v is not None:
            _hhmm_minutes(v)
        return v

    @model_validator(mode="after")
    def _check(self) -> PriceSheet:
        if self.input_cache_hit_usd_per_mtok > self.input_cache_miss_usd_per_mtok:
            raise ValueError(f"input_cache_hit_usd_per_mtok ({self.input_cache_hit_usd_per_mtok}) is above "
                             f"input_cache_miss_usd_per_mtok ({self.input_cache_miss_usd_per_mtok})")
        window = (self.offpeak_start_utc, self.offpeak_end_utc)
        if self.offpeak_discount > 0 and None in window:
            raise ValueError("offpeak_discount > 0 needs offpeak_start_utc and offpeak_end_utc (HH:MM UTC)")
        if (window[0] is None) != (window[1] is None):
            raise ValueError("give both offpeak_start_utc and offpeak_end_utc, or neither")
        if window[0] is not None and window[0] == window[1]:
            raise ValueError("the off-peak window is empty (start == end)")
        return self

    @property
    def offpeak_hours_per_day(self) -> float:
        """Length of the off-peak window in hours (0 without one); wraps midnight."""
        if self.offpeak_start_utc is None or self.offpeak_end_utc is None:
            return 0.0
        a, b = _hhmm_minutes(self.offpeak_start_utc), _hhmm_minutes(self.offpeak_end_utc)
        return ((b - a) % (24 * 60)) / 60.0

    def is_offpeak(self, utc_minutes_of_day: float) -> bool:
        """Whether minute ``utc_minutes_of_day`` (0 <= m < 1440, UTC) is in the off-peak window."""
        if self.offpeak_start_utc is None or self.offpeak_end_utc is None:
            return False
        a, b = _hhmm_minutes(self.offpeak_start_utc), _hhmm_minutes(self.offpeak_end_utc)
        m = utc_minutes_of_day % 1440
        return a <= m < b if a < b else (m >= a or m < b)

    def factor(self, period: Period) -> float:
        """Multiplier on list prices: ``list`` 1, ``valley`` ``1 - d`` (only where the sheet has an
        off-peak window; else 1), ``blended`` ``1 - d * H / 24`` (traffic even over the day)."""
        if period == "list":
            return 1.0
        if period == "valley":
            return 1.0 - self.offpeak_discount
        if period == "blended":
            return 1.0 - self.offpeak_discount * self.offpeak_hours_per_day / 24.0
        raise ValueError(f"unknown price period {period!r}; valid: {', '.join(PERIODS)}")

    def prices_usd_per_mtok(self, period: Period = "list") -> tuple[float, float, float]:
        """``(cache hit, cache miss, output)`` in USD per million tokens for ``period``."""
        f = self.factor(period)
        return (f * self.input_cache_hit_usd_per_mtok, f * self.input_cache_miss_usd_per_mtok,
                f * self.output_usd_per_mtok)

    def input_usd_per_mtok(self, hit_rate: float, period: Period = "list") -> float:
        """Mean input price at cache-hit rate ``hit_rate``: ``h * p_hit + (1 - h) * p_miss``."""
        _check_fraction("hit_rate", hit_rate)
        p_hit, p_miss, _ = self.prices_usd_per_mtok(period)
        return hit_rate * p_hit + (1.0 - hit_rate) * p_miss

    def usd_per_output_mtok(self, hit_rate: float, input_per_output: float, period: Period = "list") -> float:
        """``p_eff = r * (h * p_hit + (1 - h) * p_miss) + p_out``: revenue per million output
        tokens including the ``r`` input tokens each one brings."""
        _check_nonneg("input_per_output", input_per_output)
        return input_per_output * self.input_usd_per_mtok(hit_rate, period) + self.prices_usd_per_mtok(period)[2]

    def usd_per_mtok(self, hit_rate: float, input_per_output: float, period: Period = "list") -> float:
        """Mean revenue per million tokens of any kind: ``p_eff / (1 + r)``."""
        return self.usd_per_output_mtok(hit_rate, input_per_output, period) / (1.0 + input_per_output)


# ---------------------------------------------------------------------------- argument checks (shared)
def _check_fraction(name: str, x: float) -> None:
    if not (0.0 <= x <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {x}")


def _check_nonneg(name: str, x: float) -> None:
    if not (x >= 0.0) or math.isinf(x):
        raise ValueError(f"{name} must be a finite number >= 0, got {x}")


# ---------------------------------------------------------------------------- loading sheets
def _prices_dir():  # noqa: ANN202  (a Traversable)
    return resources.files("sim") / "data" / "prices"


def shipped_price_sheets() -> list[str]:
    """Names of the price sheets shipped in ``sim/data/prices`` (sorted)."""
    return sorted(p.name[:-5] for p in _prices_dir().iterdir() if p.name.endswith(".toml"))


def _parse_sheet(text: str, suffix: str, label: str) -> PriceSheet:
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"{label}: unknown price sheet file type {suffix!r} (use .toml, .yaml or .json)")
        if not isinstance(data, dict):
            raise ValueError(f"{label}: a price sheet must be a table of fields, got {type(data).__name__}")
        return PriceSheet.model_validate(data)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(syntax_error_line(str(label), e)) from None
    except ValidationError as e:
        raise ValueError(f"{label}: invalid price sheet: {format_validation_error(e, model=PriceSheet)}") from None


def load_price_sheet(name_or_path: str | Path) -> PriceSheet:
    """A shipped sheet by name (:func:`shipped_price_sheets`) or a ``.toml``/``.yaml``/``.json`` file.

    Raises:
        ValueError: unknown name (the message lists the shipped sheets), unreadable or invalid
            file (the message starts with the file name; TOML/YAML errors carry the line).
    """
    key = str(name_or_path)
    shipped = _prices_dir() / f"{key}.toml"
    if "/" not in key and shipped.is_file():
        return _parse_sheet(shipped.read_text(), ".toml", f"sim/data/prices/{key}.toml")
    path = Path(key)
    if not path.is_file():
        raise ValueError(f"unknown price sheet {key!r}: not a shipped sheet ({', '.join(shipped_price_sheets())}) "
                         f"nor a file")
    return _parse_sheet(path.read_text(), path.suffix, str(path))


def load_price_sheets(spec: str | Sequence[str] | None) -> list[PriceSheet]:
    """Comma-separated names/files (or a list); ``None``, ``""`` or ``"all"``: every shipped sheet.

    Raises:
        ValueError: an empty item in the text (``","``, ``"a,,b"``: a typo; dropping it priced no
            sheet, or fewer), an unknown name or a bad file."""
    if spec is None or spec == "" or spec == "all":
        items = shipped_price_sheets()
    elif isinstance(spec, str):
        items = [s.strip() for s in spec.split(",")]
        if not all(items):
            raise ValueError(f"price sheets {spec!r}: an empty name (a leading, trailing or doubled comma); give "
                             f"NAME|FILE[,...] ({', '.join(shipped_price_sheets())}) or 'all'")
    else:
        items = list(spec)
    return [load_price_sheet(s) for s in items]
