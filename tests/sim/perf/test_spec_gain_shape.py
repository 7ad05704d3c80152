"""Shape of the dynamic-vs-fixed speculative gain (sim/perf/spec.py), on a hand-checkable step model.

The stub target's decode step computing ``k`` tokens for each of ``n`` sequences per rank costs
``T = max(M, c * n * k)``: memory-bound (flat in ``k``) below ``c * n * k = M``, compute-bound
(linear in the verified tokens) above. Every expected value below is worked by hand from that
formula and ``tau(d) = 1 + sum_{i<=d} a^i``.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim.perf.spec import SpecDecodeConfig, SpecDecodePerf

M, C = 0.010, 1e-5  # 10 ms memory floor; 10 us per verified token per rank


class _Stub:
    kv_bytes_per_token = 1
    kv_capacity_tokens_per_rank = 1 << 30
    ep_synchronous = True
    wants_prefill_cached_tokens = False
    verify_tokens_per_seq = 1  # no MTP (PerfModel declares both)
    decode_tokens_per_step = 1.0

    def step_time_s(self, pt, pp, ds, dc, decode_tokens_per_seq=1.0):  # noqa: ANN001, ANN201
        ds = np.asarray(ds, dtype=np.float64)
        return np.max(np.maximum(M, C * ds * decode_tokens_per_seq), axis=-1)


def _gain(n: float, *, f: float, overhead_s: float = 0.0, a: float = 0.9) -> float:
    acc = [a] * 5
    fixed = SpecDecodePerf(_Stub(), SpecDecodeConfig(draft_tokens=5, acceptance=acc, drafter="parallel",
                                                     draft_cost_fraction=f))
    dyn = SpecDecodePerf(_Stub(), SpecDecodeConfig(draft_tokens=5, acceptance=acc, drafter="parallel",
                                                   draft_cost_fraction=f, dynamic=True, max_draft_tokens=5,
                                                   dynamic_overhead_s=overhead_s))
    ds = np.full((1, 4), float(n))
    z = np.zeros_like(ds)
    tf = float(fixed.step_time_s(z, z, ds, ds * 1000)[0])
    td = float(dyn.step_time_s(z, z, ds, ds * 1000)[0])
    return 100.0 * (tf / td - 1.0)


TAU5 = 1 + 0.9 + 0.81 + 0.729 + 0.6561 + 0.59049  # 4.68559


def test_light_load_gain_is_zero_minus_the_overhead():
    # n = 100: c * n * 6 = 6 ms < M, every draft length costs M: dynamic verifies the whole block,
    # as fixed does, so the gain is exactly 0; a per-step overhead makes it negative:
    # fixed M(1 + f)/tau5 vs dynamic M(1 + f)/tau5 + o
    assert _gain(100, f=0.1) == pytest.approx(0.0, abs=1e-9)
    per_tok = M * 1.1 / TAU5
    assert _gain(100, f=0.1, overhead_s=1e-4) == pytest.approx(100 * (per_tok / (per_tok + 1e-4) - 1))
    assert _gain(100, f=0.1, overhead_s=1e-4) < 0


def test_compute_bound_gain_by_hand():
    # n = 1,000 (c * n = M): T(k) = c n k. Free draft (f = 0): (1 + d) / tau(d) is smallest at
    # d = 0 (1.0 vs 2 / 1.9 = 1.053 ...), so dynamic stops speculating: gain = 6 / tau5 - 1 = +28.05%
    assert _gain(1000, f=0.0) == pytest.approx(100 * (6 / TAU5 - 1), rel=1e-9)
    # block draft of 10% (one forward over 6 positions = 0.6 c n, paid in both modes):
    # fixed 6.6 / 4.68559 = 1.40866; dynamic min over d of (1 + d + 0.6) / tau(d):
    # d=0 1.6, d=1 2.6/1.9 = 1.3684, d=2 3.6/2.71 = 1.3284, d=3 4.6/3.439 = 1.3376 -> d = 2
    # gain = 1.40866 / 1.32841 - 1 = +6.04%: the block's draft cost dilutes the gain
    assert _gain(1000, f=0.1) == pytest.approx(100 * ((6.6 / TAU5) / (3.6 / 2.71) - 1), rel=1e-9)
    assert _gain(1000, f=0.1) == pytest.approx(6.04, abs=0.01)


def test_gain_rises_with_load_when_the_block_can_only_be_pruned():
    # max_draft_tokens = draft_tokens: the scheduler can only shorten the block, so the gain is 0
    # while the step is memory-bound and never falls as the batch grows
    gains = [_gain(n, f=0.1) for n in (50, 100, 150, 200, 300, 500, 1000, 2000)]
    assert gains[:3] == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    assert all(b >= a - 1e-9 for a, b in zip(gains, gains[1:]))
    assert gains[-1] > 5.0


def test_dynamic_pays_the_parallel_block_even_when_verifying_nothing():
    # n = 100,000, f = 1 (a drafter as costly as the target): T(k) = 1 c n k; dynamic d = 0 costs
    # the plain step plus the 6-position block = 7 c n, d = 1 costs (2 + 6) / 1.9 = 4.21 c n ...
    # the best is d = 5: (6 + 6) / tau5 = 2.561 c n -- the same as fixed, gain 0
    assert _gain(100_000, f=1.0) == pytest.approx(0.0, abs=1e-9)


def test_deepinfer_preset_gain_rises_with_load():
    # the shipped DSpark-5 preset: nothing to prune at light load (exactly 0: dynamic verifies the
    # whole block, as fixed drafts do), a gain once verification is compute-bound, never falling
    from sim.validation.published import SPEC_GAIN_SWEEP, spec_gain_sweep
    sweep = spec_gain_sweep()
    assert list(sweep) == list(SPEC_GAIN_SWEEP)
    gains = list(sweep.values())
    assert gains[0] == pytest.approx(0.0, abs=1e-9)
    assert all(b >= a - 1e-9 for a, b in zip(gains, gains[1:]))
    assert gains[-1] > 5.0


def test_admission_order_by_hand():
    from sim.perf.spec import admission_order
    # the docstring's example: slots A1 (p 0.9, w 0.5) then B1 (0.5, 0.5)
    got = admission_order([(0.5, [0.9]), (0.5, [0.5])], 1)
    assert [p[2] for p in got] == [0, 1, 1]
    assert [x for p in got for x in p[:2]] == pytest.approx([0, 1, 0.5, 1.45, 1.0, 1.7])
    # one class: (d, tau(d), d)
    plans = admission_order([(1.0, [0.8, 0.5])], 2)
    assert [p[0] for p in plans] == [0, 1, 2] and plans[2][1] == pytest.approx(2.2) and plans[2][2] == 2


def _two_class(dynamic: bool, classes):  # noqa: ANN001, ANN202
    from sim.perf.spec import AcceptanceClass
    cfg = SpecDecodeConfig(draft_tokens=2, acceptance=[0.6, 0.6], drafter="parallel", draft_cost_fraction=0.0,
                           dynamic=dynamic, max_draft_tokens=2,
                           acceptance_classes=None if classes is None else
                           [AcceptanceClass(share=w, acceptance=a) for w, a in classes])
    return SpecDecodePerf(_Stub(), cfg)


def test_per_request_classes_prune_the_doubtful_class_first():
    # n = 500: T(k) = max(M, M k / 2), flat up to 2 tokens per sequence. Classes A (half the batch,
    # a = 0.9) and B (a = 0.3), blocks of 2. Admission: A1 .9, A2 .81, B1 .3, B2 .09 ->
    # per accepted token (units of M): K0 1/1, K1 1/1.45, K2 1/1.855 = 0.5391 (A verifies 2, B none),
    # K3 1.25/2.005, K4 1.5/2.05. Fixed 2-token drafts: T(3) = 1.5 M over tau 2.05 = 0.7317
    classes = [(0.5, [0.9, 0.9]), (0.5, [0.3, 0.3])]
    ds = np.full((1, 4), 500.0)
    z = np.zeros_like(ds)
    fixed = float(_two_class(False, classes).step_time_s(z, z, ds, ds)[0])
    dyn_perf = _two_class(True, classes)
    dyn = float(dyn_perf.step_time_s(z, z, ds, ds)[0])
    assert fixed == pytest.approx(M * 1.5 / 2.05)
    assert dyn == pytest.approx(M / 1.855)
    assert float(dyn_perf.last_draft_tokens[0]) == pytest.approx(1.0)  # A's 2 tokens, B's 0: 1 per sequence
    # the same mean curve as one class (tau(1) = 1.6, tau(2) = 2.05) can only choose one length for
    # all: best d = 1 at T(2) = M -> 1/1.6; the per-request gain is 0.7317/0.5391 = +35.7% vs +17.1%
    mean = float(_two_class(True, [(1.0, [0.6, 0.75])]).step_time_s(z, z, ds, ds)[0])
    assert mean == pytest.approx(M / 1.6)
    assert 100 * (fixed / dyn - 1) == pytest.approx(35.7, abs=0.05)
    assert 100 * (fixed / mean - 1) == pytest.approx(17.1, abs=0.05)


def test_acceptance_classes_are_checked():
    from sim.perf.spec import AcceptanceClass
    with pytest.raises(ValueError, match="add up to 1"):
        SpecDecodeConfig(draft_tokens=1, acceptance=[0.5], acceptance_classes=[AcceptanceClass(share=0.5, acceptance=[0.5])])
    with pytest.raises(ValueError, match="one per draft position"):
        SpecDecodeConfig(draft_tokens=2, acceptance=[0.5, 0.5], acceptance_classes=[AcceptanceClass(share=1.0, acceptance=[0.5])])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SpecDecodeConfig(draft_tokens=1, acceptance=[0.5], acceptance_classes=[AcceptanceClass(share=1.0, acceptance=[1.5])])
    # tau of fixed drafts is the share-weighted mean: 0.5 (1 + .9) + 0.5 (1 + .3) = 1.6
    cfg = SpecDecodeConfig(draft_tokens=1, acceptance=[0.6], acceptance_classes=[
        AcceptanceClass(share=0.5, acceptance=[0.9]), AcceptanceClass(share=0.5, acceptance=[0.3])])
    assert cfg.tau(1) == pytest.approx(1.6)


def test_acceptance_classes_load_from_a_scenario_toml(tmp_path):
    from sim.scenario import load_scenario
    p = tmp_path / "s.toml"
    p.write_text('model = "deepseek-v4-flash"\nhardware = "B200"\n[decode]\ndp_ranks = 8\n[prefill]\ndp_ranks = 2\n'
                 '[speculative]\ndraft_tokens = 2\nacceptance = [0.6, 0.6]\ndynamic = true\n'
                 'acceptance_classes = [{share = 0.5, acceptance = [0.9, 0.9], name = "code"},'
                 ' {share = 0.5, acceptance = [0.3, 0.3], name = "chat"}]\n')
    sc = load_scenario(str(p))
    assert [c.name for c in sc.speculative.acceptance_classes] == ["code", "chat"]
    assert sc.speculative.tau(2) == pytest.approx(0.5 * 2.71 + 0.5 * 1.39)
