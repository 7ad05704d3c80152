"""The vLLM pool options as scenario TOML keys and ``pdlb sim`` flags (issue 23 part 1, item 2):
max_num_seqs, max_chunk_tokens, prefill_schedule_interval, prefix_cache_retention_interval_tokens.
Checked: a TOML file's keys reach the simulated ranks; the flags set every pool; bad values are
refused with the flag or key named; the scenario dump (and so the sweep point id) does not change
while they are off."""

from __future__ import annotations

import argparse
import json

import pytest

from pdlb_cli.engine_options import add_engine_option_args, apply_engine_options
from sim.run.cluster import Cluster, hit_checkpoints_for
from sim.perf.step_class import StepClassPerf
from sim.run.pool_perf import build_perf
from sim.scenario import PRESETS, PoolConfig, Scenario, load_scenario

TOML = """
name = "v4-vllm"
model = "deepseek-v4-pro"
hardware = "B200"
block_size = 256

[mixed]
num_engines = 1
dp_ranks = 8
max_num_seqs = 16
max_chunk_tokens = 512
prefill_schedule_interval = 8
prefix_cache_retention_interval_tokens = 32768
"""


class _NoRouter:
    def add_replica(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):  # noqa: ANN204 (any other router hook: a no-op)
        return lambda *a, **k: None


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_option_args(p)
    return p.parse_args(argv)


def test_toml_keys_reach_every_rank(tmp_path) -> None:
    path = tmp_path / "v4.toml"
    path.write_text(TOML)
    sc = load_scenario(path)
    cluster = Cluster(sc, lambda blocks: _NoRouter(), build_perf)  # no request is routed here
    assert len(cluster.ranks) == 8
    for rank in cluster.ranks:
        assert (rank.max_num_seqs, rank.max_chunk_tokens) == (16, 512)
        # no MTP in the perf model: no window block past the hit is needed
        assert rank.hit_checkpoints is not None and rank.hit_checkpoints.peek_tokens == 0
        assert rank.hit_checkpoints.interval_blocks == 32768 // 256
    assert all(g.prefill_schedule_interval == 8 for g in cluster.groups)


def test_mtp_on_v4_needs_one_64_token_window_block_past_the_hit() -> None:
    sc = Scenario(name="t", model="deepseek-v4-pro", hardware="B200", block_size=256,
                  mixed=PoolConfig(dp_ranks=8, prefix_cache_retention_interval_tokens="dense"))
    base = build_perf(sc, sc.mixed)
    mtp = StepClassPerf(base, verify_tokens_per_seq=4, decode_tokens_per_step=2.49)
    assert hit_checkpoints_for(sc, sc.mixed, mtp).peek_tokens == 64  # V4's SWA block (vLLM DeepseekV4SWACache)
    assert hit_checkpoints_for(sc, sc.mixed, base).peek_tokens == 0
    assert hit_checkpoints_for(sc, sc.mixed, base).dense


def test_flags_set_every_pool_and_keep_the_rest() -> None:
    sc = PRESETS["dsv3-pd-h200"]
    args = _parse(["--max-num-seqs", "32", "--max-chunk-tokens", "2048", "--prefill-schedule-interval", "4"])
    out = apply_engine_options(sc, args)
    for pool in (out.prefill, out.decode):
        assert (pool.max_num_seqs, pool.max_chunk_tokens, pool.prefill_schedule_interval) == (32, 2048, 4)
        assert pool.prefix_cache_retention_interval_tokens is None
    assert out.prefill.num_engines == sc.prefill.num_engines
    assert apply_engine_options(sc, _parse([])) == sc  # no flag: the scenario itself


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--max-chunk-tokens", "-5"],
                                  ["--prefill-schedule-interval", "x"], ["--prefix-cache-retention", "sparse"],
                                  ["--prefix-cache-retention", "-256"]])
def test_bad_flag_values_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(argparse.ArgumentError):
        _parse(argv)


def test_the_scenario_checks_retention_against_block_size_and_model(tmp_path) -> None:
    sc = load_scenario(_write(tmp_path, TOML))
    with pytest.raises(ValueError, match="--prefix-cache-retention.*multiple of block_size \\(256\\)"):
        apply_engine_options(sc, _parse(["--prefix-cache-retention", "1000"]))
    with pytest.raises(ValueError, match="no cached sliding-window KV group"):
        apply_engine_options(PRESETS["dsv3-pd-h200"], _parse(["--prefix-cache-retention", "dense"]))
    bad = TOML.replace("32768", "100")
    with pytest.raises(ValueError, match="v4.toml.*multiple of block_size"):
        load_scenario(_write(tmp_path, bad))


def _write(tmp_path, text: str):
    path = tmp_path / "v4.toml"
    path.write_text(text)
    return path


def test_options_at_their_off_values_leave_the_dump_unchanged() -> None:
    # the dump hashes into the sweep point ids (tests/test_trustworthy_answers.py pins some)
    plain = PoolConfig(dp_ranks=8)
    explicit = PoolConfig(dp_ranks=8, max_num_seqs=None, max_chunk_tokens=None, prefill_schedule_interval=1,
                          prefix_cache_retention_interval_tokens=None)
    assert json.dumps(plain.model_dump()) == json.dumps(explicit.model_dump())
    assert "prefix_cache_retention_interval_tokens" not in plain.model_dump()
    on = PoolConfig(dp_ranks=8, prefix_cache_retention_interval_tokens=0).model_dump()
    assert on["prefix_cache_retention_interval_tokens"] == 0


SPEC = TOML + """
[speculative]
draft_tokens = 3
acceptance = [0.7, 0.6, 0.5]
verify = "every_step"
"""


def test_mtp_every_step_from_toml_reaches_the_ranks(tmp_path) -> None:
    sc = load_scenario(_write(tmp_path, SPEC))
    perf = build_perf(sc, sc.mixed)
    # hand calculation: 1 + 3 verified tokens per sequence; tau(3) = 1 + 0.7 + 0.7*0.6 + 0.7*0.6*0.5 = 2.33
    assert isinstance(perf, StepClassPerf)
    assert perf.verify_tokens_per_seq == 4 and perf.decode_tokens_per_step == pytest.approx(2.33)
    cluster = Cluster(sc, lambda blocks: _NoRouter(), build_perf)
    rank = cluster.ranks[0]
    assert rank.verify_tokens_per_seq == 4 and rank.decode_tokens_per_step == pytest.approx(2.33)
    assert rank.hit_checkpoints.peek_tokens == 64  # MTP on V4: one window block past the hit
    # the mean-field default keeps SpecDecodePerf, and its dump has no verify key (point ids unchanged)
    mean_field = load_scenario(_write(tmp_path, SPEC.replace('verify = "every_step"\n', "")))
    assert not isinstance(build_perf(mean_field, mean_field.mixed), StepClassPerf)
    assert "verify" not in mean_field.model_dump()["speculative"]
    # the flag switches it, and refuses a scenario without speculation
    assert apply_engine_options(mean_field, _parse(["--speculative-verify", "every_step"])).speculative.verify == "every_step"
    with pytest.raises(ValueError, match="no \\[speculative\\] table"):
        apply_engine_options(sc.model_copy(update={"speculative": None}), _parse(["--speculative-verify", "every_step"]))
    with pytest.raises(ValueError, match="dynamic"):
        load_scenario(_write(tmp_path, SPEC + "dynamic = true\n"))
