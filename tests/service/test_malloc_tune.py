"""glibc's malloc thresholds as ``pdlb serve`` sets them (:func:`balancer.service.body_offload.tune_malloc`,
issue 26): asyncio's small socket reads come from the heap, not a fresh memory mapping each.

Counted by page faults, not timed: a read that gets its own mapping writes into fresh anonymous
memory, a minor fault when the kernel has no page there yet (hand reasoning: one fresh ~260 KiB
mapping per ``recv(256 KiB)``, its first page written; 0.52 faults per read measured on the 2-core
development host), while reads carved from the heap reuse the same pages (0.04 per read there). Each arm runs in its own interpreter (malloc settings are per process)."""

from __future__ import annotations

import asyncio.selector_events
import platform
import subprocess
import sys

import pytest

from balancer.service.body_offload import MALLOC_MMAP_THRESHOLD_BYTES, MALLOC_TRIM_THRESHOLD_BYTES

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

READS = 2000

_PROBE = r"""
import ctypes, resource, socket, sys
from balancer.service.body_offload import tune_malloc
if sys.argv[1] == "pdlb":
    tune_malloc()
else:
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # glibc's default start value, fixed (the setting before issue 26)
a, b = socket.socketpair()
keep = []
for _ in range(200):  # warm-up: the heap grows to its working size
    a.send(b"x" * 300); keep.append(b.recv(256 * 1024)); keep = keep[-50:]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(int(sys.argv[2])):
    a.send(b"x" * 300); keep.append(b.recv(256 * 1024)); keep = keep[-50:]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(arm: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, arm, str(READS)], capture_output=True, text=True, timeout=60,
                         check=True)
    return int(out.stdout.strip())


def test_asyncio_reads_fit_under_the_mmap_threshold() -> None:
    """The reason for the threshold's value: asyncio's socket transports read ``max_size`` bytes at
    a time (256 KiB in CPython 3.10-3.13); the threshold must be above that plus malloc's and the
    bytes object's headers, and the trim threshold above the threshold (a freed read buffer at the
    heap's top is not given back at once)."""
    read = asyncio.selector_events._SelectorSocketTransport.max_size
    assert read == 256 * 1024
    assert MALLOC_MMAP_THRESHOLD_BYTES >= read + 4096
    assert MALLOC_TRIM_THRESHOLD_BYTES >= 2 * MALLOC_MMAP_THRESHOLD_BYTES


def test_small_socket_reads_come_from_the_heap() -> None:
    """2,000 reads of 300 bytes into ``recv(256 KiB)``: under the old fixed 128 KiB threshold a
    fresh mapping per read (at least one fault per 4 reads); with pdlb's settings fewer than one
    per 20 reads (the heap's pages reused)."""
    old, ours = _faults("old"), _faults("pdlb")
    assert old >= READS // 4, f"control arm: {old} faults for {READS} reads (a fresh mapping per read)"
    assert ours < READS // 20, f"{ours} page faults for {READS} small reads with pdlb's malloc settings"
