"""bench/agentx_decisions.py: the recorded cost terms add up to the scores ``ep_aware`` chose by
(an independent sum of the terms against the policy's own ``Choice.scores``), with the group term
worked out by hand; and a short end-to-end run prints its tables."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from balancer.cost_model import CostModel, DecodeStepCost, EngineCost, PrefillStepCost
from balancer.policies import make_policy
from balancer.policies.base import SelectContext
from balancer.types import Request, Role
from tests.balancer_factories import cands, view

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
ad = pytest.importorskip("agentx_decisions")

PF = PrefillStepCost(overhead_s=0.01, per_token_s=1e-4, per_attn_pair_s=0.0, per_group_token_s=1e-5)
DC = DecodeStepCost(overhead_s=0.03, per_seq_s=1e-3, per_kv_token_s=0.0, per_group_seq_s=0.0)


def three_ranks():
    # (requests, queued prefill tokens, hit tokens) of one wide-EP engine's mixed ranks
    return cands(*(view("e", Role.MIXED, dp=i, num_requests=b, prefill_tokens=q, decode_kv_tokens=0,
                        kv_capacity_tokens=10**7, matched_tokens=m, block_size=256)
                   for i, (b, q, m) in enumerate(((4, 0, 0), (6, 3000, 0), (10, 9000, 1024)))))


@pytest.mark.parametrize("parallel", [True, False])
def test_the_recorded_terms_are_the_ones_the_policy_chose_by(parallel):
    e = EngineCost(PF, DC, 8192, True, 16, 512, 8)
    cm = CostModel(prefill=e, decode=e)
    log: list[dict] = []
    pol = ad.logged(make_policy("ep_aware", parallel_chunks=parallel), log)
    c = three_ranks()
    r = Request("r", 0.0, 2048, max_output_tokens=160)
    ch = pol.select(r, c, SelectContext(random.Random(0), 0.0, 0, cm))
    (d,) = log
    assert d["chosen"] == c.replicas.index(ch.replica)
    np.testing.assert_allclose(d["total"], [ch.scores[x] for x in c.replicas], rtol=1e-12)
    np.testing.assert_array_equal(d["b"], [4, 6, 10])
    np.testing.assert_array_equal(d["hit"], [0, 0, 1024])
    ttft, _ = make_policy("ep_aware", parallel_chunks=parallel).predict_prefill_s(
        r, c, SelectContext(random.Random(0), 0.0, 0, cm))
    np.testing.assert_allclose(d["ttft"], ttft, rtol=1e-12)
    if parallel:  # 1e-5 s/token x u (2,048, 2,048, 1,024) x 16 queued requests (6 + 10); no full rank
        np.testing.assert_allclose(d["group"], [0.32768, 0.32768, 0.16384], rtol=1e-9)
    else:  # FIFO draining's terms pass through unchanged
        np.testing.assert_allclose(d["group"], d["group_drain"], rtol=1e-12)


def test_a_short_run_prints_the_tables(capsys):
    assert ad.main(["--lanes", "8", "--duration-s", "30", "--sample", "1", "--policies", "ep_aware"]) == 0
    out = capsys.readouterr().out
    assert "== ep_aware: 8 lanes, 30 s measured" in out
    assert "new sessions:" in out and "EP group (whole run):" in out
    assert "| queue ahead, k tokens | misses | realised |" in out


@pytest.mark.parametrize("args, msg", [(["--lanes", "0"], "--lanes"), (["--sample", "-1"], "--sample"),
                                       (["--policies", "scored"], "only ep_aware"),
                                       (["--policies", "ep_aware:nope=1"], "no parameter 'nope'"),
                                       (["--duration-s", "0"], "--duration-s")])
def test_bad_arguments_are_refused_before_any_run(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        ad.main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
