"""Benchmark workload generators (sim.workload.benchmarks) and `pdlb sim workload`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdlb_cli.main import main
from sim.workload import ideal_hit_rate, read_mooncake
from sim.workload.benchmarks import load_ramp_workload, shared_prefix_workload


def test_shared_prefix_layout_hand_checked():
    # 2 groups x 3 prompts, system 1024 + question 100 = 1124 tokens -> 3 blocks of 512, the first
    # 1024 // 512 = 2 shared inside a group, the third (straddling the boundary) unique.
    reqs = shared_prefix_workload(2, 3, system_prompt_tokens=1024, question_tokens=100, output_tokens=7,
                                  seed=1, block_size=512)
    assert len(reqs) == 6
    assert all(r.prompt_tokens == 1124 and len(r.block_hashes) == 3 and r.output_tokens == 7 for r in reqs)
    by_group: dict[str, list] = {}
    for r in reqs:
        by_group.setdefault(r.session_id, []).append(r)
    assert sorted(by_group) == ["g0", "g1"]
    for rs in by_group.values():
        assert len({r.block_hashes[:2] for r in rs}) == 1  # shared system prompt
        assert len({r.block_hashes[2] for r in rs}) == 3  # own question block
    assert by_group["g0"][0].block_hashes[0] != by_group["g1"][0].block_hashes[0]
    # infinite cache: per group the first request misses 3 blocks, the next two hit 2 of 3 each
    hit, _ = ideal_hit_rate(reqs, 512)
    assert hit == pytest.approx((2 * 2 * 2) / 18)
    assert all(r.arrival_time_s == 0.0 for r in reqs)  # rate inf


def test_shared_prefix_rate_shuffle_and_eos():
    a = shared_prefix_workload(4, 8, rate_per_s=10.0, seed=3)
    b = shared_prefix_workload(4, 8, rate_per_s=10.0, seed=3)
    assert [r.request_id for r in a] == [r.request_id for r in b]  # deterministic
    times = [r.arrival_time_s for r in a]
    assert times == sorted(times) and times[0] > 0
    ordered = shared_prefix_workload(4, 8, seed=3, shuffle=False)
    assert [r.request_id for r in ordered][:3] == ["g0-p0", "g0-p1", "g0-p2"]
    assert [r.request_id for r in a] != [r.request_id for r in ordered]
    eos = shared_prefix_workload(16, 16, output_tokens=256, seed=2, ignore_eos=False)
    outs = np.array([r.output_tokens for r in eos])
    assert len(set(outs)) > 10 and 200 < outs.mean() < 310  # lognormal with mean 256, sigma 0.5


@pytest.mark.parametrize("kwargs", [dict(num_groups=0), dict(prompts_per_group=0), dict(output_tokens=0),
                                    dict(system_prompt_tokens=-1), dict(rate_per_s=0.0),
                                    dict(system_prompt_tokens=0, question_tokens=0),
                                    dict(output_tokens_sigma=float("nan"))])
def test_shared_prefix_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        shared_prefix_workload(**kwargs)


def test_load_ramp_rates_per_step():
    # counts per step are Poisson(rate * step): 5,000 arrivals per step at 50/s x 100 s, so the
    # measured rate is within 4 sigma = 4 * sqrt(5000) / 100 = 2.8 req/s of the target
    rates = [10.0, 50.0, 0.0, 30.0]
    reqs = load_ramp_workload(rates, 100.0, seed=5)
    times = np.array([r.arrival_time_s for r in reqs])
    assert np.all(np.diff(times) >= 0)
    for k, rate in enumerate(rates):
        n = int(((times >= 100 * k) & (times < 100 * (k + 1))).sum())
        assert abs(n / 100.0 - rate) <= 4 * math.sqrt(rate * 100) / 100 + 1e-9
    assert all(r.prompt_tokens == 1024 and r.output_tokens == 256 for r in reqs)
    assert reqs[0].request_id.startswith("s0-")


def test_load_ramp_shared_prefix_and_bounds():
    reqs = load_ramp_workload([5.0], 40.0, shared_prefix_tokens=1024, num_prefix_groups=2, seed=1)
    firsts = {r.block_hashes[:2] for r in reqs}
    assert len(firsts) == 2  # two groups, two prefixes
    with pytest.raises(ValueError, match="max_requests"):
        load_ramp_workload([1e9], 1e3)
    with pytest.raises(ValueError):
        load_ramp_workload([], 1.0)
    with pytest.raises(ValueError):
        load_ramp_workload([-1.0], 1.0)


def test_cli_writes_replayable_jsonl(tmp_path):
    out = tmp_path / "gsp.jsonl"
    assert main(["sim", "workload", "shared-prefix", "--groups", "3", "--prompts-per-group", "4",
                 "--system-prompt-tokens", "1024", "--question-tokens", "64", "--rate", "5", "--out", str(out)]) == 0
    back = read_mooncake(out)
    assert len(back) == 12 and all(r.prompt_tokens == 1088 for r in back)
    hit, _ = ideal_hit_rate(back, 512)
    assert hit == pytest.approx((3 * 3 * 2) / (12 * 3))
    ramp = tmp_path / "ramp.jsonl"
    assert main(["sim", "workload", "ramp", "--rates", "1,2", "--step-s", "30", "--out", str(ramp)]) == 0
    assert len(read_mooncake(ramp)) > 30
    assert main(["sim", "workload", "ramp", "--rates", "1", "--step-s", "1",
                 "--out", str(tmp_path / "missing" / "x.jsonl")]) == 2


def test_load_ramp_sigma_is_bounded_and_the_mean_holds_within_it():
    from sim.workload.benchmarks import MAX_LENGTH_SIGMA

    with pytest.raises(ValueError, match=r"prompt_tokens_sigma must be a number in \[0, 2\]"):
        load_ramp_workload([1.0], 10.0, prompt_tokens_sigma=MAX_LENGTH_SIGMA + 0.01)
    with pytest.raises(ValueError, match=r"output_tokens_sigma must be a number in \[0, 2\]"):
        load_ramp_workload([1.0], 10.0, output_tokens_sigma=50)
    # sigma 1, ~20,000 prompts: the sample mean's sd is 1024 * sqrt(e - 1) / sqrt(n) ~ 9.5 tokens (the
    # lognormal's variance), so 5% (51 tokens) is > 5 sd; the median is 1024 * exp(-1/2) = 621 (formula)
    reqs = load_ramp_workload([2000.0], 10.0, prompt_tokens_sigma=1.0)
    prompts = np.array([r.prompt_tokens for r in reqs])
    assert len(prompts) > 19_000
    assert prompts.mean() == pytest.approx(1024, rel=0.05)
    assert np.median(prompts) == pytest.approx(1024 * math.exp(-0.5), rel=0.05)


@pytest.mark.parametrize("argv, message", [
    # was: accepted, every prompt 1 token under a "mean" of 1024
    (["--prompt-sigma", "50"], "error: --prompt-sigma must be a number in [0, 2] (lognormal lengths keep the mean "
                               "asked for, but their median is mean x exp(-sigma^2/2): at 2, 13.5% of it), got 50.0"),
    # was: silently cut to the 1024-token prompts
    (["--shared-prefix-tokens", "2048"], "error: --shared-prefix-tokens (2048) is longer than the prompts "
                                         "(--prompt-tokens 1024); a prefix is part of its prompt: lower "
                                         "--shared-prefix-tokens or raise --prompt-tokens"),
    # was: silently nothing shared (whole blocks only)
    (["--shared-prefix-tokens", "100"], "error: --shared-prefix-tokens (100) is shorter than one block "
                                        "(--block-size 512), so nothing would be shared; give 0 or at least 512"),
])
def test_ramp_cli_refuses_lengths_it_cannot_honour(tmp_path, capsys, argv, message):
    out = tmp_path / "w.jsonl"
    assert main(["sim", "workload", "ramp", "--rates", "1", "--step-s", "5", *argv, "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not out.exists()


def test_ramp_shared_prefix_as_long_as_the_prompt_is_accepted():
    # the boundary: every 1024-token prompt is its group's 2 shared blocks (one group): by hand, all
    # requests after the first hit both blocks
    reqs = load_ramp_workload([1.0], 20.0, prompt_tokens_mean=1024, shared_prefix_tokens=1024)
    assert len(reqs) > 2 and {r.block_hashes for r in reqs} == {reqs[0].block_hashes}
    assert len(reqs[0].block_hashes) == 2


def test_cli_prints_the_ideal_hit_rate_both_ways(tmp_path, capsys):
    """The generator prints the block- and the token-weighted ideal hit rate (``pdlb sim run``
    prints the token-weighted one for the same file). Hand count, 4 groups x 8 prompts of a
    2,048-token system prompt (4 blocks of 512) + a 128-token question: 7 of 8 prompts per group
    hit the 4 system blocks: 4 x 7 x 4 / (5 x 32) = 70.0% of blocks, 2,048 x 28 / (2,176 x 32) =
    82.4% of prompt tokens."""
    out = tmp_path / "sp.jsonl"
    assert main(["sim", "workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "8",
                 "--system-prompt-tokens", "2048", "--question-tokens", "128", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(ideal prefix hit rate 70.0% of blocks, 82.4% of prompt tokens)" in text
    assert 2048 * 28 / (2176 * 32) == pytest.approx(0.8235, abs=1e-4)
