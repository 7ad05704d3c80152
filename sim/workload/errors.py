"""Errors raised by the trace readers."""

from __future__ import annotations

import os


class TraceFormatError(ValueError):
    """A trace file is malformed.

    The message starts with ``"<path>:<line>: "`` (1-based physical line number), e.g.
    ``"trace.jsonl:17: missing field 'input_length'"``, so editors and terminals can jump to it.

    Attributes:
        path: the trace file as given to the reader.
        line: 1-based line number of the offending record.
        reason: what is wrong, without the location prefix.
    """

    def __init__(self, path: str | os.PathLike[str], line: int, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")
