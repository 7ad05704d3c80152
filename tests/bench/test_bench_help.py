"""Every bench/ script answers ``--help`` (review4 T-finding: ``bench/attention_kinds_jax.py --help``
was a ``ModuleNotFoundError: jax`` traceback on a machine without JAX, and any bad SCALE a
``ValueError`` traceback).

The class: each script started as a command with ``--help`` exits 0 and prints no traceback
(``slow``: one interpreter per script, ~1-2 s each, about 60-90 s for all on the 2-core host). The
exception is ``tf_engine_steps.py``, which hands its arguments to the ``transformers`` CLI and
first asks for its log file, in one ``error:`` line. The JAX script's own checks run without JAX
(they come before the import), not slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: the commands (a module without a ``__main__`` block, such as ``dynamo_peer.py``, is a library of the others)
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())
#: scripts whose --help is answered by something else first: the one line they print instead
NOT_THEIR_HELP = {"tf_engine_steps.py": "error: set PDLB_STEP_LOG"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_answers_help(script):
    done = _run(script, "--help")
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out[-2000:]
    if script in NOT_THEIR_HELP:
        assert done.returncode != 0 and NOT_THEIR_HELP[script] in done.stderr, out[-500:]
    else:
        assert done.returncode == 0 and "usage" in out.lower(), out[-500:]


def test_attention_kinds_jax_checks_its_argument_before_importing_jax():
    # fails before the fix: --help and 'abc' were tracebacks (jax missing, float('abc'))
    done = _run("attention_kinds_jax.py", "--help")
    assert done.returncode == 0 and "usage: python bench/attention_kinds_jax.py [SCALE]" in done.stdout
    assert "Measure one layer's decode attention" in done.stdout  # the doc
    for bad in ("abc", "0", "-1", "nan", "inf"):
        done = _run("attention_kinds_jax.py", bad)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1] == f"error: SCALE must be a finite number > 0, got {bad!r}"
    done = _run("attention_kinds_jax.py", "0.5", "2")
    assert done.returncode == 2 and "error: expected at most one argument (SCALE), got 2" in done.stderr
    try:
        import jax  # noqa: F401
    except ImportError:  # here: the one line saying what to install, no traceback
        done = _run("attention_kinds_jax.py", "0.01")
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.strip().startswith("error: bench/attention_kinds_jax.py needs JAX (pip install jax")
