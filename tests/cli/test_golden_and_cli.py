"""Golden summary of a 200-request Mooncake slice, and CLI smoke runs.

The golden file makes modelling changes visible in review: when a change is intended, regenerate
it with ``PDLB_REGEN_GOLDEN=1 python3 dev.py test tests/cli/test_golden_and_cli.py`` and commit the diff
with the reason. The golden values are the simulator's own output (a regression pin, not an
independent truth); hand-calculated checks live in test_sim_engine.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdlb_cli.main import main
from sim.run.cluster import simulate
from sim.run.metrics import summarize
from sim.scenario import PoolConfig, Scenario
from sim.workload import read_trace, spread_batches, take_slice

GOLDEN = Path(__file__).parents[1] / "golden" / "summary_200.json"
KEYS = ("ttft_s", "tpot_s", "e2e_s", "prefix_hit_rate", "ideal_hit_rate", "slo_attainment", "goodput_rps",
        "output_tokens_per_s", "prefill_work_imbalance", "decode_work_imbalance", "num_steps")
POLICIES = ("round_robin", "least_load", "cache_aware", "kv_cost")


def _golden_runs() -> dict[str, dict]:
    reqs = spread_batches(take_slice(read_trace(), 0, 200), 3.0, seed=0)
    sc = Scenario(name="golden-200", model="deepseek-v3", hardware="h200",
                  prefill=PoolConfig(num_engines=2, dp_ranks=8), decode=PoolConfig(num_engines=1, dp_ranks=8))
    out = {}
    for p in POLICIES:
        s = summarize(simulate(sc, reqs, p, seed=0))
        out[p] = {k: s[k] for k in KEYS}
    return out


def test_golden_summary_200_requests() -> None:
    got = _golden_runs()
    if os.environ.get("PDLB_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert set(want) == set(got)
    for policy, metrics in want.items():
        for key, value in metrics.items():
            assert got[policy][key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{policy}.{key}"


def test_cli_compare_writes_results(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res"
    rc = main(["sim", "compare", "--limit", "120", "--policies", "round_robin,cache_aware", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "cache_aware" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert [r["policy"] for r in summary["runs"]] == ["round_robin", "cache_aware"]
    assert "--index-mode" not in printed  # the default mode is not mentioned
    assert all(r["num_finished"] == 120 for r in summary["runs"])
    for name in ("requests_round_robin.csv", "requests_cache_aware.csv", "ttft_cdf.png", "rank_load.png", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    # the per-request CSV has a header and one row per request
    assert len((out / "requests_cache_aware.csv").read_text().strip().splitlines()) == 121


def test_cli_run_with_rate_scale_and_split_policies(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "run", "--policy", "kv_cost", "--decode-policy", "least_load", "--limit", "80",
               "--rate-scale", "2", "--no-plots", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert (run["prefill_policy"], run["decode_policy"]) == ("kv_cost", "least_load")
    assert not (tmp_path / "ttft_cdf.png").exists()


def test_cli_tier_preset_events_mode_prints_the_tier_table(tmp_path: Path, capsys) -> None:
    rc = main(["sim", "run", "--scenario", "dsv3-pd-h200-store", "--policy", "least_load", "--limit", "150",
               "--index-mode", "events", "--tier-weights", "host=0.9,store=0.25", "--no-plots",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "KV tiers" in out and "hit hbm/host/store" in out
    assert "TPOT<=100ms, --index-mode events" in out  # the non-default index mode is named in the title
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    # the token-weighted split covers every prompt token exactly once: hbm + host + store + miss = 1
    split = run["kv"]["hit_rate"]
    # the per-tier split is counted per tier; the total from the per-request cached tokens
    assert split["hbm"] + split["host"] + split["store"] == pytest.approx(run["prefix_hit_rate"], abs=1e-9)
    assert split["store"] > 0  # least_load spreads conversations: their prefixes come from the store


def test_parse_tier_weights() -> None:
    from pdlb_cli.args import parse_tier_weights

    assert parse_tier_weights(None) is None
    assert parse_tier_weights("host=0.9, store=0.25") == {"host": 0.9, "store": 0.25}
    with pytest.raises(ValueError, match="name=number"):
        parse_tier_weights("host")
    # names and the [0, 1] range are checked here too, the way balancer.router.Router checks them
    assert parse_tier_weights("host=0,store=1") == {"host": 0.0, "store": 1.0}
    with pytest.raises(ValueError, match=r"^--tier-weights: unknown tier 'disk'; valid: host, store$"):
        parse_tier_weights("disk=0.5")
    with pytest.raises(ValueError, match=r"^--tier-weights: store weight must be in \[0, 1\], got -0.1$"):
        parse_tier_weights("store=-0.1")


@pytest.mark.parametrize("argv, message", [
    (["sim", "compare", "--policies", "round_robin,nope", "--limit", "10"], "unknown policy 'nope'"),
    (["sim", "run", "--scenario", "no-such-preset", "--limit", "10"], "unknown scenario 'no-such-preset'"),
    (["sim", "run", "--trace", "/no/such/file.jsonl", "--limit", "10"], "/no/such/file.jsonl"),
])
def test_cli_errors_are_clear(argv, message, capsys, tmp_path: Path) -> None:
    rc = main(argv + ["--out", str(tmp_path), "--quiet"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_reports_malformed_trace_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5, "input_length": }\n')
    rc = main(["sim", "run", "--trace", str(bad), "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_cli_lists(capsys) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "cache_aware(cache_threshold=0.3, balance_abs=64, balance_rel=1.5)" in out
    # one line per signature whatever its length (ep_aware's is over 200 characters), for grep
    ep = [line for line in out.splitlines() if line.startswith("ep_aware(")]
    assert len(ep) == 1 and ep[0].endswith(")") and "ttft_slo_per_1k_tokens_s=" in ep[0], ep
    assert main(["sim", "scenarios"]) == 0
    assert "dsv3-pd-h200" in capsys.readouterr().out
