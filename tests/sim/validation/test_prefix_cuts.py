"""aiperf's theoretical prefix-cache hit and prefix cuts in the agentic lanes (issue 23 part 1,
session 14).

aiperf stamps each request with the leading run of its 64-token block hashes that an earlier
request of the same trace already sent, over the blocks it covers (``in // 64``), and publishes
the ratio of the sums (point 440246: 0.9687). A prompt's earlier replies were never sent as input,
so they count as misses; ``replay_stats`` computes that rule beside the old statistic (previous
prompt *and* reply reusable). Prefix cuts: in the public Weka corpus 6.9% of the turns after a
trajectory's first do not extend their previous prompt (sim/data/measured/weka_trace_shapes.json,
``prefix_cut``); ``prefix_cut_probability`` draws such turns, keeping a fraction of the previous
prompt from ``prefix_cut_kept_quantiles``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from sim.validation.agentx import simulate_440246
from sim.workload.agentic import (WEKA_SHAPES_PATH, AgenticWorkloadConfig, lane_turns, replay_stats,
                                  weka_prefix_cut_kept_quantiles, weka_prefix_cut_probability)


def _det(**kw) -> AgenticWorkloadConfig:
    # every sigma 0: trajectories of 1 + 2 = 3 turns, prompts 1,000, 1,000 + 50 + 100 = 1,150 and
    # 1,300, outputs 50; start ratio 0 -> every trajectory from turn 0, no warm-up
    base = dict(lanes=1, warmup_requests_per_lane=0, start_min_ratio=0, start_max_ratio=0, turns_median=2,
                turns_sigma=0, initial_context_median_tokens=1000, initial_context_sigma=0, new_tokens_median=100,
                new_tokens_sigma=0, new_tokens_trajectory_sigma=0, output_median_tokens=50, output_sigma=0)
    return AgenticWorkloadConfig(**{**base, **kw})


def test_theoretical_hit_is_aiperfs_block_rule_by_hand() -> None:
    # covered 64-token blocks: 1,000 // 64 = 15, 1,150 // 64 = 17, 1,300 // 64 = 20 -> 52.
    # hits: 0 (first turn), then the previous *prompt*'s whole blocks: 15, 17 -> 32 / 52.
    # The old statistic counts the previous prompt and reply: (0 + 1,050 + 1,200) / 3,450
    s = replay_stats(_det(), requests_per_lane=3)
    assert s["theoretical_cache_hit_rate"] == pytest.approx(32 / 52)
    assert s["previous_turn_reuse_rate"] == pytest.approx(2_250 / 3_450)


def test_a_prefix_cut_keeps_its_fraction_of_the_previous_prompt_by_hand() -> None:
    # every turn after the first is a cut that keeps half the previous prompt: int(0.5 * 1,000) =
    # 500 and int(0.5 * 1,150) = 575 tokens; prompts and outputs are unchanged; the kept part is all
    # that is reusable (the reply is past the cut)
    c = _det(prefix_cut_probability=1.0, prefix_cut_kept_quantiles=(0.5, 0.5))
    it = lane_turns(c, 0)
    got = [(t.turn, t.input_tokens, t.reusable_tokens, t.server_reusable_tokens, t.output_tokens)
           for t in (next(it) for _ in range(4))]
    assert got == [(0, 1000, 0, 0, 50), (1, 1150, 500, 500, 50), (2, 1300, 575, 575, 50), (0, 1000, 0, 0, 50)]
    # aiperf's rule: 500 // 64 = 7 and 575 // 64 = 8 blocks of 52
    assert replay_stats(c, requests_per_lane=3)["theoretical_cache_hit_rate"] == pytest.approx(15 / 52)


def test_no_cut_leaves_the_stream_unchanged() -> None:
    # probability 0 draws nothing more from the lane's RNG, and the quantiles then do not matter
    a = AgenticWorkloadConfig(lanes=2)
    b = AgenticWorkloadConfig(lanes=2, prefix_cut_probability=0.0, prefix_cut_kept_quantiles=(0.1, 0.2))
    for lane in range(2):
        ia, ib = lane_turns(a, lane), lane_turns(b, lane)
        assert [next(ia) for _ in range(300)] == [next(ib) for _ in range(300)]


def test_cut_share_by_formula() -> None:
    # 3-turn trajectories: 2 of every 3 turns can be cut; with p = 0.25 a quarter of them are
    turns = [next(it) for it in [lane_turns(_det(prefix_cut_probability=0.25, seed=5), 0)] for _ in range(30_000)]
    later = [t for t in turns if not t.first_of_trajectory]
    assert len(later) == 20_000
    cut = sum(t.server_reusable_tokens != t.input_tokens - 150 for t in later)
    assert cut / len(later) == pytest.approx(0.25, abs=0.015)


def test_corpus_defaults_are_the_committed_table() -> None:
    data = json.loads(WEKA_SHAPES_PATH.read_text())["prefix_cut"]
    # 3,290 cut turns of 47,948 turns after the first (hand division: 0.06862)
    assert data["cut_turns"] / data["turns_after_first"] == pytest.approx(0.0686, abs=5e-5)
    assert weka_prefix_cut_probability() == data["probability"]
    q = weka_prefix_cut_kept_quantiles()
    assert len(q) == 51 and q[0] >= 0 and q[-1] <= 1 and all(b >= a for a, b in zip(q, q[1:]))
    # bimodal: the median cut loses one 64-token block of a long prompt, a tenth keep under 10%
    assert q[25] > 0.99 and q[5] < 0.11
    # without a table of its own a cut draws from the corpus'
    c = _det(prefix_cut_probability=1.0)
    kept = [t.server_reusable_tokens / 1000 for t in (next(it) for it in [lane_turns(c, 0)] for _ in range(3_000))
            if t.turn == 1]
    assert min(kept) >= 0 and max(kept) <= 1
    assert np.median(kept) == pytest.approx(np.median(q), abs=0.02)


@pytest.mark.parametrize("kw", [dict(prefix_cut_probability=-0.1), dict(prefix_cut_probability=1.5),
                                dict(prefix_cut_kept_quantiles=(0.5,)), dict(prefix_cut_kept_quantiles=(0.6, 0.5)),
                                dict(prefix_cut_kept_quantiles=(0.5, 1.2)), dict(prefix_cut_kept_quantiles=(-0.1, 0.5))])
def test_cut_fields_refuse_bad_values(kw) -> None:
    with pytest.raises(ValidationError):
        AgenticWorkloadConfig(**kw)


def test_a_cut_turn_hits_no_more_than_its_kept_part_in_the_closed_loop() -> None:
    # every later turn keeps half of its previous prompt: on the ring's rank its hit ends at or
    # before that point (whole 256-token blocks, the window checkpoints may end it earlier)
    w = AgenticWorkloadConfig(lanes=8, duration_s=150.0, warmup_requests_per_lane=1, prefix_cut_probability=1.0,
                              prefix_cut_kept_quantiles=(0.5, 0.5))
    r = simulate_440246(w)
    rec = r.records
    last: dict[str, int] = {}
    checked = hits = 0
    for i, session in enumerate(r.sessions):
        j = last.get(session)
        last[session] = i
        if j is None or np.isnan(rec.prefill_end_s[i]):
            continue
        assert rec.cached_tokens[i] <= int(0.5 * rec.prompt_tokens[j])
        checked += 1
        hits += rec.cached_tokens[i] > 0
    assert checked > 20 and hits > 0


def test_validate_prints_the_theoretical_hit_by_aiperfs_rule() -> None:
    # the line under `pdlb sim validate --agentx-440246`: the defaults' rate by aiperf's rule, the
    # published 0.9687, and the statistic they were fitted to (previous reply counted as a hit)
    from pdlb_cli.sim.validate import theoretical_hit_note
    s = replay_stats(AgenticWorkloadConfig(), requests_per_lane=200)
    note = theoretical_hit_note()
    assert f"{s['theoretical_cache_hit_rate']:.3f} against the published 0.9687" in note
    assert f"hit: {s['previous_turn_reuse_rate']:.3f}" in note
    # by aiperf's rule the defaults miss more than published (3.1% of input tokens)
    assert s["theoretical_cache_hit_rate"] < 0.9687 < s["previous_turn_reuse_rate"] + 0.006
