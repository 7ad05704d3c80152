"""Rate-limited log lines for what clients can trigger at will (malformed HTTP, bad bodies).

A client that sends 1,000 malformed requests must not write 1,000 tracebacks (issue 25 item 7:
578 KB of ERROR tracebacks from 1,000 ``Content-Length: -5`` requests). :class:`RateLimitedLog`
writes at most one short line per ``interval_s`` for each kind of event, and says how many lines
of that kind it left out since the last one. Time is passed in (``time.monotonic()`` in the
service).
"""

from __future__ import annotations

import logging

__all__ = ["RateLimitedLog"]

MAX_KINDS = 64
"""Most kinds of event tracked at once (the kinds are fixed strings in code; a bound all the same)."""


class RateLimitedLog:
    """At most one line per ``interval_s`` per ``kind`` on ``logger``.

    Args:
        logger: where the lines go.
        interval_s: the least time between two lines of one kind (seconds, > 0).

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.logger = logger
        self.interval_s = float(interval_s)
        self._last: dict[str, float] = {}  # kind -> time of its last line
        self._left_out: dict[str, int] = {}  # kind -> lines left out since then

    def log(self, level: int, kind: str, now_s: float, msg: str, *args: object) -> bool:
        """Log ``msg % args`` (one line, no traceback) unless a line of ``kind`` was written less
        than ``interval_s`` ago; returns whether it was written. A written line ends with
        ``(N similar lines left out in the last S s)`` when some were."""
        last = self._last.get(kind)
        if last is not None and now_s - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        if last is None and len(self._last) >= MAX_KINDS:
            self._last.clear()
            self._left_out.clear()
        left_out = self._left_out.pop(kind, 0)
        self._last[kind] = now_s
        if left_out:
            msg += f" ({left_out} similar lines left out in the last {now_s - last:.0f} s)" if last is not None else ""
        self.logger.log(level, msg, *args)
        return True
