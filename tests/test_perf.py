"""Roofline perf model: hand-calculated expectations (numbers worked out in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.hardware import B200, H100, H200, H800, HARDWARE, get_hardware
from sim.models import MODELS, get_model
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
    with pytest.raises(ValueError, match="deepseek-v3, llama-3.1-70b, llama-3.1-8b"):
        get_model("gpt-5")
    assert set(MODELS) == {"deepseek-v3", "llama-3.1-8b", "llama-3.1-70b"}


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
