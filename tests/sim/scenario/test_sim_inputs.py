"""Simulator and library inputs (issue 14, items 11-14): what cannot fit is refused and counted,
a trace's block size is part of the trace, bad traces and scenarios give one-line errors on stderr,
and a seeded trace/scenario fuzzer for the simulator CLI (never a traceback, a hang or exit 1)."""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path

import pytest

from balancer.router import RequestTooLargeError, Router
from balancer.types import ReplicaId, Request
from sim.run.admission import admit, check_block_size
from pdlb_cli.main import main
from sim.run.cluster import simulate
from sim.run.metrics import summarize
from sim.scenario import PoolConfig, Scenario, load_scenario
from sim.workload import read_trace, take_slice
from sim.workload.errors import TraceFormatError
from sim.workload.mooncake import read_mooncake


def _req(i: int, prompt: int, out: int, bs: int = 512) -> Request:
    return Request(f"r{i}", float(i), prompt, tuple(range(1000 * i, 1000 * i + -(-prompt // bs))),
                   max_output_tokens=out, expected_output_tokens=out)


# ---------------------------------------------------------------------- item 11
def test_admit_counts_reasons():
    # hand-made: max_model_len 1000, decode ranks hold 800 tokens, prefill ranks 600
    reqs = [_req(0, 500, 100), _req(1, 900, 200), _req(2, 700, 50), _req(3, 500, 400), _req(4, 100, 1)]
    ok, rejected = admit(reqs, 1000, 800, 600)
    assert [r.request_id for r in ok] == ["r0", "r4"]
    # r1: 1100 > 1000; r2: prompt 700 > prefill 600; r3: 900 > decode 800
    assert rejected == {"max_model_len": 1, "kv_capacity": 2}


def test_simulate_rejects_what_cannot_fit_and_still_finishes():
    # before: a 300k + 100k request on a 370k-token rank "finished" after 33 simulated minutes and
    # stalled its EP engine; 10**12 output tokens never ended
    sc = Scenario(model="deepseek-v3", hardware="h200", max_model_len=1_000_000,
                  prefill=PoolConfig(num_engines=1, dp_ranks=8), decode=PoolConfig(num_engines=1, dp_ranks=8,
                                                                                  kv_capacity_tokens=370_000))
    reqs = [_req(0, 2000, 10), _req(1, 300_000, 100_000), _req(2, 4000, 5), _req(3, 1000, 999_500)]
    t0 = time.perf_counter()
    res = simulate(sc, reqs, "round_robin")
    s = summarize(res)
    assert time.perf_counter() - t0 < 30
    assert s["num_requests"] == s["num_finished"] == 2 and s["num_rejected"] == 2
    assert s["rejected"] == {"kv_capacity": 1, "max_model_len": 1}  # 400k > 370k; 1,000,000 > max_model_len


def test_default_max_model_len_keeps_the_mooncake_trace_whole():
    sc = load_scenario("dsv3-pd-h200")
    assert sc.effective_max_model_len == 163_840
    reqs = read_trace()
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) == 126_527 < 163_840  # nothing rejected


def test_library_router_respects_known_kv_capacity():
    router = Router("least_load", "least_load", block_size=16)
    small, big = ReplicaId("small", 0), ReplicaId("big", 0)
    router.add_replica(small, "mixed", kv_capacity_tokens=1000)
    big_req = Request("a", 0.0, 10_000_000, (), max_output_tokens=16)
    with pytest.raises(RequestTooLargeError, match="10000016 tokens"):
        router.route(big_req, 0.0)
    router.add_replica(big, "mixed", kv_capacity_tokens=20_000_000)
    for i in range(3):  # least_load would alternate; only "big" fits
        assert router.route(Request(f"b{i}", 0.0, 10_000_000, (), max_output_tokens=16), 0.0).decode == big
    assert router.route(Request("c", 0.0, 10, (), max_output_tokens=1), 0.0).decode == small  # idle one


# ---------------------------------------------------------------------- item 12
def test_block_size_of_the_trace_is_checked():
    reqs = take_slice(read_trace(), 0, 50)  # Mooncake: hash_ids per 512 tokens
    check_block_size(reqs, 512)
    for bs in (16, 1024):
        with pytest.raises(ValueError, match="block_size"):
            check_block_size(reqs, bs)
        sc = Scenario(block_size=bs, model="deepseek-v3", hardware="h200", prefill=PoolConfig(), decode=PoolConfig())
        with pytest.raises(ValueError, match="the trace's"):
            simulate(sc, reqs, "round_robin")


def test_cli_refuses_a_scenario_block_size_other_than_the_trace(tmp_path: Path, capsys):
    f = tmp_path / "sc.toml"
    # a model that fits the one-GPU pools: V3 does not, which is reported first
    f.write_text('block_size = 16\nmodel = "llama-3.1-8b"\nhardware = "h200"\n[prefill]\n[decode]\n')
    assert main(["sim", "run", "--scenario", str(f), "--limit", "20", "--quiet", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "block_size 16" in err and "Mooncake: 512" in err


# ---------------------------------------------------------------------- item 13
def _one_error(argv: list[str], capsys) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2, cap
    assert cap.out == "" and cap.err.startswith("error: ") and cap.err.count("\n") == 1, cap
    return cap.err


@pytest.mark.parametrize("content,needle", [
    (b"[" * 50_000 + b"]" * 50_000 + b"\n", ":1: invalid JSON: nested too deeply"),
    (b'{"timestamp": 0, "timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n', "given twice"),
    (b'{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, "hash_ids": [1]}\n', "'input_length' must be"),
    (b'{"timestamp": 0, "input_length": 10, "output_length": 1000000000000, "hash_ids": [1]}\n', "'output_length' must be"),
    (b'{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n', "'timestamp' must be a finite"),
    (b'{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}\n', "'input_length' must be an integer"),
])
def test_bad_mooncake_lines(tmp_path: Path, capsys, content: bytes, needle: str):
    f = tmp_path / "t.jsonl"
    f.write_bytes(content)
    err = _one_error(["sim", "run", "--trace", str(f), "--quiet", "--out", str(tmp_path / "o")], capsys)
    assert f"{f}:" in err and needle in err


def test_unreadable_traces(tmp_path: Path, capsys):
    good = b"".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 2, "hash_ids": [i, i + 1]}).encode()
                    + b"\n" for i in range(2000))
    gz = gzip.compress(good)
    cases = {"dir.jsonl": None, "trunc.jsonl.gz": gz[: len(gz) // 2], "corrupt.jsonl.gz": gz[:20] + b"\x00" * 200 + gz[220:],
             "dup.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n2023-11-16 18:15:46.6805900,10,5,3\n",
             "huge.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1000000000000,5\n",
             "digits.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900," + b"9" * 5000 + b",5\n"}
    for name, data in cases.items():
        f = tmp_path / name
        if data is None:
            f.mkdir()
        else:
            f.write_bytes(data)
        t0 = time.perf_counter()
        err = _one_error(["sim", "run", "--trace", str(f), "--quiet", "--out", str(tmp_path / "o")], capsys)
        assert time.perf_counter() - t0 < 10 and str(f) in err, (name, err)
    with pytest.raises(TraceFormatError, match="truncated gzip"):
        read_mooncake(tmp_path / "trunc.jsonl.gz")


@pytest.mark.parametrize("suffix,text,needle", [
    (".toml", '[mixed]\nnum_engines = true\n', "mixed.num_engines"),
    (".toml", '[mixed]\nnum_engines = "8"\n', "mixed.num_engines"),
    (".toml", '[mixed]\nnum_engines = 10000000\n', "mixed.num_engines"),
    (".toml", '[prefill]\ndp_ranks = 4096\nnum_engines = 16\n[decode]\ndp_ranks = 4096\nnum_engines = 2\n', "DP ranks in all"),
    (".toml", 'kv_transfer_bandwidth_bytes_per_s = inf\n[mixed]\n', "kv_transfer_bandwidth_bytes_per_s"),
    (".toml", 'block_size = 1e9\n[mixed]\n', "block_size"),
    (".json", '{"mixed": {}, "mixed": {"num_engines": 2}}', "given twice"),
    (".json", '{"mixed": {"max_decode_batch": NaN}}', "finite"),
    (".json", '[' * 50_000, "nested too deeply"),
    (".yaml", 'mixed:\n  num_engines: 2\n  num_engines: 3\n', "given twice"),
    (".yaml", '- 1\n- 2\n', "top level must be a mapping"),
])
def test_bad_scenarios(tmp_path: Path, capsys, suffix: str, text: str, needle: str):
    f = tmp_path / f"s{suffix}"
    f.write_text(text)
    t0 = time.perf_counter()
    err = _one_error(["sim", "run", "--scenario", str(f), "--limit", "5", "--quiet", "--out", str(tmp_path / "o")], capsys)
    assert time.perf_counter() - t0 < 10 and str(f) in err and needle in err, err


# ---------------------------------------------------------------------- item 14
def test_compare_argument_checks(tmp_path: Path, capsys):
    err = _one_error(["sim", "compare", "--policies", "random,random", "--limit", "5", "--quiet"], capsys)
    assert "random given more than once" in err
    err = _one_error(["sim", "compare", "--scenario", "llama8b-agg-h100", "--policies", "random,least_load",
                      "--decode-policy", "cache_aware", "--limit", "5", "--quiet"], capsys)
    assert "aggregated" in err and "cache_aware" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    t0 = time.perf_counter()
    err = _one_error(["sim", "compare", "--policies", "random", "--out", str(blocker / "res"), "--quiet"], capsys)
    assert "is not a directory" in err and time.perf_counter() - t0 < 5  # before the whole trace was simulated


# ---------------------------------------------------------------------- fuzzer (trace + scenario -> CLI)
MOONCAKE_LINE = {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2]}
SCENARIO = {"model": "deepseek-v3", "hardware": "h200", "prefill": {"num_engines": 1, "dp_ranks": 8},
            "decode": {"num_engines": 1, "dp_ranks": 8, "max_decode_batch": 64}}
HOSTILE = [None, True, False, 0, -1, 1, 2**31, 2**63, 10**12, 10**30, 0.5, -0.0, 1e308, "", "8", "x" * 500,
           [], [1, 2], [[1]], {}, {"a": 1}]


def _mutate(rng: random.Random, d: dict) -> dict:
    out = json.loads(json.dumps(d))
    for _ in range(rng.randrange(1, 3)):
        target = out
        if rng.random() < 0.4:
            subs = [k for k, v in out.items() if isinstance(v, dict)]
            if subs:
                target = out[rng.choice(subs)]
        keys = list(target) + ["extra", "num_engines", "dp_ranks", "kv_capacity_tokens", "block_size", "max_model_len"]
        target[rng.choice(keys)] = rng.choice(HOSTILE)
    return out


def _encode(rng: random.Random, d: dict, suffix: str) -> bytes:
    text = json.dumps(d)
    if suffix == ".yaml":
        import yaml
        text = yaml.safe_dump(d)
    b = text.encode()
    if rng.random() < 0.2:
        b = b[: rng.randrange(len(b) + 1)]
    return b


def test_fuzz_sim_cli_traces_and_scenarios(tmp_path: Path, capsys):
    """Seeded: every input ends in exit 0 (with results) or exit 2 with one ``error:`` line on stderr
    naming the file, within a few seconds; never a traceback (exit 1) or a hang."""
    rng = random.Random(14)
    outcomes = {0: 0, 2: 0}
    for i in range(36):
        lines = [MOONCAKE_LINE | {"timestamp": 100 * k, "hash_ids": [10 * k, 10 * k + 1]} for k in range(4)]
        k = rng.randrange(len(lines))
        lines[k] = _mutate(rng, lines[k])
        trace = tmp_path / f"t{i}.jsonl"
        body = b"\n".join(json.dumps(x).encode() for x in lines) + b"\n"
        if rng.random() < 0.15:
            body = body.replace(b",", b"", 1)
        trace.write_bytes(body)
        argv = ["sim", "run", "--trace", str(trace), "--quiet", "--no-plots", "--out", str(tmp_path / "o")]
        where = str(trace)
        if i % 2:
            suffix = rng.choice([".json", ".yaml", ".toml"])
            sc = tmp_path / f"s{i}{suffix}"
            data = _mutate(rng, SCENARIO)
            if suffix == ".toml":
                import tomllib  # noqa: F401 (only to write a TOML subset by hand)
                sc.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items() if not isinstance(v, dict))
                              + "".join(f"[{k}]\n" + "".join(f"{kk} = {json.dumps(vv)}\n" for kk, vv in v.items()
                                                             if not isinstance(vv, (dict, list)) and vv is not None)
                                        for k, v in data.items() if isinstance(v, dict)))
            else:
                sc.write_bytes(_encode(rng, data, suffix))
            argv += ["--scenario", str(sc)]
            lines = [MOONCAKE_LINE | {"timestamp": 100 * k, "hash_ids": [10 * k, 10 * k + 1]} for k in range(4)]
            trace.write_bytes(b"\n".join(json.dumps(x).encode() for x in lines) + b"\n")  # a good trace
            where = str(sc)
        t0 = time.perf_counter()
        rc = main(argv)
        cap = capsys.readouterr()
        took = time.perf_counter() - t0
        assert took < 10, (i, argv, took)
        assert rc in (0, 2), (i, rc, cap.err[-2000:])
        outcomes[rc] += 1
        if rc == 2:
            assert cap.err.startswith("error: ") and cap.err.count("\n") == 1 and where in cap.err, (i, cap.err)
        else:
            assert (tmp_path / "o" / "summary.json").is_file()
    assert outcomes[0] >= 3 and outcomes[2] >= 10, outcomes  # both paths exercised


@pytest.mark.parametrize("table, line, field", [
    ("perf", "mfu = true", "mfu"), ("perf", 'mfu = "0.5"', "mfu"), ("perf", "step_overhead_s = inf", "step_overhead_s"),
    ("perf", "gpus_per_node = 8.5", "gpus_per_node"), ("perf", "bogus = 1", "bogus"),
    ("speculative", "draft_tokens = true\nacceptance = [0.8]", "draft_tokens"),
    ("speculative", "draft_tokens = 2\nacceptance = [nan, 0.5]", "acceptance"),
])
def test_perf_and_speculative_tables_are_strict(tmp_path: Path, table, line, field):
    # the [perf] and [speculative] tables refuse booleans and strings as numbers, non-finite
    # numbers and unknown keys, as the rest of a scenario does
    f = tmp_path / "sc.toml"
    f.write_text(f'model = "deepseek-v3"\nhardware = "h200"\n[prefill]\ndp_ranks = 8\n[decode]\ndp_ranks = 8\n[{table}]\n{line}\n')
    with pytest.raises(ValueError, match=field):
        load_scenario(f)
