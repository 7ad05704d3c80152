"""Defects found by trying pdlb as a new user would (review9): each test failed before its fix.

Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sim.emulator import EmulatorConfig, create_engine_app
from sim.emulator.app import STATE


# ------------------------------------------------------------------------------ pdlb engine
async def _engine(**cfg) -> TestClient:
    c = TestClient(TestServer(create_engine_app(EmulatorConfig(zero_delay=True, **cfg)), host="127.0.0.1"))
    await c.start_server()
    c.app[STATE].port = c.port
    return c


@pytest.mark.parametrize("role, body, headers, needle", [
    # was a 500 ("Server got itself in trouble") from int('x') in the handler
    ("decode", {"data_parallel_rank": "x"}, {}, "data_parallel_rank must be an integer 0..1 (this engine has 2 DP ranks), got 'x'"),
    ("decode", {}, {"X-data-parallel-rank": "abc"}, "header X-data-parallel-rank must be an integer, got 'abc'"),
    # were served on rank 7 % 2 = 1, -1 % 2 = 1 and int(1.5) = 1: silently another rank than asked
    ("decode", {"data_parallel_rank": 7}, {}, "data_parallel_rank must be an integer 0..1 (this engine has 2 DP ranks), got 7"),
    ("decode", {"data_parallel_rank": -1}, {}, "got -1"),
    ("decode", {"data_parallel_rank": 1.5}, {}, "got 1.5"),
    ("decode", {}, {"X-data-parallel-rank": "2"}, "got 2"),
    ("decode", {"data_parallel_rank": True}, {}, "got True"),
    # was a 500 from int('x') on the decode leg and on the prefill leg
    ("decode", {"bootstrap_room": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}, {},
     "bootstrap_room must be an integer >= 0, got 'x'"),
    ("prefill", {"bootstrap_room": "x"}, {}, "bootstrap_room must be an integer >= 0, got 'x'"),
    ("prefill", {"bootstrap_room": -3}, {}, "got -3"),
    # were answered 200 with one choice (silently fewer than asked) / one concatenated prompt
    ("mixed", {"n": 3}, {}, "'n' must be 1: pdlb engine emulates one completion per request, got 3"),
    ("mixed", {"best_of": 2}, {}, "'best_of' must be 1"),
    ("mixed", {"prompt": ["a", "b"]}, {}, "batched prompts are not emulated (2 prompts in 'prompt')"),
    ("mixed", {"prompt": [[1, 2], [3]]}, {}, "batched prompts are not emulated (2 prompts in 'prompt')"),
])
async def test_engine_answers_bad_pd_fields_and_unemulated_requests_with_400(role, body, headers, needle) -> None:
    c = await _engine(role=role, dp_ranks=2)
    try:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2} | body, headers=headers)
        assert r.status == 400
        err = (await r.json())["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
        assert c.app[STATE].counts.get("ok", 0) == 0  # nothing was run
    finally:
        await c.close()


async def test_engine_still_serves_valid_pd_fields_and_single_prompts() -> None:
    c = await _engine(role="decode", dp_ranks=2)
    try:
        for body, headers in [({"data_parallel_rank": 1}, {}), ({}, {"X-data-parallel-rank": "0"}),
                              ({"n": 1, "prompt": ["one prompt"]}, {}), ({"prompt": [[1, 2, 3]]}, {})]:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2} | body, headers=headers)
            assert r.status == 200, await r.text()
            assert len((await r.json())["choices"]) == 1
        # SGLang's /generate: n in sampling_params
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}})
        assert r.status == 400 and "'n' must be 1" in (await r.json())["error"]["message"]
        r = await c.post("/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}})
        assert r.status == 400 and "'text' (string) or 'input_ids'" in (await r.json())["error"]["message"]
    finally:
        await c.close()


@pytest.mark.parametrize("query", ["nan", "inf", "-1", "x", "1e9"])
async def test_engine_bootstrap_long_poll_refuses_an_unbounded_or_bad_timeout(query: str) -> None:
    # timeout_s=inf held the long poll open for ever; nan and -1 reached asyncio.wait_for
    c = await _engine(role="prefill")
    try:
        r = await c.get("/bootstrap/5", params={"timeout_s": query})
        assert r.status == 400
        assert f"timeout_s must be a number of seconds 0..3600, got '{query}'" in (await r.json())["error"]["message"]
        r = await c.get("/bootstrap/5", params={"timeout_s": "0"})  # a valid one still answers: 504 at once
        assert r.status == 504
    finally:
        await c.close()


async def test_engine_fault_errors_are_one_line_naming_the_field() -> None:
    # was pydantic's multi-line dump with a documentation URL
    c = await _engine(role="mixed")
    try:
        r = await c.post("/emulator/faults", json={"error_rate": 5})
        msg = (await r.json())["error"]["message"]
        assert r.status == 400 and msg == "invalid faults: error_rate: Input should be less than or equal to 1"
        r = await c.post("/emulator/faults", json={"eror_rate": 0.5})
        msg = (await r.json())["error"]["message"]
        assert msg == "invalid faults: eror_rate: unknown field (did you mean 'error_rate'?)"
        r = await c.post("/emulator/faults", data=b"{x")
        assert r.status == 400 and (await r.json())["error"]["message"].startswith("invalid faults: invalid JSON body")
    finally:
        await c.close()


# ------------------------------------------------------------------------------ results folders
_TRACE = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
_SCENARIO = 'name = "{name}"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 1\n'


@pytest.mark.parametrize("cmd, prefix", [(["sim", "run"], ""), (["sim", "compare", "--policies", "round_robin"], ""),
                                         (["sim", "capacity", "--policies", "round_robin", "--max-evals", "2",
                                           "--jobs", "1"], "capacity-")])
@pytest.mark.parametrize("name, stem", [("../../escape/x", "escape-x"), ("a/b c", "a-b-c")])
def test_a_scenario_name_cannot_put_the_default_results_folder_elsewhere(cmd, prefix, name, stem, tmp_path: Path,
                                                                         monkeypatch, capsys) -> None:
    # a scenario's name is free text and was pasted into results/<name>-<time>: "../../escape/x"
    # wrote to ../escape/x-<time> (outside the working directory's results/), "a/b c" to a subfolder.
    # Expected stem by sim.file_names.safe_file_stem: runs of "/", " " become "-", leading ".-" stripped.
    from pdlb_cli.main import main

    work = tmp_path / "w" / "d"
    work.mkdir(parents=True)
    (work / "t.jsonl").write_text(_TRACE)
    (work / "s.toml").write_text(_SCENARIO.format(name=name))
    monkeypatch.chdir(work)
    rc = main([*cmd, "--trace", "t.jsonl", "--scenario", "s.toml", "--quiet", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    made = [p for p in tmp_path.rglob("*") if p.is_dir() and p.name.startswith(f"{prefix}{stem}-")]
    assert len(made) == 1 and made[0].parent == work / "results", made
    assert not (tmp_path / "w" / "escape").exists() and not (work / "results" / "a").exists()


def test_capacity_out_help_names_its_own_default_folder(capsys) -> None:
    # the help said results/<scenario>-<time>; capacity writes results/capacity-<scenario>-<time>
    from pdlb_cli.main import main

    with pytest.raises(SystemExit):
        main(["sim", "capacity", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default results/capacity-<scenario>-<YYYYmmdd- HHMMSS>" in out or \
        "(default results/capacity-<scenario>-<YYYYmmdd-HHMMSS>" in out


# ------------------------------------------------------------------------------ burst notes
def test_capacity_burst_note_does_not_advise_the_flag_already_given() -> None:
    # The note told a user who had passed --duration-s 30 to "search over a fixed window
    # (--duration-s S ...)". A run of 341 requests over 29.7 s that finishes at 69.5 s is a burst
    # (69.5 > 2 x 29.7, sim.metrics.BURST_MAKESPAN_RATIO).
    from types import SimpleNamespace

    from pdlb_cli.sim.capacity import _burst_note

    r = SimpleNamespace(best=SimpleNamespace(summary={"num_requests": 341, "arrival_window_s": 29.7, "makespan_s": 69.5}))
    given = _burst_note(r, 30.0)
    assert given.startswith("at the answer the 341 requests arrive over 29.7 s and the last finishes at 69.5 s")
    assert given.endswith("; search over a longer window than --duration-s 30 or a longer trace")
    assert "--duration-s S" in _burst_note(r) and "--duration-s S" not in given


def test_sweep_burst_message_does_not_advise_the_key_already_set() -> None:
    from sim.sweep import burst_message

    row = {"policy": "kv_cost", "rate_scale": 2.0, "seed": 0}
    note = "the 100 requests arrive over 10 s and the last finishes at 50 s"
    assert "set a longer duration_s than 10 in the sweep file or use a longer trace" in \
        burst_message([(row, note)], 4, duration_s=10)
    assert "set duration_s = S in the sweep file" in burst_message([(row, note)], 4)


# ------------------------------------------------------------------------------ pdlb sim store-sweep
def _store_trace(tmp_path: Path, classes: list[str | None], gap_s: float = 1.0) -> Path:
    import json

    lines = []
    for i, cls in enumerate(classes):  # 2-block prompts sharing their first block: hits from the second on
        rec = {"timestamp": 1000 * gap_s * i, "input_length": 1024, "output_length": 2, "hash_ids": [1, 100 + i]}
        if cls is not None:
            rec["traffic_class"] = cls
        lines.append(json.dumps(rec))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_store_sweep_on_a_trace_without_classes_runs_without_the_default_class_ttls(tmp_path: Path, capsys) -> None:
    # The default --class-ttl-hours (agent=72,chatbot=168) made every trace without those classes
    # (the Mooncake trace, any user trace) fail with an error about a flag the user never gave.
    import csv

    from pdlb_cli.main import main

    trace = _store_trace(tmp_path, [None] * 4)
    rc = main(["sim", "store-sweep", "--trace", str(trace), "--warmup-days", "0", "--ttl-hours", "1",
               "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader(open(tmp_path / "o" / "store_sweep.csv")))
    # TTL 1 h and the always-added "none"; no per-class row. Hit rate: requests 2-4 hit block 1
    # (512 of 1024 tokens) within the hour: 3 * 512 / (4 * 1024) = 0.375
    assert [r["ttl_hours"] for r in rows] == ["1", "none"]
    assert [float(r["hit_rate_all"]) for r in rows] == [pytest.approx(0.375)] * 2
    # a class the trace lacks, given on purpose, is still an error naming the flag
    assert main(["sim", "store-sweep", "--trace", str(trace), "--warmup-days", "0", "--class-ttl-hours", "agent=1",
                 "--out", str(tmp_path / "o2"), "--quiet"]) == 2
    assert "error: --class-ttl-hours: unknown traffic class 'agent'" in capsys.readouterr().err


def test_store_sweep_whose_warmup_covers_the_whole_trace_is_an_error(tmp_path: Path, capsys) -> None:
    # The default --warmup-days 7 on a 3 s trace left nothing measured: a table of 0% and then a
    # ZeroDivisionError traceback in the chatbot note. Last arrival 3 s = 3 / 86400 = 3.47e-05 days.
    from pdlb_cli.main import main

    trace = _store_trace(tmp_path, ["chatbot"] * 4)
    rc = main(["sim", "store-sweep", "--trace", str(trace), "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == ("error: no request arrives after the 7 warm-up days: the workload's last arrives "
                                       "at 3.47e-05 days (3 s); lower --warmup-days")


def test_store_sweep_chatbot_note_without_any_chatbot_hit_has_no_ratio() -> None:
    # h7 = 0 divided by zero for the relative cost
    from pdlb_cli.sim.store_sweep import _deepseek_note
    from sim.experiments.store_hit_rate import ClassHits

    zero = {"chatbot": ClassHits(requests=1, prompt_tokens=100, hit_tokens=0)}
    rows = [(None, "72", zero), (None, "168", zero)]
    assert _deepseek_note(rows) == ("chatbot hit rate, unbounded store: TTL 7 days 0.00%, 3 days 0.00%: "
                                    "a 3-day TTL costs 0.00 percentage points")


@pytest.mark.parametrize("name, text, message", [
    # was "sc.toml: 1 validation error for SessionWorkloadConfig bogus Extra inputs are not permitted
    # [type=extra_forbidden, ...] For further information visit https://errors.pydantic.dev/..."
    ("c.toml", "bogus = 1\n", "c.toml: bogus: unknown field (valid: agent, agent_fraction, block_size, chatbot, "
                              "duration_s, seed, sessions_per_hour, vocab_size)"),
    ("c.toml", "[chatbot]\nturns_mean = 2\n", "c.toml: chatbot.turns_mean: unknown field (did you mean 'turns_per_visit_mean'?)"),
    ("c.yaml", "agent_fraction: 2\n", "c.yaml: agent_fraction: Input should be less than or equal to 1"),
    ("c.json", "[1]", "c.json: the top level must be a table of SessionWorkloadConfig fields, got list"),
    ("c.json", '{"seed": }', "c.json:1:10: Expecting value"),
    (None, None, "{dir}/missing.toml: no such file"),  # was "[Errno 2] No such file or directory: ..." without the flag's file first
])
def test_session_config_errors_are_one_line_naming_file_and_field(name, text, message, tmp_path: Path, capsys) -> None:
    from pdlb_cli.main import main

    path = tmp_path / (name or "missing.toml")
    if text is not None:
        path.write_text(text)
    for cmd in (["sim", "sessions", "--out", str(tmp_path / "s.jsonl")], ["sim", "store-sweep", "--quiet"]):
        assert main([*cmd, "--config", str(path), "--days", "0.01"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "error: " + (message if name is None else f"{tmp_path}/{message}").format(dir=tmp_path)


# ------------------------------------------------------------------------------ balancer core inputs
@pytest.mark.parametrize("field, value, exc, message", [
    # were accepted (True as 1 token, 10.5 tokens counted as load) or a bare "'<' not supported ..."
    ("prompt_tokens", "10", TypeError, "request r1: prompt_tokens must be an integer >= 1, got str '10'"),
    ("prompt_tokens", True, TypeError, "request r1: prompt_tokens must be an integer >= 1, got bool True"),
    ("prompt_tokens", 10.5, TypeError, "got float 10.5"),
    ("prompt_tokens", 10.0, TypeError, "got float 10.0"),
    ("max_output_tokens", "4", TypeError, "request r1: max_output_tokens must be an integer >= 1, got str '4'"),
    ("max_output_tokens", 0, ValueError, "request r1: max_output_tokens must be an integer >= 1, got 0"),
    # expected_output_tokens was not checked at all: -50 output tokens released -50 tokens of load
    ("expected_output_tokens", -50, ValueError, "request r1: expected_output_tokens must be an integer >= 1, got -50"),
    ("expected_output_tokens", 0, ValueError, "got 0"),
    ("expected_output_tokens", 2.5, TypeError, "got float 2.5"),
    # a string was indexed as blocks 'a', 'b'; floats as float keys
    ("block_hashes", "ab", TypeError, "request r1: block_hashes must be a sequence of integers, got str 'ab'"),
    ("block_hashes", (1.5, 2.5), TypeError, "request r1: block_hashes[0] must be an integer, got float 1.5"),
    ("block_hashes", [1, None], TypeError, "block_hashes[1] must be an integer, got NoneType None"),  # a list: every hash
    ("block_hashes", 7, TypeError, "block_hashes must be a sequence of integers, got int 7"),
])
def test_request_refuses_counts_and_hashes_of_the_wrong_type(field, value, exc, message) -> None:
    from balancer.types import Request

    kw = {"request_id": "r1", "arrival_time_s": 0.0, "prompt_tokens": 32} | {field: value}
    with pytest.raises(exc) as ei:
        Request(**kw)
    assert message in str(ei.value)


def test_request_takes_numpy_integers_and_lists_as_plain_ints_and_a_tuple() -> None:
    import numpy as np

    from balancer.types import Request

    r = Request("r1", 0.0, np.int64(32), [np.uint64(5), 7], max_output_tokens=np.int32(3), expected_output_tokens=np.int64(2))
    assert r.block_hashes == (5, 7) and all(type(h) is int for h in r.block_hashes)
    assert (type(r.prompt_tokens), type(r.max_output_tokens), type(r.expected_output_tokens)) == (int, int, int)
    assert (r.prompt_tokens, r.max_output_tokens, r.output_tokens) == (32, 3, 2)
    assert Request("r2", 0.0, 32, np.array([1, 2], dtype=np.uint64)).block_hashes == (1, 2)
    hash(Request("r3", 0.0, 32, [1, 2]))  # a list made the frozen request unhashable


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"block_size": "16"}, TypeError, "block_size must be an integer >= 1, got str '16'"),
    ({"block_size": 16.5}, TypeError, "block_size must be an integer >= 1, got float 16.5"),  # was taken as is
    ({"pd_min_uncached_tokens": 0.5}, TypeError, "pd_min_uncached_tokens must be an integer >= 0, got float 0.5"),
    # NaN compares False with everything: "ttl_s <= 0" let it through and no entry ever expired
    ({"index_ttl_s": float("nan")}, ValueError, "index_ttl_s must be a number of seconds > 0 or None, got nan"),
    ({"shared_store": True, "store_ttl_s": float("nan")}, ValueError, "store_ttl_s must be a number of seconds > 0"),
    ({"index_ttl_s": "60"}, ValueError, "index_ttl_s must be a number of seconds > 0 or None, got '60'"),
    ({"index_capacity_blocks": 1e6}, TypeError, "capacity_blocks must be an integer >= 1, got float 1000000.0"),
])
def test_router_refuses_settings_of_the_wrong_type(kwargs, exc, message) -> None:
    from balancer import Router

    with pytest.raises(exc) as ei:
        Router(**kwargs)
    assert message in str(ei.value)


def test_router_index_ttl_still_expires_entries_and_inf_means_never() -> None:
    # the TTL check itself: a prompt routed at t=0 with index_ttl_s=10 matches at t=5, not at t=20
    from balancer import ReplicaId, Request, Router

    for ttl, hit_at_20 in ((10.0, 0), (float("inf"), 32)):
        r = Router("cache_aware", "cache_aware", block_size=16, index_ttl_s=ttl)
        r.add_replica(ReplicaId("d", 0), "decode")
        r.route(Request("a", 0.0, 32, (1, 2)), now_s=0.0)
        assert r.route(Request("b", 5.0, 32, (1, 2)), now_s=5.0).decode_matched_tokens == 32
        assert r.route(Request("c", 20.0, 32, (1, 2)), now_s=20.0).decode_matched_tokens == hit_at_20


# ------------------------------------------------------------------------------ user policies
def _bad_policy_router(result):
    from dataclasses import dataclass

    from balancer import Choice, Policy, ReplicaId, Router

    @dataclass(frozen=True)
    class Bad(Policy):  # not registered: passed to Router as an object
        name = "bad"

        def select(self, request, cands, ctx):
            return result(cands) if callable(result) else result

    r = Router(Bad(), Bad(), block_size=16)
    r.add_replica(ReplicaId("p", 0), "prefill")
    r.add_replica(ReplicaId("d", 0), "decode")
    return r, Choice, ReplicaId


@pytest.mark.parametrize("kind", ["unknown replica", "None", "a string", "a bare ReplicaId"])
def test_a_policy_that_returns_no_valid_choice_is_a_policy_error_and_counts_nothing(kind: str) -> None:
    # was a KeyError from the router's position map (unknown replica) or an AttributeError
    # ('NoneType' object has no attribute 'reason'), a traceback deep inside simpy in pdlb sim
    from balancer import PolicyError, ReplicaId, Request
    from balancer.types import Choice

    result = {"unknown replica": Choice(ReplicaId("nope", 0), reason="x"), "None": None, "a string": "d",
              "a bare ReplicaId": ReplicaId("d", 0)}[kind]
    r, _, _ = _bad_policy_router(result)
    with pytest.raises(PolicyError) as ei:
        r.route(Request("q1", 0.0, 32, (1, 2)), now_s=0.0)
    msg = str(ei.value)
    assert msg.startswith("policy 'bad' (decode pool) ") and "request 'q1'" in msg
    if kind == "unknown replica":
        assert "chose ReplicaId(engine='nope', dp_rank=0)" in msg and "not one of its 1 candidates" in msg
    else:
        assert msg.endswith("not a balancer.Choice")
    m = r.metrics()
    assert m["in_flight"] == 0 and m["decisions"] == {"prefill": {}, "decode": {}} and m["index_blocks"] == 0


def test_pdlb_sim_names_a_user_policy_that_breaks_its_contract(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from pdlb_cli.main import main

    pkg = tmp_path / "r9pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pol.py").write_text(
        "from dataclasses import dataclass\n"
        "from balancer.policies.base import Policy, register\n"
        "from balancer.types import Choice, ReplicaId\n"
        "@register\n@dataclass(frozen=True)\nclass R9Bad(Policy):\n    name = 'r9_bad'\n"
        "    def select(self, request, cands, ctx):\n        return Choice(ReplicaId('nope', 0), reason='x')\n")
    (tmp_path / "t.jsonl").write_text(_TRACE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from balancer.policies.base import _REGISTRY

    try:
        rc = main(["sim", "run", "--policy-module", "r9pkg.pol", "--policy", "r9_bad", "--trace", "t.jsonl",
                   "--scenario", "llama8b-agg-h100", "--quiet", "--no-plots", "--out", "o"])
    finally:  # the registry is global: leave no test policy for the tests that list every policy
        _REGISTRY.pop("r9_bad", None)
        sys.modules.pop("r9pkg.pol", None)
        sys.modules.pop("r9pkg", None)
    err = capsys.readouterr().err
    assert rc == 2 and err == ("error: policy 'r9_bad' (decode pool) chose ReplicaId(engine='nope', dp_rank=0) for "
                               "request 'r0', which is not one of its 8 candidates\n")


def test_simpys_stall_message_is_the_one_the_cluster_recognises() -> None:
    # sim.cluster tells a stall (this simpy RuntimeError) from any other RuntimeError by its start;
    # every other error (a PolicyError at the last arrival) was reported as "simulation stalled"
    import simpy

    env = simpy.Environment()
    with pytest.raises(RuntimeError) as ei:
        env.run(until=env.event())
    assert str(ei.value).startswith("No scheduled events left")


def test_every_python_block_of_the_readme_runs_and_the_policy_example_picks_by_hand(tmp_path: Path) -> None:
    # The README's library examples were never executed by a test. Run them all, in order, in a
    # fresh interpreter (the policy example registers a name in the global registry), then call the
    # example policy on hand-built candidates: requests [2, 0, 0] -> least loaded ranks 1 and 2,
    # tie=first picks 1, tie=last picks 2.
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    check = '''
import numpy as np
from balancer.candidates import Candidates
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
import random
from balancer.types import ReplicaId, Request, Role
reps = tuple(ReplicaId("e", i) for i in range(3))
z = np.zeros(3, dtype=np.int64)
c = Candidates(role=Role.DECODE, replicas=reps, num_requests=np.array([2, 0, 0]), prefill_tokens=z,
               decode_kv_tokens=z, kv_capacity_tokens=z, matched_blocks=z, matched_tokens=z, block_size=16)
ctx = SelectContext(random.Random(0))
req = Request("x", 0.0, 10)
print(make_policy("fewest_requests").select(req, c, ctx).replica.dp_rank,
      make_policy("fewest_requests", tie="last").select(req, c, ctx).replica.dp_rank)
'''
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(blocks) + check)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["1", "2"]


def test_price_from_a_summary_whose_runs_were_all_refused_says_so(tmp_path: Path, capsys) -> None:
    # a compare of requests over max_model_len writes runs with no rates; pricing it said
    # "key 'input_tokens_per_s_per_gpu' is missing or not a finite number >= 0 (got None)"
    import json

    from pdlb_cli.main import main

    f = tmp_path / "summary.json"
    f.write_text(json.dumps({"runs": [{"policy": "round_robin", "num_requests": 0, "num_finished": 0,
                                       "num_rejected": 2, "rejected": {"max_model_len": 2},
                                       "input_tokens_per_s_per_gpu": None}]}))
    assert main(["sim", "price", "--from-summary", str(f)]) == 2
    assert capsys.readouterr().err == (f"error: {f} run 0 (round_robin): nothing was simulated, all 2 requests were "
                                       "refused at arrival (2 over max_model_len); nothing to price\n")


def test_cost_model_out_errors_name_the_flag_before_fitting(tmp_path: Path, capsys) -> None:
    # were "error: [Errno 21] Is a directory: '/tmp'" and "error: [Errno 2] No such file or directory: ..."
    from pdlb_cli.main import main

    assert main(["sim", "cost-model", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {tmp_path}: is a directory; give a file name, e.g. {tmp_path / 'cost_model.toml'}")
    missing = tmp_path / "no" / "m.toml"
    assert main(["sim", "cost-model", "--out", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --out {missing}: folder {missing.parent} does not exist"
    # the workload generator's message for a missing folder now names the file too
    assert main(["sim", "workload", "ramp", "--rates", "1", "--step-s", "5", "--out", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --out {missing}: folder {missing.parent} does not exist"


def test_pdlb_policies_lists_a_registered_policy_whose_module_has_no_docstring(capsys) -> None:
    # `pdlb policies` took the first line of the module docstring: IndexError for a user module without one
    import types
    import sys
    from dataclasses import dataclass

    from balancer.policies.base import _REGISTRY, Policy, register
    from pdlb_cli.main import main

    mod = types.ModuleType("r9_nodoc")  # a module without a docstring
    sys.modules["r9_nodoc"] = mod
    try:
        @register
        @dataclass(frozen=True)
        class NoDoc(Policy):
            name = "r9_nodoc"
            k: int = 3

            def select(self, request, cands, ctx):  # pragma: no cover - never routed
                raise AssertionError

        NoDoc.__module__ = "r9_nodoc"
        assert main(["policies"]) == 0
        assert "r9_nodoc(k=3)" in capsys.readouterr().out
    finally:
        _REGISTRY.pop("r9_nodoc", None)
        sys.modules.pop("r9_nodoc", None)


def test_a_burst_at_one_instant_shows_no_goodput_as_a_dash_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    # README: `pdlb sim workload shared-prefix` puts every request at t = 0, replayed with
    # --spread-s 0. The arrival window is then 0 s and goodput NaN (sim.metrics): the table and
    # summary.md printed "nan" with no word on why.
    import json

    from pdlb_cli.main import main

    rec = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(rec) for _ in range(3)) + "\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["sim", "run", "--trace", "t.jsonl", "--spread-s", "0", "--scenario", "llama8b-agg-h100", "--quiet",
               "--no-plots", "--out", "o", "--policy", "round_robin"])
    out = capsys.readouterr().out
    assert rc == 0 and "nan" not in out
    assert ("goodput: - because the 3 requests arrive at one instant (arrival window 0 s; goodput counts "
            "SLO-meeting requests per second of it)") in " ".join(out.split())
    row = (tmp_path / "o" / "summary.md").read_text().splitlines()[2].split(" | ")
    assert row[8] == "-" and row[7] == "100.0%"  # goodput column; attainment still printed
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["runs"][0]["goodput_rps"] is None


def test_goodput_note_only_for_a_zero_window() -> None:
    from sim.report import goodput_note

    assert goodput_note({"policy": "p", "num_requests": 5, "arrival_window_s": 2.0}) == ""
    assert goodput_note({"policy": "p", "num_requests": 0, "num_rejected": 3, "arrival_window_s": None}) == ""
    assert goodput_note({"policy": "p", "num_requests": 1, "arrival_window_s": float("nan")}).startswith(
        "goodput: - because the 1 request arrives at one instant")


def test_validate_refuses_a_figure_given_twice(capsys) -> None:
    # `--figures sglang-prefill-1k,sglang-prefill-1k` ran it twice and reported "2 of 2 held-out
    # figures within +-15%" for one figure
    from pdlb_cli.main import main

    assert main(["sim", "validate", "--figures", "sglang-prefill-1k, sglang-prefill-1k"]) == 2
    assert capsys.readouterr().err == "error: --figures: sglang-prefill-1k given more than once\n"


@pytest.mark.parametrize("extra, where", [
    ('policies = ["round_robin", "round_robin"]\nrates = [1]\n', "round_robin x1 seed 0"),
    ('policies = ["round_robin"]\nrates = [1, 1.0]\n', "round_robin x1 seed 0"),
    ('policies = ["round_robin"]\nrates = [2]\nseeds = [3, 3]\n', "round_robin x2 seed 3"),
    ('policies = ["round_robin"]\nrates = [1]\n[grid]\n"mixed.num_engines" = [2, 2]\n', "round_robin x1 seed 0 mixed.num_engines=2"),
])
def test_a_sweep_point_listed_twice_is_an_error_before_running(extra: str, where: str, tmp_path: Path, capsys) -> None:
    # was: run twice under one point id ("2 of 2 points"), while compare and capacity refuse a
    # policy given twice
    from pdlb_cli.main import main

    f = tmp_path / "s.toml"
    f.write_text('scenario = "llama8b-agg-h100"\nlimit = 5\n' + extra)
    assert main(["sim", "sweep", str(f), "--out", str(tmp_path / "o"), "--jobs", "1", "--quiet", "--no-plots"]) == 2
    assert capsys.readouterr().err == (f"error: {f}: point {where} is listed more than once (a value repeated in "
                                       "policies, rates, seeds, traces, [grid] or [[points]]); list each once\n")
    assert not (tmp_path / "o" / "points.jsonl").exists()


def test_a_nested_check_naming_its_own_path_is_not_prefixed_twice(tmp_path: Path, capsys) -> None:
    # was "spx.toml: speculative: speculative.acceptance: every entry must be in [0, 1], got [2.0]"
    from pdlb_cli.main import main

    f = tmp_path / "spx.toml"
    f.write_text('name = "x"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 1\n'
                 "[speculative]\ndraft_tokens = 1\nacceptance = [2.0]\n")
    assert main(["sim", "run", "--scenario", str(f), "--limit", "5", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: {f}: speculative.acceptance: every entry must be in [0, 1], got [2.0]\n"
    # a plain field error keeps its path
    f.write_text('name = "x"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 0\n')
    assert main(["sim", "run", "--scenario", str(f), "--limit", "5", "--quiet", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: {f}: mixed.num_engines: Input should be greater than or equal to 1\n"
