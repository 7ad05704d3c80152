"""Reader for Mooncake request traces (JSON lines).

Format (kvcache-ai/Mooncake, ``FAST25-release/traces/*.jsonl``), one JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ..., 13]}

* ``timestamp``: arrival in milliseconds from the start of the trace (non-decreasing).
* ``input_length`` / ``output_length``: prompt and output lengths in tokens.
* ``hash_ids``: one id per 512-token prompt block (the last one possibly partial), assigned so
  that equal ids at equal positions after equal parents mean equal prefixes.
* optional (pdlb's session workloads, :func:`sim.workload.write_mooncake`): ``session_id`` (a
  string or integer), ``traffic_class`` (a non-empty string; the tenant under deadline
  admission) and ``priority`` (a non-empty string: the admission class, e.g. ``"high"``); absent
  or ``null`` = unknown.

Checked on the shipped conversation trace (12,031 lines): every line has exactly
``ceil(input_length / 512)`` ids, timestamps never decrease, no length is 0 (min output 1), and
no id appears at two different positions, so the reader can be strict.
"""

from __future__ import annotations

import json
import math
import os

from balancer.hashing import chain_block_ids
from balancer.types import Request

from ._checks import MAX_TRACE_TOKENS, check_limit, check_positive_int
from ._io import bounded_lines, open_binary, read_errors
from .errors import TraceFormatError

__all__ = ["MOONCAKE_BLOCK_SIZE", "read_mooncake"]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""
MAX_PRIORITY_CHARS = 64
"""Longest ``priority`` name a trace line may give."""

#: Largest ``timestamp`` accepted (ms): 2^53, past which a float no longer holds every millisecond
#: (1.7e18 ms gave TTFT 0.000 s; near 1e308, 100% attainment).
MAX_TIMESTAMP_MS = 2**53
#: A trace whose first ``timestamp`` is at least this (2^32 ms, ~50 days: epoch time) is rebased to
#: its first line, so arrival gaps stay exact in seconds; traces that start near 0 (as pdlb writes
#: them) read back unchanged.
REBASE_FROM_MS = 2**32

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class _BadRecord(Exception):
    """Internal: one record is invalid; the caller adds file and line."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {dup!r} given twice")
    return out


def _parse_record(
    raw: bytes, block_size: int, prev_ts: float
) -> tuple[float, int, int, tuple[int, ...], str | None, str | None, str | None]:
    """Validate one JSON line; return ``(timestamp_ms, input_length, max(output_length, 1),
    block_hashes, session_id, traffic_class, priority)`` or raise :class:`_BadRecord`."""
    try:
        rec = json.loads(raw, object_pairs_hook=_unique_keys)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise _BadRecord(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise _BadRecord("invalid JSON: nested too deeply") from None
    if not isinstance(rec, dict):
        raise _BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    for name in _FIELDS:
        if name not in rec:
            raise _BadRecord(f"missing field {name!r}")
    ts, n_in, n_out, ids = rec["timestamp"], rec["input_length"], rec["output_length"], rec["hash_ids"]

    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise _BadRecord(f"field 'timestamp' must be a finite number, got {ts!r}")
    if ts < 0:
        raise _BadRecord(f"field 'timestamp' must be >= 0, got {ts!r}")
    if ts > MAX_TIMESTAMP_MS:
        raise _BadRecord(f"field 'timestamp' {ts!r} ms is past 2^53 ms, where milliseconds are no longer exact "
                         "numbers (arrival gaps and TTFTs would round to 0); rebase the trace's timestamps")
    if ts < prev_ts:
        raise _BadRecord(f"timestamp goes backwards: {ts!r} after {prev_ts!r}")
    if type(n_in) is not int:
        raise _BadRecord(f"field 'input_length' must be an integer, got {n_in!r}")
    if not 1 <= n_in <= MAX_TRACE_TOKENS:
        raise _BadRecord(f"field 'input_length' must be >= 1 and <= {MAX_TRACE_TOKENS}, got {n_in}")
    if type(n_out) is not int:
        raise _BadRecord(f"field 'output_length' must be an integer, got {n_out!r}")
    if not 0 <= n_out <= MAX_TRACE_TOKENS:
        raise _BadRecord(f"field 'output_length' must be >= 0 and <= {MAX_TRACE_TOKENS}, got {n_out}")
    if type(ids) is not list:
        raise _BadRecord(f"field 'hash_ids' must be a list of integers, got {type(ids).__name__}")
    expected = -(-n_in // block_size)
    if len(ids) != expected:
        raise _BadRecord(f"field 'hash_ids' has {len(ids)} ids, expected ceil({n_in} / {block_size}) = {expected}")
    if any(type(x) is not int for x in ids):
        raise _BadRecord("field 'hash_ids' must contain only integers")
    try:
        hashes = chain_block_ids(ids)
    except ValueError as exc:
        raise _BadRecord(f"field 'hash_ids': {exc}") from None
    session = rec.get("session_id")
    if session is not None:
        if type(session) is int:
            session = str(session)
        elif type(session) is not str or not session:
            raise _BadRecord(f"field 'session_id' must be a non-empty string or an integer, got {session!r}")
    cls = rec.get("traffic_class")
    if cls is not None and (type(cls) is not str or not cls):
        raise _BadRecord(f"field 'traffic_class' must be a non-empty string, got {cls!r}")
    priority = rec.get("priority")
    if priority is not None and (type(priority) is not str or not priority or len(priority) > MAX_PRIORITY_CHARS):
        raise _BadRecord(f"field 'priority' must be a non-empty string of at most {MAX_PRIORITY_CHARS} characters, "
                         f"got {priority!r:.80}")
    return ts, n_in, max(n_out, 1), tuple(hashes), session, cls, priority


def read_mooncake(
    path: str | os.PathLike[str],
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    limit: int | None = None,
    traffic_class: str | None = None,
) -> list[Request]:
    """Read a Mooncake JSONL trace (plain or gzip-compressed) into requests.

    Each non-blank line becomes one :class:`~balancer.types.Request`:

    * ``request_id = f"r{i}"``, ``i`` the 0-based index among non-blank lines;
    * ``arrival_time_s = timestamp / 1000``; a trace logged in epoch time (first timestamp >= 2^32
      ms) is rebased to its first line, ``(timestamp - first) / 1000``, so its gaps stay exact;
      timestamps past 2^53 ms are refused;
    * ``prompt_tokens = input_length``;
    * ``block_hashes = tuple(chain_block_ids(hash_ids))``: chained, so each hash names the whole
      prefix; ``len(block_hashes) == ceil(input_length / block_size)`` (the last block may be
      partial, as in the trace);
    * ``expected_output_tokens = max_output_tokens = max(output_length, 1)``: an output length
      of 0 (none in the conversation trace, but allowed) becomes 1, since an engine always
      produces at least one token and :class:`Request` requires ``max_output_tokens >= 1``;
    * ``session_id`` and ``traffic_class`` from the optional fields of the same names when a line
      has them (a line's ``traffic_class`` wins over the argument), else ``None`` and the
      ``traffic_class`` argument (the published Mooncake traces have neither).

    Unknown extra fields are ignored. Blank lines are skipped.

    Args:
        path: trace file; gzip is detected from the content, whatever the extension.
        block_size: tokens per ``hash_ids`` entry *in the trace* (512 for Mooncake), used only
            to validate the id count; it is not the engine's KV block size.
        limit: read at most this many requests (``None``: all).
        traffic_class: tag stored on every request without its own ``traffic_class`` field.

    Returns:
        Requests in file order (which is arrival order).

    Raises:
        TraceFormatError: with ``"path:line: "`` prefix, for invalid JSON or UTF-8, a line that
            is not an object, a missing field, a field of the wrong type (lengths and ids must
            be JSON integers, ``timestamp`` a finite number), ``timestamp`` < 0, past 2^53, or smaller than
            the previous line's, ``input_length`` < 1, ``output_length`` < 0, an id outside
            ``[0, 2**64)``, ``len(hash_ids) != ceil(input_length / block_size)``, a
            ``session_id`` that is not a non-empty string or an integer, or a ``traffic_class``
            that is not a non-empty string; a line over 4 MiB or more than 2 GiB of text
            (:func:`sim.workload._io.bounded_lines`).
        ValueError: ``block_size`` < 1 or a bad ``limit``.
        OSError: the file cannot be opened.
    """
    check_positive_int(block_size, "block_size")
    check_limit(limit)
    requests: list[Request] = []
    if limit == 0:
        return requests
    prev_ts = -math.inf
    first_ts: float | None = None
    lineno = 0
    with read_errors(path, lambda: lineno + 1), open_binary(path) as fh:
        for lineno, raw in enumerate(bounded_lines(fh, path), start=1):
            if not raw.strip():
                continue
            try:
                ts, n_in, n_out, hashes, session, cls, priority = _parse_record(raw, block_size, prev_ts)
            except _BadRecord as exc:
                raise TraceFormatError(path, lineno, str(exc)) from None
            prev_ts = ts
            if first_ts is None:
                first_ts = ts if ts >= REBASE_FROM_MS else 0
            requests.append(
                Request(
                    request_id=f"r{len(requests)}",
                    arrival_time_s=(ts - first_ts) / 1000.0,  # epoch traces rebased: exact gaps up to 2^53
                    prompt_tokens=n_in,
                    block_hashes=hashes,
                    max_output_tokens=n_out,
                    expected_output_tokens=n_out,
                    session_id=session,
                    traffic_class=cls if cls is not None else traffic_class,
                    priority=priority,
                )
            )
            if limit is not None and len(requests) >= limit:
                break
    return requests
