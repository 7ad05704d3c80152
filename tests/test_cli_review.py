"""Defects a new user found by running the README's commands (review of 2026-12-02), one test
each, every expected message written out by hand from the input."""

from __future__ import annotations

import pytest

from pdlb_cli.main import main


def _argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last stderr line of an argparse rejection; asserts exit 2 and no output."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["sim", "run"], ["sim", "compare"], ["sim", "capacity"], ["sim", "price", "--simulate"],
    ["sim", "sessions", "--out", "x.jsonl"], ["sim", "store-sweep"],
    ["sim", "workload", "ramp", "--rates", "1", "--step-s", "1", "--out", "x.jsonl"],
    ["sim", "workload", "shared-prefix", "--out", "x.jsonl"],
])
def test_a_negative_seed_names_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # was: "error: expected non-negative integer" (numpy's SeedSequence, after parsing), naming no flag
    prog = "pdlb " + " ".join(a for a in argv[:3] if not a.startswith("-") and "." not in a)
    assert _argparse_error([*argv, "--seed", "-1"], capsys) == f"{prog}: error: argument --seed: must be >= 0, got -1"


@pytest.mark.parametrize("command", ["compare", "capacity"])
def test_policy_and_policies_together_are_refused(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # was: --policy replaced the list and --policies round_robin,least_load was dropped without a word
    # (compare ran only 'random')
    rc = main(["sim", command, "--policies", "round_robin,least_load", "--policy", "random", "--limit", "5", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.strip() == (
        "error: --policy and --policies both given: --policy replaces the list, so --policies would be ignored; "
        "give one (repeat --policy for several)")


def test_policies_given_with_equals_counts_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    # the '--policies=LIST' spelling is seen as given too (pdlb_cli.args.given_options)
    rc = main(["sim", "compare", "--policies=round_robin", "--policy", "random", "--limit", "5", "--quiet"])
    assert rc == 2 and "--policy and --policies both given" in capsys.readouterr().err


def test_summary_md_has_every_column_of_the_printed_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: summary.md ("the same table as Markdown") lacked E2E p50 s and out tok/s/GPU
    out = tmp_path / "res"
    assert main(["sim", "run", "--policy", "round_robin", "--limit", "20", "--quiet", "--no-plots",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    head = [c.strip() for c in printed.split("┃")[1:-1] if "\n" not in c]
    assert head == ["policy", "TTFT mean s", "TTFT p99 s", "TPOT mean ms", "TPOT p99 ms", "E2E p50 s", "hit rate",
                    "SLO att.", "goodput r/s", "out tok/s/GPU", "P imb.", "D imb."]
    md_head, rule, row = (out / "summary.md").read_text().splitlines()[:3]
    assert [c.strip() for c in md_head.strip("|").split("|")] == head
    assert rule == "|" + "---|" * 12
    printed_row = next(line for line in printed.splitlines() if line.startswith("│ round_robin"))
    assert [c.strip() for c in row.strip("|").split("|")] == [c.strip() for c in printed_row.strip("│").split("│")]


def test_capacity_progress_ends_at_the_simulations_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: the bar ended at max(estimate, run), '11/11 above_bounds' for a search of 7 simulations
    # (x1, 2, 4, ..., 64: the SLO still holds at the upper bound)
    rc = main(["sim", "capacity", "--scenario", "llama8b-agg-h100", "--limit", "20", "--policies", "round_robin",
               "--jobs", "1", "--no-plots", "--out", str(tmp_path / "cap")])
    out = capsys.readouterr().out
    assert rc == 0
    bar = next(line for line in out.splitlines() if line.startswith("round_robin") and "━" in line)
    assert " 7/7 above_bounds " in bar, bar
    row = next(line for line in out.splitlines() if line.startswith("│ round_robin"))
    assert [c.strip() for c in row.strip("│").split("│")][9] == "7"  # the evals column


def test_sweep_table_never_cuts_the_policy_or_grid_names(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: 'cache_aware…' and 'mixed.num_…' in the 160-column table printed to a file or pipe, so two
    # variants of one policy, or two grid keys, read alike
    sweep = tmp_path / "s.toml"
    sweep.write_text('scenario = "llama8b-agg-h100"\npolicies = ["round_robin", "cache_aware:cache_threshold=0.5"]\n'
                     'rates = [1.0]\nlimit = 10\n[grid]\n"mixed.num_engines" = [2]\n"mixed.max_prefill_tokens" = [1024]\n')
    assert main(["sim", "sweep", str(sweep), "--jobs", "1", "--quiet", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("┏"):out.index("┘") + 1]
    assert "…" not in table
    cells = lambda line: [c.strip() for c in line.strip("│┃").split("│" if line.startswith("│") else "┃")]  # noqa: E731
    lines = table.splitlines()
    heads = [cells(x) for x in lines if x.startswith("┃")]
    # a folded header reads top to bottom
    assert ["".join(parts) for parts in zip(*heads)][:5] == [
        "policy", "rate", "seed", "mixed.num_engines", "mixed.max_prefill_tokens"]
    body = [cells(x) for x in lines if x.startswith("│")]
    # rows folded over several lines: a row starts where the rate column is filled
    labels, cur = [], None
    for c in body:
        if c[1]:
            cur = [c[0]]
            labels.append(cur)
        else:
            cur.append(c[0])
    assert ["".join(parts) for parts in labels] == ["round_robin", "cache_aware(cache_threshold=0.5)"]


@pytest.mark.parametrize("kwargs, message", [
    # was: a 74.5 GiB numpy allocation and a traceback (1e10 requests), or minutes of hashing
    ({"num_groups": 100_000, "prompts_per_group": 100_000}, "10,000,000,000 requests, more than max_requests=10,000,000"),
    ({"system_prompt_tokens": 10 ** 11, "question_tokens": 0},
     "system_prompt_tokens + question_tokens must be <= 16,777,216 tokens (the longest a trace may give), "
     "got 100,000,000,000"),
    ({"output_tokens": 1 << 25},
     "output_tokens must be <= 16,777,216 tokens (the longest a trace may give), got 33,554,432"),
    # 10,000 x 1,000 prompts of ceil(10,128 / 512) = 20 blocks = 2e8 blocks
    ({"num_groups": 10_000, "prompts_per_group": 1_000, "system_prompt_tokens": 10_000},
     "200,000,000 prompt blocks in all, more than 50,000,000; fewer requests, shorter prompts or a larger block size"),
])
def test_shared_prefix_workload_is_bounded_before_it_allocates(kwargs, message) -> None:
    from sim.workload import shared_prefix_workload
    with pytest.raises(ValueError) as ei:
        shared_prefix_workload(**kwargs)
    assert str(ei.value) == message


def test_load_ramp_is_bounded_before_it_hashes() -> None:
    from sim.workload import load_ramp_workload
    with pytest.raises(ValueError) as ei:  # was: hung hashing 2e9 blocks per request
        load_ramp_workload([1.0], 10.0, prompt_tokens_mean=1e12)
    assert str(ei.value) == ("prompt_tokens_mean must be <= 16,777,216 tokens (the longest a trace may give), "
                             "got 1,000,000,000,000")
    # a wide lognormal is clipped at 2^24 tokens per prompt: mean 1e7, sigma 2 (the most allowed) puts
    # P(draw > 2^24) = P(Z > (ln 2^24 - ln 1e7 + 2) / 2) = P(Z > 1.26) ~ 10% of ~100 requests
    reqs = load_ramp_workload([10.0], 10.0, prompt_tokens_mean=1e7, prompt_tokens_sigma=2.0, seed=1)
    assert max(r.prompt_tokens for r in reqs) == 1 << 24
    assert all(len(r.block_hashes) == -(-r.prompt_tokens // 512) for r in reqs)


def test_workload_out_directory_names_the_flag(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: "error: [Errno 21] Is a directory: '<dir>'"
    rc = main(["sim", "workload", "ramp", "--rates", "1", "--step-s", "5", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.strip() == (
        f"error: --out {tmp_path}: is a directory; give a file name, e.g. {tmp_path / 'workload.jsonl'}")


def test_too_many_sessions_names_the_flags(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # 1e9 days x 60 sessions per hour > 5 million sessions; was: "lower duration_s or sessions_per_hour"
    rc = main(["sim", "sessions", "--days", "1e9", "--out", str(tmp_path / "s.jsonl")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.strip() == "error: more than 5 million sessions: lower --days or --sessions-per-hour"


def _capacity_notes(argv: list[str], out, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], dict, dict]:
    """(printed notes, capacity.json, the x-max point's summary from capacity_points.csv)."""
    import csv
    import json
    assert main(["sim", "capacity", *argv, "--jobs", "1", "--quiet", "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "capacity.json").read_text())
    top = max(float(p["rate_scale"]) for p in doc["results"][0]["points"])
    with open(out / "capacity_points.csv") as f:
        row = next(r for r in csv.DictReader(f) if float(r["rate_scale"]) == top)
    summary = {k: float(row[f"summary.{k}"]) for k in ("arrival_window_s", "makespan_s")}
    return [line.strip() for line in printed.splitlines() if ": note: " in line], doc, summary


def test_capacity_says_when_its_answer_is_a_burst(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: "above_bounds at x64" on 20 requests without a word that they arrive within ~0.05 s and
    # take seconds to finish: goodput per second of the arrival window reads as a sustained rate
    notes, doc, best = _capacity_notes(["--scenario", "llama8b-agg-h100", "--limit", "20", "--policies", "round_robin"],
                                       tmp_path / "burst", capsys)
    assert doc["results"][0]["rate_scale"] == 64
    window, makespan = best["arrival_window_s"], best["makespan_s"]
    assert makespan > 2 * window  # the condition, from the answer run's own summary
    burst = [n for n in notes if "burst" in n]  # (and issue 24's small-sample note: 20 requests)
    assert burst == [f"round_robin: note: at the answer the 20 requests arrive over {window:.3g} s and the last "
                     f"finishes at {makespan:.3g} s: the cluster absorbed a burst and drained it, which is not a "
                     "rate it sustains; search over a fixed window (--duration-s S: every rate runs S seconds of "
                     "arrivals) or a longer trace"]
    assert doc["results"][0]["notes"][0] == burst[0].removeprefix("round_robin: note: ")
    assert [n for n in notes if "small sample: the answer rests on 20 requests" in n]


def test_capacity_adds_no_burst_note_to_a_sustained_answer(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2 req/s for 200 s of 512-token prompts and 16-token answers on 8 Llama-8B GPUs: at x2 (the
    # upper bound) 400 requests arrive over ~100 s and each finishes within a second of arriving
    trace = tmp_path / "ramp.jsonl"
    assert main(["sim", "workload", "ramp", "--rates", "2", "--step-s", "200", "--prompt-tokens", "512",
                 "--output-tokens", "16", "--out", str(trace)]) == 0
    capsys.readouterr()
    notes, doc, best = _capacity_notes(["--scenario", "llama8b-agg-h100", "--trace", str(trace), "--policies",
                                        "round_robin", "--rate-min", "0.5", "--rate-max", "2"], tmp_path / "steady", capsys)
    assert doc["results"][0]["status"] == "above_bounds" and doc["results"][0]["rate_scale"] == 2
    assert [n for n in notes if "burst" in n] == []  # (issue 24's small-sample note remains: < 1,000 requests)
    assert best["makespan_s"] < 1.1 * best["arrival_window_s"]


@pytest.mark.parametrize("command", ["run", "compare", "capacity"])
def test_a_bad_model_is_reported_before_the_header_and_progress(command: str, tmp_path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An unsupported config.json, a missing one, an unknown preset: one error line, exit 2, and
    nothing printed before it (it used to come after the scenario header and a progress bar)."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["FooForCausalLM"], "hidden_size": 8}')
    for model, message in ((str(cfg), f"error: {cfg}: unsupported architecture 'FooForCausalLM'"),
                           (str(tmp_path / "missing" / "config.json"), "error: model config "),
                           ("no-such-model", "error: unknown model 'no-such-model'")):
        rc = main(["sim", command, "--scenario", "llama8b-agg-h100", "--set", f"model={model}", "--duration-s", "5",
                   "--out", str(tmp_path / "out")])
        captured = capsys.readouterr()
        assert rc == 2, captured
        assert captured.out == "", captured.out
        assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err


@pytest.mark.parametrize("command", ["run", "compare", "capacity"])
def test_a_model_that_does_not_fit_is_reported_before_the_header_and_progress(
        command: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """review11: V4.1-Flash (297.1 GB of weights: 288.8 GB MXFP4 experts + 8.3 GB FP8 dense) on
    llama70b-pd-h100's TP4 H100 ranks (74.3 GB per GPU > 72 GB) was reported after the header and a
    started progress bar, without naming the pool; now one line naming it, nothing before."""
    rc = main(["sim", command, "--scenario", "llama70b-pd-h100", "--set", "model=deepseek-v4.1-flash",
               "--duration-s", "5", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert captured.out == "", captured.out
    assert captured.err.startswith("error: prefill pool: deepseek-v4.1-flash does not fit on 1 x 4 H100"), captured.err
    assert "74.3 GB of weights" in captured.err and "prefill.gpus_per_rank" in captured.err
    assert captured.err.count("\n") == 1, captured.err
