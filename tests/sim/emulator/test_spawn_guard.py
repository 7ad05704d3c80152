"""A SIGTERMed test session leaves no ``pdlb engine`` / ``pdlb serve`` behind (``tests/spawn_guard.py``).

A child pytest, with the same session hooks as ``tests/conftest.py``, starts two engines and a
``pdlb serve --processes 2`` (a parent and its two router processes) through
:mod:`sim.emulator.testing`, writes their process ids and sleeps; this test SIGTERMs the child
pytest and then checks that not one of those processes (their descendants included: the router
processes) is left. Before the guard every one of them survived the SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
ROOT = TESTS.parent

CHILD_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import spawn_guard


def pytest_sessionstart(session):
    spawn_guard.install()


def pytest_sessionfinish(session, exitstatus):
    spawn_guard.stop_all()
"""

CHILD_TEST = """
import json, os, time
from pathlib import Path
from sim.emulator.testing import spawn_engine, spawn_router


def test_servers_then_wait():
    p, d = spawn_engine("prefill"), spawn_engine("decode")
    r = spawn_router("sglang", [p], [d], "--processes", "2")
    Path(os.environ["SPAWN_GUARD_PIDS"]).write_text(json.dumps([p.popen.pid, d.popen.pid, r.popen.pid]))
    time.sleep(300)  # the parent test SIGTERMs this session long before
"""


def _procs() -> dict[int, tuple[str, int, int]]:
    """Every process: pid -> (state, parent pid, start time in clock ticks), from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()  # after "(comm)"
            except OSError:
                continue
            out[int(entry.name)] = (fields[0], int(fields[1]), int(fields[19]))  # state, ppid, starttime
    return out


def _tree(roots: set[int]) -> dict[int, int]:
    """``roots`` and all their descendants now: pid -> start time (told apart from a reused pid)."""
    procs = _procs()
    found = {pid: procs[pid][2] for pid in roots if pid in procs}
    grew = True
    while grew:
        grew = False
        for pid, (_state, ppid, start) in procs.items():
            if ppid in found and pid not in found:
                found[pid] = start
                grew = True
    return found


def _alive(snapshot: dict[int, int]) -> set[int]:
    """The processes of ``snapshot`` still running (not zombies, not a reused pid)."""
    procs = _procs()
    return {pid for pid, start in snapshot.items() if pid in procs and procs[pid][0] != "Z" and procs[pid][2] == start}


@pytest.mark.slow  # ~20-40 s on a loaded 2-core host (a child pytest, 2 engines, a 2-process router)
def test_a_sigtermed_session_leaves_no_server(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    pids_file = tmp_path / "pids.json"
    env = {**os.environ, "SPAWN_GUARD_PIDS": str(pids_file), "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                              str(tmp_path / "test_child.py"), "--rootdir", str(tmp_path)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 150
        while not pids_file.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids_file.exists(), child.communicate(timeout=30)[0].decode(errors="replace")[-3000:]
        time.sleep(0.3)  # the file is written in one call; let it land
        tree = _tree(set(json.loads(pids_file.read_text())))
        # 2 engines, the router and its 2 router processes at least (and multiprocessing's helpers)
        assert len(_alive(tree)) >= 5, tree
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        assert child.returncode == -signal.SIGTERM  # died of SIGTERM, as without the guard
        deadline = time.monotonic() + 10
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(tree), f"servers outlived the SIGTERMed session: {sorted(_alive(tree))}"
    finally:  # whatever happened, nothing of this test stays (these are this test's own children)
        if child.poll() is None:
            child.kill()
            child.wait(10)
        for pid in _alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if child.stdout is not None:
            child.stdout.close()
