"""Expert-load imbalance after EPLB (sim/perf/imbalance.py) and its use in the roofline.

Expected values are hand calculations (arithmetic in the comments) from the formula in the module
docstring and TensorRT-LLM tech blog 4, Table 1 (DeepSeek-R1, EPLB: EP32 / 288 slots: mean 1,024,
std 52.0, (max - mean)/mean 0.109; EP36 / 288 slots: mean 1,024, std 53.9, 0.115).
"""

from __future__ import annotations

import numpy as np
import pytest

from sim.models.presets import get_model
from sim.perf.base import causal_attn_pairs
from sim.perf.config import PerfConfig
from sim.perf.imbalance import (
    EPLB_RESIDUAL_STD,
    eplb_imbalance,
    eplb_residual_std,
    expected_max_std_normal,
    routing_noise_rel_var,
)
from sim.perf.roofline import RooflinePerf

V3 = {"num_experts": 256, "experts_per_token": 8}


def test_expected_max_of_normals_blom():
    # Phi^-1((32 - 0.375) / 32.25) = Phi^-1(0.980620) = 2.0667; Phi^-1(35.625 / 36.25 = 0.982759) = 2.1143
    assert expected_max_std_normal(32) == pytest.approx(2.0667, abs=1e-4)
    assert expected_max_std_normal(36) == pytest.approx(2.1143, abs=1e-4)
    assert expected_max_std_normal(1) == 0.0
    # Blom vs the exact expected maxima of 10 and 100 standard normals (Harter's 1961 tables:
    # 1.5388 and 2.5076): within 0.01 over the EP sizes that matter
    assert expected_max_std_normal(10) == pytest.approx(1.5388, abs=0.01)
    assert expected_max_std_normal(100) == pytest.approx(2.5076, abs=0.01)
    with pytest.raises(ValueError):
        expected_max_std_normal(0)


def test_routing_noise_hypergeometric_by_hand():
    # EP32, top-8 of 256: per token (32/8)(31/32)(248/255) = 3.768627; over 4,096 tokens 9.2007e-4
    assert float(routing_noise_rel_var(32, 4096, 256, 8)) == pytest.approx(3.768627 / 4096, rel=1e-6)
    # i.e. 1,024 copies per rank with std 31.06 (Poisson would give 32)
    assert 1024 * np.sqrt(float(routing_noise_rel_var(32, 4096, 256, 8))) == pytest.approx(31.06, abs=0.01)
    # no tokens, no noise; one rank holds everything (G = 1): no variance
    assert float(routing_noise_rel_var(32, 0, 256, 8)) == 0.0
    assert float(routing_noise_rel_var(1, 100, 256, 8)) == 0.0
    with pytest.raises(ValueError):
        routing_noise_rel_var(32, 10, 8, 9)


def test_residual_std_from_the_tensorrt_llm_measurement():
    # sigma_sys^2 = (52/1024)^2 - 9.2007e-4 = 2.57874e-3 - 9.2007e-4 = 1.65867e-3 -> 4.0727% at 9 slots;
    # one slot: x sqrt(9) = 0.12218
    assert EPLB_RESIDUAL_STD == pytest.approx(0.12218, abs=1e-5)
    assert eplb_residual_std(32, 288, 1024.0, 52.0) == EPLB_RESIDUAL_STD
    with pytest.raises(ValueError, match="below the routing noise"):
        eplb_residual_std(32, 288, 1024.0, 20.0)


def test_reproduces_both_eplb_rows_of_the_table():
    # EP32 (the row the residual comes from): the Gaussian maximum gives 1 + 2.0667 * 0.050781 = 1.1049
    # against the published 1 + 0.109
    g32 = float(eplb_imbalance(32, 4096, physical_experts=288, **V3))
    assert g32 == pytest.approx(1.1049, abs=1e-4)
    assert g32 == pytest.approx(1.109, abs=0.005)
    # EP36 with 8 slots per rank (not used to derive anything): 4,608 tokens; noise (36/8)(35/36)(248/255)
    # / 4608 = 9.2345e-4, placement 0.12218^2 / 8 = 1.86598e-3 -> std 5.281% = 54.1 copies (published
    # 53.9); max/mean 1 + 2.1143 * 0.05281 = 1.1117 (published 1.115)
    std36 = 1024 * np.sqrt(float(routing_noise_rel_var(36, 4608, 256, 8)) + EPLB_RESIDUAL_STD ** 2 * 36 / 288)
    assert std36 == pytest.approx(54.08, abs=0.01) and std36 == pytest.approx(53.9, rel=0.01)
    g36 = float(eplb_imbalance(36, 4608, physical_experts=288, **V3))
    assert g36 == pytest.approx(1.1117, abs=1e-4) and g36 == pytest.approx(1.115, abs=0.005)


def test_imbalance_shrinks_with_batch_grows_with_ep_and_fewer_slots():
    small, large = (float(eplb_imbalance(32, t, physical_experts=288, **V3)) for t in (1_000, 1_000_000))
    assert small > large > 1.0
    # more ranks for the same slots: fewer slots per GPU and a larger maximum
    assert float(eplb_imbalance(72, 100_000, physical_experts=288, **V3)) > float(
        eplb_imbalance(32, 100_000, physical_experts=288, **V3))
    # no placement error and a huge batch: balanced; one rank: exactly 1
    assert float(eplb_imbalance(32, 1e12, physical_experts=288, residual_std=0.0, **V3)) == pytest.approx(1.0, abs=1e-4)
    assert float(eplb_imbalance(1, 100, physical_experts=288, **V3)) == 1.0
    # broadcasts over tokens
    assert np.shape(eplb_imbalance(32, np.array([1e3, 1e4, 1e5]), physical_experts=288, **V3)) == (3,)
    with pytest.raises(ValueError, match="physical_experts"):
        eplb_imbalance(32, 100, physical_experts=200, **V3)


MFU, MBU, OVH = 0.5, 0.7, 2e-3


def _engine(**kw):
    return RooflinePerf.for_engine("deepseek-v3", "H800", num_dp_ranks=32, mfu=MFU, mbu=MBU, step_overhead_s=OVH,
                                   **kw)


def test_roofline_prefill_step_with_eplb_by_hand():
    # EP32 H800, 1,000 fresh tokens per rank, no TBO: one dispatch of 32,000 tokens. gamma = 1 + 2.0667 *
    # sqrt(0.12218^2 * 32/288 + 3.768627/32,000) = 1 + 2.0667 * sqrt(1.65867e-3 + 1.17770e-4) = 1.08711
    z, pt = np.zeros(32), np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)
    base = _engine().step_time_breakdown(pt, pairs, z, z)
    e = _engine(eplb_physical_experts=288)
    b = e.step_time_breakdown(pt, pairs, z, z)
    gamma = 1.08711
    assert b["comm"] == pytest.approx(gamma * base["comm"], rel=1e-5)
    # the busiest GPU computes gamma x the mean tokens; the weights it streams are its own slots
    ds = get_model("deepseek-v3")
    compute = 32_000 * ds.expert_flops_per_token / 32 / (1979e12 * MFU)
    streamed = (1 - (1 - 8 / 256) ** 32_000) * ds.expert_weight_bytes / 32 / (3.35e12 * MBU)
    assert b["moe"] == pytest.approx(max(gamma * compute, streamed), rel=1e-5)
    assert b["rank"] == pytest.approx(base["rank"])
    assert b["total"] == pytest.approx(b["rank"] + b["moe"] + b["comm"] + OVH)
    # under TBO each micro-batch dispatches 16,000 tokens: noise 3.768627/16,000 = 2.35539e-4,
    # gamma = 1 + 2.0667 * sqrt(1.89421e-3) = 1.08995
    bt = _engine(tbo=True, eplb_physical_experts=288).step_time_breakdown(pt, pairs, z, z)
    bt0 = _engine(tbo=True).step_time_breakdown(pt, pairs, z, z)
    assert bt["comm"] == pytest.approx(1.08995 * bt0["comm"], rel=1e-5)


def test_roofline_memory_bound_decode_streams_the_same_weights():
    # 4 decode sequences per rank (128 tokens in the group): the routed experts are memory-bound,
    # so the busiest GPU's extra tokens cost no extra time there; its dispatch/combine still does
    z, d = np.zeros(32), np.full(32, 4.0)
    base = _engine().step_time_breakdown(z, z, d, d * 1000)
    b = _engine(eplb_physical_experts=288).step_time_breakdown(z, z, d, d * 1000)
    gamma = float(eplb_imbalance(32, 128, physical_experts=288, **V3))
    assert gamma > 1.3  # 128 tokens: mostly routing noise (3.768627/128 = 0.0294 relative variance)
    assert b["moe"] == pytest.approx(base["moe"], rel=1e-12)
    assert b["comm"] == pytest.approx(gamma * base["comm"], rel=1e-9)


def test_mixed_leading_axis_and_config_plumbing():
    z, pt, d = np.zeros(32), np.full(32, 1000.0), np.full(32, 100.0)
    pairs = causal_attn_pairs(pt, 0)
    e = _engine(eplb_physical_experts=288)
    b2 = e.step_time_breakdown(np.stack([pt, z]), np.stack([pairs, z]), np.stack([z, d]), np.stack([z, d * 10]))
    assert b2["comm"][0] == pytest.approx(e.step_time_breakdown(pt, pairs, z, z)["comm"], rel=1e-12)
    assert b2["comm"][1] == pytest.approx(e.step_time_breakdown(z, z, d, d * 10)["comm"], rel=1e-12)
    # the fixed factors and the placement model exclude each other; slots below the experts are refused
    with pytest.raises(ValueError, match="excludes the fixed"):
        _engine(eplb_physical_experts=288, ep_imbalance_prefill=1.1)
    with pytest.raises(ValueError, match="routed experts"):
        _engine(eplb_physical_experts=255)
    with pytest.raises(ValueError):
        PerfConfig(eplb_residual_std=-0.1)
    assert PerfConfig().eplb_physical_experts is None and PerfConfig().eplb_residual_std == EPLB_RESIDUAL_STD
    # off by default: a non-EP engine or a dense model ignores it
    dense = RooflinePerf.for_engine("llama-3.1-8b", "H100", num_dp_ranks=1, eplb_physical_experts=288)
    assert not dense._eplb
