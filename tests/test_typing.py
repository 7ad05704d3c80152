"""The library ships ``py.typed``: ``mypy balancer`` (config in pyproject.toml) must stay clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_balancer_is_clean(tmp_path):
    pytest.importorskip("mypy")  # in the test extra; skipped only outside `python3 dev.py test`
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "balancer"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout
