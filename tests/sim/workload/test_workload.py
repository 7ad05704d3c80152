"""Tests for sim.workload: trace readers, synthetic workloads, transforms, ideal hit rate.

Expected values are worked out by hand in the comments, or (for the embedded trace) were
computed independently by the lead with a separate script.
"""

from __future__ import annotations

import gzip
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from balancer.hashing import chain_block_ids
from balancer.types import Request
from sim.workload import (
    TraceFormatError,
    default_trace_path,
    ideal_hit_rate,
    parse_azure_timestamp_ns,
    poisson_workload,
    read_azure,
    read_mooncake,
    read_trace,
    scale_rate,
    spread_batches,
    take_slice,
)

SHARED_MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def is_sorted(reqs: list[Request], strict: bool = False) -> bool:
    times = [r.arrival_time_s for r in reqs]
    return all((a < b) if strict else (a <= b) for a, b in itertools.pairwise(times))


def req(rid: str, t: float, prompt: int = 10, hashes: tuple[int, ...] = ()) -> Request:
    return Request(request_id=rid, arrival_time_s=t, prompt_tokens=prompt, block_hashes=hashes)


# ---------------------------------------------------------------- Mooncake reader

MOONCAKE_SMALL = (
    '{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}\n'
    "\n"  # blank lines are skipped and do not consume a request index
    '{"timestamp": 1500, "input_length": 1025, "output_length": 0, "hash_ids": [0, 2, 3]}\n'
    '{"timestamp": 1500, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 4], "extra": 1}\n'
)


def test_read_mooncake_small_file(tmp_path: Path) -> None:
    reqs = read_mooncake(write(tmp_path / "t.jsonl", MOONCAKE_SMALL))
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2"]
    assert [r.arrival_time_s for r in reqs] == [0.0, 1.5, 1.5]  # ms / 1000
    assert [r.prompt_tokens for r in reqs] == [1000, 1025, 1536]
    # output_length 0 -> 1; expected == max
    assert [r.max_output_tokens for r in reqs] == [20, 1, 7]
    assert [r.expected_output_tokens for r in reqs] == [20, 1, 7]
    # ceil(1000/512)=2, ceil(1025/512)=3, ceil(1536/512)=3 blocks
    assert [len(r.block_hashes) for r in reqs] == [2, 3, 3]
    assert reqs[0].block_hashes == tuple(chain_block_ids([0, 1]))
    # Shared leading ids -> shared leading hashes, and nothing after the first difference.
    assert reqs[0].block_hashes[0] == reqs[1].block_hashes[0] == reqs[2].block_hashes[0]
    assert reqs[2].block_hashes[:2] == reqs[0].block_hashes
    assert reqs[1].block_hashes[1] != reqs[0].block_hashes[1]
    assert all(r.session_id is None and r.traffic_class is None for r in reqs)


def test_read_mooncake_gzip_limit_and_tag(tmp_path: Path) -> None:
    plain = read_mooncake(write(tmp_path / "t.jsonl", MOONCAKE_SMALL))
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(MOONCAKE_SMALL.encode()))
    assert read_mooncake(gz) == plain
    assert read_mooncake(gz, limit=2) == plain[:2]
    assert read_mooncake(gz, limit=0) == []
    assert {r.traffic_class for r in read_mooncake(gz, traffic_class="chatbot")} == {"chatbot"}
    # block_size is the trace's block size: 256 makes the id counts wrong.
    with pytest.raises(TraceFormatError, match=r"t\.jsonl\.gz:1: .*expected ceil\(1000 / 256\) = 4"):
        read_mooncake(gz, block_size=256)


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]', "invalid JSON"),
        ('{"timestamp": 5, "output_length": 5, "hash_ids": [0, 1]}', "missing field 'input_length'"),
        ('{"timestamp": 5, "input_length": -600, "output_length": 5, "hash_ids": []}', "'input_length' must be >= 1"),
        ('{"timestamp": 5, "input_length": 0, "output_length": 5, "hash_ids": []}', "'input_length' must be >= 1"),
        (
            '{"timestamp": 5, "input_length": 600, "output_length": -1, "hash_ids": [0, 1]}',
            "'output_length' must be >= 0",
        ),
        ('{"timestamp": 5, "input_length": "600", "output_length": 5, "hash_ids": [0, 1]}', "must be an integer"),
        ('{"timestamp": 5, "input_length": 600.0, "output_length": 5, "hash_ids": [0, 1]}', "must be an integer"),
        ('{"timestamp": "5", "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}', "finite number"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0]}', "has 1 ids, expected"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, "a"]}', "only integers"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, -1]}', "must be in"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": 3}', "must be a list"),
        ("[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_read_mooncake_malformed(tmp_path: Path, bad_line: str, message: str) -> None:
    # good line 1, blank line 2, bad line 3: the error names physical line 3.
    path = write(tmp_path / "trace.jsonl", GOOD + "\n" + bad_line + "\n" + GOOD)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_mooncake(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert info.value.line == 3 and info.value.path == str(path)
    assert isinstance(info.value, ValueError)


def test_read_mooncake_time_going_backwards(tmp_path: Path) -> None:
    lines = [
        '{"timestamp": 100, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 100, "input_length": 1, "output_length": 1, "hash_ids": [1]}',  # equal is fine
        '{"timestamp": 99, "input_length": 1, "output_length": 1, "hash_ids": [2]}',
    ]
    path = write(tmp_path / "back.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"back\.jsonl:3: timestamp goes backwards: 99 after 100"):
        read_mooncake(path)


def test_read_mooncake_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(GOOD.encode() + b'{"timestamp": 1, "x": "\xff"}\n')
    with pytest.raises(TraceFormatError, match=r"bin\.jsonl:2: invalid JSON"):
        read_mooncake(path)


# ---------------------------------------------------------------- embedded / real trace


def test_embedded_default_trace() -> None:
    path = default_trace_path()
    assert path.name == "mooncake_conversation.jsonl.gz" and path.is_file()
    assert (path.parent / "NOTICE.txt").is_file()
    reqs = read_trace()
    assert len(reqs) == 12031  # README: 12,031 rows
    # First line of the trace: timestamp 0, input 6758, output 500, 14 ids (= ceil(6758/512)).
    assert (reqs[0].arrival_time_s, reqs[0].prompt_tokens, reqs[0].output_tokens) == (0.0, 6758, 500)
    assert len(reqs[0].block_hashes) == 14
    assert reqs[-1].request_id == "r12030"
    assert reqs[-1].arrival_time_s == pytest.approx(3536.999)  # last timestamp 3536999 ms
    # README: every request starts with block 0 -> the same first hash everywhere.
    assert len({r.block_hashes[0] for r in reqs}) == 1
    assert is_sorted(reqs)


def test_embedded_trace_ideal_hit_rate() -> None:
    blocks, tokens = ideal_hit_rate(read_trace(), 512)
    # README: 36.6% of blocks, 37.4% token-weighted; lead's independent script: 0.3736237.
    assert tokens == pytest.approx(0.3736237, abs=1e-3)
    assert blocks == pytest.approx(0.366, abs=1e-3)


@pytest.mark.skipif(not SHARED_MOONCAKE.exists(), reason="shared trace directory not mounted")
def test_embedded_trace_equals_shared_plain_copy() -> None:
    assert read_trace(SHARED_MOONCAKE) == read_trace()


# ---------------------------------------------------------------- Azure reader

AZURE_SMALL = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
    "2023-11-16 18:15:46.6805900,374,44\r\n"
    "2023-11-16 18:15:47.0000000,1025,0\r\n"
    "2023-11-16 18:16:00.5000001,512,7\r\n"
    "2023-11-17 00:00:00.0000000,1,1\r\n"
)


def test_read_azure_small_file(tmp_path: Path) -> None:
    reqs = read_azure(write(tmp_path / "az.csv", AZURE_SMALL))
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2", "r3"]
    # By hand: 47.0 - 46.68059 = 0.31941; 1:00.5000001 - 46.6805900 = 13.8194101;
    # next midnight - 18:15:46.68059 = 5 h 44 min 13.31941 s = 20653.31941 s.
    assert [r.arrival_time_s for r in reqs] == pytest.approx([0.0, 0.31941, 13.8194101, 20653.31941], abs=1e-9)
    assert [r.prompt_tokens for r in reqs] == [374, 1025, 512, 1]
    assert [r.output_tokens for r in reqs] == [44, 1, 7, 1]  # GeneratedTokens 0 -> 1
    assert [r.max_output_tokens for r in reqs] == [44, 1, 7, 1]
    # ceil(374/512)=1, ceil(1025/512)=3, ceil(512/512)=1, ceil(1/512)=1
    assert [len(r.block_hashes) for r in reqs] == [1, 3, 1, 1]
    all_hashes = [h for r in reqs for h in r.block_hashes]
    assert len(set(all_hashes)) == len(all_hashes) == 6  # no prefix sharing at all
    assert ideal_hit_rate(reqs, 512) == (0.0, 0.0)
    # block_size and limit
    assert [len(r.block_hashes) for r in read_azure(tmp_path / "az.csv", block_size=256, limit=2)] == [2, 5]


def test_read_azure_real_traces_parse() -> None:
    for name, rows in (("azure_llm_2023_code.csv", 8819), ("azure_llm_2023_conv.csv", 19366)):
        path = SHARED_MOONCAKE.parent / name
        if not path.exists():
            pytest.skip("shared trace directory not mounted")
        reqs = read_trace(path)
        assert len(reqs) == rows  # README row counts
        assert reqs[0].arrival_time_s == 0.0
    # code trace rows 1-2: 18:17:04.0319600 - 18:17:03.9799600 = 0.052 s
    code = read_azure(SHARED_MOONCAKE.parent / "azure_llm_2023_code.csv", limit=2)
    assert code[1].arrival_time_s == pytest.approx(0.052, abs=1e-9)


def test_parse_azure_timestamp_ns() -> None:
    # 1970-01-01 00:00:01.5 -> 1.5e9 ns; offsets shift to UTC; 9 digits kept exactly.
    assert parse_azure_timestamp_ns("1970-01-01 00:00:01.5") == 1_500_000_000
    assert parse_azure_timestamp_ns("1970-01-01T01:00:00+01:00") == 0
    assert parse_azure_timestamp_ns("1970-01-01 00:00:00.000000001Z") == 1
    for bad in ("2023-11-16", "2023-02-30 00:00:00", "2023-11-16 24:00:00", "yesterday"):
        with pytest.raises(ValueError):
            parse_azure_timestamp_ns(bad)


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ("2023-11-16 18:15:4x.0000000,10,5", "column 'TIMESTAMP': bad timestamp"),
        ("2023-13-16 18:15:47.0000000,10,5", "column 'TIMESTAMP'"),
        ("2023-11-16 18:15:47.0000000,1o,5", "column 'ContextTokens' must be an integer"),
        ("2023-11-16 18:15:47.0000000,10,5.5", "column 'GeneratedTokens' must be an integer"),
        ("2023-11-16 18:15:47.0000000,0,5", "'ContextTokens' must be >= 1"),
        ("2023-11-16 18:15:47.0000000,10,-5", "'GeneratedTokens' must be >= 0"),
        ("2023-11-16 18:15:47.0000000,10", "expected 3 fields, got 2"),
        ("2023-11-16 18:15:45.0000000,10,5", "timestamp goes backwards"),
    ],
)
def test_read_azure_malformed(tmp_path: Path, bad_row: str, message: str) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n" + bad_row + "\n"
    path = write(tmp_path / "az.csv", text)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_azure(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_read_azure_bad_header(tmp_path: Path) -> None:
    path = write(tmp_path / "h.csv", "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    with pytest.raises(TraceFormatError, match=r"h\.csv:1: header lacks column\(s\) \['ContextTokens'\]"):
        read_azure(path)
    with pytest.raises(TraceFormatError, match=r"e\.csv:1: empty file"):
        read_azure(write(tmp_path / "e.csv", ""))


# ---------------------------------------------------------------- read_trace dispatch


def test_read_trace_dispatch(tmp_path: Path) -> None:
    moon = write(tmp_path / "m.jsonl", MOONCAKE_SMALL)
    az = write(tmp_path / "a.csv", AZURE_SMALL)
    assert read_trace(moon) == read_mooncake(moon)
    assert read_trace(az) == read_azure(az)
    odd = write(tmp_path / "trace.txt", MOONCAKE_SMALL)
    assert read_trace(odd, fmt="mooncake", limit=1) == read_mooncake(moon, limit=1)
    with pytest.raises(ValueError, match="cannot infer the trace format"):
        read_trace(odd)
    with pytest.raises(ValueError, match="valid formats: auto, mooncake, azure"):
        read_trace(moon, fmt="sharegpt")
    with pytest.raises(ValueError, match="embedded default trace is in mooncake format"):
        read_trace(None, fmt="azure")
    assert len(read_trace(None, fmt="mooncake", limit=5)) == 5


# ---------------------------------------------------------------- poisson_workload

POISSON: dict[str, Any] = dict(prompt_tokens_mean=2000.0, output_tokens_mean=200.0)


def test_poisson_deterministic_per_seed() -> None:
    a = poisson_workload(500, 4.0, seed=7, shared_prefix_tokens=1024, num_prefix_groups=3, **POISSON)
    b = poisson_workload(500, 4.0, seed=7, shared_prefix_tokens=1024, num_prefix_groups=3, **POISSON)
    c = poisson_workload(500, 4.0, seed=8, shared_prefix_tokens=1024, num_prefix_groups=3, **POISSON)
    assert a == b
    assert [r.arrival_time_s for r in a] != [r.arrival_time_s for r in c]
    # Different seeds share no block hashes (different hash roots), so merging is safe.
    assert not {h for r in a for h in r.block_hashes} & {h for r in c for h in r.block_hashes}
    assert [r.request_id for r in a[:3]] == ["r0", "r1", "r2"]
    assert is_sorted(a, strict=True)
    assert poisson_workload(0, 1.0, seed=0, **POISSON) == []


def test_poisson_rate_and_length_means() -> None:
    n, rate = 20_000, 5.0
    reqs = poisson_workload(n, rate, seed=123, **POISSON)
    # The last arrival is a sum of n Exp(rate) gaps: mean n/rate, relative sd 1/sqrt(n) = 0.71%;
    # 4% is more than 5 sd.
    assert n / reqs[-1].arrival_time_s == pytest.approx(rate, rel=0.04)
    gaps = np.diff([0.0] + [r.arrival_time_s for r in reqs])
    # Exponential gaps: coefficient of variation 1 (sd of the sample CV ~ 1/sqrt(n) ~ 0.7%).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    # Lognormal sigma=1: sd of the sample mean = mean * sqrt(e - 1) / sqrt(n) = 0.93%; 5 sd ~ 4.6%.
    assert np.mean([r.prompt_tokens for r in reqs]) == pytest.approx(2000, rel=0.05)
    # sigma=0.5: sd of the sample mean = mean * sqrt(e^0.25 - 1) / sqrt(n) = 0.38%; 5 sd ~ 1.9%.
    assert np.mean([r.output_tokens for r in reqs]) == pytest.approx(200, rel=0.02)
    assert min(r.prompt_tokens for r in reqs) >= 1 and min(r.output_tokens for r in reqs) >= 1


def test_poisson_constant_lengths_and_block_counts() -> None:
    reqs = poisson_workload(
        50,
        1.0,
        seed=1,
        prompt_tokens_mean=1000,
        output_tokens_mean=30,
        prompt_tokens_sigma=0,
        output_tokens_sigma=0,
        block_size=256,
    )
    assert {r.prompt_tokens for r in reqs} == {1000}
    assert {r.output_tokens for r in reqs} == {30}
    assert {len(r.block_hashes) for r in reqs} == {4}  # ceil(1000 / 256)
    assert ideal_hit_rate(reqs, 256) == (0.0, 0.0)  # no shared prefix -> nothing to hit


def test_poisson_shared_prefixes() -> None:
    # Constant 3000-token prompts, 512-token blocks -> 6 blocks; the first 1024 // 512 = 2 are
    # shared within each of 3 groups, the other 4 are unique.
    reqs = poisson_workload(
        300,
        10.0,
        seed=3,
        prompt_tokens_mean=3000,
        output_tokens_mean=10,
        prompt_tokens_sigma=0,
        shared_prefix_tokens=1024 + 100,
        num_prefix_groups=3,
    )
    assert {len(r.block_hashes) for r in reqs} == {6}
    assert len({r.block_hashes[:2] for r in reqs}) == 3
    later = [h for r in reqs for h in r.block_hashes[2:]]
    assert len(set(later)) == len(later) == 300 * 4
    # Ideal hit rate: each group's first request misses, every later one hits 2 of 6 blocks,
    # so blocks = 2 * (300 - 3) / (6 * 300) = 0.33; tokens = 1024 * 297 / (3000 * 300) = 0.33792.
    blocks, tokens = ideal_hit_rate(reqs, 512)
    assert blocks == pytest.approx(2 * 297 / 1800)
    assert tokens == pytest.approx(1024 * 297 / 900_000)


def test_poisson_short_prompt_shares_only_its_full_blocks() -> None:
    # One group, 2048-token prefix (4 blocks), prompts of mean 800: a request of n tokens shares
    # its first min(2048, n) // 512 blocks with every other request, and nothing after that.
    reqs = poisson_workload(
        200,
        10.0,
        seed=5,
        prompt_tokens_mean=800,
        output_tokens_mean=10,
        shared_prefix_tokens=2048,
        num_prefix_groups=1,
    )
    longest = max(reqs, key=lambda r: r.prompt_tokens)
    for r in reqs:
        k = min(2048, r.prompt_tokens) // 512
        assert r.block_hashes[:k] == longest.block_hashes[:k]
        if k < len(r.block_hashes):  # the first non-shared block is unique to the request
            assert all(r.block_hashes[k] != o.block_hashes[k] for o in reqs if o is not r and len(o.block_hashes) > k)


def test_poisson_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        poisson_workload(10, 0.0, seed=0, **POISSON)
    with pytest.raises(ValueError, match="num_requests"):
        poisson_workload(-1, 1.0, seed=0, **POISSON)
    with pytest.raises(ValueError, match="prompt_tokens_mean"):
        poisson_workload(10, 1.0, seed=0, prompt_tokens_mean=0, output_tokens_mean=1)


# ---------------------------------------------------------------- transforms


def test_scale_rate() -> None:
    reqs = [req("a", 0.0), req("b", 1.0), req("c", 3.0)]
    before = list(reqs)
    fast = scale_rate(reqs, 2.0)
    assert [r.arrival_time_s for r in fast] == [0.0, 0.5, 1.5]  # times halved
    assert [r.arrival_time_s for r in scale_rate(reqs, 0.5)] == [0.0, 2.0, 6.0]
    assert [r.request_id for r in fast] == ["a", "b", "c"]
    assert reqs == before and [r.arrival_time_s for r in reqs] == [0.0, 1.0, 3.0]  # input untouched
    for bad in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            scale_rate(reqs, bad)


def test_take_slice() -> None:
    reqs = [req(f"r{i}", float(i)) for i in range(6)]  # times 0..5
    ids = lambda rs: [r.request_id for r in rs]  # noqa: E731
    assert ids(take_slice(reqs, 1, 2)) == ["r1", "r2"]
    assert ids(take_slice(reqs, 4)) == ["r4", "r5"]
    assert ids(take_slice(reqs, start_s=1.0, duration_s=2.0)) == ["r1", "r2"]  # [1, 3): 3 excluded
    assert ids(take_slice(reqs, start_s=3.5)) == ["r4", "r5"]
    assert ids(take_slice(reqs, duration_s=2.5)) == ["r0", "r1", "r2"]  # from the earliest arrival
    assert ids(take_slice(reqs, 1, 1, start_s=2.0)) == ["r3"]  # position counted after the window
    assert take_slice(reqs, start_s=2.0)[0].arrival_time_s == 2.0  # not re-based
    assert take_slice(reqs, 10) == []
    for kwargs in ({"start": -1}, {"count": -1}, {"duration_s": 0.0}, {"start_s": math.nan}):
        with pytest.raises(ValueError):
            take_slice(reqs, **kwargs)  # type: ignore[arg-type]


def test_spread_batches() -> None:
    # Batches at t=0 (3 requests) and t=3 (2), singleton at t=6; window 3 s.
    times = [0.0, 0.0, 0.0, 3.0, 3.0, 6.0]
    reqs = [req(f"r{i}", t) for i, t in enumerate(times)]
    out = spread_batches(reqs, 3.0, seed=11)
    assert spread_batches(reqs, 3.0, seed=11) == out  # deterministic per seed
    assert spread_batches(reqs, 3.0, seed=12) != out
    assert [r.arrival_time_s for r in reqs] == times  # input untouched
    assert sorted(r.request_id for r in out) == [r.request_id for r in reqs]
    new = {r.request_id: r.arrival_time_s for r in out}
    for r in reqs:
        assert r.arrival_time_s <= new[r.request_id] < r.arrival_time_s + 3.0
    assert is_sorted(out)
    assert new["r0"] <= new["r1"] <= new["r2"] and new["r3"] <= new["r4"]  # batch order kept
    assert len(set(new.values())) == 6
    kept = {r.request_id: r.arrival_time_s for r in spread_batches(reqs, 3.0, seed=11, include_singletons=False)}
    assert kept["r5"] == 6.0
    # A window wider than the batch spacing interleaves batches; the output is still sorted.
    wide = spread_batches(reqs, 10.0, seed=0)
    assert is_sorted(wide)
    with pytest.raises(ValueError):
        spread_batches(reqs, 0.0, seed=0)


def test_spread_batches_on_embedded_trace() -> None:
    reqs = read_trace()
    out = spread_batches(reqs, 3.0, seed=0)
    assert len(out) == len(reqs)
    # README: 90% of gaps are 0 before spreading; afterwards (almost) none are.
    gaps = np.diff([r.arrival_time_s for r in out])
    assert (gaps >= 0).all() and (gaps == 0).mean() < 0.01
    # Batches are 3.0 s apart (+-3 ms) and never move by >= 3 s, so the hit rate is unchanged
    # up to reordering across the boundary of adjacent batches.
    assert ideal_hit_rate(out, 512)[1] == pytest.approx(0.3736237, abs=1e-3)


# ---------------------------------------------------------------- ideal_hit_rate


def test_ideal_hit_rate_hand_example() -> None:
    # block_size 4. A (t=0): 8 tokens, blocks [a, b]; B (t=1): 10 tokens, [a, b, c];
    # C (t=2): 6 tokens, [a, b] (its 2nd block is partial). Given out of order on purpose.
    a = tuple(chain_block_ids([1, 2]))
    b = tuple(chain_block_ids([1, 2, 3]))
    reqs = [req("C", 2.0, 6, a), req("A", 0.0, 8, a), req("B", 1.0, 10, b)]
    # In arrival order: A hits 0, B hits 2 (a, b), C hits 2.
    # blocks: (0 + 2 + 2) / (2 + 3 + 2) = 4/7
    # tokens: (0 + min(8, 10) + min(8, 6)) / (8 + 10 + 6) = 14/24
    assert ideal_hit_rate(reqs, 4) == pytest.approx((4 / 7, 14 / 24))
    # A prefix hit stops at the first miss even if later blocks were seen: [x, a...] is chained,
    # so a different first block makes every later hash new.
    d = tuple(chain_block_ids([9, 2]))
    assert ideal_hit_rate([req("A", 0.0, 8, a), req("D", 1.0, 8, d)], 4) == (0.0, 0.0)
    assert ideal_hit_rate([], 4) == (0.0, 0.0)
    with pytest.raises(ValueError):
        ideal_hit_rate(reqs, 0)
