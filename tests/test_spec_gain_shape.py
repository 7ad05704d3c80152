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
    from sim.validate import SPEC_GAIN_SWEEP, spec_gain_sweep
    sweep = spec_gain_sweep()
    assert list(sweep) == list(SPEC_GAIN_SWEEP)
    gains = list(sweep.values())
    assert gains[0] == pytest.approx(0.0, abs=1e-9)
    assert all(b >= a - 1e-9 for a, b in zip(gains, gains[1:]))
    assert gains[-1] > 5.0
