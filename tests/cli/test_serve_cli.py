"""``pdlb serve`` / ``pdlb engine`` command lines: worker flags, one-line errors with exit status 2,
the no-workers warning and --help texts.

Expected messages are written by hand from the rules they check (the option's range, the worker
spec syntax, the registry of names); numbers in the "does not fit" message are derived by hand
next to the assertion. Every failing command is run in-process through ``pdlb_cli.main.main``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket

import pytest

from balancer.policies import available_policies
from balancer.service.launch import _ready_line
from pdlb_cli.serve import config_from_args
from balancer.service.config import parse_worker_spec
from pdlb_cli.main import build_parser, main

POLICIES = ", ".join(available_policies())


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _serve_cfg(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


FD_LIMIT_WARNING = "warning: the open-file limit ("
"""The start of ``pdlb serve``'s warning on a host whose hard open-file limit cannot hold the default
``max_connections`` (tests/service/test_fd_limit.py tests it): it depends on the host, so the
exact-output checks here leave it out."""


def _fails(argv: list[str], capsys) -> str:
    """Run ``pdlb ARGV`` in-process; it must exit 2 and print exactly one line on stderr (besides
    the host-dependent :data:`FD_LIMIT_WARNING`)."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    return "".join(line for line in captured.err.splitlines(keepends=True) if not line.startswith(FD_LIMIT_WARNING))


# ---------------------------------------------------------------------- 1. worker flags
def test_repeated_worker_flags_accumulate_in_order():
    cfg = _serve_cfg("--prefill", "http://127.0.0.1:31000", "--prefill", "http://127.0.0.1:31001,dp=2",
                     "http://127.0.0.1:31002", "--decode", "http://127.0.0.1:32000",
                     "--decode", "http://127.0.0.1:32001,kv=4096")
    assert [(w.url, w.role, w.dp_size) for w in cfg.workers] == [
        ("http://127.0.0.1:31000", "prefill", 1), ("http://127.0.0.1:31001", "prefill", 2),
        ("http://127.0.0.1:31002", "prefill", 1), ("http://127.0.0.1:32000", "decode", 1),
        ("http://127.0.0.1:32001", "decode", 1)]
    assert cfg.workers[4].kv_capacity_tokens == 4096
    assert "workers=P3/D2/M0" in _ready_line(cfg, 8000)
    mixed = _serve_cfg("--pd-protocol", "none", "--mixed", "http://a:1", "--mixed", "http://b:1")
    assert [w.url for w in mixed.workers] == ["http://a:1", "http://b:1"]


def test_flag_workers_add_to_config_file_workers(tmp_path):
    f = tmp_path / "pdlb.yaml"
    f.write_text("workers:\n  - {url: 'http://a:1', role: prefill}\nblock_size: 32\n")
    cfg = _serve_cfg("--config", str(f), "--decode", "http://b:1", "--decode", "http://c:1")
    assert [(w.url, w.role) for w in cfg.workers] == [("http://a:1", "prefill"), ("http://b:1", "decode"),
                                                      ("http://c:1", "decode")]
    assert cfg.router.block_size == 32  # the file's value survives: --block-size not given


@pytest.mark.parametrize("argv", [
    ["--prefill", "http://127.0.0.1:31000", "--prefill", "http://127.0.0.1:31000"],
    ["--prefill", "http://127.0.0.1:31000", "--decode", "http://127.0.0.1:31000/"],  # same URL after normalising
])
def test_duplicate_worker_url_is_an_error_naming_it(argv, capsys):
    err = _fails(["serve", "--port", "0", *argv], capsys)
    assert err == "error: duplicate worker url(s) http://127.0.0.1:31000: list each engine once\n"


def test_parse_worker_spec_fields():
    assert parse_worker_spec(" http://h:1/ ,dp=8, bootstrap=none,kv=0", "prefill") == {
        "url": "http://h:1", "role": "prefill", "dp_size": 8, "bootstrap_port": None, "kv_capacity_tokens": 0}
    assert parse_worker_spec("https://h:1,bootstrap=8998", "decode") == {
        "url": "https://h:1", "role": "decode", "bootstrap_port": 8998}


# ---------------------------------------------------------------------- 3. config errors
SPEC_SYNTAX = "URL[,dp=N][,bootstrap=PORT|none][,kv=TOKENS][,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT][,model=NAME]"


@pytest.mark.parametrize("argv,message", [
    (["--prefill-policy", "cache-aware"],
     f"router.prefill_policy: unknown policy 'cache-aware' (did you mean 'cache_aware'?); valid policies: {POLICIES}"),
    (["--decode-policy", "fastest"], f"router.decode_policy: unknown policy 'fastest'; valid policies: {POLICIES}"),
    (["--port", "99999"], "port: Input should be less than or equal to 65535"),
    (["--block-size", "0"], "router.block_size: block_size must be an integer >= 1, got 0"),
    (["--processes", "0", "--max-retries", "-1"],  # two problems on one line, pydantic's field order
     "retry.max_retries: Input should be greater than or equal to 0; "
     "processes: Input should be greater than or equal to 1"),
    (["--prefill", "localhost:31000"],
     "worker spec 'localhost:31000': the URL must start with http:// or https:// (e.g. 'http://localhost:31000')"),
    (["--mixed", "ftp://x"],  # another scheme: no example glued onto it ('http://ftp://x' before)
     "worker spec 'ftp://x': the URL must start with http:// or https://, got scheme 'ftp'"),
    (["--prefill", "http://127.0.0.1:31000,dp=0"],
     "worker spec 'http://127.0.0.1:31000,dp=0': dp must be an integer number of DP ranks 1..1024, got '0'"),
    (["--decode", "http://127.0.0.1:31000,kv=abc"],
     "worker spec 'http://127.0.0.1:31000,kv=abc': kv must be an integer number of tokens 0..1099511627776, got 'abc'"),
    (["--prefill", "http://127.0.0.1:31000,bootstrap=70000"],
     "worker spec 'http://127.0.0.1:31000,bootstrap=70000': bootstrap must be a port number 1..65535 or none, "
     "got '70000'"),
    (["--mixed", "http://127.0.0.1:31000,tp=2"],
     f"worker spec 'http://127.0.0.1:31000,tp=2': unknown option 'tp=2' (syntax: {SPEC_SYNTAX})"),
    (["--prefill", "http://127.0.0.1:31000,dp=2,dp=4"],
     "worker spec 'http://127.0.0.1:31000,dp=2,dp=4': dp given more than once"),
    # an empty item says so (review, session 15: was "unknown option ''")
    (["--decode", "http://127.0.0.1:31000,"],
     f"worker spec 'http://127.0.0.1:31000,': item 2 is empty (a trailing comma) (syntax: {SPEC_SYNTAX})"),
    (["--decode", "http://127.0.0.1:31000,,dp=2"],
     f"worker spec 'http://127.0.0.1:31000,,dp=2': item 2 is empty (two commas in a row) (syntax: {SPEC_SYNTAX})"),
    # worker URLs are parsed at startup (as the HTTP client would), not on the first request
    (["--prefill", "http://127.0.0.1:notaport"],
     "worker spec 'http://127.0.0.1:notaport': port 'notaport' is not an integer 1..65535"),
    (["--decode", "http://127.0.0.1:70000"],
     "worker spec 'http://127.0.0.1:70000': port '70000' is not an integer 1..65535"),
    (["--decode", "http://127.0.0.1:0,dp=2"],
     "worker spec 'http://127.0.0.1:0,dp=2': port '0' is not an integer 1..65535"),
    (["--mixed", "http://:8000"],
     "worker spec 'http://:8000': the URL has no host (e.g. 'http://10.0.0.5:30000')"),
    # NaN and infinities (review F9): were "Input should be greater than 0" for NaN, and inf was taken
    (["--request-timeout-s", "nan"], "request_timeout_s: must be a finite number, got nan"),
    (["--request-timeout-s", "inf"], "request_timeout_s: must be a finite number, got inf"),
    (["--first-byte-timeout-s=-inf"], "first_byte_timeout_s: must be a finite number, got -inf"),
    # review R10 (session 16): an empty alias was taken as "no alias" (/v1/models then asked a worker)
    (["--served-model-name", ""], "served_model_name: String should have at least 1 character"),
])
def test_serve_config_errors_are_one_line(argv, message, capsys):
    assert _fails(["serve", "--port", "0", *argv], capsys) == f"error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["--max-process-restarts", "-1"],
     "--max-process-restarts: expected an integer >= 0 (0: a dead router process is not restarted), got -1"),
    (["--restart-window-s", "0"], "--restart-window-s: expected a number of seconds > 0, got 0"),
    (["--restart-window-s", "-5"], "--restart-window-s: expected a number of seconds > 0, got -5"),
    (["--restart-window-s", "nan"], "--restart-window-s: expected a number of seconds > 0, got nan"),
])
def test_restart_flags_are_refused_before_start_whatever_the_process_count(argv, message, monkeypatch, capsys):
    # review F3: were refused only with several processes, in the supervisor's words ("max_restarts
    # must be >= 0"), and taken silently by one process (the default with a worker on this host)
    import pdlb_cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "serve", lambda *a, **k: pytest.fail("pdlb serve started"))
    for processes in ("1", "2"):
        assert _fails(["serve", "--port", "0", "--processes", processes, *argv], capsys) == f"error: {message}\n"


def test_restart_flags_at_their_bounds_are_taken(monkeypatch):
    import pdlb_cli.serve as serve_cli

    seen = {}
    monkeypatch.setattr(serve_cli, "serve", lambda cfg, **kw: seen.update(kw) or 0)
    assert main(["serve", "--port", "0", "--max-process-restarts", "0", "--restart-window-s", "inf"]) == 0
    assert (seen["max_process_restarts"], seen["restart_window_s"]) == (0, float("inf"))


def test_serve_config_file_errors_name_the_file_and_suggest_fields(tmp_path, capsys):
    f = tmp_path / "pdlb.yaml"
    f.write_text("port: 99999\nworkerz: []\nretry: {max_retry: 2}\n")
    assert _fails(["serve", "--config", str(f)], capsys) == (
        f"error: {f}: port: Input should be less than or equal to 65535; "
        "retry.max_retry: unknown field (did you mean 'max_retries'?); "
        "workerz: unknown field (did you mean 'workers'?)\n")
    # YAML's .nan and .inf anywhere in the config (review F9)
    f.write_text("request_timeout_s: .nan\nretry: {jitter: .inf}\n")
    assert _fails(["serve", "--config", str(f)], capsys) == (
        f"error: {f}: request_timeout_s: must be a finite number, got nan; retry.jitter: must be a finite number, got inf\n")


# ---------------------------------------------------------------------- 2. engine errors
@pytest.mark.parametrize("argv,message", [
    (["--model", "nosuch"],
     "model: unknown model 'nosuch'; valid names: deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, deepseek-v4.1-flash, llama-3.1-70b, llama-3.1-8b, qwen3-30b-a3b, qwen3-32b "
     "(or a Hugging Face config.json path)"),
    (["--hardware", "h999"], "hardware: unknown hardware 'h999'; valid names: B200, H100, H200, H800"),
    # 671e9 parameters x 1 byte (FP8) = 671.0 GB; 72.0 GB = 90% of the H100's 80 GB; 2.0 GB reserve
    (["--role", "prefill", "--model", "deepseek-v3"],
     "deepseek-v3 does not fit on 1 x 1 H100 (ep_synchronous=False): 671.0 GB of weights + 2.0 GB activation "
     "reserve per GPU > 72.0 GB (90% of 80 GB); use more GPUs (more EP ranks / TP) or a larger GPU "
     "(pdlb engine: --gpus-per-rank, --dp-ranks, --hardware)"),
    (["--dp-ranks", "0", "--error-status", "200"],
     "dp_ranks: Input should be greater than or equal to 1; "
     "faults.error_status: Input should be greater than or equal to 400"),
    (["--port", "99999"], "--port 99999: not a TCP port (0..65535)"),
])
def test_engine_errors_are_one_line(argv, message, capsys):
    argv = ["engine", "--port", "0", *argv] if "--port" not in argv else ["engine", *argv]
    assert _fails(argv, capsys) == f"error: {message}\n"


def _no_unclosed_session(caplog) -> None:
    gc.collect()  # an unclosed aiohttp ClientSession reports itself when collected
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]


@pytest.mark.parametrize("argv", [
    ["engine", "--port", "{port}"],
    ["engine", "--port", "0", "--bootstrap-port", "{port}"],
    ["serve", "--port", "{port}", "--pd-protocol", "none", "--mixed", "http://127.0.0.1:9"],
])
def test_port_in_use_is_one_line_and_closes_everything(argv, capsys, caplog):
    caplog.set_level(logging.WARNING)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _fails([a.format(port=port) for a in argv], capsys)
    assert err == f"error: port {port} is already in use on 127.0.0.1 (another pdlb serve or engine still running?)\n"
    _no_unclosed_session(caplog)


# ---------------------------------------------------------------------- 4. no workers
def test_serve_without_workers_warns(capsys):
    with socket.socket() as busy:  # the warning comes before listening; a busy port ends the run there
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _fails(["serve", "--port", str(port)], capsys)
    assert err.splitlines() == [
        "warning: no workers: every request gets 503 until workers are added with the admin API (POST /workers) "
        "or given with --prefill/--decode/--mixed",
        f"error: port {port} is already in use on 127.0.0.1 (another pdlb serve or engine still running?)"]


def test_config_file_worker_url_with_a_bad_port_is_one_line(tmp_path, capsys):
    f = tmp_path / "pdlb.yaml"
    f.write_text("workers:\n  - {url: 'http://127.0.0.1:notaport', role: decode}\n")
    assert _fails(["serve", "--config", str(f)], capsys) == (
        f"error: {f}: workers.0.url: worker url 'http://127.0.0.1:notaport': port 'notaport' is not an "
        "integer 1..65535\n")


def _serve_warnings(argv: list[str], capsys) -> list[str]:
    """stderr lines of ``pdlb serve ARGV`` up to its (forced) busy-port error, which is dropped."""
    with socket.socket() as busy:  # the warnings come before listening; a busy port ends the run there
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        lines = _fails(["serve", "--port", str(busy.getsockname()[1]), *argv], capsys).splitlines()
    assert lines[-1].startswith("error: port ")
    return lines[:-1]


BOOTSTRAP_WARNING = (
    "warning: prefill worker http://127.0.0.1:31000 has no bootstrap port: with pd_protocol sglang its requests "
    "carry bootstrap_port null and decode engines that need it fail every PD request (502); give the engine's "
    "--disaggregation-bootstrap-port as http://127.0.0.1:31000,bootstrap=PORT (bootstrap_port: PORT in a config "
    "file), or bootstrap=none to send null on purpose")


@pytest.mark.parametrize("argv,expected", [
    (["--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:31000", "--decode", "http://127.0.0.1:32000"],
     [BOOTSTRAP_WARNING]),
    # bootstrap=none is the documented way to send null: no warning; nor for vLLM (no bootstrap)
    (["--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:31000,bootstrap=none",
      "--decode", "http://127.0.0.1:32000"], []),
    (["--pd-protocol", "vllm", "--prefill", "http://127.0.0.1:31000", "--decode", "http://127.0.0.1:32000"], []),
    (["--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:31000,bootstrap=31000"],
     ["warning: pd_protocol sglang with 1 prefill worker(s) but no decode worker: every request gets 503 until "
      "one is added (--decode URL or POST /workers)"]),
    (["--pd-protocol", "vllm", "--decode", "http://127.0.0.1:32000", "http://127.0.0.1:32001"],
     ["warning: pd_protocol vllm with 2 decode worker(s) but no prefill worker: requests go to the decode workers "
      "alone, which PD decode engines reject; add --prefill URL, or serve aggregated engines with --pd-protocol "
      "none --mixed URL"]),
    # mixed (aggregated) engines alone are a valid setup under any protocol
    (["--pd-protocol", "sglang", "--mixed", "http://127.0.0.1:32000"], []),
])
def test_serve_warns_about_pd_setups_that_cannot_work(argv, expected, capsys):
    assert _serve_warnings(argv, capsys) == expected


# ---------------------------------------------------------------------- 5./6. --help
@pytest.mark.parametrize("command", ["serve", "engine"])
def test_every_option_has_help_with_a_default(command):
    p = _subparser(command)
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        assert a.help, a.option_strings
        if not isinstance(a, argparse._StoreTrueAction):  # on/off switches: default off
            assert "(default: " in a.help, a.option_strings
    text = p.format_help()
    assert "(default: None)" not in text and "%(default)" not in text


def test_serve_help_names_syntax_policies_and_simulator_differences():
    p = _subparser("serve")
    helps = {a.dest: " ".join(a.help.split()) for a in p._actions if a.help}
    assert "kv=TOKENS" in p.description
    assert f"one of: {POLICIES} (default: ep_aware)" in helps["prefill_policy"]
    assert "(default: ep_aware" in helps["decode_policy"] and "'pdlb sim run --policy P' uses P for both" \
        in helps["decode_policy"]
    assert "(default: 64;" in helps["block_size"] and "512" in helps["block_size"]
    assert "(default: 0," in helps["pd_min_uncached_tokens"]
    assert "(default: 5)" in helps["max_retries"] and "(default: 60)" in helps["health_check_interval_s"]


def test_engine_help_lists_model_and_hardware_names():
    helps = {a.dest: " ".join(a.help.split()) for a in _subparser("engine")._actions if a.help}
    assert helps["model"] == ("model preset, one of: deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, deepseek-v4.1-flash, llama-3.1-70b, llama-3.1-8b, qwen3-30b-a3b, qwen3-32b "
                              "(default: %(default)s)")
    assert "B200, H100, H200, H800" in helps["hardware"]
    assert "(default: %(default)s)" in helps["role"]


@pytest.mark.parametrize("flag, field, default", [("--prefill-timeout-s", "prefill_timeout_s", 60.0),
                                                   ("--stream-first-chunk-timeout-s", "stream_first_chunk_timeout_s", 120.0)])
def test_timeout_flags_zero_turns_off(flag, field, default):
    import argparse

    from pdlb_cli.serve import add_serve_parser, config_from_args

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    base = ["serve", "--mixed", "http://127.0.0.1:9", "--pd-protocol", "none"]
    assert getattr(config_from_args(p.parse_args(base)), field) == default
    assert getattr(config_from_args(p.parse_args([*base, flag, "7"])), field) == 7.0
    assert getattr(config_from_args(p.parse_args([*base, flag, "0"])), field) is None


def test_admission_tuning_flags_without_admission_are_an_error(tmp_path):
    # an operator who forgets --admission must not believe the router sheds: the same rule as pdlb sim
    with pytest.raises(ValueError, match=r"--admission-max-queue, --admission-ttft-slo-s need --admission"):
        _serve_cfg("--prefill", "http://p:1", "--decode", "http://d:2", "--admission-ttft-slo-s", "1",
             "--admission-max-queue", "5")
    on = _serve_cfg("--prefill", "http://p:1", "--decode", "http://d:2", "--admission", "--admission-ttft-slo-s", "1")
    assert on.admission.enabled and on.admission.ttft_slo_s == 1.0
    cfg_file = tmp_path / "pdlb.yaml"  # enabled in the file: the flags tune it
    cfg_file.write_text("admission:\n  enabled: true\n")
    from_file = _serve_cfg("--config", str(cfg_file), "--prefill", "http://p:1", "--decode", "http://d:2",
                     "--admission-max-queue", "5")
    assert from_file.admission.enabled and from_file.admission.max_queue_requests == 5


@pytest.mark.parametrize("policy, warned", [
    ("ep_aware:ttft_slo_s=2,slo_margin=0.5", True),  # the default cost model: every engine wide EP
    ("ep_aware:ttft_slo_s=2,slo_wide_ep=true", False),
    ("ep_aware", False),  # no budget
    ("cache_aware", False),
])
def test_serve_warns_of_a_ttft_budget_ep_aware_will_not_use(policy, warned):
    # review R4: pdlb serve took an ep_aware budget it ignores on wide-EP engines, silently
    from pdlb_cli.serve import ignored_budget_warning

    cfg = _serve_cfg("--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:51000,bootstrap=51000",
                     "--decode", "http://127.0.0.1:52000", "--prefill-policy", policy)
    got = ignored_budget_warning(cfg)
    assert (got is not None) is warned, got
    if warned:
        assert got == ("the prefill policy ep_aware has a TTFT budget it will not use: every prefill engine is wide EP "
                       "(ep_synchronous in the cost model), where ep_aware routes SLO-blind unless slo_wide_ep=true")


# review F9 (session 15): ep_aware's opt-in cost terms that need the cost model's engine data were
# taken silently without it (decisions then the same as without the option, by the code: tau = 1,
# no sequence cap)
SPEC_MSG = ("the decode policy ep_aware has spec_decode=true, which changes nothing here: no {role} engine has "
            "decode_tokens_per_step above 1 in the cost model (give --cost-model a file with it: pdlb sim cost-model "
            "writes it for a [speculative] table with verify = \"every_step\")")
CAP_MSG = ("the decode policy ep_aware has seq_cap=true, which changes nothing here: no {role} engine has "
           "max_num_seqs in the cost model (give --cost-model a file with it: pdlb sim cost-model writes the pool's)")


@pytest.mark.parametrize("policy, cost_model, expected", [
    ("ep_aware:spec_decode=true", None, [SPEC_MSG.format(role="decode")]),
    ("ep_aware:seq_cap=true", None, [CAP_MSG.format(role="decode")]),
    ("ep_aware:spec_decode=true,seq_cap=true", None, [SPEC_MSG.format(role="decode"), CAP_MSG.format(role="decode")]),
    ("ep_aware:spec_decode=true,seq_cap=true", {"decode_tokens_per_step": 2.28, "max_num_seqs": 256}, []),
    ("ep_aware:spec_decode=true", {"max_num_seqs": 256}, [SPEC_MSG.format(role="decode")]),
    ("ep_aware", None, []),  # off: nothing to say
    ("least_load", None, []),
])
def test_serve_warns_of_ep_aware_options_the_cost_model_cannot_feed(policy, cost_model, expected, tmp_path):
    from balancer.cost_model import DEFAULT_COST_MODEL
    from pdlb_cli.serve import idle_policy_option_warnings

    argv = ["--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:51000,bootstrap=51000",
            "--decode", "http://127.0.0.1:52000", "--decode-policy", policy]
    if cost_model is not None:  # the default model with these decode-engine keys (JSON: read_cost_model_file)
        import json

        data = DEFAULT_COST_MODEL.to_dict()
        data["decode"].update(cost_model)
        f = tmp_path / "cm.json"
        f.write_text(json.dumps(data))
        argv += ["--cost-model", str(f)]
    assert idle_policy_option_warnings(_serve_cfg(*argv)) == expected


def test_the_option_warnings_name_the_mixed_pool_and_reach_stderr(capsys):
    lines = _serve_warnings(["--pd-protocol", "none", "--mixed", "http://127.0.0.1:52000",
                             "--decode-policy", "ep_aware:seq_cap=true"], capsys)
    assert lines == ["warning: " + CAP_MSG.format(role="mixed")]


# review2 (session 15): ep_aware:parallel_chunks=true changes a decision only on a mixed pool whose
# engines run a prompt's chunks beside the queue (max_num_seqs x request_chunk_tokens <= chunk_tokens,
# balancer/policies/ep_aware.py _cadence_one; the default cost model has neither key), and it was
# taken silently elsewhere
PC_MIXED_ONLY = ("the {pool} policy ep_aware has parallel_chunks=true, which changes nothing here: it prices mixed "
                 "pools only ({pool} pools the same either way)")
PC_NO_KEYS = ("the decode policy ep_aware has parallel_chunks=true, which changes nothing here: no mixed engine has "
              "max_num_seqs and request_chunk_tokens with max_num_seqs x request_chunk_tokens <= chunk_tokens in the "
              "cost model, or cadence=false (give --cost-model a file with them: pdlb sim cost-model writes the pool's)")
PD = ["--pd-protocol", "sglang", "--prefill", "http://127.0.0.1:51000,bootstrap=51000",
      "--decode", "http://127.0.0.1:52000"]
MIXED = ["--pd-protocol", "none", "--mixed", "http://127.0.0.1:52000"]


@pytest.mark.parametrize("argv, decode_keys, expected", [
    (PD + ["--decode-policy", "ep_aware:parallel_chunks=true"], None, [PC_MIXED_ONLY.format(pool="decode")]),
    (PD + ["--prefill-policy", "ep_aware:parallel_chunks=true"], None, [PC_MIXED_ONLY.format(pool="prefill")]),
    (MIXED + ["--decode-policy", "ep_aware:parallel_chunks=true"], None, [PC_NO_KEYS]),
    # 64 x 128 = 8,192 <= the chunk budget 8,192: chunks in parallel, the option takes effect
    (MIXED + ["--decode-policy", "ep_aware:parallel_chunks=true"], {"max_num_seqs": 64, "request_chunk_tokens": 128},
     []),
    # 64 x 256 = 16,384 > 8,192: FIFO draining's terms stay
    (MIXED + ["--decode-policy", "ep_aware:parallel_chunks=true"], {"max_num_seqs": 64, "request_chunk_tokens": 256},
     [PC_NO_KEYS]),
    (MIXED + ["--decode-policy", "ep_aware:parallel_chunks=true,cadence=false"],
     {"max_num_seqs": 64, "request_chunk_tokens": 128}, [PC_NO_KEYS]),
    (MIXED + ["--decode-policy", "ep_aware"], None, []),  # off: nothing to say
    # issue 23 part 3 (session 16): prefill_at_once prices the same mixed pools of parallel chunks
    (PD + ["--decode-policy", "ep_aware:prefill_at_once=true"], None,
     [PC_MIXED_ONLY.format(pool="decode").replace("parallel_chunks", "prefill_at_once")]),
    (MIXED + ["--decode-policy", "ep_aware:prefill_at_once=true"], None,
     [PC_NO_KEYS.replace("parallel_chunks", "prefill_at_once")]),
    (MIXED + ["--decode-policy", "ep_aware:prefill_at_once=true"], {"max_num_seqs": 64, "request_chunk_tokens": 128},
     []),
    (PD + ["--prefill-policy", "ep_aware:session_forecast=true"], None,
     ["the prefill policy ep_aware has session_forecast=true, which changes nothing here: it prices decode and "
      "mixed pools only (prefill pools the same either way)"]),
    (PD + ["--decode-policy", "ep_aware:session_forecast=true"], None, []),  # decode pools: it prices them
    # review R3 (session 16): dense engines (each rank its own step) have no group tokens: the parallel
    # model's group terms (per_group_token x ...) and FIFO draining's are both 0 (ep_aware.py
    # _prefill_cost_one: w_ext = 0 unless ep_synchronous); tests/cli/test_idle_policy_options.py runs it
    (MIXED + ["--decode-policy", "ep_aware:parallel_chunks=true"],
     {"max_num_seqs": 64, "request_chunk_tokens": 128, "ep_synchronous": False},
     ["the decode policy ep_aware has parallel_chunks=true, which changes nothing here: the mixed engines whose "
      "chunks run in parallel are dense (ep_synchronous = false in the cost model), so a prompt has no group tokens "
      "to price either way"]),
])
def test_serve_warns_of_parallel_chunks_that_can_change_nothing(argv, decode_keys, expected, tmp_path):
    from balancer.cost_model import DEFAULT_COST_MODEL
    from pdlb_cli.serve import idle_policy_option_warnings

    if decode_keys is not None:  # a mixed engine without its own entry is priced as the decode engine
        import json

        data = DEFAULT_COST_MODEL.to_dict()
        assert data["decode"]["chunk_tokens"] == 8192
        data["decode"].update(decode_keys)
        f = tmp_path / "cm.json"
        f.write_text(json.dumps(data))
        argv = argv + ["--cost-model", str(f)]
    assert idle_policy_option_warnings(_serve_cfg(*argv)) == expected


# review R4 (session 16): with --http-front aiohttp the parent cannot place connections by load (the
# lean front gives them back; launch.py builds no placement view without it) and fell back to round
# robin silently, also for an explicit --connection-placement follow_load
PLACEMENT = ("warning: {what} needs the lean HTTP front (it gives connections back with Connection: close): with "
             "--http-front aiohttp the 2 router processes get new connections round robin, never given back (say "
             "--connection-placement round_robin to silence this)")


@pytest.mark.parametrize("argv, expected", [
    (["--processes", "2", "--http-front", "aiohttp"], [PLACEMENT.format(what="load-following connection placement")]),
    (["--processes", "2", "--http-front", "aiohttp", "--connection-placement", "follow_load"],
     [PLACEMENT.format(what="--connection-placement follow_load")]),
    (["--processes", "2", "--http-front", "aiohttp", "--connection-placement", "round_robin"], []),
    (["--processes", "2"], []),  # the lean front: placement follows the load
    (["--processes", "2", "--http-front", "lean", "--connection-placement", "follow_load"], []),
    (["--processes", "1", "--http-front", "aiohttp"], []),  # one process: nothing to place
])
def test_serve_says_when_connections_cannot_follow_the_load(argv, expected, capsys):
    assert _serve_warnings([*argv, "--mixed", "http://127.0.0.1:52000"], capsys) == expected


# review3 S1 (session 16): --pin-processes with one router process and --placement-target-util where
# connections are not placed by load were silently ignored (the README's demo, loopback workers on a
# host of fewer than 8 cores, runs one process). Expected lines: the rule (the option acts only with
# several processes placed by load), written out by hand.
PIN_ONE = ("warning: --pin-processes changes nothing here: one router process (it pins each of several to its own "
           "CPU; --processes N)")
TARGET = ("warning: --placement-target-util changes nothing here: it sizes the load-following placement's active "
          "processes, and {why}")
EVEN = ("warning: --placement-even-out changes nothing here: it evens out the load-following placement's active "
        "processes, and {why}")


@pytest.mark.parametrize("argv, expected", [
    (["--processes", "1", "--pin-processes"], [PIN_ONE]),
    (["--pin-processes"], [PIN_ONE]),  # a loopback worker on this 2-core host: one process by default
    (["--processes", "2", "--pin-processes"], []),
    (["--processes", "1", "--placement-target-util", "0.9"],
     [TARGET.format(why="there is one router process (--processes N)")]),
    (["--processes", "2", "--connection-placement", "round_robin", "--placement-target-util", "0.9"],
     [TARGET.format(why="connections are placed round robin (--connection-placement round_robin)")]),
    (["--processes", "2", "--http-front", "aiohttp", "--connection-placement", "round_robin",
      "--placement-target-util", "0.9"],
     [TARGET.format(why="connections are placed round robin (--connection-placement round_robin)")]),
    (["--processes", "2", "--placement-target-util", "0.9"], []),  # the lean front places by load: it acts
    (["--processes", "1"], []),  # not given: nothing to say
    # review5 U1 (session 17): --placement-even-out acts only where --placement-target-util does (the
    # load-following placement of several processes: placement.py's even-out pass); it was silent
    (["--processes", "1", "--placement-even-out"], [EVEN.format(why="there is one router process (--processes N)")]),
    (["--processes", "2", "--connection-placement", "round_robin", "--placement-even-out"],
     [EVEN.format(why="connections are placed round robin (--connection-placement round_robin)")]),
    (["--processes", "2", "--http-front", "aiohttp", "--connection-placement", "round_robin", "--placement-even-out"],
     [EVEN.format(why="connections are placed round robin (--connection-placement round_robin)")]),
    (["--processes", "2", "--placement-even-out"], []),  # placed by load: it acts
    (["--processes", "1", "--no-placement-even-out"], []),  # off: nothing to say
])
def test_serve_says_when_a_process_option_changes_nothing(argv, expected, capsys, monkeypatch):
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)  # 2 CPUs, as here
    assert _serve_warnings([*argv, "--mixed", "http://127.0.0.1:52000"], capsys) == expected


# review5 U2 (session 17): a config file made every ServiceConfig field count as given (the file's
# config was dumped whole into the flags' data), so any file with one router process got
# "--placement-target-util changes nothing here" although neither the file nor a flag named it.
# Expected: a warning only for what the file or a flag names (the rule above, by hand).
@pytest.mark.parametrize("file_text, argv, expected", [
    ("processes: 1\n", [], []),
    ("processes: 1\nplacement_target_util: 0.9\n", [],
     [TARGET.format(why="there is one router process (--processes N)")]),
    ("processes: 1\nplacement_even_out: true\n", [], [EVEN.format(why="there is one router process (--processes N)")]),
    ("processes: 2\n", ["--processes", "1", "--placement-target-util", "0.9"],
     [TARGET.format(why="there is one router process (--processes N)")]),
    ("processes: 2\nconnection_placement: round_robin\nplacement_even_out: true\n", [],
     [EVEN.format(why="connections are placed round robin (--connection-placement round_robin)")]),
])
def test_serve_config_file_warns_only_of_what_it_names(file_text, argv, expected, capsys, tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("workers:\n  - url: http://127.0.0.1:52000\n    role: mixed\n" + file_text)
    assert _serve_warnings(["--config", str(f), *argv], capsys) == expected


def test_serve_config_file_prefill_worker_without_bootstrap_port_is_warned(capsys, tmp_path):
    """review5 U2: the same whole dump made every file worker's bootstrap_port count as given, so a
    config file's SGLang prefill worker without one was never warned of (a flag's worker was)."""
    f = tmp_path / "pd.yaml"
    f.write_text("pd_protocol: sglang\nworkers:\n  - url: http://127.0.0.1:31000\n    role: prefill\n"
                 "  - url: http://127.0.0.1:31001\n    role: decode\n")
    assert _serve_warnings(["--config", str(f), "--processes", "1"], capsys) == [BOOTSTRAP_WARNING]
    f.write_text("pd_protocol: sglang\nworkers:\n  - url: http://127.0.0.1:31000\n    role: prefill\n"
                 "    bootstrap_port: 8998\n  - url: http://127.0.0.1:31001\n    role: decode\n")
    assert _serve_warnings(["--config", str(f), "--processes", "1"], capsys) == []
    f.write_text(f.read_text().replace("8998", "null"))  # null on purpose (config.py's rule): not warned of
    assert _serve_warnings(["--config", str(f), "--processes", "1"], capsys) == []


def test_served_model_name_help_says_it_is_an_alias():
    """review3 S2: the help said only "model id that /v1/models lists"; docs/serving.md, "Model
    names": a request naming it reaches each engine under the engine's own name."""
    (a,) = [a for a in _subparser("serve")._actions if "--served-model-name" in a.option_strings]
    assert "reaches each engine under the engine's own name" in a.help
    assert "/v1/models lists it" in a.help
    # review5 U6 (session 17): a request naming no model is answered under the alias too (docs/serving.md,
    # "Model names"; service since 025c4e4); the help named only requests that name it
    assert 'as is one naming no model (absent, null or "")' in a.help
