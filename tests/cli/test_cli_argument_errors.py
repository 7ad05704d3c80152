"""Bad arguments to the ``pdlb sim`` commands are one error line naming the flag (exit 2), before
any header or progress bar: a negative seed, ``--policy`` with ``--policies``, an ``--out`` that is a
folder, too many sessions, a model that is unknown or does not fit. Every expected message is
written out by hand from the input.
"""

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
    """V4.1-Flash (297.1 GB of weights: 288.8 GB MXFP4 experts + 8.3 GB FP8 dense) on
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
