"""Ray's own banners stay out of pdlb's output (its errors do not). Named to run before
test_ray_executor.py, whose module-wide Ray instance would otherwise be running alongside."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.search.executor import quiet_ray_logs

ROOT = Path(__file__).parents[3]


def test_quiet_ray_logs_passes_errors_only_and_restores_the_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("ray._private.some_module")  # Ray's modules log under "ray"
    before = logging.getLogger("ray").level
    with quiet_ray_logs():
        log.warning("Token authentication is enabled for this Ray cluster.")
        log.info("Started a local Ray instance.")
        log.error("Failed to start GCS")
    log.warning("after")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", "Failed to start GCS"),
                                                                       ("WARNING", "after")]
    assert logging.getLogger("ray").level == before


@pytest.mark.slow
def test_starting_a_local_ray_instance_prints_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    # was: "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ..." on
    # stderr, in the middle of `pdlb sim capacity --executor ray` output
    code = ("from sim.search.executor import RayExecutor\n"
            "ex = RayExecutor(num_cpus=1)\n"
            "print('slots', ex.slots)\n"
            "ex.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "slots 1\n"
    assert res.stderr == ""
