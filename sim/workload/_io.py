"""Opening trace files: plain or gzip-compressed, detected by content (not by extension)."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Callable, Iterator
from typing import IO, cast

from .errors import TraceFormatError

_GZIP_MAGIC = b"\x1f\x8b"

#: Longest trace line read (4 MiB; a Mooncake line at the 16.8M-token prompt bound is ~0.4 MB):
#: a longer one is refused before it is held whole (``/dev/zero`` has no newline at all).
MAX_LINE_BYTES = 1 << 22
#: Most trace text read, after decompression (2 GiB, ~5M Mooncake lines; the embedded trace is
#: 12,031 lines): more is refused, since its requests would not fit in memory anyway.
MAX_TRACE_BYTES = 1 << 31


def bounded_lines(fh: IO[bytes], path: str | os.PathLike[str], *, max_line_bytes: int | None = None,
                  max_total_bytes: int | None = None) -> Iterator[bytes]:
    """The lines of ``fh`` (with their newline), each read with a length bound, so that neither one
    line nor the whole file can take more memory than the bounds (defaults :data:`MAX_LINE_BYTES`,
    :data:`MAX_TRACE_BYTES`, read at call time).

    Raises:
        TraceFormatError: a line longer than the bound (``"<path>:<line>: line longer than ..."``),
            or more text than the total bound.
    """
    max_line = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes
    max_total = MAX_TRACE_BYTES if max_total_bytes is None else max_total_bytes
    total = 0
    lineno = 0
    while True:
        raw = fh.readline(max_line + 1)
        if not raw:
            return
        lineno += 1
        total += len(raw)
        if len(raw) > max_line:
            raise TraceFormatError(path, lineno, f"line longer than {max_line:,} bytes: not a trace of one request "
                                                 "per line (a binary file, or a file with no line breaks?)")
        if total > max_total:
            raise TraceFormatError(path, lineno, f"more than {max_total:,} bytes of trace text; read the first "
                                                 "requests only (--limit N) or split the trace")
        yield raw


def _is_gzip(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == _GZIP_MAGIC


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for reading bytes, transparently decompressing gzip.

    Raises:
        OSError: as :func:`open` (e.g. :class:`FileNotFoundError`).
    """
    if _is_gzip(path):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def open_text(path: str | os.PathLike[str]) -> IO[str]:
    """Open ``path`` for reading UTF-8 text, transparently decompressing gzip.

    The stream uses ``newline=""`` (as :mod:`csv` requires): ``\\n`` and ``\\r\\n`` rows both
    work (the Azure CSVs use ``\\r\\n``). A UTF-8 byte-order mark is skipped.

    Raises:
        OSError: as :func:`open` (e.g. :class:`FileNotFoundError`).
    """
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", newline="")


@contextlib.contextmanager
def read_errors(path: str | os.PathLike[str], line: Callable[[], int]) -> Iterator[None]:
    """Turn failures to read ``path`` into one :class:`TraceFormatError` naming the file and the
    line being read (``line()``): a directory, a file that cannot be opened, a corrupt or
    truncated gzip stream."""
    try:
        yield
    except IsADirectoryError:
        raise TraceFormatError(path, 0, "is a directory, not a trace file") from None
    except FileNotFoundError:
        raise
    except gzip.BadGzipFile as exc:
        raise TraceFormatError(path, line(), f"corrupt gzip data: {exc}") from None
    except EOFError:
        raise TraceFormatError(path, line(), "truncated gzip file (it ends in the middle of the compressed stream)") from None
    except zlib.error as exc:
        raise TraceFormatError(path, line(), f"corrupt gzip data: {exc}") from None
    except OSError as exc:
        raise TraceFormatError(path, line(), f"cannot read: {exc.strerror or exc}") from None
