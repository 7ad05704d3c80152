"""Finding and reading traces by format: the embedded default and format dispatch."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from balancer.types import Request

from .azure import read_azure
from .mooncake import MAX_TIMESTAMP_MS, read_mooncake

__all__ = ["DEFAULT_TRACE_NAME", "TRACE_FORMATS", "default_trace_path", "read_trace", "read_trace_cut", "scale_and_cut"]

DEFAULT_TRACE_NAME = "mooncake_conversation.jsonl.gz"
"""File name of the embedded trace under ``sim/data`` (see ``sim/data/NOTICE.txt``)."""

TRACE_FORMATS = ("auto", "mooncake", "azure")
"""Values accepted by :func:`read_trace`'s ``fmt``."""

#: File extensions :func:`read_trace` recognises with ``fmt="auto"``, and their formats.
TRACE_EXTENSIONS = {".jsonl": "mooncake", ".jsonl.gz": "mooncake", ".csv": "azure", ".csv.gz": "azure"}


def default_trace_path() -> Path:
    """Path of the embedded Mooncake conversation trace (12,031 requests, gzip JSONL).

    Source: kvcache-ai/Mooncake ``FAST25-release/traces/conversation_trace.jsonl`` at commit
    3cca71da, Apache License 2.0, unmodified except for gzip (attribution in
    ``sim/data/NOTICE.txt``). Located with :mod:`importlib.resources`, so it works from a
    source checkout, an editable install and an installed wheel (pdlb is never installed
    zipped, so the resource is a real file).

    Raises:
        FileNotFoundError: the package data is missing (a broken install).
    """
    resource = resources.files("sim").joinpath("data", DEFAULT_TRACE_NAME)
    path = Path(os.fspath(resource)) if isinstance(resource, os.PathLike) else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"embedded trace sim/data/{DEFAULT_TRACE_NAME} is missing from the installed package")
    return path


def detect_trace_format(path: str | os.PathLike[str]) -> str:
    """The trace format of ``path`` from its extension (:data:`TRACE_EXTENSIONS`).

    Raises:
        ValueError: an unknown extension (the message lists the known ones).
    """
    name = os.fspath(path).lower()
    for ext, fmt in TRACE_EXTENSIONS.items():
        if name.endswith(ext):
            return fmt
    raise ValueError(
        f"cannot infer the trace format of {os.fspath(path)!r} from its extension "
        f"(known: {', '.join(TRACE_EXTENSIONS)}); pass fmt='mooncake' or fmt='azure'"
    )


def check_trace_path(path: str | os.PathLike[str]) -> None:
    """Raise the one error every command prints for a trace path that is not a readable file.

    Raises:
        FileNotFoundError: ``"trace file not found: PATH"`` (no such file).
        IsADirectoryError: ``"trace file is a directory: PATH"``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file not found: {os.fspath(path)}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"trace file is a directory: {os.fspath(path)}")


def read_trace(path: str | os.PathLike[str] | None = None, fmt: str = "auto", **kwargs: Any) -> list[Request]:
    """Read a trace file in any supported format.

    Args:
        path: trace file, or ``None`` for the embedded default (:func:`default_trace_path`).
        fmt: ``"mooncake"`` (:func:`read_mooncake`), ``"azure"`` (:func:`read_azure`) or
            ``"auto"``: by extension, ``.jsonl`` / ``.jsonl.gz`` -> mooncake, ``.csv`` /
            ``.csv.gz`` -> azure.
        **kwargs: passed to the reader (``limit``, ``block_size``, ``traffic_class``).

    Returns:
        The requests, in file order.

    Raises:
        ValueError: unknown ``fmt`` (the message lists the valid ones), ``fmt="azure"`` with
            ``path=None``, or, with ``"auto"``, an unknown extension.
        TraceFormatError: the file is malformed (see the readers).
        FileNotFoundError / IsADirectoryError: from :func:`check_trace_path`.
        OSError: the file cannot be opened.
    """
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; valid formats: {', '.join(TRACE_FORMATS)}")
    if path is None:
        if fmt not in ("auto", "mooncake"):
            raise ValueError(f"the embedded default trace is in mooncake format, not {fmt!r}")
        path = default_trace_path()
    check_trace_path(path)
    if fmt == "auto":
        fmt = detect_trace_format(path)
    if fmt == "mooncake":
        return read_mooncake(path, **kwargs)
    return read_azure(path, **kwargs)


def scale_and_cut(requests: list[Request], rate_scale: float = 1.0, duration_s: float | None = None) -> list[Request]:
    """``--rate-scale`` then ``--duration-s``, the last steps of :func:`read_trace_cut`: divide
    every arrival time by ``rate_scale``, then keep the requests arriving in the first
    ``duration_s`` seconds (from the first arrival) of the *scaled* trace.

    So ``--duration-s`` is the simulated arrival window at every rate: ``--rate-scale 2
    --duration-s 60`` simulates 60 s of arrivals at twice the trace's rate (twice the requests of
    ``--rate-scale 1 --duration-s 60``), and a capacity search tests every rate over the same
    window (a rate is judged on ``duration_s`` seconds of load, not on fewer at higher rates).
    ``--limit`` comes before both (at most that many requests, whatever the window). The first
    request always arrives in the window, so the result is never empty when ``requests`` is not.

    Raises:
        ValueError: the scaled trace's last arrival is past 2^53 ms (the loaders' bound:
            :data:`sim.workload.mooncake.MAX_TIMESTAMP_MS`), e.g. ``rate_scale`` 1e-300.
    """
    from sim.workload.transform import scale_rate, take_slice

    out = scale_rate(requests, rate_scale) if rate_scale != 1.0 else list(requests)
    if out and out[-1].arrival_time_s * 1000.0 > MAX_TIMESTAMP_MS:  # the loaders' bound, after scaling (review R5)
        raise ValueError(f"--rate-scale {rate_scale:g} puts the last arrival at {out[-1].arrival_time_s:.3g} s, "
                         "past 2^53 ms, where milliseconds are no longer exact numbers (arrival gaps and TTFTs "
                         "would round to 0); use a larger --rate-scale")
    if duration_s is not None:
        out = take_slice(out, duration_s=duration_s)
    return out


def read_trace_cut(trace: str | os.PathLike[str] | None, fmt: str = "auto", *, limit: int | None = None,
                   spread_s: float = 0.0, seed: int = 0, rate_scale: float = 1.0,
                   duration_s: float | None = None) -> tuple[list[Request], str]:
    """What every command does with ``--trace/--format/--limit/--spread-s/--rate-scale/--duration-s``,
    in this order: resolve the format (``auto``: by extension; the embedded trace is Mooncake),
    read, keep the first ``limit`` requests, spread timestamp groups over ``spread_s`` seconds
    (seeded), scale the rate, keep the first ``duration_s`` seconds of arrivals
    (:func:`scale_and_cut`: the window is in simulated time, after scaling). Returns the requests
    and the resolved format. Capacity searches and sweeps read once with the defaults of the last
    two and apply :func:`scale_and_cut` per rate.

    Raises:
        ValueError: ``azure`` without a trace file, an undetectable format (one line naming the
            known extensions), an empty trace. FileNotFoundError / TraceFormatError from the reader.
    """
    from sim.workload.transform import spread_batches, take_slice

    if trace is None and fmt == "azure":
        raise ValueError("--format azure needs --trace (the embedded trace is in mooncake format)")
    if trace is not None:
        check_trace_path(trace)
    if fmt == "auto":
        try:
            fmt = detect_trace_format(trace) if trace else "mooncake"
        except ValueError:
            raise ValueError(f"--trace {trace}: cannot infer the trace format from the file extension "
                             f"(known: {', '.join(TRACE_EXTENSIONS)}); pass --format mooncake or --format azure") from None
    requests = read_trace(trace, fmt)
    if not requests:
        raise ValueError(f"--trace {trace}: the trace has no requests")
    if limit is not None:
        requests = take_slice(requests, 0, limit)
    if spread_s > 0:
        requests = spread_batches(requests, spread_s, seed=seed)
    return scale_and_cut(requests, rate_scale, duration_s), fmt
