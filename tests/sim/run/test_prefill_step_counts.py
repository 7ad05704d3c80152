"""The step group's counts of steps that carry prefill under vLLM's prefill cadence (issue 23 part 3,
session 17): ``StepGroup.open_prefill_steps`` (a step open to prefill), ``bound_prefill_steps`` (a
step between open ones on which a capacity-bound rank prefilled), ``idle_prefill_steps`` (one on which
a rank with nothing to decode prefilled). What ``bench/agentx_mixed_steps.py`` reads.

Expected values are hand calculations with a perf model whose every step takes 1 s (the step
indices are in the comments)."""

from __future__ import annotations

import pytest

from sim.run.engine import step_group
from tests.sim.run.test_vllm_engine_options import _agg, _req, _run


@pytest.fixture
def groups(monkeypatch):
    """The step groups the next simulation builds."""
    got: list = []
    init = step_group.StepGroup.__init__

    def keep(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        init(self, *a, **k)
        got.append(self)
    monkeypatch.setattr(step_group.StepGroup, "__init__", keep)
    return got


def _counts(g) -> tuple[int, int, int]:
    return g.open_prefill_steps, g.bound_prefill_steps, g.idle_prefill_steps


def test_an_idle_rank_prefills_between_open_steps_and_a_later_prompt_waits_for_one(groups):
    # interval 4, chunk cap 16: A (t=0, 40 tokens) prefills in steps 0 (open), 1 and 2 (the rank decodes
    # nothing yet: idle), first token t=3. B (t=5.5, 8 tokens) waits through steps 6 and 7 (A decodes) for
    # open step 8: first token t=9. Open 2 (steps 0, 8), bound 0, idle 2 (steps 1, 2).
    r = _run(_agg(prefill_schedule_interval=4, max_chunk_tokens=16), [_req("A", 0.0, 40, 20), _req("B", 5.5, 8, 2)])
    assert r.first_token_s.tolist() == [3.0, 9.0]
    assert [_counts(g) for g in groups] == [(2, 0, 2)]


def test_a_capacity_bound_rank_prefills_on_every_step(groups):
    # interval 4, chunk cap 16, one running sequence: A (40 tokens) is admitted in step 0 (open), B (8 tokens)
    # waits for the slot, so the rank is capacity bound: A's chunks run in steps 1 and 2 (bound), first token
    # t=3; A decodes 19 more tokens in steps 3-21 (no chunk to run: not counted), finishes t=22; B is admitted
    # and prefilled in step 22 (not open: 22 % 4 = 2; bound): first token t=23. Open 1, bound 3, idle 0.
    r = _run(_agg(prefill_schedule_interval=4, max_chunk_tokens=16, max_num_seqs=1),
             [_req("A", 0.0, 40, 20), _req("B", 0.0, 8, 1)])
    assert r.first_token_s.tolist() == [3.0, 23.0] and r.finish_s.tolist() == [22.0, 23.0]
    assert [_counts(g) for g in groups] == [(1, 3, 0)]


def test_without_the_cadence_nothing_is_counted(groups):
    _run(_agg(max_chunk_tokens=16), [_req("A", 0.0, 40, 20), _req("B", 5.5, 8, 2)])
    assert [_counts(g) for g in groups] == [(0, 0, 0)]
