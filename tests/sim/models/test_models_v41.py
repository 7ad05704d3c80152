"""DeepSeek-V4.1-Flash (CSA2 attention, causal encoder-decoder, MXFP4 experts, Engram).

Expected values are hand calculations from the published text_config values (cited in
sim/models/presets.py), brute-force sums over positions, or pinned outputs of the pre-V4.1 code (V4-Flash).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.models.hf import model_from_hf_config
from sim.models.presets import ModelSpec, get_model
from sim.perf.roofline import RooflinePerf

V41 = get_model("deepseek-v4.1-flash")

# the released text_config (sim/models/presets.py sources [trt-cfg] and [cfg])
TEXT_CONFIG = dict(
    vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=40, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6, sliding_window=128,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3, kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4,
    engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
    engram_n_heads=8, engram_head_dim=256, num_nextn_predict_layers=3)
CONFIG = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": TEXT_CONFIG,
          "vision_config": {"num_hidden_layers": 32}, "dtype": "bfloat16",
          "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}}

# hand counts from the config values
H, NH, HD, QL, OL, OG, V, W = 5120, 64, 512, 1280, 1024, 8, 129280, 128
EXPERT = 3 * H * 2304  # one SwiGLU expert: 35,389,440
ATTN = H * QL + QL + QL * NH * HD + H * HD + HD + NH * HD * OL + OG * OL * H + NH  # per layer: 126,617,408
MHC = 2 * ((4 * 4 + 2 * 4) * 4 * H + 24 + 3)  # fn, base, scale for the attention and FFN sites
LAYER = ATTN + 2 * H + MHC + EXPERT + 384 * H + 384  # + norms, shared expert, router weight and bias
SOURCE = {2: 2 * H * HD + 2 * HD + HD, 1: H * HD + HD}  # compressor by ratio (+ norm) ...
INDEX_K = HD * 128 + 128  # ... and the index-key projection of a KV source
INDEXER = QL * 32 * 128 + H * 32  # an index source's query projection and head weights
ENGRAM = 6144 * 5 * H + 2 * 4 * H  # (4 - 1) x 8 x 256 -> (4 + 1) x hidden, + gate norms


def _sources(layers):
    kv = sum(SOURCE[1 if i == 20 else 2] + INDEX_K for i in (2, 8, 14, 20) if i in layers)
    return kv + INDEXER * sum(1 for i in (2, 8, 14, 20, 24, 28, 32, 36) if i in layers)


def test_parameter_counts_by_hand_and_against_the_card():
    routed = 40 * 384 * EXPERT
    assert V41.routed_expert_params == routed
    total = 2 * V * H + H + 40 * LAYER + _sources(range(40)) + 2 * ENGRAM + routed
    assert V41.total_params == total
    assert abs(total / 552e9 - 1) < 0.005  # card: 552B backbone
    # a decode token: every layer, 6 routed experts each, the LM head (embedding lookup excluded)
    decode = total - routed + 40 * 6 * EXPERT - V * H
    assert V41.linear_flops_per_token == pytest.approx(2 * decode)
    assert 16.0e9 < decode < 16.2e9  # card: 16B while generating
    # a prompt token: encoder layers 0-19 (Engram at 1 and 14), layer 20's GLOBAL projection + norm
    prefill = (20 * LAYER + _sources(range(20)) + 2 * ENGRAM + 20 * 6 * EXPERT
               + SOURCE[1] + INDEX_K + H)
    assert V41.prefill_dense_flops_per_token + V41.prefill_expert_flops_per_token == pytest.approx(2 * prefill)
    assert V41.prefill_expert_flops_per_token == pytest.approx(2 * 20 * 6 * EXPERT)
    assert 7.8e9 < prefill < 8.0e9  # card: 8B while reading input
    assert V41.prefill_activated_params == pytest.approx(prefill + V * H)
    # a replayed row costs what the decode token costs beyond the encoder
    assert V41.replay_dense_flops_per_token + V41.replay_expert_flops_per_token == pytest.approx(2 * (decode - prefill))
    assert V41.engram_table_params == (384006168 + 384016682) * 256  # 196.6B, not in total_params


def test_weight_and_kv_bytes_by_hand():
    # MXFP4 experts (0.5 B + one e8m0 scale per 32): 288.8 GB (colibri: "routed experts 289 GB",
    # 18.8 MB per expert); dense FP8
    assert V41.expert_weight_bytes == pytest.approx(40 * 384 * EXPERT * (0.5 + 1 / 32))
    assert V41.expert_weight_bytes / (40 * 384) == pytest.approx(18.8e6, rel=0.002)
    assert V41.dense_weight_bytes == pytest.approx(V41.total_params - V41.routed_expert_params)
    # records: NVFP4 main 512 * (0.5 + 1/16) = 288, MXFP4 index 128 * (0.5 + 1/32) = 68
    assert (V41.kv_row_bytes, V41.index_row_bytes, V41.swa_row_bytes) == (288, 68, 528)
    # three ratio-2 sources emit every other position, the ratio-1 source every one: 890 B
    assert V41.kv_bytes_per_token == 3 * (288 + 68) // 2 + (288 + 68) == 890
    assert V41.kv_bytes_per_seq_fixed == 40 * 128 * 528
    # "roughly a quarter of V4 Flash's footprint"
    assert V41.kv_bytes_per_token / get_model("deepseek-v4-flash").kv_bytes_per_token == pytest.approx(0.231, abs=0.001)


def test_attended_rows_and_index_keys_by_hand():
    # L = 100: 40 windows of 100 rows; layers 2-19 select min(512, 50) of the ratio-2 rows,
    # layers 20-39 min(512, 100) of the unpooled ones
    assert V41.decode_attended_keys(100) == pytest.approx(40 * 100 + 18 * 50 + 20 * 100)
    # sources 2, 8, 14 score L/2 keys, 20 all L, 24-36 the candidate pool (<= 16,384)
    assert V41.indexer_keys(100) == pytest.approx(3 * 50 + 100 + 4 * 100)
    assert V41.decode_attended_keys(5000) == pytest.approx(40 * 128 + 38 * 512)
    assert V41.indexer_keys(100_000) == pytest.approx(3 * 50_000 + 100_000 + 4 * 16_384)
    L = 5000
    assert V41.decode_kv_read_bytes(L) == pytest.approx(40 * 128 * 528 + 38 * 512 * 288 + (3 * 2500 + 5 * 5000) * 68)


def _brute_attended(j, layers):
    r = V41.compress_ratios
    out = 0.0
    for i in layers:
        out += min(j, W)
        if r[i]:
            out += min(512, j / (2 if i < 20 else 1))
    return out


def _brute_indexer(j, layers):
    out = 0.0
    for i in (2, 8, 14, 20, 24, 28, 32, 36):
        if i in layers:
            keys = j / 2 if i < 20 else j
            out += min(keys, 16384) if i > 20 else keys
    return out


@pytest.mark.parametrize("c,p", [(1, 0), (100, 0), (1000, 0), (4096, 0), (50, 4000), (175, 4208), (512, 3000),
                                 (20_000, 50_000)])
def test_prefill_runs_the_encoder_on_every_token_and_the_decoder_on_the_last_window(c, p):
    # encoder: the new tokens and, after a prefix hit, the rebuilt window before them (min(p, 128));
    # decoder: the prompt's last window, min(p + c, 128) positions ending at p + c
    enc, dec = range(20), range(20, 40)
    rebuilt, rows = min(p, 128), min(p + c, 128)
    enc_pos, dec_pos = range(p - rebuilt + 1, p + c + 1), range(p + c - rows + 1, p + c + 1)
    att = sum(_brute_attended(j, enc) for j in enc_pos) + sum(_brute_attended(j, dec) for j in dec_pos)
    idx = sum(_brute_indexer(j, enc) for j in enc_pos) + sum(_brute_indexer(j, dec) for j in dec_pos)
    assert V41.prefill_attended_keys(c, p) == pytest.approx(att, rel=2e-3)
    assert V41.prefill_indexer_keys(c, p) == pytest.approx(idx, rel=2e-3)
    assert (V41.replay_rows(c, p), V41.rebuild_rows(c, p)) == (rows, rebuilt)


def test_prefill_at_a_high_cache_hit_pays_window_rows_not_just_new_tokens():
    # DeepInfer's 96% hit on 4,383-token prompts: 175 new tokens, 128 rebuilt encoder rows and 128
    # decoder rows, so a prompt costs (175 + 128) prompt-token FLOPs + 128 replayed rows
    e = _engine()
    z = np.zeros(4)
    c, p, n = 175, 4208, 93  # 93 prompts per GPU: 16,384 // 175
    pairs = n * (c * p + c * (c + 1) / 2)
    b = e.step_time_breakdown(np.full(4, n * c), np.full(4, pairs), z, z, prefill_cached_tokens=np.full(4, n * p))
    lin = n * ((c + 128) * V41.prefill_dense_flops_per_token + 128 * V41.replay_dense_flops_per_token) / B200["fp8"]
    att = n * V41.prefill_attended_keys(c, p) * 64 * 2 * 1024 / B200["bf16"]
    idx = n * V41.prefill_indexer_keys(c, p) * 2 * 32 * 128 / B200["fp8"]
    memory = ((V41.dense_params - V41.embedding_params) + n * (p + c) * 890) / B200["bw"]
    assert float(b["rank"]) == pytest.approx(max(lin + att + idx, memory), rel=1e-6)
    moe, _ = _moe_and_comm(e, n * ((c + 128) * 0.5 + 128 * 0.5))
    assert float(b["moe"]) == pytest.approx(moe, rel=1e-9)


B200 = dict(fp8=4.5e15 * 0.5, bf16=2.25e15 * 0.5, bw=8e12 * 0.7, nvl=900e9 * 0.8)


def _engine() -> RooflinePerf:
    return RooflinePerf.for_engine("deepseek-v4.1-flash", "B200", num_dp_ranks=4, mfu=0.5, mbu=0.7,
                                   step_overhead_s=0.0)


def _moe_and_comm(e: RooflinePerf, units_per_rank: float) -> tuple[float, float]:
    """Expert roofline of the 4-GPU group and NVLink dispatch/combine of one rank, by hand: all in
    one 8-GPU node, 6 copies x 3/4 off-GPU x hidden x (1 + 2) bytes x 40 MoE layers per unit."""
    m = V41
    group = 4 * units_per_rank
    compute = group * 2 * 40 * 6 * EXPERT / 4 / B200["fp8"]
    touched = 1 - (1 - 6 / 384) ** group
    stream = touched * m.expert_weight_bytes / 4 / B200["bw"]
    comm = units_per_rank * 6 * 0.75 * H * 3 * 40 / B200["nvl"]
    return max(compute, stream), comm * (1 - e.comm_overlap)


def test_prefill_step_by_hand():
    e = _engine()
    c, R = 1000, 4
    z = np.zeros(R)
    b = e.step_time_breakdown(np.full(R, float(c)), np.full(R, c * (c + 1) / 2), z, z)
    # encoder on 1,000 tokens, decoder on the last 128
    lin = (c * V41.prefill_dense_flops_per_token + 128 * V41.replay_dense_flops_per_token) / B200["fp8"]
    att_rows = (20 * (128 * 129 / 2 + 128 * (c - 128)) + 18 * c * (c + 1) / 4  # encoder, exact
                + 128 * (20 * 128 + 20 * 512))  # decoder rows at positions 873..1000
    idx_keys = 3 * c * (c + 1) / 4 + 5 * sum(range(c - 127, c + 1))
    compute = lin + att_rows * 64 * 2 * 1024 / B200["bf16"] + idx_keys * 2 * 32 * 128 / B200["fp8"]
    memory = ((V41.dense_params - V41.embedding_params) + c * 890) / B200["bw"]
    assert float(b["rank"]) == pytest.approx(max(compute, memory), rel=2e-3)
    moe, comm = _moe_and_comm(e, c * 0.5 + 128 * 0.5)  # 20 of the 40 MoE layers per row
    assert float(b["moe"]) == pytest.approx(moe, rel=1e-9)
    assert float(b["comm"]) == pytest.approx(comm, rel=1e-9)
    assert float(b["total"]) == pytest.approx(float(b["rank"]) + moe + comm, rel=1e-9)


def test_decode_step_by_hand():
    e = _engine()
    R, ds, L = 4, 60.0, 5000.0
    z = np.zeros(R)
    b = e.step_time_breakdown(z, z, np.full(R, ds), np.full(R, ds * L))
    compute = (ds * V41.dense_flops_per_token / B200["fp8"] + ds * 24576 * 64 * 2 * 1024 / B200["bf16"]
               + ds * 32500 * 2 * 32 * 128 / B200["fp8"])
    kv_read = 40 * 128 * 528 + 38 * 512 * 288 + 32500 * 68
    memory = ((V41.dense_params - V41.embedding_params) + ds * kv_read + ds * 890) / B200["bw"]
    assert float(b["rank"]) == pytest.approx(max(compute, memory), rel=1e-9)
    moe, comm = _moe_and_comm(e, ds)
    assert float(b["moe"]) == pytest.approx(moe, rel=1e-9)
    assert float(b["comm"]) == pytest.approx(comm, rel=1e-9)


def test_prompt_tokens_cost_about_half_a_decode_token():
    e = _engine()
    R, z = 4, np.zeros(4)
    # long prompts: the 128 replayed rows are amortised; the step is compute-bound on the encoder
    big = float(e.step_time_s(np.full(R, 16384.0), np.full(R, 16384 * 16385 / 2), z, z))
    v4 = RooflinePerf.for_engine("deepseek-v4-flash", "B200", num_dp_ranks=4, mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    big4 = float(v4.step_time_s(np.full(R, 16384.0), np.full(R, 16384 * 16385 / 2), z, z))
    # 7.9B vs V4-Flash's 13.1B linear parameters per prompt token (+ their attention)
    assert 0.5 < big / big4 < 0.75


def test_v4_flash_numbers_unchanged():
    # pinned from the pre-V4.1 code (main at 5b1a7a0), same calls
    m = get_model("deepseek-v4-flash")
    assert (m.total_params, m.activated_params, m.kv_bytes_per_token) == (284332175698, 13799567698, 3851)
    assert m.expert_weight_bytes == 147169738752.0
    for dp, pf, dec, cap in ((4, 0.05644148522643912, 0.01570445596862362, 30096281),
                             (64, 0.208766376, 0.014266368000000001, 39053151)):
        e = RooflinePerf.for_engine("deepseek-v4-flash", "B200", num_dp_ranks=dp, mfu=0.5, mbu=0.7,
                                    step_overhead_s=0.0, tbo=True)
        z = np.zeros(dp)
        assert float(e.step_time_s(np.full(dp, 4096.0), np.full(dp, 4096 * 1000 + 4096 * 4097 / 2), z, z)) == pf
        assert float(e.step_time_s(z, z, np.full(dp, 60.0), np.full(dp, 60 * 5000.0), decode_tokens_per_seq=3)) == dec
        assert e.kv_capacity_tokens_per_rank == cap


def test_hf_config_gives_the_preset(tmp_path):
    path = tmp_path / "DeepSeek-V4.1-Flash" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIG))
    spec = model_from_hf_config(CONFIG, name="deepseek-v4.1-flash")
    assert spec == V41
    from_file = get_model(str(path))
    assert from_file.name == "DeepSeek-V4.1-Flash" and from_file.kv_bytes_per_token == 890
    assert from_file.total_params == V41.total_params
    # expert_dtype fp8 (the widened diagnostic checkpoint) -> 1 byte per expert weight
    fp8 = model_from_hf_config({**CONFIG, "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp8"}})
    assert fp8.expert_param_bytes == 1.0
    # no CED when the last KV source is pooled: every prompt token runs every layer
    flat = model_from_hf_config({**CONFIG, "text_config": {**TEXT_CONFIG, "kv_source_layer_ids": [2, 8, 14]}})
    assert not flat.is_ced and flat.prefill_dense_flops_per_token == flat.dense_flops_per_token


@pytest.mark.parametrize("change,message", [
    ({"text_config": None, "num_hidden_layers": None}, "nested 'text_config'"),
    ({"text_config": {**TEXT_CONFIG, "kv_source_layer_ids": None}}, "kv_source_layer_ids"),
    ({"text_config": {**TEXT_CONFIG, "compress_ratios": [0, 2]}}, "at least num_hidden_layers"),
    ({"text_config": {**TEXT_CONFIG, "index_source_layer_ids": [8, 20]}}, "before the first KV or index source"),
    ({"text_config": {**TEXT_CONFIG, "kv_source_layer_ids": [0, 20]}}, "ratio > 0"),
    ({"text_config": {**TEXT_CONFIG, "engram_num_embeddings": [1]}}, "engram_num_embeddings"),
    ({"text_config": {**TEXT_CONFIG, "head_dim": 500}}, "multiples of 32"),
])
def test_bad_v41_configs_say_what_is_wrong(change, message):
    cfg = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        model_from_hf_config(cfg)


def test_ced_spec_errors():
    base = {k: getattr(V41, k) for k in V41.__dataclass_fields__ if k not in ("total_params", "activated_params")}
    with pytest.raises(ValueError, match="every KV source at or before layer 10"):
        ModelSpec(**{**base, "ced_encoder_layers": 10})
    with pytest.raises(ValueError, match="ced_replay_tokens > 0"):
        ModelSpec(**{**base, "ced_replay_tokens": 0})
    with pytest.raises(ValueError, match="one compress ratio per layer"):
        ModelSpec(**{**base, "compress_ratios": (0, 2)})


def _packed_step_by_hand_inputs():
    # DeepInfer's operating point of test_prefill_at_a_high_cache_hit_pays_window_rows_not_just_new_tokens:
    # 93 prompts of 4,383 tokens per rank, 4,208 cached, 175 new each, all in one 16,384-token step
    return 175, 4208, 93


def test_simulated_step_of_many_cached_prompts_pays_a_replay_window_each():
    # the simulator's step group once called the roofline without the cached prefix, which it
    # then recovered from the pairs as if the rank held one chunk: 93 prompts paid ~2 replay windows
    # instead of 93 (0.170 s instead of 0.420 s on this engine). Expected: the roofline given the prefix
    # explicitly, whose terms test_prefill_at_a_high_cache_hit_... checks by hand.
    import simpy

    from balancer.types import ReplicaId, Role
    from sim.run.engine.rank import PrefillJob, Rank
    from sim.run.engine.step_group import StepGroup

    c, p, n = _packed_step_by_hand_inputs()
    e = _engine()
    env = simpy.Environment()
    ranks = [Rank(ReplicaId("p", i), i, Role.PREFILL, kv_capacity_blocks=10**6, block_size=64,
                  max_prefill_tokens=16384, max_decode_batch=1) for i in range(4)]
    for rank in ranks:
        for j in range(n):
            job = PrefillJob(j, c + p, 10, ())
            job.cached_tokens = job.done_tokens = p  # the prefix hit, as Rank.plan sets it
            rank.enqueue_prefill(job)
    done = []
    group = StepGroup(env, ranks, e, on_prefill_done=lambda r, j, t: done.append(t),
                      on_decode_admitted=lambda *a: None, on_decode_finished=lambda *a: None)
    group.notify()
    env.run(until=10.0)
    z = np.zeros(4)
    expected = float(e.step_time_s(np.full(4, n * c), np.full(4, n * (c * p + c * (c + 1) / 2)), z, z,
                                   prefill_cached_tokens=np.full(4, n * p)))
    assert len(done) == 4 * n and done == pytest.approx([expected] * (4 * n), rel=1e-9)
    assert 0.41 < expected < 0.43  # 93 windows (the pairs-only reading gives 0.170 s)


def test_pricing_prefill_capacity_pays_a_replay_window_per_prompt():
    # sim.pricing's prefill capacity of V4.1 at 96% hits packs n prompts in a step; it once
    # lost all but ~2 of their replay windows (1.86M input tok/s per GPU at 1k-token prompts; 258k
    # with one per prompt). Expected: the function's docstring formula, n * L / step, with the step
    # of the roofline given the prefix (hand-checked above).
    from sim.pricing.throughput import prefill_input_tokens_per_s_per_rank
    from sim.scenario import PoolConfig

    c, p, n = _packed_step_by_hand_inputs()
    e = _engine()
    pool = PoolConfig(num_engines=1, dp_ranks=4, max_prefill_tokens=16384)
    z = np.zeros(4)
    step = float(e.step_time_s(np.full(4, n * c), np.full(4, n * (c * p + c * (c + 1) / 2)), z, z,
                               prefill_cached_tokens=np.full(4, n * p)))
    hit = p / (c + p) + 1e-12  # floor(h * L) = 4,208
    assert prefill_input_tokens_per_s_per_rank(e, pool, c + p, hit) == pytest.approx(n * (c + p) / step, rel=1e-12)
