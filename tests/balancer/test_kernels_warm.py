"""Loading the compiled kernels leaves nothing for the first decision to import (issue 25 review
F11: numba's ``typeof`` of an ndarray loads ``numpy.ma`` lazily, ~120 ms inside the first route)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_loading_the_kernels_loads_numpy_ma():
    pytest.importorskip("numba")
    # a fresh interpreter: in this one another test may already have loaded numpy.ma
    code = ("import sys\n"
            "from balancer import kernels\n"
            "assert kernels.compiled() is not None\n"
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
