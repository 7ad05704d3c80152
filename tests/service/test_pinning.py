"""``pin_processes`` (``pdlb serve --pin-processes``): each router process on its own CPU.

Expected values by hand: process i gets the i-th CPU of the parent's set in ascending order,
wrapping (balancer/service/processes/pinning.py's docstring); the live test reads each router
process's CPU set from the kernel (``os.sched_getaffinity`` of its pid), not from pdlb.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from balancer.service.config import ServiceConfig
from balancer.service.processes.pinning import process_cpu


# ---------------------------------------------------------------------- the rule
@pytest.mark.parametrize("index,cpus,expected", [
    (0, {3, 1, 7}, 1), (1, {3, 1, 7}, 3), (2, {3, 1, 7}, 7),  # ascending order, whatever the set's order
    (3, {3, 1, 7}, 1), (7, {3, 1, 7}, 3),  # more processes than CPUs: wraps (7 % 3 = 1)
    (5, [4], 4), (2, [0, 0, 2], 0),  # one CPU; duplicates counted once: [0, 2][2 % 2]
])
def test_process_cpu_is_the_index_th_cpu_in_ascending_order_wrapping(index, cpus, expected):
    assert process_cpu(index, cpus) == expected


@pytest.mark.parametrize("index,cpus", [(-1, {0, 1}), (0, set()), (3, [])])
def test_process_cpu_refuses_a_negative_index_or_no_cpus(index, cpus):
    with pytest.raises(ValueError):
        process_cpu(index, cpus)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
@pytest.mark.parametrize("index", [0, 1, 2])
def test_pin_process_pins_the_calling_process_and_its_later_threads(index):
    # in a child interpreter (pytest's own CPU set is left alone): after pin_process(i) the process
    # and a thread it starts afterwards each run on process_cpu(i, the set it had before)
    code = ("import os, sys, threading\n"
            "from balancer.service.processes.pinning import pin_process, process_cpu\n"
            "before = os.sched_getaffinity(0)\n"
            f"cpu = pin_process({index})\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join()\n"
            f"assert cpu == process_cpu({index}, before), (cpu, before)\n"
            "assert os.sched_getaffinity(0) == {cpu} and seen == [{cpu}], (os.sched_getaffinity(0), seen)\n"
            "print(cpu)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == sorted(os.sched_getaffinity(0))[index % len(os.sched_getaffinity(0))]


# ---------------------------------------------------------------------- config and CLI
def test_pin_processes_defaults_off_and_takes_only_a_boolean():
    assert ServiceConfig().pin_processes is False
    assert ServiceConfig(pin_processes=True).pin_processes is True
    for bad in ("yes", "true", 1, 0, None):
        with pytest.raises(ValidationError):
            ServiceConfig(pin_processes=bad)


def test_pin_processes_flag_and_config_file(tmp_path):
    from tests.cli.test_serve_cli import _serve_cfg

    base = ["--pd-protocol", "none", "--mixed", "http://127.0.0.1:31000"]
    assert _serve_cfg(*base).pin_processes is False
    assert _serve_cfg(*base, "--pin-processes").pin_processes is True
    f = tmp_path / "pdlb.yaml"
    f.write_text("pin_processes: true\n")
    assert _serve_cfg("--config", str(f), *base).pin_processes is True  # the file's value survives
    assert _serve_cfg("--config", str(f), *base, "--no-pin-processes").pin_processes is False
    f.write_text("pin_processes: maybe\n")
    with pytest.raises((SystemExit, ValueError)):
        _serve_cfg("--config", str(f), *base)


# ---------------------------------------------------------------------- live
def _router_processes(pid: int) -> list[int]:
    """``pdlb serve``'s router processes: its children but multiprocessing's resource tracker, oldest first."""
    from tests.service.test_placement import _children

    return sorted(p for p in _children(pid) if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists("/proc/self/stat"), reason="Linux only")
@pytest.mark.parametrize("pin", [True, False])
def test_pdlb_serve_pins_each_router_process_to_its_own_cpu(pin):
    # pdlb serve --processes 3 [--pin-processes] in front of one emulated engine: with the option
    # each router process's CPU set (read from the kernel) is one CPU, process i (started i-th)
    # on the i-th CPU of the set, wrapping; the parent keeps the whole set; requests are served.
    # Without it (control arm) every process has the whole set.
    import urllib.request

    from sim.emulator.testing import spawn_engines, spawn_router

    cpus = sorted(os.sched_getaffinity(0))
    engines = spawn_engines([("mixed", "--zero-delay")])
    r = spawn_router("none", [], [], "--processes", "3", *(["--pin-processes"] if pin else []), mixed=engines)
    try:
        kids = _router_processes(r.popen.pid)
        assert len(kids) == 3
        sets = [os.sched_getaffinity(k) for k in kids]
        if pin:
            assert sets == [{cpus[i % len(cpus)]} for i in range(3)]
        else:
            assert sets == [set(cpus)] * 3
        assert os.sched_getaffinity(r.popen.pid) == set(cpus)
        body = b'{"model": "pdlb-emulated", "prompt": "hi", "max_tokens": 2}'
        for _ in range(6):
            req = urllib.request.Request(r.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
    finally:
        for p in (r, *engines):
            p.popen.terminate()
        for p in (r, *engines):
            p.popen.wait(15)
