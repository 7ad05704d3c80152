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
