"""bench/weka_subagent_shapes.py: the subagent shapes of a Weka-format corpus, on hand-made traces.

Expected values: by hand (worked out in the comments), with aiperf's join rule and its reading of
a subagent request's ``t`` before its entry's as relative (SemiAnalysisAI/aiperf ``weka_trace.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from weka_subagent_shapes import subagent_shapes  # noqa: E402


def test_corpus_script_by_hand(tmp_path) -> None:
    # root requests at t = 0 (api 1 s), 10, 100. Subagents: A at 2 s (absolute inner t, 3 requests,
    # 20 s) and B at 5 s (relative inner t, as aiperf reads a t before the entry's; 2 requests,
    # 200 s): both after root request 0 -> one spawn of 2 siblings; A ends at 22 s, and the root
    # request at 100 s starts after it: joined; B ends at 205 s, no later root request: background.
    # C at 100 s (1 request): a spawn of 1, no later root request: background
    trace = {"requests": [
        {"t": 0, "type": "n", "in": 1000, "out": 10, "api_time": 1.0},
        {"t": 2, "type": "subagent", "duration_ms": 20_000, "requests": [
            {"t": 2, "in": 100, "out": 5, "api_time": 1.0}, {"t": 5, "in": 300, "out": 7, "api_time": 2.0},
            {"t": 11, "in": 400, "out": 9, "api_time": 1.0}]},
        {"t": 5, "type": "subagent", "duration_ms": 200_000, "requests": [
            {"t": 0, "in": 200, "out": 5, "api_time": 1.0}, {"t": 4, "in": 250, "out": 5, "api_time": 1.0}]},
        {"t": 10, "type": "s", "in": 1100, "out": 10, "api_time": 1.0},
        {"t": 100, "type": "n", "in": 1200, "out": 10, "api_time": 1.0},
        {"t": 100, "type": "subagent", "duration_ms": 1000, "requests": [{"t": 100, "in": 50, "out": 1}]},
    ]}
    (tmp_path / "a.json").write_text(json.dumps(trace))
    (tmp_path / "b.json").write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
    s = subagent_shapes(sorted(tmp_path.glob("*.json")))
    assert s["traces"] == 1 and s["unreadable"] == 1 and s["traces_with_subagents"] == 1
    assert s["fanout_counts"] == {"1": 1, "2": 1}
    assert (s["joined"], s["background"]) == (1, 2)
    assert s["subagent_requests"] == 6 and s["root_requests"] == 3
    assert s["subagent_share_of_requests"] == pytest.approx(6 / 9)
    assert s["turns"]["p50"] == 2 and s["first_prompt_tokens"]["p50"] == 100
    # new tokens: A 300-100-5 = 195, 400-300-7 = 93; B 250-200-5 = 45
    assert sorted([195, 93, 45]) == [45, 93, 195] and s["new_tokens_per_turn"]["p50"] == 93
    # gaps (end to start): A 5 - (2 + 1) = 2, 11 - (5 + 2) = 4; B (5 + 4) - (5 + 0 + 1) = 3
    assert s["gap_s"]["p50"] == 3 and s["gap_s"]["mean"] == pytest.approx(3.0)
    assert s["sibling_stagger_s"]["p50"] == 3  # B starts 3 s after A
    with pytest.raises(ValueError, match="no subagent"):
        subagent_shapes([tmp_path / "b.json"])
