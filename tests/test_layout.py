"""The tests are laid out like the packages (issue 27 step 5): a test file lives in the folder of
what it tests, ``tests/balancer/``, ``tests/service/``, ``tests/sim/<floor>/`` (the simulator's
floors, ``SIM_FLOORS`` of ``tests/test_import_graph.py``, plus its tools), ``tests/cli/`` or
``tests/bench/``; only the checks of the whole repository stay in ``tests/``. A new test file in the
wrong place: move it (``git mv``), or run ``python3 /work/notes/floors_layout.py --apply`` where that
script is at hand. Expected folder names are written out by hand from docs/ARCHITECTURE.md."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: the whole repository's checks, the only test files at the top
TOP = {"test_import_graph.py", "test_install_extras.py", "test_layout.py", "test_no_capability_probes.py",
       "test_no_library_patches.py", "test_readme_examples.py", "test_trustworthy_answers.py", "test_typing.py"}
FOLDERS = {"balancer", "service", "cli", "bench", "sim/workload", "sim/models", "sim/perf", "sim/scenario", "sim/run",
           "sim/search", "sim/validation", "sim/emulator", "sim/experiments", "sim/pricing"}


def test_top_level_test_files_are_the_whole_repository_checks() -> None:
    top = {p.name for p in TESTS.glob("test_*.py")}
    assert top - TOP == set(), f"move these into the folder of what they test: {sorted(top - TOP)}"


def test_test_files_live_in_the_package_folders() -> None:
    folders = {p.parent.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if p.parent != TESTS}
    assert folders - FOLDERS == set()
    # every folder holds tests (an empty one is a leftover)
    assert folders == FOLDERS


def test_test_file_names_are_unique() -> None:
    # pytest imports a test file by its name (no __init__.py): two of one name cannot both run
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names))
