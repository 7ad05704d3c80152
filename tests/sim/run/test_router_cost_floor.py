"""The simulator hands its 440246 eager-step floor to the router's cost model (issue 23 part 3):
:func:`sim.run.router_cost.cost_model_for` sets ``EngineCost.prefill_step_floor_s`` from
:class:`sim.perf.step_class.StepClassPerf` ``eager_floor_s``, and ``pdlb sim cost-model``'s table carries it.

Expected values: the floor constants of :mod:`sim.validation.agentx` (fit to the launcher's measured
eager steps, docs/validate.md "The eager prefill step"), and the step times by hand: ``max(model
step, floor)``.
"""

from __future__ import annotations

import tomllib

import numpy as np

from balancer.cost_model import CostModel
from sim.run.router_cost import cost_model_for, to_toml
from sim.validation.agentx import EAGER_STEP_FLOOR_S, perf_factory_440246, scenario_440246


def test_the_440246_floor_reaches_the_cost_model_and_its_table():
    sc = scenario_440246()
    cm = cost_model_for(sc, perf_factory_440246(eager_floor=True))
    assert cm.decode.prefill_step_floor_s == EAGER_STEP_FLOOR_S  # the mixed pool: prefill beside decoding ranks
    assert cm.prefill.prefill_step_floor_s == EAGER_STEP_FLOOR_S
    # the floor is what the simulator takes for a 512-token chunk while ranks decode: its step time
    # there is the floor (115.94 ms), well above the linear model's chunk (under 60 ms)
    perf = perf_factory_440246(eager_floor=True)(sc, sc.mixed)
    R = sc.mixed.dp_ranks
    tok = np.zeros((1, R))
    tok[0, 0] = 512.0
    seqs = np.full((1, R), 8.0)
    sim_s = float(perf.step_time_s(tok, tok * (tok + 1.0) / 2.0, seqs, seqs * 20_000.0)[0])
    p = cm.decode.prefill
    linear_s = p.overhead_s + (p.per_token_s + p.per_group_token_s) * 512 + p.per_attn_pair_s * 512 * 513 / 2
    assert sim_s == EAGER_STEP_FLOOR_S and linear_s < 0.06
    assert max(linear_s, cm.decode.prefill_step_floor_s) == sim_s
    back = CostModel.from_dict(tomllib.loads(to_toml(cm, "agentx-440246"))["cost_model"])
    assert back == cm
    # without the floor: none in the model, and none in the table (tables of other scenarios as before)
    off = cost_model_for(sc, perf_factory_440246(eager_floor=False))
    assert off.decode.prefill_step_floor_s == 0.0
    assert "prefill_step_floor_s" not in to_toml(off, "agentx-440246")
