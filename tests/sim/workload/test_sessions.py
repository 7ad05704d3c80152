"""Session workloads: prefix consistency of later turns, shared agent system prompts, exact return
timing on a degenerate config, determinism, the JSONL round trip and its error paths."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict

import numpy as np
import pytest

from balancer.hashing import hash_token_blocks
from pdlb_cli.main import main
from sim.run.engine.kv_store import KvStore
from sim.experiments.store_hit_rate import replay_store
from sim.workload import (
    SessionClassConfig,
    SessionWorkloadConfig,
    TraceFormatError,
    ideal_hit_rate,
    read_mooncake,
    session_workload,
    workload_summary,
    write_mooncake,
)
from sim.workload.sessions import _Context, _return_gap_s

DAY = 86400.0


def _small(**kw) -> SessionWorkloadConfig:
    base = dict(duration_s=0.25 * DAY, sessions_per_hour=40.0, seed=7)
    base.update(kw)
    return SessionWorkloadConfig(**base)


def _by_session(reqs):
    out = defaultdict(list)
    for r in reqs:
        out[r.session_id].append(r)
    return out


def test_later_turns_extend_earlier_prompts():
    reqs = session_workload(_small())
    assert len(reqs) > 200
    sessions = _by_session(reqs)
    multi = 0
    for rs in sessions.values():
        assert len({r.traffic_class for r in rs}) == 1
        for a, b in zip(rs, rs[1:]):
            # prompt_b = prompt_a + output_a + a new message of >= 1 token
            assert b.prompt_tokens >= a.prompt_tokens + a.output_tokens + 1
            assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes
            multi += 1
        for r in rs:  # only full blocks are hashed
            assert len(r.block_hashes) == r.prompt_tokens // 512
    assert multi > 100


def test_context_hashes_incrementally_like_hashing_the_whole_sequence():
    # independent: hash_token_blocks over the concatenated tokens in one call
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 1000, size=n, dtype=np.uint32) for n in (5, 700, 3, 1030, 1)]
    ctx = _Context([], np.empty(0, np.uint32), 0)
    for p in parts:
        ctx.extend(p, 256)
    whole = np.concatenate(parts)
    assert ctx.hashes == hash_token_blocks(whole, 256)
    assert ctx.tokens == whole.size and ctx.tail.size == whole.size % 256


def test_agent_sessions_share_their_agents_system_prompt():
    cfg = _small(agent_fraction=1.0, agent=SessionClassConfig(system_prompt_tokens=4 * 512 + 100, num_system_prompts=3,
                                                              turns_per_visit_mean=2.0, think_time_median_s=2.0,
                                                              message_tokens_mean=1000, message_tokens_sigma=0))
    reqs = session_workload(cfg)
    assert {r.traffic_class for r in reqs} == {"agent"}
    firsts = {rs[0].block_hashes[:4] for rs in _by_session(reqs).values()}
    assert 1 < len(firsts) <= 3  # the same 4 system-prompt blocks for every session of one agent
    # the 5th block mixes system-prompt tokens with the session's own message: never shared
    fifth = [rs[0].block_hashes[4] for rs in _by_session(reqs).values()]
    assert len(set(fifth)) == len(fifth)


def test_return_visits_with_a_fixed_gap_by_hand():
    # one turn per visit, always return after exactly 1 h: a session starting at t0 issues requests
    # at t0, t0 + 1 h, ... while < duration (10 h); times are rounded to whole ms.
    c = SessionClassConfig(turns_per_visit_mean=1.0, return_probability=1.0, return_gap_median_s=3600.0,
                           return_gap_sigma=0.0, message_tokens_mean=10, message_tokens_sigma=0,
                           output_tokens_mean=5, output_tokens_sigma=0, max_context_tokens=10**6)
    reqs = session_workload(SessionWorkloadConfig(duration_s=36000.0, sessions_per_hour=2.0, agent_fraction=0.0,
                                                  chatbot=c, seed=3))
    for rs in _by_session(reqs).values():
        t0 = rs[0].arrival_time_s
        expected = int((36000.0 - t0 - 1e-9) // 3600.0) + 1
        assert len(rs) == expected
        for k, r in enumerate(rs):
            assert r.arrival_time_s == pytest.approx(t0 + 3600.0 * k, abs=1e-3)
            assert r.prompt_tokens == 10 * (k + 1) + 5 * k  # k earlier messages+outputs, a new message
            assert r.output_tokens == 5


def test_no_return_and_one_turn_gives_one_request_per_session():
    c = SessionClassConfig(turns_per_visit_mean=1.0, return_probability=0.0)
    reqs = session_workload(_small(agent_fraction=0.0, chatbot=c))
    assert all(len(rs) == 1 for rs in _by_session(reqs).values())
    assert workload_summary(reqs, 512)["chatbot"]["ideal_hit_rate"] == 0.0  # nothing is ever reused


def test_context_limit_ends_a_session():
    c = SessionClassConfig(max_context_tokens=3000, return_probability=1.0, return_gap_median_s=60.0)
    reqs = session_workload(_small(agent_fraction=0.0, chatbot=c))
    assert max(r.prompt_tokens for r in reqs) <= 3000


def test_pareto_return_gap_has_the_configured_median():
    c = SessionClassConfig(return_gap_distribution="pareto", return_gap_median_s=7200.0, return_gap_pareto_alpha=0.8)
    rng = np.random.default_rng(0)
    gaps = np.array([_return_gap_s(rng, c) for _ in range(20000)])
    # formula: median of Pareto(x_m, alpha) = x_m * 2**(1/alpha) = 7200 s; x_m is the minimum
    assert np.median(gaps) == pytest.approx(7200.0, rel=0.04)
    assert gaps.min() >= 7200.0 / 2 ** (1 / 0.8)


def test_deterministic_sorted_and_seeded():
    a, b = session_workload(_small()), session_workload(_small())
    assert a == b
    assert session_workload(_small(seed=8)) != a
    ts = [r.arrival_time_s for r in a]
    assert ts == sorted(ts) and ts[-1] < 0.25 * DAY
    assert all(round(t * 1000) / 1000 == t for t in ts)
    assert [r.request_id for r in a] == [f"r{i}" for i in range(len(a))]
    s = workload_summary(a, 512)
    assert s["all"]["requests"] == s["chatbot"]["requests"] + s["agent"]["requests"] == len(a)
    assert s["all"]["ideal_hit_rate"] == pytest.approx(ideal_hit_rate(a, 512)[1], abs=1e-12)


def test_partial_agent_config_keeps_agent_defaults(tmp_path):
    from sim.workload.sessions import load_session_config

    f = tmp_path / "c.json"
    f.write_text('{"agent": {"return_probability": 0.1}, "chatbot": {"return_gap_median_s": 43200}}')
    cfg = load_session_config(f)
    assert cfg.agent.return_probability == 0.1 and cfg.agent.system_prompt_tokens == 12000
    assert cfg.chatbot.return_gap_median_s == 43200 and cfg.chatbot.system_prompt_tokens == 0
    (tmp_path / "bad.json").write_text('{"agent_fraction": 2}')
    with pytest.raises(ValueError, match="bad.json"):
        load_session_config(tmp_path / "bad.json")


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        SessionWorkloadConfig(agent_fraction=1.5)
    with pytest.raises(ValueError):
        SessionClassConfig(return_probability=-0.1)
    with pytest.raises(ValueError):
        SessionWorkloadConfig(unknown_field=1)


def test_jsonl_round_trip_keeps_fields_and_prefix_structure(tmp_path):
    reqs = session_workload(_small())
    path = tmp_path / "w.jsonl.gz"
    assert write_mooncake(reqs, path) == len(reqs)
    back = read_mooncake(path)
    assert len(back) == len(reqs)
    for a, b in zip(reqs, back):
        assert (b.arrival_time_s, b.prompt_tokens, b.output_tokens, b.session_id, b.traffic_class) == (
            a.arrival_time_s, a.prompt_tokens, a.output_tokens, a.session_id, a.traffic_class)
        assert len(b.block_hashes) == -(-a.prompt_tokens // 512)  # the partial block gets a unique id
    # hashes are relabelled, prefix sharing is not: equal hit rates
    assert ideal_hit_rate(back, 512) != (0.0, 0.0)
    assert ideal_hit_rate(back, 512)[1] == ideal_hit_rate(reqs, 512)[1]
    for ttl in (600.0, None):
        h1 = replay_store(reqs, KvStore(None, ttl_s=ttl), 512)
        h2 = replay_store(back, KvStore(None, ttl_s=ttl), 512)
        assert {c: v.hit_tokens for c, v in h1.items()} == {c: v.hit_tokens for c, v in h2.items()}


def _write_lines(path, recs):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"session_id": []}, "field 'session_id' must be a non-empty string or an integer"),
        ({"session_id": ""}, "field 'session_id'"),
        ({"traffic_class": 3}, "field 'traffic_class' must be a non-empty string"),
        ({"traffic_class": ""}, "field 'traffic_class'"),
    ],
)
def test_reader_rejects_bad_optional_fields_with_file_and_line(tmp_path, extra, reason):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    path = tmp_path / "t.jsonl"
    _write_lines(path, [good, good | extra])
    with pytest.raises(TraceFormatError) as e:
        read_mooncake(path)
    assert str(e.value).startswith(f"{path}:2: {reason}")


def test_reader_optional_fields_absent_null_int_and_override(tmp_path):
    rec = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    path = tmp_path / "t.jsonl"
    _write_lines(path, [rec, rec | {"session_id": None, "traffic_class": None},
                        rec | {"session_id": 42, "traffic_class": "agent"}])
    rs = read_mooncake(path, traffic_class="chatbot")
    assert [(r.session_id, r.traffic_class) for r in rs] == [(None, "chatbot"), (None, "chatbot"), ("42", "agent")]


def test_writer_rejects_bad_requests(tmp_path):
    from balancer.types import Request

    bad = Request("x", 0.0, prompt_tokens=1100, block_hashes=(1,), max_output_tokens=1)  # 1 hash, needs 2 or 3
    with pytest.raises(ValueError, match="request x: 1 block hashes for 1100 tokens"):
        write_mooncake([bad], tmp_path / "a.jsonl")
    r1 = Request("a", 5.0, prompt_tokens=10, max_output_tokens=1)
    r0 = Request("b", 4.0, prompt_tokens=10, max_output_tokens=1)
    with pytest.raises(ValueError, match="request b: arrival 4.0 s is before"):
        write_mooncake([r1, r0], tmp_path / "b.jsonl")
    # plain JSONL, float timestamp, ids: the partial block of a 10-token prompt gets one id
    write_mooncake([Request("c", 0.0015, prompt_tokens=10, max_output_tokens=2)], tmp_path / "c.jsonl")
    rec = json.loads((tmp_path / "c.jsonl").read_text())
    assert rec["timestamp"] == 1.5 and rec["output_length"] == 2 and len(rec["hash_ids"]) == 1
    assert "session_id" not in rec


def test_cli_sessions_writes_a_readable_file(tmp_path, capsys):
    out = tmp_path / "s.jsonl.gz"
    assert main(["sim", "sessions", "--out", str(out), "--days", "0.05", "--seed", "2"]) == 0
    with gzip.open(out, "rt") as fh:
        n_lines = sum(1 for _ in fh)
    back = read_mooncake(out)
    assert len(back) == n_lines > 0
    assert back == read_mooncake(out)
    assert "ideal hit rate" in capsys.readouterr().out
    assert main(["sim", "sessions", "--out", str(out), "--days", "0"]) == 2
    assert main(["sim", "sessions", "--out", str(out), "--agent-fraction", "2"]) == 2
