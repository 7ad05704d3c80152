"""The pure helpers of bench/agentx_policies.py: attainment with the error band applied and the
capacity answer's highest load; expected values worked out by hand from the inputs written here."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
ax = pytest.importorskip("agentx_policies")


def test_attainment_counts_requests_meeting_both_bounds_with_the_band_applied():
    ttft = np.array([5.0, 9.0, 9.5, 12.0])
    itl = np.array([20.0, 29.0, 25.0, 10.0])
    # nominal (10 s, 30 ms): 5/20, 9/29, 9.5/25 meet; 12 s misses -> 3 of 4
    assert ax.attainment(ttft, itl, 10.0, 30.0) == 0.75
    # 10% worse TTFT and ITL: 9.9/31.9 misses the ITL, 10.45 s misses the TTFT -> only the first
    assert ax.attainment(ttft, itl, 10.0, 30.0, 1.1, 1.1) == 0.25
    # 20% better: 12 s -> 9.6 s meets -> all 4
    assert ax.attainment(ttft, itl, 10.0, 30.0, 0.8, 0.8) == 1.0


def test_highest_load_takes_the_largest_of_1x_to_2x_that_holds():
    loads = {"1/8x": 8, "1x": 64, "1.5x": 96, "2x": 128}
    res = {("p", "1/8x"): {"att": 0.99}, ("p", "1x"): {"att": 0.95}, ("p", "1.5x"): {"att": 0.91},
           ("p", "2x"): {"att": 0.5}, ("q", "1/8x"): {"att": 0.99}, ("q", "1x"): {"att": 0.8},
           ("q", "1.5x"): {"att": 0.7}, ("q", "2x"): {"att": 0.6}}
    assert ax.highest_load(res, "p", loads, 0.9, "att") == ("1.5x", 96)
    # light load alone does not count as a capacity answer
    assert ax.highest_load(res, "q", loads, 0.9, "att") == ("none", 0)
