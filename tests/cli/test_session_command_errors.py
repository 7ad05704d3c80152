"""``pdlb sim store-sweep`` and ``pdlb sim sessions`` on unusual inputs: a trace without traffic
classes, a warm-up covering the whole trace, no chatbot hit, bad session configs (one line naming
file and field). Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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
