"""bench/agentx_subagent_variants.py: the variants docs/validate.md reports ("Subagents at once inside
a lane") stay buildable and say what the docs say they are; its list options are refused by class.

Expected values: the docs' table (fields, think times, deratings), and the subagent share of requests
the docs state for the tree (45% with session 13's laws: the 062126 corpus' 42%, aiperf's FAQ)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import agentx_subagent_variants as v  # noqa: E402

from sim.workload.agentic import AgenticWorkloadConfig, measured_turns, uses_subagent_tree  # noqa: E402


@pytest.mark.parametrize("name", list(v.VARIANTS))
def test_every_variant_builds(name) -> None:
    fields, ds, ps = v.VARIANTS[name]
    c = AgenticWorkloadConfig(**fields)
    assert 0.3 < ds <= 0.73 and 0.3 < ps <= 0.64
    assert uses_subagent_tree(c) == (name not in ("defaults", "F2"))


def test_variants_as_documented() -> None:
    # docs/validate.md's variant table: think times and deratings fitted on the seed-42 hour
    assert v.VARIANTS["VB"][0]["think_s"] == 17.42 and v.VARIANTS["VB"][1:] == (0.7228, 0.5447)
    assert v.VARIANTS["VB"][0]["subagent_new_tokens_median"] == 600.0
    assert v.VARIANTS["VC"][0]["subagent_new_tokens_median"] == 1200.0
    assert v.VARIANTS["VAcal"][1:] == v.VARIANTS["VAseqcal"][1:] == (0.7171, 0.4739)
    assert v.VARIANTS["VAcal"][0]["subagent_at_once"] and not v.VARIANTS["VAseqcal"][0]["subagent_at_once"]
    assert v.VARIANTS["VD"][0]["warmup_max_output_tokens"] == 1
    assert v.TREE["subagent_fanout_weights"] == (21, 9, 8)  # the public corpus' spawns
    assert v.TREE["subagent_background_probability"] == pytest.approx(3 / 63, abs=1e-4)


def test_tree_share_of_subagent_requests_is_the_documented_45_percent() -> None:
    c = AgenticWorkloadConfig(**v.VARIANTS["VA"][0])
    turns = list(measured_turns(c, 400))
    assert sum(t.subagent for t in turns) / len(turns) == pytest.approx(0.45, abs=0.02)


@pytest.mark.parametrize("argv", [["--variants", "VB,,VD"], ["--variants", "VX"], ["--seeds", "-1"],
                                  ["--seeds", "1,1"], ["--jobs", "0"]])
def test_bad_options_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        v.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
