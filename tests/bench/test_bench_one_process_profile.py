"""The pure parts of bench/one_process_profile.py: the code areas of py-spy frames, the tables
collapsed from a py-spy raw file, and the refusal of bad arguments. Expected values are counted by
hand from the raw lines written here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
opp = pytest.importorskip("one_process_profile")


@pytest.mark.parametrize(("frame", "area"), [
    ("_serve (/x/balancer/service/lean_front.py:519)", "pdlb lean front"),
    ("_attempt (/x/balancer/service/proxy.py:584)", "pdlb proxy"),
    ("send (/x/balancer/service/upstream.py:491)", "pdlb upstream client"),
    ("_route (/x/balancer/router.py:513)", "pdlb core (routing)"),
    ("add (/x/balancer/service/processes/shared_load.py:10)", "pdlb shared state"),
    ("run (/usr/lib/python3.12/asyncio/runners.py:118)", "event loop (C) + idle"),
    ("create_task (/usr/lib/python3.12/asyncio/tasks.py:384)", "asyncio (Python)"),
    ("select (/usr/lib/python3.11/selectors.py:468)", "epoll wait"),
    ("epoll_pwait (libc.so.6)", "epoll wait"),
    ("observe (prometheus_client/metrics.py:6)", "prometheus"),
    ("whatever (/somewhere/else.py:1)", "other"),
])
def test_area_of_a_frame(frame: str, area: str) -> None:
    assert opp.area(frame) == area


def test_collapse_counts_leaf_areas_functions_and_inclusive_once_per_stack(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    # three stacks: 5 + 3 + 2 = 10 samples; _serve is in all three (inclusive 10), _attempt in the
    # first two (8), the event loop's run is the leaf of the third only (2); a recursive stack
    # (handle twice) counts handle once per stack
    raw.write_text(
        "process 1:\"python\";run (/p/asyncio/runners.py:118);_serve (/x/balancer/service/lean_front.py:519);"
        "_attempt (/x/balancer/service/proxy.py:584);_route (/x/balancer/router.py:513) 5\n"
        "process 1:\"python\";run (/p/asyncio/runners.py:118);_serve (/x/balancer/service/lean_front.py:519);"
        "handle (/x/balancer/service/proxy.py:480);handle (/x/balancer/service/proxy.py:483);"
        "_attempt (/x/balancer/service/proxy.py:590) 3\n"
        "process 1:\"python\";_serve (/x/balancer/service/lean_front.py:530);run (/p/asyncio/runners.py:118) 2\n"
        "not a sample line\n")
    col = opp.collapse(raw)
    assert col["samples"] == 10
    assert dict(col["areas"]) == {"pdlb core (routing)": 5, "pdlb proxy": 3, "event loop (C) + idle": 2}
    incl = {fn.split(" (")[0]: n for fn, n in col["incl"].items()}
    assert incl["_serve"] == 10 and incl["_attempt"] == 8 and incl["handle"] == 3 and incl["_route"] == 5
    assert incl["run"] == 10
    leaf = {fn.split(" (")[0]: n for fn, n in col["self"].items()}
    assert leaf == {"_route": 5, "_attempt": 3, "run": 2}


def test_report_scales_samples_to_the_measured_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    # 4 samples in epoll (left out), 6 busy: 3 proxy, 3 core; 120 us/request measured -> 20 us a sample
    raw.write_text("a;select (/p/selectors.py:468) 4\n"
                   "a;_attempt (/x/balancer/service/proxy.py:1) 3\n"
                   "a;_route (/x/balancer/router.py:1) 3\n")
    out = opp.report("regular", opp.collapse(raw), 120.0, 10)
    assert out["busy"] == 6
    assert out["areas_us"]["pdlb proxy"] == pytest.approx(60.0)
    assert out["areas_us"]["pdlb core (routing)"] == pytest.approx(60.0)
    assert "120 us CPU per request" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--modes", "nope"], ["--rate", "0"], ["--duration-s", "0.5"],
                                  ["--connections", "0"], ["--py-spy", ""]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "one_process_profile.py"), *argv],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "error:" in r.stderr
