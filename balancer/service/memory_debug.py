"""``GET /debug/memory``: where a router process's memory is (a debugging aid, off by default).

Enabled only when the serving process has the environment variable ``PDLB_DEBUG_MEMORY=1``; it
then answers on the admin API's terms (``admin_api_key`` bearer token, or loopback only without
one). The answer is one JSON object:

* ``rss_bytes``: resident memory (``/proc/self/statm``).
* ``python``: ``allocated_blocks`` (``sys.getallocatedblocks``: objects' blocks alive in
  CPython's allocator), ``gc_counts`` (per generation), ``gc_frozen`` (``gc.get_freeze_count``),
  ``gc_objects`` (objects the collector tracks) and ``types``: the count of each type among them
  (the 200 commonest).
* ``pymalloc``: CPython's small-object allocator (``sys._debugmallocstats``, read through a
  temporary file in place of file descriptor 2 for the call): ``arenas`` (current),
  ``arenas_highwater``, ``arena_bytes`` (arenas x their size), ``allocated_bytes`` (blocks in use),
  ``available_bytes`` (free blocks in used pools) and ``unused_pool_bytes`` (empty pools of arenas
  still held): arena bytes far above allocated bytes is fragmentation (an arena is returned to
  the OS only when every block in it is free).
* ``smaps``: this process's ``/proc/self/smaps_rollup`` fields ``Anonymous`` and ``Rss`` (bytes).
* ``malloc``: glibc ``mallinfo2`` fields (bytes): ``arena`` (heap from ``brk`` and the thread
  arenas), ``hblkhd`` (large blocks in their own mappings), ``uordblks`` (in use), ``fordblks``
  (free but kept), ``keepcost``; ``arenas`` (count of ``<heap>`` entries of ``malloc_info``).
  Absent without glibc.
* ``tracemalloc`` (only if tracing: ``PYTHONTRACEMALLOC=25``, or started by the query flag
  ``trace=N``, N frames, which traces only what is allocated from then on): ``traced_bytes`` and, against
  the snapshot the previous call took, the 20 tracebacks whose size grew most (``size_diff_bytes``,
  ``count_diff``, the innermost 6 frames).

Query flags: ``collect=1`` runs a full collection first (``gc.collect()``; its count is
``collected``), and with ``garbage=1`` it also says what the cyclic garbage was: ``garbage_types``
(the 40 commonest types among the objects found unreachable), ``garbage_frames`` (the functions
of the frames among them, ``file:function``) and ``garbage_exceptions`` (exception types): cycles
through a failed request's exception, traceback and frames are the usual source; ``trim=1`` then calls ``malloc_trim(0)`` and reports ``rss_before_trim_bytes``. RSS
that a trim gives back was free heap kept by malloc (fragmentation or a high-water mark), not
live objects; RSS a collection gives back was cyclic garbage.

Cost: walking ``gc.get_objects()`` takes O(objects) on the event loop (tens of ms for a serving
router); that is why it is off unless asked for.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
import sys
import tempfile
from collections import Counter
from typing import Any

__all__ = ["ENV_FLAG", "enabled", "malloc_stats", "memory_report", "rss_bytes"]

ENV_FLAG = "PDLB_DEBUG_MEMORY"
"""Environment variable that turns the endpoint on (value ``1``)."""
TOP_TYPES = 200
TOP_TRACEBACKS = 20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``PDLB_DEBUG_MEMORY=1`` is set (``environ`` defaults to ``os.environ``)."""
    return (os.environ if environ is None else environ).get(ENV_FLAG, "") == "1"


def rss_bytes() -> int:
    """This process's resident memory (bytes; 0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def malloc_stats() -> dict[str, int] | None:
    """glibc's ``mallinfo2`` (bytes) and the number of malloc arenas; ``None`` without glibc (2.33+)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    out = {name: int(getattr(info, name)) for name in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")}
    out["arenas"] = _arena_count(libc)
    return out


def _arena_count(libc: ctypes.CDLL) -> int:
    """``<heap nr=...>`` entries of ``malloc_info`` (one per arena; -1 if it cannot be read)."""
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(prefix="pdlb-malloc-info-") as tmp:
        fp = libc.fopen(tmp.name.encode(), b"w")
        if not fp:
            return -1
        try:
            libc.malloc_info(0, fp)
        finally:
            libc.fclose(fp)
        with open(tmp.name, "rb") as f:
            return len(re.findall(rb"<heap nr=", f.read()))


_PYMALLOC_FIELDS = {
    b"# arenas allocated current": "arenas", b"# arenas highwater mark": "arenas_highwater",
    b"bytes in allocated blocks": "allocated_bytes", b"bytes in available blocks": "available_bytes",
    b"pools * 16384 bytes": "unused_pool_bytes",
}


def pymalloc_stats() -> dict[str, int] | None:
    """CPython's small-object allocator figures (module docstring); ``None`` if not available."""
    if not hasattr(sys, "_debugmallocstats"):
        return None
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    out: dict[str, int] = {}
    for line in text.splitlines():
        for key, name in _PYMALLOC_FIELDS.items():
            if key in line and name not in out:
                out[name] = int(line.rsplit(b"=", 1)[1].strip().replace(b",", b""))
        m = re.match(rb"(\d+) arenas \* (\d+) bytes/arena", line.strip())
        if m:
            out["arena_bytes"] = int(m.group(1)) * int(m.group(2))
    return out


def smaps_rollup() -> dict[str, int] | None:
    """``Rss`` and ``Anonymous`` of ``/proc/self/smaps_rollup`` (bytes); ``None`` where missing."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Anonymous"):
            out[name] = int(rest.split()[0]) * 1024
    return out


_last_snapshot: list[Any] = []


def _tracemalloc_diff() -> dict[str, Any] | None:
    import tracemalloc

    if not tracemalloc.is_tracing():
        return None
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    out: dict[str, Any] = {"traced_bytes": tracemalloc.get_traced_memory()[0]}
    if _last_snapshot:
        stats = snap.compare_to(_last_snapshot[0], "traceback")
        out["growth"] = [{"size_diff_bytes": s.size_diff, "count_diff": s.count_diff, "size_bytes": s.size,
                          "traceback": [f"{f.filename}:{f.lineno}" for f in list(s.traceback)[-6:]]}
                         for s in sorted(stats, key=lambda s: -s.size_diff)[:TOP_TRACEBACKS]]
    _last_snapshot[:] = [snap]
    return out


def _garbage_report() -> dict[str, Any]:
    """What a full collection finds unreachable now (kept alive for the count with
    ``gc.DEBUG_SAVEALL``, then released and collected by the caller's ``gc.collect()``)."""
    old = gc.get_debug()
    gc.set_debug(old | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(old)
    types = Counter(type(o).__name__ for o in found)
    frames = Counter(f"{os.path.basename(o.f_code.co_filename)}:{o.f_code.co_name}" for o in found
                     if type(o).__name__ == "frame")
    excs = Counter(type(o).__name__ for o in found if isinstance(o, BaseException))
    del found
    return {"garbage_types": dict(types.most_common(40)), "garbage_frames": dict(frames.most_common(40)),
            "garbage_exceptions": dict(excs.most_common(20))}


def memory_report(collect: bool = False, trim: bool = False, garbage: bool = False,
                  trace_frames: int = 0) -> dict[str, Any]:
    """The endpoint's JSON object (module docstring); ``collect`` / ``trim`` / ``garbage`` /
    ``trace_frames`` (``trace=N``, 1..100) as its query flags."""
    out: dict[str, Any] = {}
    if trace_frames:
        import tracemalloc

        if not tracemalloc.is_tracing():
            tracemalloc.start(max(1, min(100, trace_frames)))
    if collect and garbage:
        out.update(_garbage_report())
    if collect:
        out["collected"] = gc.collect()
    if trim:
        out["rss_before_trim_bytes"] = rss_bytes()
        libc = _libc()
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    out["rss_bytes"] = rss_bytes()
    objs = gc.get_objects()
    types = Counter(type(o).__name__ for o in objs)
    out["python"] = {"allocated_blocks": sys.getallocatedblocks(), "gc_counts": list(gc.get_count()),
                     "gc_frozen": gc.get_freeze_count(), "gc_objects": len(objs),
                     "types": dict(types.most_common(TOP_TYPES))}
    del objs
    out["pymalloc"] = pymalloc_stats()
    out["smaps"] = smaps_rollup()
    out["malloc"] = malloc_stats()
    out["tracemalloc"] = _tracemalloc_diff()
    return out
