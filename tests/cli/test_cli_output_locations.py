"""Where the commands write: a scenario name cannot move the default results folder, ``--out``
help names the folder, and a bad ``--out`` names the flag before any work. Expected paths and
messages are written out by hand from the inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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
    # Expected stem by sim.run.file_names.safe_file_stem: runs of "/", " " become "-", leading ".-" stripped.
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
