"""Reader for the Azure LLM inference traces (2023 release, CSV).

Format (Azure/AzurePublicDataset, ``data/AzureLLMInferenceTrace_{code,conv}.csv``)::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

``TIMESTAMP`` has 7 fractional digits (100 ns ticks), finer than ``datetime``'s microseconds,
so it is parsed here to integer nanoseconds. The trace carries no prompt content, so there is no prefix sharing:
every request gets its own block hashes.
"""

from __future__ import annotations

import calendar
import csv
import os
import re
from collections.abc import Iterator

import xxhash

from balancer.hashing import chain_block_ids
from balancer.types import Request

from ._checks import MAX_TRACE_TOKENS, check_limit, check_positive_int
from ._io import bounded_lines, open_binary, read_errors
from .errors import TraceFormatError

__all__ = ["parse_azure_timestamp_ns", "read_azure"]

_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TS_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?")
_INT_RE = re.compile(r"[+-]?\d{1,19}")  # at most 19 digits: no huge int() conversions


def _text_lines(lines: Iterator[bytes]) -> Iterator[str]:
    """UTF-8 text of each line (a byte-order mark before the first is skipped); raises
    UnicodeDecodeError on bad UTF-8, which the reader reports with its line."""
    first = True
    for raw in lines:
        if first and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        first = False
        yield raw.decode("utf-8")


def parse_azure_timestamp_ns(text: str) -> int:
    """Parse ``"YYYY-MM-DD HH:MM:SS[.f{1,9}][Z|+HH:MM]"`` to integer nanoseconds since the epoch.

    A ``T`` separator and a UTC offset (as in the 2024 release) are accepted; timestamps without
    an offset are taken as UTC. Up to 9 fractional digits are kept exactly.

    Raises:
        ValueError: the text does not match or names an impossible date/time.
    """
    m = _TS_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"bad timestamp {text!r} (expected 'YYYY-MM-DD HH:MM:SS.fffffff')")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    if not (1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]):
        raise ValueError(f"bad timestamp {text!r}: no such date")
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(f"bad timestamp {text!r}: no such time")
    frac, tz = m.group(7), m.group(8)
    ns = calendar.timegm((year, month, day, hour, minute, second)) * 1_000_000_000
    if frac:
        ns += int(frac.ljust(9, "0"))
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        ns -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60) * 1_000_000_000
    return ns


def read_azure(
    path: str | os.PathLike[str],
    *,
    block_size: int = 512,
    limit: int | None = None,
    traffic_class: str | None = None,
) -> list[Request]:
    """Read an Azure LLM inference 2023 CSV trace (plain or gzip-compressed) into requests.

    The header row must name ``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens`` (any
    order; extra columns ignored). Each data row becomes one request:

    * ``request_id = f"r{i}"``, ``i`` the 0-based data-row index;
    * ``arrival_time_s``: seconds since the first data row's timestamp (so the first is 0.0),
      computed from integer nanoseconds;
    * ``prompt_tokens = ContextTokens``;
    * ``expected_output_tokens = max_output_tokens = max(GeneratedTokens, 1)`` (0 becomes 1;
      none in the 2023 traces);
    * ``block_hashes``: ``ceil(ContextTokens / block_size)`` hashes unique to the request
      (``chain_block_ids`` over ids never reused within the file, rooted at a hash of the file
      name), so no two requests share a prefix;
    * ``traffic_class`` as given.

    Blank lines are skipped.

    Args:
        path: CSV file; gzip is detected from the content.
        block_size: tokens per synthetic KV block (>= 1).
        limit: read at most this many requests (``None``: all).
        traffic_class: tag stored on every request (e.g. ``"chatbot"``).

    Returns:
        Requests in file order.

    Raises:
        TraceFormatError: with ``"path:line: "`` prefix, for a missing header or column, a row
            with the wrong number of fields, an unparsable timestamp or integer, a timestamp
            earlier than the previous row's, ``ContextTokens`` < 1, ``GeneratedTokens`` < 0,
            or bytes that are not UTF-8.
        ValueError: ``block_size`` < 1 or a bad ``limit``.
        OSError: the file cannot be opened.
    """
    check_positive_int(block_size, "block_size")
    check_limit(limit)
    requests: list[Request] = []
    if limit == 0:
        return requests
    root = xxhash.xxh3_64_intdigest(b"pdlb/azure/" + os.path.basename(os.fspath(path)).encode())
    next_id = 0
    t0_ns: int | None = None
    prev_ns = 0
    reader = None
    with read_errors(path, lambda: (reader.line_num if reader is not None else 0) + 1), open_binary(path) as fh:
        reader = csv.reader(_text_lines(bounded_lines(fh, path)))  # bounded: one line, and the whole file
        try:
            header = next((row for row in reader if row), None)
            if header is None:
                raise TraceFormatError(path, max(reader.line_num, 1), "empty file, expected a CSV header")
            names = [h.strip() for h in header]
            twice = sorted({c for c in names if names.count(c) > 1 and c})
            if twice:
                raise TraceFormatError(path, reader.line_num, f"header names column(s) {twice} more than once")
            missing = [c for c in _COLUMNS if c not in names]
            if missing:
                raise TraceFormatError(path, reader.line_num, f"header lacks column(s) {missing}, got {names}")
            i_ts, i_ctx, i_gen = (names.index(c) for c in _COLUMNS)
            n_fields = len(names)
            for row in reader:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                line = reader.line_num
                if len(row) != n_fields:
                    raise TraceFormatError(path, line, f"expected {n_fields} fields, got {len(row)}: {row}")
                try:
                    ts_ns = parse_azure_timestamp_ns(row[i_ts])
                except ValueError as exc:
                    raise TraceFormatError(path, line, f"column 'TIMESTAMP': {exc}") from None
                ctx = _parse_int(path, line, "ContextTokens", row[i_ctx])
                gen = _parse_int(path, line, "GeneratedTokens", row[i_gen])
                if t0_ns is None:
                    t0_ns = prev_ns = ts_ns
                if ts_ns < prev_ns:
                    raise TraceFormatError(
                        path, line, f"timestamp goes backwards: {row[i_ts].strip()!r} is before the previous row"
                    )
                prev_ns = ts_ns
                if not 1 <= ctx <= MAX_TRACE_TOKENS:
                    raise TraceFormatError(path, line, f"column 'ContextTokens' must be >= 1 and <= {MAX_TRACE_TOKENS}, got {ctx}")
                if not 0 <= gen <= MAX_TRACE_TOKENS:
                    raise TraceFormatError(path, line, f"column 'GeneratedTokens' must be >= 0 and <= {MAX_TRACE_TOKENS}, got {gen}")
                n_blocks = -(-ctx // block_size)
                hashes = tuple(chain_block_ids(range(next_id, next_id + n_blocks), parent_hash=root))
                next_id += n_blocks
                out = max(gen, 1)
                requests.append(
                    Request(
                        request_id=f"r{len(requests)}",
                        arrival_time_s=(ts_ns - t0_ns) / 1e9,
                        prompt_tokens=ctx,
                        block_hashes=hashes,
                        max_output_tokens=out,
                        expected_output_tokens=out,
                        traffic_class=traffic_class,
                    )
                )
                if limit is not None and len(requests) >= limit:
                    break
        except UnicodeDecodeError as exc:
            raise TraceFormatError(path, reader.line_num + 1, f"not valid UTF-8: {exc}") from None
        except csv.Error as exc:
            raise TraceFormatError(path, reader.line_num, f"bad CSV: {exc}") from None
    return requests


def _parse_int(path: str | os.PathLike[str], line: int, column: str, text: str) -> int:
    text = text.strip()
    if not _INT_RE.fullmatch(text):
        raise TraceFormatError(path, line, f"column {column!r} must be an integer of at most 19 digits, got {text[:40]!r}")
    return int(text)
