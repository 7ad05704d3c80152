"""Shipped preset files (sim/data/presets/*.toml): they load, every value names its source, the
published deployment shapes are what the sources say, and the old Python presets are untouched."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

import sim.scenario as scenario_mod
from pdlb_cli.main import main
from sim.run.pool_perf import roofline_for_pool
from sim.scenario import DEFAULT_PRESET, PRESET_DIR, PRESETS, load_scenario

SHIPPED = sorted(PRESET_DIR.glob("*.toml"))
ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")
SOURCE_DECL = re.compile(r"^#\s+([a-z0-9-]+)\s+=\s+\S")  # header: "#   tag  = what the tag means"


def test_the_three_published_presets_ship():
    assert {p.stem for p in SHIPPED} >= {"deepseek-v3-h800", "sglang-h100-ep", "deepinfer-sm100"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_preset_loads_by_name_and_builds_its_perf_models(path: Path):
    sc = load_scenario(path.stem)
    assert sc.name == path.stem and PRESETS[path.stem] is sc
    for pool in (sc.prefill, sc.decode):
        e = roofline_for_pool(sc, pool)  # raises if the weights do not fit
        assert e.kv_capacity_tokens_per_rank > 0
        assert e.tbo == (sc.perf.tbo if sc.perf is not None else False)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_value_has_a_declared_source_comment(path: Path):
    lines = path.read_text().splitlines()
    declared = {m.group(1) for line in lines if (m := SOURCE_DECL.match(line))}
    assert {"assumed"} <= declared, "the header must declare its source tags"
    data = tomllib.loads(path.read_text())
    def leaves(d: dict) -> int:  # values in (nested) tables; each must sit on its own line
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in d.values())

    n_values = leaves(data)
    checked = 0
    for no, line in enumerate(lines, 1):
        if not ASSIGN.match(line):
            continue
        checked += 1
        assert "#" in line, f"{path.name}:{no}: value without a source comment"
        comment = line.split("#", 1)[1].strip()
        tag = comment.split(":", 1)[0].strip()
        assert ":" in comment and tag in declared, f"{path.name}:{no}: source tag {tag!r} not declared"
        assert len(comment.split(":", 1)[1].strip()) >= 5, f"{path.name}:{no}: empty source text"
    assert checked == n_values  # every TOML value sits on its own commented line


def test_published_deployment_shapes():
    # day-6 overview: prefill EP32/DP32 over 4 nodes, decode EP144/DP144 over 18 nodes (8 GPUs/node)
    ds = load_scenario("deepseek-v3-h800")
    assert (ds.hardware, ds.prefill.dp_ranks, ds.decode.dp_ranks) == ("H800", 4 * 8, 18 * 8)
    assert ds.perf.fp8_weights and ds.perf.tbo
    # SGLang blog: prefill 4 nodes EP32, decode 9 nodes EP72, batch 256 per GPU
    sg = load_scenario("sglang-h100-ep")
    assert (sg.hardware, sg.prefill.dp_ranks, sg.decode.dp_ranks, sg.decode.max_decode_batch) == ("H100", 32, 72, 256)
    # DeepInfer: 4 SM100 GPUs prefill, 64 decode (EP64); SM100 = B200-class
    di = load_scenario("deepinfer-sm100")
    assert (di.hardware, di.model, di.prefill.num_gpus, di.decode.num_gpus) == ("B200", "deepseek-v4.1-flash", 4, 64)
    assert di.num_gpus == 68
    for sc in (ds, sg, di):
        assert sc.prefill.ep and sc.decode.ep and sc.prefill.gpus_per_rank == sc.decode.gpus_per_rank == 1


def test_python_presets_unchanged():
    assert DEFAULT_PRESET == "dsv3-pd-h200"
    sc = load_scenario(DEFAULT_PRESET)
    assert sc.perf is None and sc.prefill.num_ranks == 48 and sc.decode.num_ranks == 8 and sc.num_gpus == 56


def test_presets_are_package_data():
    # a wheel / pip install must carry the files: pyproject's package-data patterns must match them
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["sim"]
    for path in SHIPPED:
        rel = path.relative_to(PRESET_DIR.parents[1]).as_posix()  # data/presets/<name>.toml
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel


def test_cli_lists_shipped_presets(capsys):
    assert main(["sim", "scenarios"]) == 0
    out = capsys.readouterr().out
    for name in ("deepseek-v3-h800", "sglang-h100-ep", "deepinfer-sm100", "dsv3-pd-h200"):
        assert name in out
    assert "(176 GPUs)" in " ".join(out.split())  # deepseek-v3-h800: 32 + 144 GPUs (rich may wrap)


def test_bad_shipped_presets_are_reported(tmp_path: Path, monkeypatch):
    text = (PRESET_DIR / "sglang-h100-ep.toml").read_text()
    monkeypatch.setattr(scenario_mod, "PRESET_DIR", tmp_path)
    (tmp_path / "other-name.toml").write_text(text)
    with pytest.raises(ValueError, match="must equal the file name 'other-name'"):
        scenario_mod._load_shipped_presets()
    (tmp_path / "other-name.toml").unlink()
    (tmp_path / "dsv3-pd-h200.toml").write_text(text.replace('"sglang-h100-ep"', '"dsv3-pd-h200"', 1))
    with pytest.raises(ValueError, match="already defined"):
        scenario_mod._load_shipped_presets()
    bad = tmp_path / "typo.toml"
    bad.write_text(text.replace("[perf]", "[perf]\ntbo_overlap = 1"))
    with pytest.raises(ValueError, match=r"(?s)typo\.toml.*perf\.tbo_overlap"):
        load_scenario(bad)
