"""Roofline perf model: hand-calculated expectations (numbers worked out in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.models.hardware import B200, H100, H200, H800, HARDWARE, get_hardware
from sim.models.presets import MODELS, get_model
from sim.perf import PerfModel, RooflinePerf, causal_attn_pairs

MFU, MBU, OVH = 0.5, 0.7, 2e-3  # explicit in every engine below so the hand numbers stay valid


def engine(model, hw, **kw):
    kw.setdefault("num_dp_ranks", 1)
    return RooflinePerf.for_engine(model, hw, mfu=MFU, mbu=MBU, step_overhead_s=OVH, **kw)


# ----------------------------------------------------------------------------- specs
def test_hardware_presets():
    assert set(HARDWARE) == {"H100", "H800", "H200", "B200"}
    assert H100.bf16_flops == 989e12 and H100.fp8_flops == 1979e12  # dense, not sparse
    assert H100.hbm_bw == 3.35e12 and H100.hbm_bytes == 80e9
    assert H100.nvlink_bw == 450e9  # 900 GB/s bidirectional / 2
    assert H800.nvlink_bw == 200e9 and H800.fp8_flops == H100.fp8_flops  # 400 GB/s bidir / 2
    assert H200.hbm_bytes == 141e9 and H200.hbm_bw == 4.8e12
    assert B200.fp8_flops == 4500e12 and B200.hbm_bytes == 180e9
    assert get_hardware("h800") is H800
    with pytest.raises(ValueError, match="B200, H100, H200, H800"):
        get_hardware("A100")


def test_model_presets_and_param_counts():
    # HF safetensors totals: Llama-3.1-8B 8,030,261,248; Llama-3.1-70B 70,553,706,496.
    assert get_model("llama-3.1-8b").total_params == 8_030_261_248
    assert get_model("llama-3.1-70b").total_params == 70_553_706_496
    ds = get_model("deepseek-v3")
    # paper: 671B total, 37B activated (MTP module excluded)
    assert abs(ds.total_params / 671e9 - 1) < 0.005
    assert 37e9 <= ds.activated_params < 38e9
    # routed experts: 58 MoE layers * 256 experts * 3 * 7168 * 2048 = 653.9B
    assert ds.routed_expert_params == 58 * 256 * 3 * 7168 * 2048
    assert ds.num_moe_layers == 58 and ds.is_moe and ds.is_mla
    with pytest.raises(ValueError, match="deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, deepseek-v4.1-flash, llama-3.1-70b, llama-3.1-8b, qwen3-30b-a3b, qwen3-32b"):
        get_model("gpt-5")
    assert set(MODELS) == {"deepseek-v3", "deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v4.1-flash", "llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "qwen3-32b"}


def test_kv_bytes_per_token():
    # GQA: 2 (K,V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes = 131,072
    assert get_model("llama-3.1-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    # 70B: 2 * 80 * 8 * 128 * 2 = 327,680
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 327_680
    # MLA: 61 layers * (512 latent + 64 rope) * kv_bytes (2, BF16) = 70,272
    ds = get_model("deepseek-v3")
    assert ds.kv_bytes_per_token == 61 * (512 + 64) * ds.kv_bytes == 70_272
    assert engine("deepseek-v3", "H200", num_dp_ranks=8).kv_bytes_per_token == 70_272


def test_attention_flops_per_pair():
    # GQA: 4 * 32 layers * 32 heads * 128 = 524,288
    assert get_model("llama-3.1-8b").attn_flops_per_pair == 524_288
    ds = get_model("deepseek-v3")
    # MLA absorbed (decode): 61 * 128 * 2 * ((512 + 64) + 512) = 16,990,208
    assert ds.attn_flops_per_pair == 61 * 128 * 2 * (576 + 512) == 16_990_208
    # MLA non-absorbed (prefill): 61 * 128 * 2 * ((128 + 64) + 128) = 4,997,120
    assert ds.prefill_attn_flops_per_pair == 4_997_120


# ----------------------------------------------------------------------------- dense engines
def test_memory_bound_decode_dense():
    # Llama-3.1-8B on one H100, 8 decode sequences with 8,000 context tokens in total.
    # weights streamed: (8,030,261,248 - 525,336,576 embedding) * 2 B = 15,009,849,344 B
    # KV read 8,000 * 131,072 + KV written 8 * 131,072 = 1,049,624,576 B
    # bytes = 16,059,473,920 / (3.35e12 * 0.7 = 2.345e12 B/s) = 6.8484 ms
    # compute = 8 * 15.01 GFLOP + 8,000 * 524,288 = 0.124 TFLOP / 494.5 TFLOP/s = 0.25 ms << memory
    e = engine("llama-3.1-8b", "H100")
    expected = (15_009_849_344 + (8_000 + 8) * 131_072) / (3.35e12 * 0.7) + 2e-3
    got = e.step_time_s([0], [0], [8], [8_000])
    assert got.shape == ()
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(8.8484e-3, rel=1e-4)


def test_compute_bound_prefill_dense():
    # Llama-3.1-8B on one H100, one 4,096-token prompt, nothing cached.
    # linear FLOPs 4,096 * 2 * 7,504,924,672 = 6.1480e13 (BF16 peak 989e12 * 0.5)
    # attention pairs 4,096 * 4,097 / 2 = 8,390,656 * 524,288 = 4.3991e12 (BF16)
    # compute = 6.5879e13 / 4.945e14 = 0.13322 s; memory = (15.0 GB + 4,096 * 131,072) / 2.345e12 = 6.6 ms
    e = engine("llama-3.1-8b", "H100")
    pairs = causal_attn_pairs(4096, 0)
    assert pairs == 8_390_656
    expected = (4096 * 15_009_849_344 + 8_390_656 * 524_288) / (989e12 * 0.5) + 2e-3
    assert e.step_time_s([4096], [pairs], [0], [0]) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.13522, rel=1e-4)


def test_tensor_parallel_divides_work():
    # TP4 Llama-70B: FLOPs and bytes per GPU are 1/4; KV of 8 heads splits over 4 GPUs.
    e = engine("llama-3.1-70b", "H100", gpus_per_rank=4)
    weights = (70_553_706_496 - 128_256 * 8192) * 2
    expected = (weights + (20_000 + 16) * 327_680) / 4 / (3.35e12 * 0.7) + 2e-3
    assert e.step_time_s([0], [0], [16], [20_000]) == pytest.approx(expected, rel=1e-12)
    assert not e.ep_synchronous


def test_kv_capacity_dense():
    # Llama-3.1-8B on H100: 80e9 * 0.9 - 16,060,522,496 weights - 2e9 reserve = 53,939,477,504 B
    # / 131,072 B per token = 411,525 tokens
    assert engine("llama-3.1-8b", "H100").kv_capacity_tokens_per_rank == 411_525
    # TP2: per GPU 72e9 - 8,030,261,248 - 2e9 = 61,969,738,752 B / (131,072 / 2) = 945,583
    assert engine("llama-3.1-8b", "H100", gpus_per_rank=2).kv_capacity_tokens_per_rank == 945_583


def test_capacity_error_when_weights_do_not_fit():
    # DeepSeek-V3 FP8 at EP8 on H800: 17.1 GB dense + 653.9 / 8 = 81.7 GB experts = 98.9 GB > 72 GB
    with pytest.raises(ValueError, match="does not fit"):
        engine("deepseek-v3", "H800", num_dp_ranks=8)
    # Llama-70B BF16 (141 GB) on one H100
    with pytest.raises(ValueError, match="does not fit"):
        engine("llama-3.1-70b", "H100")
    # ... but EP8 on H200 fits (98.9 GB < 141 * 0.9 - 2 = 124.9 GB)
    e = engine("deepseek-v3", "H200", num_dp_ranks=8)
    assert e.kv_capacity_tokens_per_rank > 0 and e.ep_synchronous


# ----------------------------------------------------------------------------- EP engine
def _ds_ep32():
    return engine("deepseek-v3", "H800", num_dp_ranks=32)


def test_ep_default_and_protocol():
    e = _ds_ep32()
    assert isinstance(e, PerfModel)
    assert e.ep_synchronous
    assert not engine("deepseek-v3", "H200", num_dp_ranks=1, gpus_per_rank=8).ep_synchronous
    assert not engine("llama-3.1-8b", "H100", num_dp_ranks=4).ep_synchronous
    # per GPU weights: 17.12 GB dense + 653.9 / 32 = 20.43 GB experts
    assert e.weight_bytes_per_gpu == pytest.approx(17_117_648_384 + 653_908_770_816 / 32)


def test_ep_max_over_ranks_equals_single_rank_formula():
    # DeepSeek-V3 EP32 on H800, decode only: every rank 64 seqs * 2,000 ctx, then rank 5 doubles.
    ds = get_model("deepseek-v3")
    e = _ds_ep32()
    R = 32
    seqs = np.full(R, 64.0)
    ctx = seqs * 2000
    base = e.step_time_s(np.zeros(R), np.zeros(R), seqs, ctx)
    seqs2, ctx2 = seqs.copy(), ctx.copy()
    seqs2[5], ctx2[5] = 128, 128 * 2000
    loaded = e.step_time_s(np.zeros(R), np.zeros(R), seqs2, ctx2)
    assert loaded > base

    # by hand, rank 5: 128 tokens, 256,000 ctx tokens
    lin, attn, bw = 1979e12 * MFU, 989e12 * MFU, 3.35e12 * MBU
    dense_w = (ds.dense_params - ds.embedding_params) * 1  # FP8 bytes streamed
    compute = 128 * ds.dense_flops_per_token / lin + 256_000 * 16_990_208 / attn
    memory = (dense_w + (256_000 + 128) * 70_272) / bw
    rank5 = max(compute, memory)
    # shared MoE term: 31 * 64 + 128 = 2,112 tokens over 32 GPUs, all experts touched
    T = 31 * 64 + 128
    moe = max(T * 2 * 58 * 8 * 3 * 7168 * 2048 / 32 / lin, 653_908_770_816 / 32 / bw)
    # low-latency dispatch/combine: busiest rank sends 128 * 8 copies * 7168 * (1 + 2) B * 58 layers
    comm = 128 * 8 * 7168 * 3 * 58 / (50e9 * 0.8)
    assert loaded == pytest.approx(rank5 + moe + comm + OVH, rel=1e-9)
    b = e.step_time_breakdown(np.zeros(R), np.zeros(R), seqs2, ctx2)
    assert b["rank"] == pytest.approx(rank5) and b["moe"] == pytest.approx(moe)
    assert b["comm"] == pytest.approx(comm)
    assert np.argmax(b["rank_all"]) == 5


def test_ep_zero_batch_is_overhead_plus_weights():
    # all ranks idle (dummy batch): only the dense weights are streamed, no expert is touched
    ds = get_model("deepseek-v3")
    e = _ds_ep32()
    z = np.zeros(32)
    expected = (ds.dense_params - ds.embedding_params) / (3.35e12 * MBU) + OVH
    assert e.step_time_s(z, z, z, z) == pytest.approx(expected, rel=1e-12)


def test_ep_prefill_uses_node_dedup_comm():
    # 4 nodes; a token's 8 experts hit 4 * (1 - 0.75^8) = 3.60 distinct nodes, of which
    # 3 * (1 - 0.75^8) = 2.70 remote: fewer NIC bytes than the 8 copies of decode kernels.
    e = _ds_ep32()
    z = np.zeros(32)
    pt = np.full(32, 1000.0)
    b_pf = e.step_time_breakdown(pt, causal_attn_pairs(pt, 0), z, z)
    b_dec = e.step_time_breakdown(z, z, pt, pt)
    remote = 3 * (1 - 0.75 ** 8)
    nic = 1000 * remote * 7168 * 3 * 58 / 40e9
    nvl = 1000 * 8 * (7 / 8) * 7168 * 3 * 58 / 160e9
    assert b_pf["comm"] == pytest.approx(max(nic, nvl))
    assert b_dec["comm"] == pytest.approx(1000 * 8 * 7168 * 3 * 58 / 40e9)


# ----------------------------------------------------------------------------- vectorisation
@pytest.mark.parametrize("make,R", [
    (lambda: engine("llama-3.1-8b", "H100"), 1),
    (lambda: engine("llama-3.1-70b", "H200", gpus_per_rank=4), 1),
    (lambda: engine("deepseek-v3", "H800", num_dp_ranks=32), 32),
    (lambda: engine("deepseek-v3", "H200", num_dp_ranks=1, gpus_per_rank=8), 1),
])
def test_vectorised_equals_scalar_calls(make, R):
    e = make()
    rng = np.random.default_rng(0)
    K = 7
    pt = rng.integers(0, 3000, (K, R)) * (rng.random((K, R)) < 0.5)
    cached = rng.integers(0, 5000, (K, R))
    pp = causal_attn_pairs(pt, cached)
    ds = rng.integers(0, 200, (K, R))
    dc = ds * rng.integers(1, 4000, (K, R))
    batch = e.step_time_s(pt, pp, ds, dc)
    assert batch.shape == (K,)
    one_by_one = [e.step_time_s(pt[k], pp[k], ds[k], dc[k]) for k in range(K)]
    np.testing.assert_allclose(batch, one_by_one, rtol=1e-12)
    # extra leading axes broadcast too
    assert e.step_time_s(pt[None], pp[None], ds[None], dc[None]).shape == (1, K)


def test_more_work_never_faster():
    e = _ds_ep32()
    z = np.zeros((1, 32))
    d = np.arange(0, 400, 20.0)[:, None] * np.ones(32)
    t = e.step_time_s(z, z, d, d * 3000)
    assert np.all(np.diff(t) >= 0)


# ----------------------------------------------------------------------------- issue 6 additions
from sim.run.pool_perf import roofline_for_pool  # noqa: E402
from sim.perf.config import PerfConfig  # noqa: E402
from sim.perf.roofline import ep_dispatch_combine_bytes  # noqa: E402
from sim.scenario import PoolConfig, Scenario  # noqa: E402


def test_ep_dispatch_combine_bytes_hand_case():
    # DeepSeek-V3: hidden 7168, top-8; a copy is 7168 * (1 FP8 dispatch + 2 BF16 combine) = 21,504 B.
    # EP32 over 8-GPU nodes: P(other GPU, same node) = 7/32, P(off node) = 24/32.
    nvl, net = ep_dispatch_combine_bytes(7168, 8, 32, 8)
    assert nvl == pytest.approx(8 * 7 / 32 * 21_504) == pytest.approx(37_632)
    assert net == pytest.approx(8 * 24 / 32 * 21_504) == pytest.approx(129_024)
    # EP8 in one node: 7 of 8 copies over NVLink, nothing off-node
    assert ep_dispatch_combine_bytes(7168, 8, 8, 8) == pytest.approx((150_528, 0.0))
    assert ep_dispatch_combine_bytes(7168, 8, 1, 8) == (0.0, 0.0)
    with pytest.raises(ValueError, match="ep_size"):
        ep_dispatch_combine_bytes(7168, 8, 0, 8)


def test_ep_low_latency_over_nvlink_option():
    # ep_ll_nvlink: decode copies to own-node experts go over NVLink (200 GB/s * 0.8 on H800),
    # off-node ones over the NIC (50 GB/s * 0.8), concurrently:
    # per token max(37,632 / 160e9, 129,024 / 40e9) * 58 layers = 3.2256e-6 * 58 s.
    z = np.zeros(32)
    d = np.full(32, 1000.0)
    e = engine("deepseek-v3", "H800", num_dp_ranks=32, ep_ll_nvlink=True)
    assert e.step_time_breakdown(z, z, d, d)["comm"] == pytest.approx(1000 * 129_024 / 40e9 * 58)
    # default (pure-RDMA low-latency kernels): all 8 copies over the NIC
    assert _ds_ep32().step_time_breakdown(z, z, d, d)["comm"] == pytest.approx(1000 * 8 * 21_504 * 58 / 40e9)


def test_tbo_is_max_instead_of_sum_hand_case():
    # DeepSeek-V3 EP32 on H800, every rank prefills one fresh 1,000-token prompt.
    ds = get_model("deepseek-v3")
    z = np.zeros(32)
    pt = np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)  # 500,500 per rank
    lin, attn, bw = 1979e12 * MFU, 989e12 * MFU, 3.35e12 * MBU
    dense_w = (ds.dense_params - ds.embedding_params) * 1  # FP8 bytes
    # TBO: each micro-batch streams the weights again (2x weight bytes), KV traffic once
    compute = 1000 * ds.dense_flops_per_token / lin + 500_500 * 4_997_120 / attn
    rank = max(compute, (2 * dense_w + 1000 * 70_272) / bw)
    T = 32_000
    touched = 1 - (1 - 8 / 256) ** T
    moe = max(T * 2 * 58 * 8 * 3 * 7168 * 2048 / 32 / lin, 2 * touched * 653_908_770_816 / 32 / bw)
    remote = 3 * (1 - 0.75 ** 8)  # normal kernels: distinct remote nodes (see test above)
    comm = max(1000 * remote * 21_504 * 58 / 40e9, 1000 * 8 * (7 / 8) * 21_504 * 58 / 160e9)
    tbo = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True)
    b = tbo.step_time_breakdown(pt, pairs, z, z)
    assert b["rank"] == pytest.approx(rank) and b["moe"] == pytest.approx(moe) and b["comm"] == pytest.approx(comm)
    assert b["total"] == pytest.approx(max(rank + moe, comm) + OVH)
    # without TBO the same components add up (rank/moe read the weights once)
    b0 = _ds_ep32().step_time_breakdown(pt, pairs, z, z)
    assert b0["total"] == pytest.approx(b0["rank"] + b0["moe"] + comm + OVH)
    assert b["total"] < b0["total"]
    # idle step under TBO: only the dense weights, streamed twice
    assert tbo.step_time_s(z, z, z, z) == pytest.approx(2 * dense_w / bw + OVH, rel=1e-12)
    # tbo_overhead_s adds per step
    t2 = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, tbo_overhead_s=1e-3)
    assert t2.step_time_s(z, z, z, z) == pytest.approx(2 * dense_w / bw + OVH + 1e-3, rel=1e-12)


def _llama8b_scenario(**perf):
    perf = PerfConfig(mfu=MFU, mbu=MBU, step_overhead_s=OVH, **perf)
    return Scenario(model="llama-3.1-8b", hardware="h100", mixed=PoolConfig(), perf=perf)


def test_fp8_weights_halve_weight_bytes():
    bf16 = roofline_for_pool(sc := _llama8b_scenario(), sc.mixed)
    fp8 = roofline_for_pool(sc8 := _llama8b_scenario(fp8_weights=True), sc8.mixed)
    # 8,030,261,248 params * 2 B vs * 1 B
    assert bf16.weight_bytes_per_gpu == 16_060_522_496
    assert fp8.weight_bytes_per_gpu == 8_030_261_248
    # memory-bound decode (8 seqs, 8,000 ctx): streamed weights 15,009,849,344 B -> half
    kv = (8_000 + 8) * 131_072
    assert fp8.step_time_s([0], [0], [8], [8_000]) == pytest.approx((15_009_849_344 / 2 + kv) / (3.35e12 * MBU) + OVH)
    # capacity: (0.9 * 80e9 - weights - 2e9) // 131,072 tokens
    assert fp8.kv_capacity_tokens_per_rank == int((0.9 * 80e9 - 8_030_261_248 - 2e9) // 131_072)
    assert fp8.kv_capacity_tokens_per_rank > bf16.kv_capacity_tokens_per_rank
    # compute-bound prefill of 8,192 tokens: linear FLOPs at the FP8 peak (2x BF16), attention at BF16
    lin_flops = 8192 * 2 * (8_030_261_248 - 525_336_576)
    attn = causal_attn_pairs(8192, 0) * 524_288 / (989e12 * MFU)
    assert fp8.step_time_s([8192], [causal_attn_pairs(8192, 0)], [0], [0]) == pytest.approx(
        lin_flops / (1979e12 * MFU) + attn + OVH)
    # and back: fp8_weights=False on FP8-native DeepSeek-V3 doubles its weight bytes
    # (EP16 on H200: 2 * (17.1 + 653.9 / 16) = 116 GB per GPU fits in 0.9 * 141 GB; EP8 would not)
    ds = Scenario(model="deepseek-v3", hardware="h200", mixed=PoolConfig(dp_ranks=16),
                  perf=PerfConfig(fp8_weights=False))
    base = Scenario(model="deepseek-v3", hardware="h200", mixed=PoolConfig(dp_ranks=16))
    assert roofline_for_pool(ds, ds.mixed).weight_bytes_per_gpu == pytest.approx(
        2 * roofline_for_pool(base, base.mixed).weight_bytes_per_gpu)
    ds8 = ds.model_copy(update={"mixed": PoolConfig(dp_ranks=8)})
    with pytest.raises(ValueError, match="does not fit on 8 x 1 H200"):
        roofline_for_pool(ds8, ds8.mixed)


def test_no_perf_config_reproduces_the_default_roofline():
    # the golden scenarios have no [perf]: the perf model must be exactly the old for_engine one
    from sim.run.pool_perf import build_perf
    from sim.scenario import PRESETS
    sc = PRESETS["dsv3-pd-h200"]
    assert sc.perf is None
    rng = np.random.default_rng(1)
    for pool in (sc.prefill, sc.decode):
        a, b = roofline_for_pool(sc, pool), build_perf(sc, pool)
        pt = rng.integers(0, 3000, (5, 8)) * 1.0
        pp = causal_attn_pairs(pt, rng.integers(0, 4000, (5, 8)))
        ds_ = rng.integers(0, 100, (5, 8)) * 1.0
        args = (pt, pp, ds_, ds_ * 1500)
        np.testing.assert_array_equal(a.step_time_s(*args), b.step_time_s(*args))
        assert a.kv_capacity_tokens_per_rank == b.kv_capacity_tokens_per_rank


def test_gpus_per_node_override_puts_ep32_in_one_nvlink_domain():
    # 32 GPUs per node: every remote expert is on NVLink: 8 * 31/32 copies * 21,504 B * 58 / (200e9 * 0.8)
    sc = Scenario(model="deepseek-v3", hardware="h800", mixed=PoolConfig(dp_ranks=32),
                  perf=PerfConfig(mfu=MFU, mbu=MBU, step_overhead_s=OVH, gpus_per_node=32))
    e = roofline_for_pool(sc, sc.mixed)
    z, d = np.zeros(32), np.full(32, 100.0)
    assert e.step_time_breakdown(z, z, d, d)["comm"] == pytest.approx(100 * 8 * 31 / 32 * 21_504 * 58 / 160e9)


# ----------------------------------------------------------------------------- issue 6: opt-in EP terms
def _ds_prefill_components(mfu=MFU, comm_eff_normal=0.8):
    """Hand numbers of the EP32 H800 TBO prefill case above (1,000 fresh tokens per rank)."""
    ds = get_model("deepseek-v3")
    lin, attn, bw = 1979e12 * mfu, 989e12 * mfu, 3.35e12 * MBU
    dense_w = (ds.dense_params - ds.embedding_params) * 1
    rank = max(1000 * ds.dense_flops_per_token / lin + 500_500 * 4_997_120 / attn, (2 * dense_w + 1000 * 70_272) / bw)
    touched = 1 - (1 - 8 / 256) ** 32_000
    moe = max(32_000 * 2 * 58 * 8 * 3 * 7168 * 2048 / 32 / lin, 2 * touched * 653_908_770_816 / 32 / bw)
    remote = 3 * (1 - 0.75 ** 8)
    comm = max(1000 * remote * 21_504 * 58 / (50e9 * comm_eff_normal),
               1000 * 8 * (7 / 8) * 21_504 * 58 / (200e9 * comm_eff_normal))
    return rank, moe, comm


def _phases(rank, moe, comm):
    # per layer, micro-batch A's [attention] / [MoE] against B's [combine] / [dispatch]:
    # a = rank/2, e = moe/2 per micro-batch; dispatch is 1/3 of the bytes (FP8 vs BF16 combine)
    a, e, d, c = rank / 2, moe / 2, comm / 6, comm / 3
    return max(a, c) + max(a, d) + max(e, d) + max(e, c)


def test_tbo_phases_hand_case():
    z, pt = np.zeros(32), np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)
    rank, moe, comm = _ds_prefill_components()
    e = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, tbo_phases=True)
    b = e.step_time_breakdown(pt, pairs, z, z)
    assert (b["rank"], b["moe"], b["comm"]) == pytest.approx((rank, moe, comm))
    assert b["total"] == pytest.approx(_phases(rank, moe, comm) + OVH, rel=1e-12)
    # never faster than perfect overlap, never slower than no overlap
    assert max(rank + moe, comm) + OVH <= b["total"] <= rank + moe + comm + OVH
    # the phase sum reduces to the max when one side dominates in every phase
    assert _phases(4.0, 2.0, 0.3) == pytest.approx(6.0) and _phases(0.1, 0.1, 6.0) == pytest.approx(6.0)
    # tbo_phases without tbo changes nothing (no overlap to refine)
    plain = engine("deepseek-v3", "H800", num_dp_ranks=32)
    assert engine("deepseek-v3", "H800", num_dp_ranks=32, tbo_phases=True).step_time_s(pt, pairs, z, z) == \
        pytest.approx(plain.step_time_s(pt, pairs, z, z), rel=1e-12)


def test_prefill_comm_sm_fraction_and_normal_efficiency_hand_case():
    z, pt = np.zeros(32), np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)
    # 20 of 132 SMs held by normal-mode kernels: compute runs at 112/132 -> times x 132/112;
    # normal-mode comm at 0.9 of the links (45 GB/s NIC, 180 GB/s NVLink)
    rank, moe, comm = _ds_prefill_components(comm_eff_normal=0.9)
    e = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, tbo_phases=True,
               prefill_comm_sm_fraction=20 / 132, comm_efficiency_normal=0.9)
    b = e.step_time_breakdown(pt, pairs, z, z)
    slow = 132 / 112
    assert (b["rank"], b["moe"], b["comm"]) == pytest.approx((rank * slow, moe * slow, comm))
    assert b["total"] == pytest.approx(_phases(rank * slow, moe * slow, comm) + OVH)
    # decode steps: low-latency kernels hold no SMs and keep comm_efficiency (0.8): unchanged
    d = np.full(32, 100.0)
    ref = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, tbo_phases=True)
    assert e.step_time_s(z, z, d, d * 2000) == pytest.approx(ref.step_time_s(z, z, d, d * 2000), rel=1e-12)
    # without TBO nothing overlaps, so no SM contention is charged
    e0 = engine("deepseek-v3", "H800", num_dp_ranks=32, prefill_comm_sm_fraction=20 / 132,
                comm_efficiency_normal=0.9)
    b0 = e0.step_time_breakdown(pt, pairs, z, z)
    assert b0["comm"] == pytest.approx(comm) and b0["total"] == pytest.approx(b0["rank"] + b0["moe"] + comm + OVH)


def test_ep_imbalance_hand_case():
    z, pt = np.zeros(32), np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)
    rank, moe, comm = _ds_prefill_components()
    # max/mean load 1.25 on the busiest GPU: its routed experts and received copies scale by it
    e = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, ep_imbalance_prefill=1.25, ep_imbalance_decode=1.5)
    b = e.step_time_breakdown(pt, pairs, z, z)
    assert (b["rank"], b["moe"], b["comm"]) == pytest.approx((rank, 1.25 * moe, 1.25 * comm))
    assert b["total"] == pytest.approx(max(rank + 1.25 * moe, 1.25 * comm) + OVH)
    # decode step: 1.5 on the low-latency comm (100 tokens * 8 copies * 21,504 B * 58 / 40 GB/s)
    d = np.full(32, 100.0)
    assert e.step_time_breakdown(z, z, d, d * 10)["comm"] == pytest.approx(1.5 * 100 * 8 * 21_504 * 58 / 40e9)
    # mixed leading axis: row 0 prefill (1.25), row 1 decode only (1.5)
    pt2 = np.stack([pt, z])
    b2 = e.step_time_breakdown(pt2, np.stack([pairs, z]), np.stack([z, d]), np.stack([z, d * 10]))
    assert b2["comm"][0] == pytest.approx(1.25 * comm)
    assert b2["comm"][1] == pytest.approx(1.5 * 100 * 8 * 21_504 * 58 / 40e9)


def test_new_terms_off_by_default_and_validated():
    z, pt = np.zeros(32), np.full(32, 1000.0)
    pairs = causal_attn_pairs(pt, 0)
    a = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True)
    b = engine("deepseek-v3", "H800", num_dp_ranks=32, tbo=True, tbo_phases=False, comm_efficiency_normal=None,
               prefill_comm_sm_fraction=0.0, ep_imbalance_prefill=1.0, ep_imbalance_decode=1.0)
    assert not a._extended and not b._extended
    assert a.step_time_s(pt, pairs, z, z) == b.step_time_s(pt, pairs, z, z)  # bit-identical
    for kw, msg in (({"comm_efficiency_normal": 0.0}, "comm_efficiency_normal"),
                    ({"prefill_comm_sm_fraction": 1.0}, "prefill_comm_sm_fraction"),
                    ({"ep_imbalance_decode": 0.9}, "ep_imbalance")):
        with pytest.raises(ValueError, match=msg):
            engine("deepseek-v3", "H800", num_dp_ranks=32, **kw)
    with pytest.raises(ValueError):
        PerfConfig(ep_imbalance_prefill=0.5)


def test_extended_single_rank_matches_array_path():
    # the one-rank fast path is skipped when an opt-in term is on; the array path gives the same
    # numbers for one rank given as shape (1,) and as shape (2, 1) rows
    e = engine("deepseek-v3", "H200", num_dp_ranks=1, gpus_per_rank=8, ep_synchronous=True, tbo=True, tbo_phases=True,
               ep_imbalance_decode=1.2)
    one = e.step_time_s([0.0], [0.0], [64.0], [64_000.0])
    two = e.step_time_s([[0.0], [0.0]], [[0.0], [0.0]], [[64.0], [64.0]], [[64_000.0], [64_000.0]])
    assert float(np.ravel(one)[0]) == pytest.approx(two[0], rel=1e-12) == pytest.approx(two[1], rel=1e-12)


# ----------------------------------------------------------------------------- one settings object
def test_perf_config_carries_the_roofline_settings_once():
    # the roofline's settings are written once (RooflineSettings, with their bounds); a scenario's
    # [perf] table (PerfConfig) is made from them: the same names in the same order with the same
    # defaults, plus the two that change the model and the hardware instead (fp8_weights,
    # gpus_per_node, after tbo_overhead_s where the table always had them): compared field by field
    from dataclasses import fields

    from sim.perf.config import PerfConfig
    from sim.perf.roofline import RooflineSettings

    names = [f.name for f in fields(RooflineSettings)]
    assert [n for n in PerfConfig.model_fields if n not in ("fp8_weights", "gpus_per_node")] == names
    assert list(PerfConfig.model_fields)[8:11] == ["tbo_overhead_s", "fp8_weights", "gpus_per_node"]
    # a bound written on RooflineSettings is the table's: prefill_comm_sm_fraction is in [0, 1)
    # (the roofline's own check, "must be in [0, 1)"), mfu in [MIN_EFFICIENCY, 1] = [0.001, 1]
    for bad in ({"prefill_comm_sm_fraction": 1.0}, {"mfu": 0.0009}, {"eplb_physical_experts": 0}):
        with pytest.raises(ValueError):
            PerfConfig(**bad)
    assert PerfConfig(prefill_comm_sm_fraction=0.99, mfu=0.001).mfu == 0.001
    assert PerfConfig().roofline_settings() == RooflineSettings()
    cfg = PerfConfig(mfu=0.4, tbo=True, eplb_physical_experts=288, fp8_weights=True)
    assert cfg.roofline_settings() == RooflineSettings(mfu=0.4, tbo=True, eplb_physical_experts=288)


def test_settings_object_and_keywords_build_the_same_model():
    from sim.perf.roofline import RooflineSettings

    st = RooflineSettings(mfu=0.4, mbu=0.6, tbo=True, tbo_overhead_s=1e-3)
    a = RooflinePerf.for_engine("deepseek-v3", "H800", num_dp_ranks=32, settings=st)
    b = RooflinePerf.for_engine("deepseek-v3", "H800", num_dp_ranks=32, mfu=0.4, mbu=0.6, tbo=True,
                                tbo_overhead_s=1e-3)
    work = (np.full(32, 4096.0), np.full(32, 4096.0 * 4097 / 2), np.full(32, 8.0), np.full(32, 8e3))
    assert a.settings == b.settings == st
    assert a.step_time_s(*work) == b.step_time_s(*work)
    # a keyword overrides the object's field and leaves the others
    c = RooflinePerf.for_engine("deepseek-v3", "H800", num_dp_ranks=32, settings=st, mfu=0.3)
    assert (c.mfu, c.mbu, c.tbo) == (0.3, 0.6, True)
    with pytest.raises(TypeError):
        RooflinePerf.for_engine("llama-3.1-8b", "H100", num_dp_ranks=1, not_a_setting=1)
    with pytest.raises(ValueError, match="mfu, mbu and comm_efficiency must be in"):
        RooflinePerf.for_engine("llama-3.1-8b", "H100", num_dp_ranks=1, settings=RooflineSettings(mfu=0.0))
