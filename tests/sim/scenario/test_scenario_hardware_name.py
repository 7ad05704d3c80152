"""An unknown hardware name is a scenario error naming the file and the field, like every other bad
scenario value (review finding 7, session 14: it was ``error: prefill pool: unknown hardware
'h900'; ...`` from the perf build, without the file). Expected lines written by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlb_cli.main import main
from sim.scenario import load_scenario

POOLS = '[prefill]\nnum_engines = 1\ndp_ranks = 8\n[decode]\nnum_engines = 1\ndp_ranks = 8\n'


def test_unknown_hardware_names_the_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('name = "x"\nmodel = "deepseek-v3"\nhardware = "h900"\n' + POOLS)
    with pytest.raises(ValueError) as e:
        load_scenario(f)
    assert str(e.value) == f"{f}: hardware: unknown hardware 'h900'; valid names: B200, H100, H200, H800"


@pytest.mark.parametrize("name", ["h100", "H100", " h200 "])
def test_known_hardware_names_load_in_any_case(name: str, tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text(f'name = "x"\nmodel = "deepseek-v3"\nhardware = "{name}"\n' + POOLS)
    assert load_scenario(f).hardware == name  # kept as written; sim.models.hardware.get_hardware resolves it


def test_the_command_line_error_names_the_file(tmp_path: Path, capsys) -> None:
    f = tmp_path / "s.toml"
    f.write_text('name = "x"\nmodel = "deepseek-v3"\nhardware = "h900"\n' + POOLS)
    assert main(["sim", "run", "--scenario", str(f), "--limit", "10", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"error: {f}: hardware: unknown hardware 'h900'; "
                                       "valid names: B200, H100, H200, H800\n")
    assert not (tmp_path / "o").exists()
