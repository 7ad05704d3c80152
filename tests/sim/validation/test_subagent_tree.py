"""Subagent trees in the agentic lanes: sibling fan-out, background subagents, siblings at once
inside a lane's slot (sim/workload/agentic.py ``lane_plans``, sim/run/closed_loop.py), and the
committed corpus shapes behind their parameters (bench/weka_subagent_shapes.py's output).

Expected values: by hand (deterministic configs, every sigma 0, worked out in the comments), by
formula (shares of requests), and by the timing rules of aiperf's AgentX replay as the closed loop
states them (a sibling starts one think time after the parent turn that spawned it; a joined
parent turn one think time after its last joined sibling's last token; a lane's next trajectory
one think time after its whole tree drained), checked on the simulator's own request records."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from pydantic import ValidationError

from sim.workload.agentic import (AgenticWorkloadConfig, lane_plans, lane_turns, measured_turns,
                                  uses_subagent_tree, weka_subagent_shapes)

THINK_S = 2.0


def _det(**kw) -> AgenticWorkloadConfig:
    # every sigma 0: parents of 1 + 2 = 3 turns from 1,000 tokens, subagents of 1 + 1 = 2 turns
    # from 500 tokens; new tokens 100, outputs 50 everywhere; a constant 2 s think time
    base = dict(lanes=1, warmup_requests_per_lane=0, start_min_ratio=0, start_max_ratio=0, turns_median=2,
                turns_sigma=0, initial_context_median_tokens=1000, initial_context_sigma=0, new_tokens_median=100,
                new_tokens_sigma=0, new_tokens_trajectory_sigma=0, output_median_tokens=50, output_sigma=0,
                subagent_turns_median=1, subagent_turns_sigma=0, subagent_context_median_tokens=500,
                subagent_context_sigma=0, think_s=THINK_S)
    return AgenticWorkloadConfig(**{**base, **kw})


# --- the plan (generator) ---

def test_plan_of_two_siblings_by_hand() -> None:
    # weights (0, 1): always 2 siblings; p = 1: a spawn after each parent turn but the last
    plan = next(lane_plans(_det(subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1)), 0))
    assert [(t.session, t.turn, t.input_tokens, t.server_reusable_tokens, t.subagent) for t in plan.turns] == [
        ("lane0-traj0", 0, 1000, 0, False), ("lane0-traj0", 1, 1150, 1000, False),
        ("lane0-traj0", 2, 1300, 1150, False)]
    assert [len(g) for g in plan.spawns] == [2, 2, 0]  # none after the last turn
    for i, group in enumerate(plan.spawns[:2]):
        for j, sub in enumerate(group):
            assert sub.joined  # background probability 0
            # a fresh context: 500 cold, then 500 + 50 + 100 = 650 extending it
            assert [(t.session, t.input_tokens, t.server_reusable_tokens, t.subagent) for t in sub.turns] == [
                (f"lane0-traj0-sub{i}.{j}", 500, 0, True), (f"lane0-traj0-sub{i}.{j}", 650, 500, True)]


def test_background_probability_one_marks_every_subagent_background() -> None:
    plan = next(lane_plans(_det(subagent_spawn_probability=1.0, subagent_background_probability=1.0), 0))
    subs = [s for g in plan.spawns for s in g]
    assert len(subs) == 2 and not any(s.joined for s in subs)


def test_lane_turns_flattens_the_tree_in_plan_order() -> None:
    c = _det(subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1))
    plan = next(lane_plans(c, 0))
    want = []
    for turn, group in zip(plan.turns, plan.spawns):
        want.append(turn)
        for sub in group:
            want.extend(sub.turns)
    it = lane_turns(c, 0)
    assert [next(it) for _ in range(len(want))] == want
    assert len(want) == 3 + 2 * 2 * 2  # 3 parent turns, 2 spawns of 2 siblings of 2 turns


def test_tree_share_of_subagent_requests_by_formula() -> None:
    # p after each of T - 1 = 2 non-final parent turns, mean fan-out F, n = 2 turns per subagent:
    # share = p (T - 1) F n / (T + p (T - 1) F n). p = 0.5, weights (1, 1) -> F = 1.5:
    # 0.5 * 2 * 1.5 * 2 = 3 -> 3 / 6 = 0.5
    c = _det(subagent_spawn_probability=0.5, subagent_fanout_weights=(1, 1), seed=5)
    it = lane_turns(c, 0)
    turns = [next(it) for _ in range(30_000)]
    assert sum(t.subagent for t in turns) / len(turns) == pytest.approx(0.5, abs=0.015)


def test_the_default_stream_does_not_use_the_tree_and_is_unchanged() -> None:
    # the tree's fields draw nothing while the tree is off: the default stream (and the sequential
    # fan-out's) is the same with or without them, and subagent laws touch only subagent turns
    a = AgenticWorkloadConfig(lanes=2)
    b = AgenticWorkloadConfig(lanes=2, subagent_new_tokens_median=3000.0, subagent_new_tokens_sigma=0.3)
    assert not uses_subagent_tree(a) and not uses_subagent_tree(b)
    for lane in range(2):
        ia, ib = lane_turns(a, lane), lane_turns(b, lane)
        assert [next(ia) for _ in range(300)] == [next(ib) for _ in range(300)]
    for kw in ({"subagent_fanout_weights": (1.0,)}, {"subagent_background_probability": 0.1},
               {"subagent_at_once": True}):
        assert uses_subagent_tree(AgenticWorkloadConfig(**kw))


def test_subagent_new_token_law_by_hand() -> None:
    # subagent new tokens 1,000 (sigma 0) instead of the parent's 100: 500 -> 500 + 50 + 1,000
    c = _det(subagent_spawn_probability=1.0, subagent_new_tokens_median=1000.0, subagent_new_tokens_sigma=0.0)
    plan = next(lane_plans(c, 0))
    assert [t.input_tokens for t in plan.spawns[0][0].turns] == [500, 1550]
    assert [t.input_tokens for t in plan.turns] == [1000, 1150, 1300]  # the parent keeps its own law


@pytest.mark.parametrize("bad", [(), (-1.0, 2.0), (0.0, 0.0), tuple([1.0] * 65)])
def test_fanout_weights_refuse_bad_values(bad) -> None:
    with pytest.raises(ValidationError, match="subagent_fanout_weights"):
        AgenticWorkloadConfig(subagent_fanout_weights=bad)


@pytest.mark.parametrize(("field", "value"), [("subagent_background_probability", 1.5),
                                              ("subagent_background_probability", -0.1),
                                              ("subagent_new_tokens_median", 0.0),
                                              ("subagent_new_tokens_sigma", -1.0)])
def test_tree_fields_refuse_bad_values(field, value) -> None:
    with pytest.raises(ValidationError):
        AgenticWorkloadConfig(**{field: value})


# --- the closed loop: siblings at once inside the lane's slot ---

def _run(**kw):
    from sim.validation.agentx import simulate_440246
    return simulate_440246(_det(**{"lanes": 2, "duration_s": 120.0, **kw}))


def _requests_by_session(r):
    """session -> [(arrival, finish)] in submission order (a session's turns in order)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rec = r.records
    for i, s in enumerate(r.sessions):
        out[s].append((float(rec.arrival_s[i]), float(rec.finish_s[i])))
    return out


def test_siblings_start_at_once_and_the_parent_waits_for_them() -> None:
    r = _run(subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1), subagent_at_once=True)
    by = _requests_by_session(r)
    checked = 0
    for s, reqs in by.items():
        if "-sub" in s:
            continue
        for i, (_, fin) in enumerate(reqs[:2]):
            sibs = [by.get(f"{s}-sub{i}.{j}") for j in range(2)]
            if any(x is None or len(x) < 2 or np.isnan(x[-1][1]) for x in sibs):
                continue
            # both siblings' first turns: the parent turn's last token + one think time
            assert sibs[0][0][0] == pytest.approx(fin + THINK_S) and sibs[1][0][0] == pytest.approx(fin + THINK_S)
            for sib in sibs:  # a sibling's next turn: its previous turn's last token + one think time
                assert sib[1][0] == pytest.approx(sib[0][1] + THINK_S)
            if i + 1 < len(reqs):  # the joined parent turn: the later sibling's last token + one think time
                assert reqs[i + 1][0] == pytest.approx(max(sibs[0][1][1], sibs[1][1][1]) + THINK_S)
                checked += 1
    assert checked >= 4


def test_background_subagents_run_beside_the_parent_and_hold_the_lane() -> None:
    r = _run(subagent_spawn_probability=1.0, subagent_background_probability=1.0, subagent_at_once=True)
    by = _requests_by_session(r)
    parents = sorted((s for s in by if "-sub" not in s), key=lambda s: (s.split("-")[0], int(s.split("traj")[1])))
    checked_parent = checked_next = 0
    for s in parents:
        reqs = by[s]
        for i in range(len(reqs) - 1):  # the parent does not wait: previous turn's last token + one think
            assert reqs[i + 1][0] == pytest.approx(reqs[i][1] + THINK_S)
            checked_parent += 1
        lane, k = s.split("-")[0], int(s.split("traj")[1])
        nxt = by.get(f"{lane}-traj{k + 1}")
        tree = [x for t, v in by.items() if t == s or t.startswith(s + "-sub") for x in v]
        if nxt is None or len(reqs) < 3 or any(np.isnan(f) for _, f in tree):
            continue
        # the lane's next trajectory: one think time after the whole tree drained
        assert nxt[0][0] == pytest.approx(max(f for _, f in tree) + THINK_S)
        checked_next += 1
    assert checked_parent >= 4 and checked_next >= 1


def _max_in_flight_per_lane(r) -> int:
    rec = r.records
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for i, s in enumerate(r.sessions):
        lane = s.split("-")[0]
        fin = float(rec.finish_s[i])
        events[lane].append((float(rec.arrival_s[i]), 1))
        events[lane].append((fin if not np.isnan(fin) else np.inf, -1))
    best = 0
    for ev in events.values():
        n = 0
        for _, d in sorted(ev, key=lambda e: (e[0], e[1])):  # a finish before a send at the same instant
            n += d
            best = max(best, n)
    return best


def test_lane_slot_holds_up_to_the_fanout_at_once_and_one_request_otherwise() -> None:
    # joined siblings only: the parent waits while its 2 siblings run, so a lane has at most 2
    # requests in flight, and reaches 2; one after another (the same tree) it has 1
    at_once = _run(subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1), subagent_at_once=True)
    one_by_one = _run(subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1))
    assert _max_in_flight_per_lane(at_once) == 2
    assert _max_in_flight_per_lane(one_by_one) == 1
    # the same plan either way: the one-by-one lanes send the flattened tree in its order
    assert at_once.sessions[0] == one_by_one.sessions[0] == "lane0-traj0"


def test_warmup_ends_when_every_lane_has_finished_its_warmup_requests() -> None:
    # 3 warm-up requests per lane; the window opens when the last lane's third request finished:
    # no measured request is sent before it, and every lane's first 3 sends are unmeasured
    r = _run(lanes=3, warmup_requests_per_lane=3, subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1),
             subagent_at_once=True)
    rec = r.records
    n = len(r.sessions)
    per_lane: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(r.sessions):
        per_lane[s.split("-")[0]].append(i)
    third_done = []
    for idx in per_lane.values():
        fins = sorted(float(rec.finish_s[i]) for i in idx if not np.isnan(rec.finish_s[i]))
        third_done.append(fins[2])
    assert r.measure_start_s == pytest.approx(max(third_done))
    sent = r.requests[:, 0]
    assert len(sent) > 0 and sent.min() >= r.measure_start_s
    assert n > len(r.requests)


# --- the corpus shapes behind the parameters ---

def test_committed_corpus_shapes() -> None:
    # bench/weka_subagent_shapes.py on callanjfox/kv-cache-tester traces/ at 94f6046 (710 readable)
    s = weka_subagent_shapes()
    assert (s["subagents"], s["spawns"], s["joined"], s["background"]) == (63, 38, 60, 3)
    assert s["fanout_counts"] == {"1": 21, "2": 9, "3": 8}
    assert s["turns"]["p50"] == 11 and s["first_prompt_tokens"]["p50"] == 10335
    assert s["new_tokens_per_turn"]["p50"] == 2259


def test_measured_turns_count_subagent_requests_once() -> None:
    c = _det(lanes=2, subagent_spawn_probability=1.0, subagent_fanout_weights=(0, 1))
    assert len(list(measured_turns(c, 50))) == 100
