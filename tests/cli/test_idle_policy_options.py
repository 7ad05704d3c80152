"""ep_aware's ``spec_decode`` and ``parallel_chunks`` where they change nothing, and every command
that runs policies says so (review R1, R2; ``sim.run.idle_options``): ``sim run``/``compare``/``capacity``
(``spec_decode`` was warned there since session 15; ``parallel_chunks`` nowhere) and ``sim sweep`` (neither).

Where the warning is true is decided from ep_aware's code (``EpAware._cadence_one``: the parallel
model applies only on a mixed pool with ``cadence`` and ``max_num_seqs x request_chunk_tokens <=
chunk_tokens``, and its group terms are ``per_group_token`` ones, 0 on a dense engine as FIFO
draining's are); the evidence that it is true is a run with the option and one without giving the
same per-request CSV, and, as the control, a run where it does act giving a different one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlb_cli.main import main

# an aggregated wide-EP pool whose ranks run their chunks in parallel: 16 x 512 <= 8192 (hand product)
EP_MIXED = """name = "epmix"
model = "deepseek-v3"
hardware = "h200"
[mixed]
num_engines = 2
dp_ranks = 8
max_prefill_tokens = 8192
max_num_seqs = 16
max_chunk_tokens = {chunk}
"""

PD = ("parallel_chunks changes nothing on scenario '{name}': it prices mixed pools only, and this scenario is PD "
      "(prefill and decode pools are priced the same either way)")
NOT_PARALLEL = ("parallel_chunks changes nothing on {where}: its mixed pool does not run a rank's chunks in "
                "parallel (it needs max_chunk_tokens with max_num_seqs x max_chunk_tokens <= max_prefill_tokens, "
                "max_num_seqs capped by max_decode_batch)")
DENSE = ("parallel_chunks changes nothing on scenario 'llama8b-agg-h100': its mixed engines are dense (each rank "
         "steps alone), so a prompt has no group tokens to price either way")
NO_CADENCE = ("parallel_chunks changes nothing on scenario 'epmix': it prices the cadence's parallel chunks, and "
              "cadence=false turns them off")
SPEC = ("spec_decode changes nothing on scenario '{name}': its {role} pool gains one output token per step "
        "(a [speculative] table with verify = \"every_step\" gives more)")
AGG = ["--scenario", "llama8b-agg-h100"]
AGG_PARALLEL = [*AGG, "--set", "mixed.max_num_seqs=4", "--set", "mixed.max_chunk_tokens=512"]  # 4 x 512 <= 2048


def _warnings(capsys) -> list[str]:  # noqa: ANN001
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]


def _scenario(tmp_path: Path, chunk: int = 512) -> list[str]:
    f = tmp_path / f"epmix{chunk}.toml"
    f.write_text(EP_MIXED.format(chunk=chunk))
    return ["--scenario", str(f)]


PC = "ep_aware(parallel_chunks=True)"


@pytest.mark.parametrize("cmd", ["run", "compare", "capacity"])
@pytest.mark.parametrize("case, policy, extra, want", [
    ("pd", "ep_aware:parallel_chunks=true", ["--scenario", "llama70b-pd-h100"],
     [f"{PC}: " + PD.format(name="llama70b-pd-h100")]),
    ("agg-no-limit", "ep_aware:parallel_chunks=true", AGG,
     [f"{PC}: " + NOT_PARALLEL.format(where="scenario 'llama8b-agg-h100'")]),
    ("agg-dense", "ep_aware:parallel_chunks=true", AGG_PARALLEL, [f"{PC}: " + DENSE]),
    ("ep-too-long", "ep_aware:parallel_chunks=true", "epmix:1024",  # 16 x 1024 > 8192
     [f"{PC}: " + NOT_PARALLEL.format(where="scenario 'epmix'")]),
    ("no-cadence", "ep_aware:parallel_chunks=true,cadence=false", "epmix:512",
     ["ep_aware(cadence=False,parallel_chunks=True): " + NO_CADENCE]),
    ("acts", "ep_aware:parallel_chunks=true", "epmix:512", []),
    ("spec-pd", "ep_aware:spec_decode=true", ["--scenario", "llama70b-pd-h100"],
     ["ep_aware(spec_decode=True): " + SPEC.format(name="llama70b-pd-h100", role="decode")]),
    ("spec-agg", "ep_aware:spec_decode=true", AGG,
     ["ep_aware(spec_decode=True): " + SPEC.format(name="llama8b-agg-h100", role="mixed")]),
    ("both", "ep_aware:spec_decode=true,parallel_chunks=true", ["--scenario", "llama70b-pd-h100"],
     ["ep_aware(parallel_chunks=True,spec_decode=True): " + SPEC.format(name="llama70b-pd-h100", role="decode"),
      "ep_aware(parallel_chunks=True,spec_decode=True): " + PD.format(name="llama70b-pd-h100")]),
    ("neither", "ep_aware", AGG, []),
])
def test_idle_options_are_warned_once(cmd, case, policy, extra, want, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    if isinstance(extra, str):
        extra = _scenario(tmp_path, int(extra.split(":")[1]))
    flag = "--policies" if cmd == "compare" else "--policy"
    argv = ["sim", cmd, flag, policy, *extra, "--limit", "10", "--quiet", "--no-plots", "--out", str(tmp_path / "o")]
    if cmd == "capacity":
        argv += ["--jobs", "1", "--max-evals", "2"]
    assert main(argv) == 0
    assert _warnings(capsys) == [f"warning: {w}" for w in want]


def test_parallel_chunks_on_the_prefill_policy_of_a_pd_run_is_named_by_it(tmp_path: Path, capsys) -> None:
    assert main(["sim", "run", "--scenario", "llama70b-pd-h100", "--policy", "ep_aware:parallel_chunks=true",
                 "--decode-policy", "least_load", "--limit", "10", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == [f"warning: {PC}: " + PD.format(name="llama70b-pd-h100")]


@pytest.mark.parametrize("case, extra, same", [
    ("pd", ["--scenario", "llama70b-pd-h100"], True),
    ("agg-no-limit", AGG, True),
    ("agg-dense", AGG_PARALLEL, True),
    ("ep-too-long", "epmix:1024", True),
    ("acts", "epmix:512", False),  # the control: where no warning is given, the option does change the run
])
def test_the_warned_parallel_chunks_really_changes_nothing(case, extra, same, tmp_path: Path,  # noqa: ANN001
                                                            capsys) -> None:  # noqa: ANN001
    # 300 requests at twice the trace's rate: queues form, so the parallel model has something to price
    if isinstance(extra, str):
        extra = _scenario(tmp_path, int(extra.split(":")[1]))
    got = []
    for i, policy in enumerate(("ep_aware", "ep_aware:parallel_chunks=true")):
        out = tmp_path / f"o{i}"
        assert main(["sim", "run", "--policy", policy, *extra, "--limit", "300", "--rate-scale", "2", "--quiet",
                     "--no-plots", "--out", str(out)]) == 0
        got.append(next(out.glob("requests_*.csv")).read_text())
    capsys.readouterr()
    assert (got[0] == got[1]) is same


SWEEP = """scenario = "{scenario}"
policies = ["ep_aware:spec_decode=true", "ep_aware:parallel_chunks=true", "kv_cost"]
rates = [1.0]
limit = 10
{grid}
"""


@pytest.mark.parametrize("grid, want", [
    # no grid: both options idle on the one scenario, as sim run says
    ("", ["warning: ep_aware(spec_decode=True): " + SPEC.format(name="epmix", role="mixed"),
          f"warning: {PC}: " + NOT_PARALLEL.format(where="scenario 'epmix'")]),
    # parallel_chunks idle on both points' scenarios (16 x 1024, 16 x 2048 > 8192)
    ('[grid]\n"mixed.max_chunk_tokens" = [1024, 2048]',
     ["warning: ep_aware(spec_decode=True): "
      + SPEC.format(name="epmix", role="mixed").replace("scenario 'epmix'", "any of the 2 scenarios"),
      f"warning: {PC}: " + NOT_PARALLEL.format(where="any of the 2 scenarios")]),
    # ... but not where one point runs its chunks in parallel (16 x 512 <= 8192), and spec_decode
    # not where one point verifies MTP drafts on every step (1 + 0.8 > 1 token per step)
    ('[[points]]\n"mixed.max_chunk_tokens" = 512\n[[points]]\n"speculative.draft_tokens" = 1\n'
     '"speculative.acceptance" = [0.8]\n"speculative.verify" = "every_step"', []),
])
def test_sweep_warns_of_options_idle_on_every_point(grid, want, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    _scenario(tmp_path, 1024)
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(scenario="epmix1024.toml", grid=grid))
    assert main(["sim", "sweep", str(f), "--quiet", "--no-plots", "--jobs", "1", "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == want


def test_a_scenario_cost_model_with_accepted_tokens_makes_spec_decode_act(tmp_path: Path, capsys) -> None:
    # review R6: the router of a simulated run prices with the scenario's [router] cost_model when it
    # has one (sim/run/router_config.py); the spec_decode warning read the perf model instead, and so
    # said "changes nothing" where the router's model has decode_tokens_per_step = 2: the runs differ
    sc = tmp_path / "epmix512.toml"
    sc.write_text(EP_MIXED.format(chunk=512))
    cm = tmp_path / "cm.toml"
    assert main(["sim", "cost-model", "--scenario", str(sc), "--out", str(cm)]) == 0
    body = cm.read_text().replace("[cost_model", "[router.cost_model")
    assert "\n[router.cost_model.decode]\n" in body
    body = body.replace("\n[router.cost_model.decode]\n", "\n[router.cost_model.decode]\ndecode_tokens_per_step = 2.0\n", 1)
    with_model = tmp_path / "with_model.toml"
    with_model.write_text(EP_MIXED.format(chunk=512) + "\n" + "\n".join(ln for ln in body.splitlines()
                                                                        if not ln.startswith("#")) + "\n")
    capsys.readouterr()
    got = []
    for i, policy in enumerate(("ep_aware", "ep_aware:spec_decode=true")):
        out = tmp_path / f"o{i}"
        assert main(["sim", "run", "--policy", policy, "--scenario", str(with_model), "--limit", "300", "--rate-scale",
                     "2", "--quiet", "--no-plots", "--out", str(out)]) == 0
        got.append(next(out.glob("requests_*.csv")).read_text())
        assert _warnings(capsys) == []
    assert got[0] != got[1]


# review3 S4 (session 16): pdlb serve warned of ep_aware's session facts where they change nothing
# (prefill_at_once prices mixed pools only, session_forecast decode and mixed pools only), the
# simulator's commands did not. The rule is ep_aware's (docs/policies/ep_aware.md: "mixed pools with
# S L <= C only"; the forecast adjusts decode and mixed ranks' b_r, kv_r); expected lines by hand.
AT_ONCE_PD = ("prefill_at_once changes nothing on scenario 'llama70b-pd-h100': it prices mixed pools only, and this "
              "scenario is PD (prefill and decode pools are priced the same either way)")
FORECAST_PD = ("session_forecast changes nothing on scenario 'llama70b-pd-h100': on the prefill policy: it prices "
               "decode and mixed pools only, and this scenario's prefill pool is priced the same either way")
FACTS = "ep_aware(prefill_at_once=True,session_forecast=True)"


@pytest.mark.parametrize("prefill, decode, want", [
    ("ep_aware:session_forecast=true,prefill_at_once=true", "least_load",
     [f"{FACTS}: {AT_ONCE_PD}", f"{FACTS}: {FORECAST_PD}"]),
    ("ep_aware", "ep_aware:prefill_at_once=true", [f"ep_aware(prefill_at_once=True): {AT_ONCE_PD}"]),
    ("ep_aware", "ep_aware:session_forecast=true", []),  # the decode pool: the forecast prices it
])
def test_session_facts_idle_on_a_pd_scenario_are_warned(prefill, decode, want, tmp_path: Path, capsys) -> None:
    assert main(["sim", "run", "--scenario", "llama70b-pd-h100", "--policy", prefill, "--decode-policy", decode,
                 "--limit", "10", "--quiet", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == [f"warning: {w}" for w in want]


def test_prefill_at_once_on_a_mixed_pool_whose_chunks_run_in_parallel_is_not_warned(tmp_path: Path, capsys) -> None:
    assert main(["sim", "run", "--policy", "ep_aware:prefill_at_once=true", *_scenario(tmp_path, 512),
                 "--limit", "10", "--quiet", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    assert _warnings(capsys) == []


def test_the_warned_session_facts_on_the_prefill_policy_really_change_nothing(tmp_path: Path, capsys) -> None:
    # 300 requests at twice the trace's rate (queues form); the evidence is the same per-request CSV
    # with and without the options on the PD scenario's prefill policy
    got = []
    for i, policy in enumerate(("ep_aware", "ep_aware:session_forecast=true,prefill_at_once=true")):
        out = tmp_path / f"o{i}"
        assert main(["sim", "run", "--scenario", "llama70b-pd-h100", "--policy", policy, "--decode-policy",
                     "least_load", "--limit", "300", "--rate-scale", "2", "--quiet", "--no-plots",
                     "--out", str(out)]) == 0
        got.append(next(out.glob("requests_*.csv")).read_text())
    capsys.readouterr()
    assert got[0] == got[1]
