"""The pure helpers of bench/router_overhead.py: each peer's command line, pdlb's per mode, and the
summary's issue-26 ratios and goal verdicts; expected values worked out by hand from the inputs
written here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
ro = pytest.importorskip("router_overhead")


def eng(port: int) -> SimpleNamespace:
    return SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port)


def test_requests_name_the_emulated_engines_model_and_peers_are_pinned() -> None:
    assert ro.BODY["model"] == "pdlb-emulated"  # smg answers model_not_found for any other name
    assert {n: p.version for n, p in ro.PEERS.items()} == {"smg": "1.13.0", "sglang-router": "0.3.2",
                                                             "vllm-router": "0.1.17"}
    assert ro.PEERS["vllm-router"].log_level == "warning"  # it refuses "warn"


def test_each_peer_speaks_its_own_pd_protocol() -> None:
    p, d = [eng(8001)], [eng(9001), eng(9002)]
    assert ro.PEERS["smg"].pd_args(p, d) == ["--pd-disaggregation", "--prefill", "http://127.0.0.1:8001", "8001",
                                             "--decode", "http://127.0.0.1:9001", "--decode", "http://127.0.0.1:9002"]
    assert ro.PEERS["vllm-router"].pd_args(p, d) == ["--vllm-pd-disaggregation", "--prefill", "http://127.0.0.1:8001",
                                                     "--decode", "http://127.0.0.1:9001",
                                                     "--decode", "http://127.0.0.1:9002"]
    args = ro._pdlb_args("vllm-pd", [eng(8001), eng(9001)], 1)
    assert args[args.index("--pd-protocol") + 1] == "vllm" and "bootstrap" not in " ".join(args)
    args = ro._pdlb_args("pd", [eng(8001), eng(9001)], 1)
    assert args[args.index("--prefill") + 1] == "http://127.0.0.1:8001,bootstrap=8001"


def run(p50: float, p99: float, rps: float, cpu_us: float) -> dict[str, float]:
    return {"p50": p50 / 1e3, "p99": p99 / 1e3, "rps": rps, "cpu_us": cpu_us, "n": 100}


def test_summary_prints_the_issue_table_and_goals(capsys: pytest.CaptureFixture[str]) -> None:
    res = {"direct": [run(0.5, 1.0, 1000, 50)],
           "pdlb": [run(1.0, 2.5, 60, 100)],
           "pdlb x8 (default)": [run(1.0, 3.0, 100, 200)],
           "smg": [run(0.8, 2.0, 80, 100)],
           "vllm-router": [run(0.9, 1.5, 120, 160)],
           "peers": ["smg", "vllm-router"]}
    ro._summary({"regular": res})
    out = capsys.readouterr().out
    # pdlb x8 / smg: req/s 100/80 = 1.25x, CPU 200/100 = 2.00x, added p99 (3-1)/(2-1) = 2.00x
    assert "| regular | pdlb x8 (default) | smg | 1.25x | 2.00x | 2.00x |" in out
    # / vllm-router: 100/120 = 0.83x, 200/160 = 1.25x, added p99 2/0.5 = 4.00x
    assert "| regular | pdlb x8 (default) | vllm-router | 0.83x | 1.25x | 4.00x |" in out
    # goals against the best peer: req/s 100 vs 120, added p99 2.00 vs 0.50 ms, CPU 200 vs 100,
    # and 200 / 100 = 2.00x one pdlb process's
    assert ("regular pdlb x8 (default): req/s 0.83x the best peer's (misses >= 1.0x), added p99 2.00 ms vs "
            "the best peer's 0.50 (misses), CPU/req 2.00x the best peer's (misses <= 1.5x), "
            "2.00x one pdlb process's (misses <= 1.3x)") in out


def test_default_row_is_named_with_the_count_pdlb_serve_really_starts() -> None:
    # pdlb serve without --processes takes one router CPU in LOCAL_ENGINE_CORE_SHARE (4) when a worker is
    # on its host, as the bench's are (issue 30): by hand, max(1, CPUs // 4); the bench used to name the
    # row with the CPU count itself (x8 for 2 processes on --router-cpus 0-7)
    import os

    from balancer.service.launch import LOCAL_ENGINE_CORE_SHARE

    assert LOCAL_ENGINE_CORE_SHARE == 4
    cpus = os.sched_getaffinity(0)
    assert ro.pdlb_default_processes(None) == max(1, len(cpus) // 4)
    assert ro.pdlb_default_processes({min(cpus)}) == 1
    assert os.sched_getaffinity(0) == cpus  # the bench's own CPUs restored
    args = SimpleNamespace(default_processes=ro.pdlb_default_processes(None))
    assert ro._pdlb_name(0, args) == f"pdlb x{max(1, len(cpus) // 4)} (default)"


def test_variant_rows_name_their_own_process_count_and_are_never_the_main_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = SimpleNamespace(default_processes=2)
    assert ro._variant_name("uvloop", ["--event-loop", "uvloop", "--processes", "8"], args) == "pdlb x8, uvloop"
    assert ro._variant_name("aiohttp", ["--upstream-client", "aiohttp"], args) == "pdlb x2, aiohttp"
    # no default row: the goals are judged on the last --pdlb-processes row (x8), not the variant after it
    res = {"direct": [run(0.5, 1.0, 1000, 50)], "pdlb": [run(1.0, 2.5, 60, 100)],
           "pdlb x8": [run(1.0, 3.0, 100, 200)], "pdlb x8, uvloop": [run(1.0, 3.0, 110, 180)],
           "smg": [run(0.8, 2.0, 80, 100)], "peers": ["smg"]}
    ro._summary({"regular": res})
    out = capsys.readouterr().out
    # pdlb x8 / smg by hand: req/s 100/80 = 1.25x, CPU 200/100 = 2.00x, added p99 (3-1)/(2-1) = 2.00x
    assert "| regular | pdlb x8 | smg | 1.25x | 2.00x | 2.00x |" in out
    assert "regular pdlb x8: req/s 1.25x the best peer's (meets >= 1.0x)" in out


def test_baseline_checkouts_are_recognised_by_the_files_that_run_them(tmp_path: Path) -> None:
    # this checkout runs (pdlb_cli/main.py and balancer/router.py exist); a folder without them does not
    assert ro.is_pdlb_checkout(Path(__file__).resolve().parents[2])
    assert not ro.is_pdlb_checkout(tmp_path)
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "cli.py").write_text("")  # what the bench used to look for
    assert not ro.is_pdlb_checkout(tmp_path)
