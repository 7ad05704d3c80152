"""Issue 24 item 7 (non-monotone part): a ``--search gpus`` answer says what it checked of the
monotonicity it assumes, and the check does not depend on which points the search's width made it
evaluate: the answer's neighbours (one engine more or fewer per pool) are always evaluated.

Verdicts come from hand-made rules on the engine counts (no simulation), so every expected answer,
neighbour and note below is worked out by hand from the rule.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from balancer.types import Request
from sim.search.capacity import GpuSearch, monotonicity_note, neighbours, run_searches
from sim.search.executor import SerialExecutor
from sim.search.point import SLO, PointResult, parse_policy, register_workload
from sim.scenario import load_scenario

LENIENT = SLO(ttft_s=100.0, tpot_s=10.0, attainment=0.9)


class RuleExecutor(SerialExecutor):
    """Verdict of a point = ``rule(prefill engines, decode engines)``; records the counts asked for."""

    def __init__(self, rule) -> None:  # noqa: ANN001
        self.rule = rule
        self.asked: list[tuple[int, int]] = []

    def submit(self, point):  # noqa: ANN001, ANN201
        sc = point.scenario
        p, d = sc.prefill.num_engines, sc.decode.num_engines
        self.asked.append((p, d))
        fut: cf.Future = cf.Future()
        fut.set_result(PointResult(point, self.rule(p, d), 1.0, 1.0, 1.0, 10, sc.num_gpus, p, d, None))
        return fut


def _search(rule, width: int, max_evals: int = 40):  # noqa: ANN001, ANN202
    register_workload("issue24:monotone", [Request(request_id=f"q{i}", arrival_time_s=float(i), prompt_tokens=100,
                                                   block_hashes=(), max_output_tokens=2, expected_output_tokens=2)
                                           for i in range(2)])
    s = GpuSearch(load_scenario("dsv3-pd-h200"), "issue24:monotone", parse_policy("least_load"), LENIENT,
                  max_engines={"prefill": 8, "decode": 8}, check_floor=False, width=width, max_evals=max_evals)
    ex = RuleExecutor(rule)
    (res,) = run_searches([s], ex)
    return res, ex


def test_neighbours_by_hand() -> None:
    assert neighbours((3, 2), [8, 8]) == [(2, 2), (4, 2), (3, 1), (3, 3)]
    assert neighbours((1, 8), [8, 8]) == [(2, 8), (1, 7)]  # 0 engines and 9 > maximum left out
    assert neighbours((5,), [5]) == [(4,)]


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_a_dip_next_to_the_answer_is_found_at_every_width(width: int) -> None:
    # rule: meets iff prefill >= 3 and decode >= 2, except 4 prefill + 2 decode (a dip: one more
    # prefill engine loses the SLO). Along the maxima lines (decode 8, prefill 8) the rule is
    # monotone, so phase 1 gives P* = 3, D* = 2 at any width, and the corner (3, 2) meets: the
    # answer is 3 + 2 at every width. Before this check, no width evaluated (4, 2) (phase 1 stays on
    # the maxima lines, phase 2 stops at the corner): the search said nothing. Now the neighbour
    # (4, 2) is always evaluated and its miss is reported.
    res, ex = _search(lambda p, d: p >= 3 and d >= 2 and (p, d) != (4, 2), width)
    assert res.status == "found" and (res.prefill_engines, res.decode_engines) == (3, 2)
    assert {(2, 2), (4, 2), (3, 1), (3, 3)} <= set(ex.asked)
    (note,) = [n for n in res.notes if n.startswith(("non-monotone", "monotone"))]
    assert note.startswith("non-monotone: 4 prefill + 2 decode engines miss the SLO where 3 prefill + 2 decode "
                           "meet it;")
    assert "the answer's 4 neighbours" in note


@pytest.mark.parametrize("width", [1, 2, 4])
def test_a_monotone_rule_says_what_was_checked(width: int) -> None:
    # rule: meets iff prefill >= 3 and decode >= 2 (monotone): answer 3 + 2, neighbours
    # (2, 2) miss, (4, 2) meet, (3, 1) miss, (3, 3) meet: consistent
    res, ex = _search(lambda p, d: p >= 3 and d >= 2, width)
    assert (res.prefill_engines, res.decode_engines) == (3, 2)
    (note,) = [n for n in res.notes if n.startswith(("non-monotone", "monotone"))]
    assert note == (f"monotone as far as checked: checked {len(set(ex.asked))} evaluated points pairwise and the "
                    "answer's 4 neighbours (one engine more or fewer per pool); counts never evaluated are assumed "
                    "to follow")


def test_neighbours_left_unevaluated_by_the_budget_are_named() -> None:
    # width 1, rule p >= 3 and d >= 2. Evaluations before the answer, by hand: phase 1 asks (8, 8)
    # (both pools at their maxima: one point), then (4, 8) and (8, 4) (midpoints of (0, 8]), then
    # (2, 8) and (8, 2), then (3, 8) and (8, 1): 7 points; phase 2 the corner (3, 2): 8. None of the
    # neighbours (2, 2), (4, 2), (3, 1), (3, 3) was evaluated; max_evals 10 leaves room for 2:
    # (2, 2) and (4, 2) (the order of neighbours()); (3, 1) and (3, 3) are named unchecked.
    res, ex = _search(lambda p, d: p >= 3 and d >= 2, 1, max_evals=10)
    assert len(set(ex.asked)) == 10 and res.status == "found"
    (note,) = [n for n in res.notes if n.startswith(("non-monotone", "monotone"))]
    assert "the answer's 2 neighbours" in note
    assert "2 neighbours not evaluated (--max-evals reached): 3 prefill + 1 decode, 3 prefill + 3 decode" in note


def test_monotonicity_note_by_hand() -> None:
    # one pool; evaluated 8 meet, 4 miss, 6 meet, 5 meet, 3 meet (3 meets below a miss at 4)
    v = {(8,): True, (4,): False, (6,): True, (5,): True, (3,): True}
    note = monotonicity_note(["mixed"], (5,), v, [8])
    assert note.startswith("non-monotone: 4 mixed engines miss the SLO where 3 mixed meet it;")
    assert "checked 5 evaluated points pairwise and the answer's 2 neighbours" in note
    # the same without the pass at 3: consistent
    del v[(3,)]
    assert monotonicity_note(["mixed"], (5,), v, [8]).startswith("monotone as far as checked: checked 4 evaluated")
