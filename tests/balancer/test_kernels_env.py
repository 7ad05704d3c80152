"""``PDLB_KERNELS`` turns ep_aware's compiled kernels off for ``pdlb``'s commands (review finding
F8: only the Python call ``balancer.kernels.use_compiled(False)`` did). Checked both ways through
the ``pdlb`` command itself, in a fresh interpreter each: off, the kernels are off after the run
(the numpy path decided); on or unset, they are loaded; the decisions (a simulated run's
per-request CSV) are the same bytes, as the kernels promise (tests/balancer/test_kernels.py); and
in the worker processes a command starts (``sim capacity``'s pool) the variable holds too. A bad
value is a one-line error of the command (rc 2).
Expected values: the variable's documented values (balancer/kernels.py, README "Decision cost").
About 10 s (three short simulated runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from balancer import kernels

RUN = ("import sys\n"
       "from pdlb_cli.main import main\n"
       "rc = main(sys.argv[1:])\n"
       "from balancer import kernels\n"
       "print('RESULT', rc, 'numba' in sys.modules, kernels.compiled() is not None)\n")


def _pdlb(env_value: str | None, out_dir) -> subprocess.CompletedProcess:  # noqa: ANN001
    import os

    env = {k: v for k, v in os.environ.items() if k != kernels.ENV_VAR}
    if env_value is not None:
        env[kernels.ENV_VAR] = env_value
    args = ["sim", "run", "--policy", "ep_aware", "--scenario", "dsv3-pd-h800", "--limit", "60", "--quiet",
            "--no-plots", "--out", str(out_dir)]
    return subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("value,on", [("off", False), ("OFF", False), ("0", False), ("false", False), ("no", False),
                                      ("on", True), ("1", True), ("true", True), ("yes", True), ("", True),
                                      (" Off ", False)])
def test_the_variables_values(value, on):
    assert kernels.enabled_by_env({kernels.ENV_VAR: value}) is on
    assert kernels.enabled_by_env({}) is True  # unset: on (the default)
    assert kernels.enabled_by_env({"OTHER": "off"}) is True


def test_importing_balancer_loads_no_kernels():
    # review R2: `import balancer` built an EpAware (the default PolicySpec, validated at class
    # definition), which loaded numba and compiled the kernels (0.5-3 s CPU, ~150 MB) in every
    # process, whatever PDLB_KERNELS said; now a Router with a policy that uses them loads them
    pytest.importorskip("numba")
    code = ("import sys\n"
            "import balancer\n"
            "from balancer.policies import make_policy\n"
            "make_policy('ep_aware')\n"
            "a = 'numba' in sys.modules\n"
            "from balancer.router import Router\n"
            "Router('round_robin', 'round_robin')\n"
            "b = 'numba' in sys.modules\n"
            "Router('ep_aware', 'ep_aware')\n"
            "print(a, b, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]


def test_the_core_reads_no_environment(monkeypatch):
    # the variable is applied by the entry points (balancer core: no I/O): setting it in this
    # process changes nothing until one of them applies it
    monkeypatch.setenv(kernels.ENV_VAR, "off")
    kernels.use_compiled(True)
    try:
        assert kernels.compiled() is not None or pytest.importorskip("numba") is None
    finally:
        kernels.use_compiled(True)


def test_the_pool_workers_of_a_command_follow_it(monkeypatch):
    # sim's process pool (sim capacity, sweep) starts fresh interpreters (forkserver): each applies
    # the variable in its initializer
    pytest.importorskip("numba")
    from sim.search.executor import _init_worker

    monkeypatch.setenv(kernels.ENV_VAR, "off")
    try:
        _init_worker({}, ())
        assert kernels.compiled() is None
        monkeypatch.setenv(kernels.ENV_VAR, "on")
        _init_worker({}, ())
        assert kernels.compiled() is not None
    finally:
        kernels.use_compiled(True)


def test_the_parallel_runs_pool_follows_it_too(monkeypatch):
    # sim run / compare with several policies and --jobs N: another pool (review R1: it did not)
    pytest.importorskip("numba")
    from sim.search.parallel_runs import _init
    from sim.scenario import load_scenario

    monkeypatch.setenv(kernels.ENV_VAR, "off")
    try:
        _init(load_scenario("llama8b-agg-h100"), [], (), None)
        assert kernels.compiled() is None
    finally:
        kernels.use_compiled(True)


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="PDLB_KERNELS must be 'on' or 'off'.*'of'"):
        kernels.enabled_by_env({kernels.ENV_VAR: "of"})


def test_pdlb_kernels_off_runs_the_numpy_path_with_the_same_decisions(tmp_path):
    pytest.importorskip("numba")
    got = {}
    for value in ("off", "on", None):
        out = _pdlb(value, tmp_path / str(value))
        assert out.returncode == 0, out.stderr
        result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
        got[value] = result[-1].split()[1:]
    assert got["off"] == ["0", "False", "False"]  # numba never imported (review R2: it was, by `import balancer`)
    assert got["on"] == ["0", "True", "True"] and got[None] == ["0", "True", "True"]  # unset: on
    csv_off, csv_on = (sorted((tmp_path / v).glob("requests*.csv")) for v in ("off", "on"))
    assert len(csv_off) == 1 and csv_off[0].read_bytes() == csv_on[0].read_bytes()


def test_a_bad_value_is_a_one_line_error_of_the_command(tmp_path):
    out = _pdlb("bogus", tmp_path)
    assert out.returncode == 0, out.stderr  # the -c wrapper prints main's return code
    assert out.stdout.split("RESULT")[-1].split()[0] == "2"  # main's return code
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: PDLB_KERNELS must be 'on' or 'off' (the compiled ep_aware kernels), got 'bogus'"]
    assert not list(tmp_path.glob("requests*.csv"))


def test_the_help_names_the_variable(capsys):
    # review R9: only README named it
    from pdlb_cli.main import main

    for argv in (["--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "PDLB_KERNELS=off" in " ".join(capsys.readouterr().out.split())
