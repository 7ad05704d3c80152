"""bench/weka_corpus_reuse.py: aiperf's theoretical-hit rule and the prefix cuts of a Weka-format
corpus, on hand-made traces (expected values by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import weka_corpus_reuse as w  # noqa: E402


def _write(d: Path, name: str, requests: list[dict], block_size: int = 4) -> Path:
    p = d / f"{name}.json"
    p.write_text(json.dumps({"id": name, "block_size": block_size, "requests": requests}))
    return p


def test_rules_by_hand(tmp_path) -> None:
    # blocks of 4 tokens. Root: [1,2] (in 8) -> [1,2,3] (in 13: covers 3 blocks, replies not sent
    # before) -> [1,9,10] (in 12, a cut inside the previous prompt: keeps block 1 of its 3 whole
    # blocks). A subagent at t=1.5 sends [1,2,7] (in 12).
    # aiperf's rule, all requests in start order: 0/2, [1,2] 2/3 (subagent), [1,2,3] 2/3, [1,9,10] 1/3
    # -> 5 / 11; roots alone: 0/2, 2/3, 1/3 -> 3 / 8
    _write(tmp_path, "a", [
        {"t": 0.0, "type": "n", "in": 8, "out": 3, "hash_ids": [1, 2]},
        {"t": 1.5, "type": "subagent", "requests": [{"t": 1.5, "type": "n", "in": 12, "out": 1, "hash_ids": [1, 2, 7]}]},
        {"t": 2.0, "type": "n", "in": 13, "out": 2, "hash_ids": [1, 2, 3]},
        {"t": 3.0, "type": "n", "in": 12, "out": 1, "hash_ids": [1, 9, 10]},
    ])
    (tmp_path / "broken.json").write_text("version https://git-lfs")  # an LFS pointer: skipped
    r = w.corpus_reuse(sorted(tmp_path.glob("*.json")))
    assert (r["traces"], r["unreadable"], r["root_turns_after_first"]) == (1, 1, 2)
    assert r["aiperf_rule_all_requests"] == pytest.approx(5 / 11)
    assert r["aiperf_rule_root_requests"] == pytest.approx(3 / 8)
    # previous prompt: (0 + min(8, 13) + min(13, 12)) / (8 + 13 + 12); with the reply:
    # (0 + min(11, 13) + min(15, 12)) / 33
    assert r["previous_prompt_only_root"] == pytest.approx(20 / 33)
    assert r["previous_prompt_plus_reply_root"] == pytest.approx(23 / 33)
    # one cut of two later turns; it keeps 4 tokens of the previous prompt's 12 whole-block tokens
    assert r["cut_turns"] == 1 and r["cut_probability"] == pytest.approx(0.5)
    assert r["kept_fraction_quantiles_0_to_100_step_2"] == pytest.approx([1 / 3] * 51)
    # misses: turn 2 covers 13 - 8 = 5 tokens missed (hit 2 blocks = 8), turn 3: 12 - 4 = 8 missed
    assert r["miss_share_of_input_from_cuts"] == pytest.approx(8 / 25)
    assert r["miss_share_of_input_from_extending_turns"] == pytest.approx(5 / 25)


def test_refuses_a_corpus_without_two_root_turns(tmp_path) -> None:
    _write(tmp_path, "one", [{"t": 0.0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match="two root requests"):
        w.corpus_reuse(sorted(tmp_path.glob("*.json")))
