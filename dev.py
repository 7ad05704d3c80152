#!/usr/bin/env python3
"""Developer entry point that needs nothing but Python 3.11+.

    python3 dev.py compare [ARGS...]   # pdlb sim compare on the embedded Mooncake trace
    python3 dev.py test [PYTEST ARGS]  # the test suite
    python3 dev.py pdlb ARGS...        # any pdlb command

Each creates ./.venv on first use and installs pdlb with its test extras from this repository's
own pyproject.toml (re-installing when pyproject.toml changes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".pdlb-installed"


def ensure_venv() -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"pdlb needs Python >= 3.11 (this is {sys.version.split()[0]})")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest and (BIN / "pdlb").exists():
        return
    if not (BIN / "python").exists():
        print(f"creating {VENV} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("installing pdlb and its test dependencies into .venv ...", flush=True)
    subprocess.check_call([str(BIN / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    subprocess.check_call([str(BIN / "python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"])
    STAMP.write_text(digest)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    ensure_venv()
    if cmd == "compare":
        return subprocess.call([str(BIN / "pdlb"), "sim", "compare", *rest], cwd=ROOT)
    if cmd == "test":
        return subprocess.call([str(BIN / "python"), "-m", "pytest", *rest], cwd=ROOT)
    if cmd == "pdlb":
        return subprocess.call([str(BIN / "pdlb"), *rest], cwd=ROOT)
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
