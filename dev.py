#!/usr/bin/env python3
"""Developer entry point that needs nothing but Python 3.11+.

    python3 dev.py compare [ARGS...]   # pdlb sim compare on the embedded Mooncake trace
    python3 dev.py test [PYTEST ARGS]  # the test suite
    python3 dev.py pdlb ARGS...        # any pdlb command

Each creates ./.venv on first use and installs pdlb from this repository's own pyproject.toml
(re-installing when pyproject.toml changes): ``compare`` and ``pdlb`` the simulator only (the
``sim`` extra), ``test`` everything the tests need (the ``test`` extra: Ray, mypy, pytest, ...,
which the simulator does not need). A venv made for the tests serves ``compare`` too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".pdlb-installed"
#: Extras each command needs, and the extras that include others (``test`` pulls in ``sim``).
EXTRAS = {"compare": "sim", "pdlb": "sim", "test": "test"}
INCLUDES = {"test": {"test", "sim"}, "sim": {"sim"}}


def _installed(digest: str) -> set[str]:
    """Extras installed for this pyproject.toml (none when it changed or nothing is installed)."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(stamp, dict) or stamp.get("pyproject_sha256") != digest or not (BIN / "pdlb").exists():
        return set()
    return {e for x in stamp.get("extras", []) for e in INCLUDES.get(x, {x})}


def ensure_venv(extra: str = "test") -> None:
    if sys.version_info < (3, 11):
        sys.exit(f"pdlb needs Python >= 3.11 (this is {sys.version.split()[0]})")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    have = _installed(digest)
    if extra in have:
        return
    if not (BIN / "python").exists():
        print(f"creating {VENV} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    what = "the simulator" if extra == "sim" else "pdlb and its test dependencies"
    print(f"installing {what} into .venv (pdlb[{extra}]) ...", flush=True)
    subprocess.check_call([str(BIN / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    subprocess.check_call([str(BIN / "python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extra}]"])
    extras = sorted(have | INCLUDES[extra])
    STAMP.write_text(json.dumps({"pyproject_sha256": digest, "extras": extras}))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in EXTRAS:
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    ensure_venv(EXTRAS[cmd])
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
