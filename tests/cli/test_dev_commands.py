"""``pdlb dev``: the developer experiments and tools, whose parsers left the library modules
(``python -m sim.experiments.*``, ``sim/validation/gpu_runs.py``, ``sim/emulator/hostile.py``).
Expected messages are written by hand from each flag's rule; the k-routers table's K = 1 ratio is
1 by its definition (each mode against its own K = 1 run)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from pdlb_cli.dev.main import SUBCOMMANDS
from pdlb_cli.main import main
from sim.emulator.hostile import spawn_fake_engine


def _argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip().splitlines()[-1]


def test_dev_lists_its_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["dev", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    names = ["k-routers", "broker-routers", "tiers-vs-routing", "overload", "gpu-runs", "hostile-engine"]
    assert [c.name for c in SUBCOMMANDS] == names
    for name in names:
        assert f"    {name}" in out, name


@pytest.mark.parametrize(("argv", "message"), [
    (["dev", "k-routers", "--ks", "0"], "pdlb dev k-routers: error: argument --ks: must be >= 1, got 0 (item 1 of '0')"),
    (["dev", "k-routers", "--ks", "1,,2"],
     "pdlb dev k-routers: error: argument --ks: expected integers >= 1 separated by single commas, got '1,,2' "
     "(item 2 is empty: two commas in a row after '1')"),
    (["dev", "k-routers", "--modes", "events,bogus"],
     "pdlb dev k-routers: error: argument --modes: unknown index mode(s) bogus (approximate, events, hybrid, "
     "each optionally +shared-load or +reports)"),
    (["dev", "broker-routers", "--ks", "x"],
     "pdlb dev broker-routers: error: argument --ks: expected an integer >= 1, got 'x' (item 1 of 'x')"),
    (["dev", "tiers-vs-routing", "--rate-scales", "0.6,0"],
     "pdlb dev tiers-vs-routing: error: argument --rate-scales: must be a finite number > 0, got '0' "
     "(item 2 of '0.6,0')"),
    (["dev", "overload", "--duration-s", "-1"],
     "pdlb dev overload: error: argument --duration-s: must be a finite number > 0, got '-1'"),
    (["dev", "hostile-engine", "--port", "-1"],
     "pdlb dev hostile-engine: error: argument --port: must be >= 0, got -1"),
])
def test_bad_arguments_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _argparse_error(argv, capsys) == message


def test_k_routers_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # a small run: 2 router counts of one mode on the trace's first 150 requests
    assert main(["dev", "k-routers", "--ks", "1,2", "--modes", "approximate", "--limit", "150",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| approximate |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2"]
    assert rows[0].rstrip(" |").endswith("x1.00")  # K = 1 against itself
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["mode"], r["k"]) for r in summary] == [("approximate", 1), ("approximate", 2)]
    assert (tmp_path / "summary.md").read_text() == out  # the printed table, written as it was printed


def test_the_fake_engine_starts_through_pdlb_dev() -> None:
    # spawn_fake_engine runs `python -m pdlb_cli.main dev hostile-engine --port 0`: it answers
    # /health and switches its mode on POST /fake/mode
    proc = spawn_fake_engine()
    try:
        assert "dev" in proc.args and "hostile-engine" in proc.args
        with urllib.request.urlopen(f"{proc.url}/health", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok", "requests": 0}
        req = urllib.request.Request(f"{proc.url}/fake/mode", data=b'{"mode": "reject"}', method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["mode"] == "reject"
    finally:
        proc.stop()
