"""bench/shared_prefix_apply.py measures what it says: every distinct decision written is read and
recorded once by the reader (the script asserts it), and both costs are positive CPU times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
spa = pytest.importorskip("shared_prefix_apply")


def test_measure_reads_every_decision_once() -> None:
    publish_us, drain_us = spa.measure(blocks=4, decisions=40, per_pass=3, policy="round_robin", replicas=2, block_size=16)
    assert publish_us > 0 and drain_us > 0
