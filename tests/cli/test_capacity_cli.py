"""``pdlb sim capacity`` end to end (small slices of the embedded trace), ``--set`` overrides,
policy parameters on the command line and ``--policy-module``."""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from pathlib import Path

import pytest

from pdlb_cli.main import main
from pdlb_cli.args import apply_overrides, parse_override
from sim.scenario import load_scenario


def test_capacity_rate_cli_writes_table_json_csv_plot_and_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cap"
    rc = main(["sim", "capacity", "--policies", "cache_aware,round_robin", "--limit", "150", "--jobs", "1",
               "--slo-ttft-per-1k-tokens-s", "0.5", "--tol", "0.1", "--curve", "0.5", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "highest rate meeting 90% of requests TTFT<=2s+0.5s/1k prompt tokens" in printed
    doc = json.loads((out / "capacity.json").read_text())
    res = {r["policy"]: r for r in doc["results"]}
    assert set(res) == {"cache_aware", "round_robin"}
    for r in res.values():
        assert r["status"] == "found", r["reason"]
        lo, hi = r["bracket"]
        assert hi / lo <= 1.1 + 1e-12
        assert r["rate_rps"] == pytest.approx(lo * r["base_rps"])
        # the best point met the SLO and its goodput = SLO-meeting requests / arrival window
        best = r["best"]
        assert best["meets_slo"] and best["attainment"] >= 0.9
        assert best["goodput_rps"] == pytest.approx(best["attainment"] * best["offered_rps"])
        assert [p["meets_slo"] for p in r["points"] if p["rate_scale"] == lo] == [True]
        assert all(not p["meets_slo"] for p in r["points"] if p["rate_scale"] >= hi)
    assert len(doc["curves"]["cache_aware"]) == 1 and doc["curves"]["cache_aware"][0]["rate_scale"] == 0.5
    assert doc["meta"]["scenario"]["name"] == "dsv3-pd-h200"
    rows = list(csv.DictReader(open(out / "capacity_points.csv")))
    assert len(rows) == sum(len(r["points"]) for r in res.values()) + 2  # + the two curve runs
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "<table>" in html and "sim capacity" in html
    assert "http://" not in html and "https://" not in html  # self-contained: nothing fetched
    assert (out / "capacity_rate.png").stat().st_size > 10_000
    # the ratio column: the best anchor has 1.00
    md = (out / "capacity.md").read_text()
    assert "| 1.00 |" in md


@pytest.mark.parametrize("flags, blind", [([], False), (["--no-route-slo"], True)])
def test_capacity_says_when_the_router_was_slo_blind(flags, blind, tmp_path: Path, capsys) -> None:
    # an SLO unreachable even at zero load: no simulation runs, the answer's header and meta still say how it routed.
    # A dense scenario: on the default (all wide EP) ep_aware routes SLO-blind either way, and the header says so
    # (tests/cli/test_idle_slo_warning.py, review R3)
    rc = main(["sim", "capacity", "--policies", "ep_aware", "--scenario", "llama70b-pd-h100", "--limit", "100",
               "--slo-ttft-s", "0.1", "--jobs", "1", "--no-plots", "--out", str(tmp_path), "--quiet", *flags])
    assert rc == 0
    assert ("routed SLO-blind" in capsys.readouterr().out) is blind
    assert ("routed SLO-blind" in (tmp_path / "capacity.md").read_text().splitlines()[0]) is blind
    assert json.loads((tmp_path / "capacity.json").read_text())["meta"]["route_slo"] is (not blind)


def test_capacity_header_names_the_duration_window(tmp_path: Path, capsys) -> None:
    # with --duration-s the header once described only the whole trace (100 requests over the
    # slice's span), as if every rate ran all of it; it now names the window it was given
    rc = main(["sim", "capacity", "--policies", "ep_aware", "--limit", "100", "--duration-s", "10",
               "--slo-ttft-s", "0.1", "--jobs", "1", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "100 requests over" in printed and "each rate simulated over its first 10 s of arrivals" in printed


def test_capacity_reports_an_unreachable_slo_with_its_reason(tmp_path: Path, capsys) -> None:
    # 99% of requests within a flat 0.5 s (capacity's default adds 0.5 s per 1k prompt tokens; 0 here):
    # long prompts of the trace cannot prefill that fast even alone
    rc = main(["sim", "capacity", "--policies", "least_load", "--limit", "300", "--slo-ttft-s", "0.5",
               "--slo-ttft-per-1k-tokens-s", "0", "--slo-attainment", "99%", "--jobs", "1", "--no-plots", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "unreachable" in printed and "even at zero load" in printed and "-token prompt" in printed
    r = json.loads((tmp_path / "capacity.json").read_text())["results"][0]
    assert r["status"] == "unreachable" and r["points"] == [] and r["zero_load_floor"]["max_attainment"] < 0.99


def test_capacity_gpus_cli(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "capacity", "--search", "gpus", "--policies", "cache_aware", "--limit", "150", "--jobs", "1",
               "--rate-scale", "0.25", "--slo-ttft-per-1k-tokens-s", "1", "--max-prefill-engines", "8",
               "--max-decode-engines", "2", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    r = json.loads((tmp_path / "capacity.json").read_text())["results"][0]
    assert r["status"] == "found", r["reason"]
    assert 1 <= r["prefill_engines"] <= 8 and 1 <= r["decode_engines"] <= 2
    assert r["num_gpus"] == 8 * (r["prefill_engines"] + r["decode_engines"])
    # minimal: one prefill engine fewer (with the decode pool at its maximum) misses the SLO
    pts = {(p["prefill_engines"], p["decode_engines"]): p["meets_slo"] for p in r["points"]}
    assert r["prefill_engines"] > 1 and pts[(r["prefill_engines"] - 1, 2)] is False
    assert (tmp_path / "capacity_gpus.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--policy", "cache_aware:bogus=1"], "policy 'cache_aware' has no parameter 'bogus'"),
    (["--policy", "cache_aware:cache_threshold=x"], "expected a number"),
    (["--policies", "nope"], "unknown policy 'nope'"),
    (["--policy-module", "no_such_mod_q"], "--policy-module no_such_mod_q: cannot import"),
    (["--rate-min", "2", "--rate-max", "1"], "does not hold"),
    (["--search", "gpus", "--max-mixed-engines", "3"], "has no mixed pool"),
    (["--set", "prefill.bogus=1"], "bogus"),
])
def test_capacity_bad_input_is_one_error_line(argv, message, tmp_path: Path, capsys) -> None:
    rc = main(["sim", "capacity", "--limit", "50", "--jobs", "1", "--quiet", "--out", str(tmp_path), *argv])
    assert rc == 2
    out = capsys.readouterr().err
    assert "error:" in out and message in out
    assert not (tmp_path / "capacity.json").exists()


def test_set_overrides_scenario_fields() -> None:
    sc = load_scenario("dsv3-pd-h200")
    assert parse_override("prefill.num_engines=3") == ("prefill.num_engines", 3)
    assert parse_override("hardware=h100") == ("hardware", "h100")  # not TOML: a bare string
    got = apply_overrides(sc, [parse_override("prefill.num_engines=3"), parse_override("perf.mfu=0.5"),
                               parse_override("shared_store.class_ttl_s.chatbot=3600")])
    assert got.prefill.num_engines == 3 and got.num_gpus == 8 * 3 + 8
    assert got.perf.mfu == 0.5
    assert got.shared_store is not None and got.shared_store.class_ttl_s == {"chatbot": 3600}
    assert sc.prefill.num_engines == 6  # the preset is untouched
    with pytest.raises(ValueError, match="expected dotted.key=value"):
        parse_override("prefill.num_engines")
    with pytest.raises(ValueError, match="not a table"):
        apply_overrides(sc, [("model.x", 1)])
    with pytest.raises(ValueError, match="num_engines"):
        apply_overrides(sc, [("prefill.num_engines", 0)])


def test_set_on_sim_run(tmp_path: Path) -> None:
    rc = main(["sim", "run", "--policy", "least_load", "--limit", "40", "--set", "prefill.num_engines=2",
               "--no-plots", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert run["num_gpus"] == 8 * 2 + 8


def test_policy_module_registers_a_user_policy(tmp_path: Path, monkeypatch, capsys) -> None:
    pkg = tmp_path / "userpol_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "firstpol.py").write_text(textwrap.dedent('''
        """Always the first candidate (a user policy for the test)."""
        from dataclasses import dataclass
        from balancer.policies import Policy, register
        from balancer.types import Choice

        @register
        @dataclass(frozen=True)
        class First(Policy):
            name = "user_first"
            offset: int = 0

            def select(self, request, cands, ctx):
                return Choice(cands.replicas[self.offset % len(cands.replicas)])
    '''))
    monkeypatch.chdir(tmp_path)  # found from the current directory, in this process and in pool workers
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        rc = main(["sim", "capacity", "--policy-module", "userpol_pkg.firstpol", "--policy", "user_first:offset=1",
                   "--limit", "60", "--jobs", "2", "--slo-ttft-per-1k-tokens-s", "1", "--tol", "0.2",
                   "--no-plots", "--out", str(tmp_path / "o"), "--quiet"])
        assert rc == 0
        r = json.loads((tmp_path / "o" / "capacity.json").read_text())["results"][0]
        assert r["policy"] == "user_first(offset=1)" and r["points"]
    finally:
        from balancer.policies.base import _REGISTRY
        _REGISTRY.pop("user_first", None)
        sys.modules.pop("userpol_pkg.firstpol", None)


def _browser() -> str | None:
    import shutil

    for name in ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.slow
def test_report_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The report opens in a real browser with its plot drawn: a screenshot has the plot's blue
    (matplotlib's first line colour, #1f77b4) in it, which only the embedded PNG can put there.
    Needs Chromium (Debian: apt-get install chromium-headless-shell); skipped without it."""
    import subprocess

    import matplotlib.image
    import numpy as np

    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium-headless-shell)")
    out = tmp_path / "cap"
    assert main(["sim", "capacity", "--policies", "least_load", "--limit", "100", "--jobs", "1", "--tol", "0.2",
                 "--slo-ttft-per-1k-tokens-s", "0.5", "--out", str(out), "--quiet"]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1300,1400", (out / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = matplotlib.image.imread(shot)[..., :3]
    assert img.shape[:2] == (1400, 1300)
    blue = np.array([0x1F, 0x77, 0xB4]) / 255
    near = np.abs(img - blue).max(axis=-1) < 0.06
    assert near.sum() > 50  # the plot's markers and lines (the page without its image has none: checked by hand)
    assert img.std() > 0.05  # not a blank page


def test_a_reason_shared_by_every_policy_is_printed_once(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "capacity", "--policies", "least_load,round_robin", "--limit", "300", "--slo-ttft-s", "0.5",
               "--slo-ttft-per-1k-tokens-s", "0", "--slo-attainment", "0.99", "--jobs", "1", "--no-plots",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("even at zero load") == 1 and "all 2 policies: unreachable" in printed


def test_set_on_sim_price(capsys) -> None:
    # the default price scenario has 4 prefill GPUs (one engine of 4); two engines make it 8
    assert main(["sim", "price", "--set", "prefill.num_engines=2"]) == 0
    out = capsys.readouterr().out
    assert "(set prefill.num_engines=2) (8 prefill + 64 decode" in out
    assert main(["sim", "price", "--set", "prefill.bogus=2"]) == 2
    assert "prefill.bogus: unknown field" in capsys.readouterr().err
