"""vLLM scheduler options of sim/run/engine (off by default): prefill cadence (DP prefill balancing),
per-request chunk cap, max_num_seqs, MTP verified on every step (sim/perf/step_class.py).

Expected values are hand calculations with a perf model whose every step takes 1 s."""

from __future__ import annotations

import math

import numpy as np
import pytest

from balancer.types import ReplicaId, Request, Role
from sim.run.cluster import simulate
from sim.run.engine.rank import DecodeSeq, PrefillJob, Rank
from sim.perf.step_class import StepClassPerf
from sim.scenario import PoolConfig, Scenario


class OneSecondPerf:
    """Every step takes 1 s (plus ``extra`` s when any rank prefills); records the
    ``decode_tokens_per_seq`` it was asked for."""

    kv_bytes_per_token = 100
    kv_capacity_tokens_per_rank = 10_000
    ep_synchronous = False
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
    decode_tokens_per_step = 1.0

    def __init__(self, extra: float = 0.0) -> None:
        self.extra = extra
        self.verify_seen: list[float] = []

    def step_time_s(self, pt, pp, ds, dc, *, prefill_cached_tokens=None, decode_tokens_per_seq=1.0):
        self.verify_seen.append(decode_tokens_per_seq)
        pt = np.asarray(pt, dtype=np.float64)
        return 1.0 + self.extra * np.any(pt > 0, axis=-1)


def _agg(**pool) -> Scenario:
    return Scenario(name="t", block_size=4, mixed=PoolConfig(num_engines=1, dp_ranks=1, max_prefill_tokens=64,
                                                             max_decode_batch=16, **pool))


def _req(rid: str, t: float, prompt: int, out: int) -> Request:
    return Request(rid, t, prompt, max_output_tokens=out, expected_output_tokens=out)


def _run(scenario: Scenario, reqs, perf=None):
    perf = perf or OneSecondPerf()
    return simulate(scenario, reqs, "round_robin", perf_factory=lambda sc, pool: perf).records


@pytest.mark.parametrize("fast_forward", [True, False])
def test_prefill_cadence_defers_a_new_prompt_to_the_next_open_step(fast_forward):
    # A (t=0, 8 tokens, 20 out): step 0 (open) prefills it, first token t=1, then it decodes.
    # B arrives at t=1.5, during step 1. Interval 4: steps 2 and 3 are throttled (A decodes, the
    # last open step left nothing waiting), step 4 = [4, 5) prefills B: first token 5.
    # Interval 1: B prefills in step 2 = [2, 3): first token 3.
    reqs = [_req("A", 0.0, 8, 20), _req("B", 1.5, 8, 2)]
    r4 = _run(_agg(prefill_schedule_interval=4).model_copy(update={"fast_forward": fast_forward}), reqs)
    r1 = _run(_agg().model_copy(update={"fast_forward": fast_forward}), reqs)
    assert r4.first_token_s.tolist() == [1.0, 5.0]
    assert r1.first_token_s.tolist() == [1.0, 3.0]


def test_prefill_cadence_lets_an_idle_rank_prefill_on_any_step():
    # nothing decodes: the throttle does not apply. A at t=0.5 (8 tokens, 1 out) waits for no open
    # step: prefilled in [0.5, 1.5)
    r = _run(_agg(prefill_schedule_interval=8), [_req("A", 0.5, 8, 1)])
    assert r.first_token_s.tolist() == [1.5] and r.finish_s.tolist() == [1.5]


def test_chunk_cap_splits_each_prompt_and_shares_the_budget():
    # cap 16, budget 64: two 40-token prompts at t=0 compute 16 + 16 tokens per step -> both
    # finish in ceil(40 / 16) = 3 steps (first token t=3). No cap: A takes 40 + B 24 in step 0
    # (A's first token t=1), B's last 16 in step 1 (t=2).
    reqs = [_req("A", 0.0, 40, 1), _req("B", 0.0, 40, 1)]
    assert _run(_agg(max_chunk_tokens=16), reqs).first_token_s.tolist() == [3.0, 3.0]
    assert _run(_agg(), reqs).first_token_s.tolist() == [1.0, 2.0]


def test_max_num_seqs_keeps_a_prompt_waiting_while_the_rank_is_full():
    # max_num_seqs 1: B cannot be admitted while A runs (prefill step 0, decode steps 1-2, A done
    # at t=3); B is prefilled in step 3: first token t=4. Without the cap both start at once.
    reqs = [_req("A", 0.0, 8, 3), _req("B", 0.0, 8, 3)]
    r = _run(_agg(max_num_seqs=1), reqs)
    assert r.first_token_s.tolist() == [1.0, 4.0] and r.finish_s.tolist() == [3.0, 6.0]
    assert _run(_agg(), reqs).first_token_s.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_mtp_finishes_in_ceil_tokens_over_acceptance_steps(fast_forward):
    # A: 8-token prompt, 11 output tokens: the first from the prefill step (t=1), the other 10 at
    # 2.5 per step -> ceil(10 / 2.5) = 4 decode steps: done at t=5 (without MTP: 10 steps, t=11).
    # Every step asks the model for 1 + 3 verified tokens per decoding sequence.
    base = OneSecondPerf()
    perf = StepClassPerf(base, verify_tokens_per_seq=4, decode_tokens_per_step=2.5)
    sc = _agg().model_copy(update={"fast_forward": fast_forward})
    r = _run(sc, [_req("A", 0.0, 8, 11)], perf)
    assert r.first_token_s.tolist() == [1.0] and r.finish_s.tolist() == [5.0]
    assert set(base.verify_seen) == {4.0}
    assert _run(sc, [_req("A", 0.0, 8, 11)]).finish_s.tolist() == [11.0]


def test_decoding_sequences_take_their_verified_tokens_from_the_budget():
    # budget 64, two sequences verifying 4 tokens each: 64 - 8 = 56 tokens left for the prompt
    rank = Rank(ReplicaId("e", 0), 0, Role.MIXED, 1000, 4, 64, 16)
    rank.verify_tokens_per_seq = 4
    for i in range(2):
        rank._join(DecodeSeq(i, 10, 5, 4))
    rank.enqueue_prefill(PrefillJob(2, 100, 5, ()))
    plan = rank.plan()
    assert plan.prefill_tokens == 56 and plan.decode_seqs == 2
    assert rank.plan(allow_prefill=False).prefill_tokens == 0


def test_mtp_remaining_steps_by_hand():
    rank = Rank(ReplicaId("e", 0), 0, Role.MIXED, 1000, 4, 64, 16)
    rank.decode_tokens_per_step = 2.49
    for n in (1, 2, 3, 100, 249, 250, 983):
        s = DecodeSeq(n, 10, n, 1)
        rank._join(s)
        assert s.remaining == math.ceil(n / 2.49)


def test_step_class_perf_prices_each_row_by_its_class():
    dec, pf = OneSecondPerf(), OneSecondPerf(extra=9.0)  # prefill rows: 10 s from pf, 1 s from dec
    perf = StepClassPerf(dec, pf, verify_tokens_per_seq=4, decode_tokens_per_step=2.49)
    pt = np.array([[0, 0], [5, 0], [0, 0]])
    z = np.zeros((3, 2))
    got = perf.step_time_s(pt, z, np.ones((3, 2)), z)
    assert got.tolist() == [1.0, 10.0, 1.0]
    assert perf.decode_tokens_per_step == 2.49 and perf.kv_bytes_per_token == 100
    for bad in ({"verify_tokens_per_seq": 0}, {"verify_tokens_per_seq": 4, "decode_tokens_per_step": 4.5},
                {"verify_tokens_per_seq": 2.5}):
        with pytest.raises(ValueError):
            StepClassPerf(dec, **bad)


def test_options_are_validated():
    for bad in ({"max_num_seqs": 0}, {"max_chunk_tokens": 0}, {"prefill_schedule_interval": 0}):
        with pytest.raises(ValueError):
            PoolConfig(**bad)


def test_records_grow_keeps_rows_and_fills_new_ones():
    from sim.run.records import RequestRecords
    rec = RequestRecords(2)
    rec.finish_s[0] = 1.0
    rec.prompt_tokens[1] = 5
    rec.grow(5)
    assert rec.num_requests == 5 and len(rec.finish_s) == 5 and len(rec.router_matched_tokens) == 5
    assert rec.finish_s[0] == 1.0 and np.isnan(rec.finish_s[1:]).all()
    assert rec.prompt_tokens.tolist() == [-1, 5, -1, -1, -1] and rec.cached_tokens.tolist() == [0] * 5
    with pytest.raises(ValueError):
        rec.grow(3)


def test_dynamic_submission_routes_at_the_current_time_and_calls_the_hook():
    # two requests submitted at t=0 and (from the hook) when the first finishes: the second's
    # arrival is the first's finish time (hand: 8-token prompt, 3 out, 1 s steps -> done at t=3)
    from balancer.config import RouterConfig
    from sim.run.cluster import Cluster
    from sim.run.router_config import router_factory
    sc = _agg()
    cl = Cluster(sc, router_factory(sc, RouterConfig(prefill_policy="round_robin", decode_policy="least_load", block_size=4)),
                 lambda s, p: OneSecondPerf())
    with pytest.raises(RuntimeError, match="begin_dynamic"):
        cl.submit(_req("A", 0.0, 8, 3))
    rec = cl.begin_dynamic(2)
    seen = []

    def hook(i, now):
        seen.append((i, now))
        if i == 0:
            cl.submit(_req("B", now, 8, 3))
    cl.on_request_finished = hook
    assert cl.submit(_req("A", 0.0, 8, 3)) == 0
    cl.env.run(until=100)
    assert seen == [(0, 3.0), (1, 6.0)] and rec.arrival_s.tolist() == [0.0, 3.0]
    with pytest.raises(RuntimeError, match="more than 2"):
        cl.submit(_req("C", 100.0, 8, 3))


class LinearPerf(OneSecondPerf):
    """A step takes 0.01 s per prefill token of its busiest rank plus 0.03 s (hand-checkable)."""

    def step_time_s(self, pt, pp, ds, dc, *, prefill_cached_tokens=None, decode_tokens_per_seq=1.0):
        pt = np.asarray(pt, dtype=np.float64)
        return 0.03 + 0.01 * pt.max(axis=-1)


def test_eager_floor_lifts_only_light_prefill_steps():
    # Rows (2 ranks): decode only; prefill 5 tokens with a decoding rank; prefill 50 tokens with a
    # decoding rank; prefill 5 tokens and no rank decoding. Roofline by hand: 0.03, 0.08, 0.53, 0.08.
    # Floors 0.2 (some rank decodes) / 0.1 (none decodes): 0.03 (decode-only steps are CUDA graphs,
    # no floor), max(0.08, 0.2) = 0.2, max(0.53, 0.2) = 0.53, max(0.08, 0.1) = 0.1.
    base = LinearPerf()
    pt = np.array([[0, 0], [5, 0], [0, 50], [5, 0]], dtype=float)
    ds = np.array([[1, 2], [0, 3], [1, 0], [0, 0]], dtype=float)
    z = np.zeros((4, 2))
    off = StepClassPerf(base, verify_tokens_per_seq=4, decode_tokens_per_step=2.49)
    assert np.allclose(off.step_time_s(pt, z, ds, z), [0.03, 0.08, 0.53, 0.08])
    on = StepClassPerf(base, verify_tokens_per_seq=4, decode_tokens_per_step=2.49, eager_floor_s=0.2,
                       eager_floor_no_decode_s=0.1)
    assert np.allclose(on.step_time_s(pt, z, ds, z), [0.03, 0.2, 0.53, 0.1])
    # one floor for both kinds when the no-decode one is not given; one row (shape (R,)) -> scalar
    same = StepClassPerf(base, eager_floor_s=0.2)
    assert np.allclose(same.step_time_s(pt, z, ds, z), [0.03, 0.2, 0.53, 0.2])
    assert float(same.step_time_s(pt[3], z[3], ds[3], z[3])) == pytest.approx(0.2)
    assert "eager floor=0.2/0.2 s" in repr(same) and "eager floor" not in repr(off)


@pytest.mark.parametrize("bad", [{"eager_floor_s": -0.1}, {"eager_floor_s": float("nan")},
                                 {"eager_floor_s": 11.0}, {"eager_floor_no_decode_s": -1e-9},
                                 {"eager_floor_no_decode_s": float("inf")}])
def test_eager_floor_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="eager_floor"):
        StepClassPerf(OneSecondPerf(), **bad)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_eager_floor_sets_a_short_prompts_first_token(fast_forward):
    # One rank, A: 8-token prompt, 3 output tokens. Prefill step 0.03 + 0.08 = 0.11 s, floored to
    # 0.5 s (no rank decodes yet: the no-decode floor): first token at 0.5; then 2 decode steps
    # of 0.03 s (no floor: decode only) -> done at 0.56. Without the floor: 0.11 and 0.17.
    perf = StepClassPerf(LinearPerf(), eager_floor_s=0.9, eager_floor_no_decode_s=0.5)
    sc = _agg().model_copy(update={"fast_forward": fast_forward})
    r = _run(sc, [_req("A", 0.0, 8, 3)], perf)
    assert r.first_token_s.tolist() == pytest.approx([0.5]) and r.finish_s.tolist() == pytest.approx([0.56])
    r0 = _run(sc, [_req("A", 0.0, 8, 3)], StepClassPerf(LinearPerf()))
    assert r0.first_token_s.tolist() == pytest.approx([0.11]) and r0.finish_s.tolist() == pytest.approx([0.17])
