"""DeepSeek-V4-Flash architecture (compressed attention, FP4 experts) and speculative decoding."""

from __future__ import annotations

import numpy as np
import pytest

from balancer.types import Request
from sim.run.cluster import simulate
from sim.run.metrics import per_request
from sim.models.presets import ModelSpec, get_model
from sim.perf.base import causal_attn_pairs
from sim.run.pool_perf import roofline_for_pool
from sim.perf.config import PerfConfig
from sim.perf.roofline import RooflinePerf
from sim.perf.spec import SpecDecodeConfig, SpecDecodePerf, accepted_tokens_per_step
from sim.scenario import PoolConfig, Scenario, load_scenario

V4 = get_model("deepseek-v4-flash")


def test_v4_flash_counts_match_the_model_card():
    # model card: 284B total, 13B activated; routed experts 43 layers x 256 x 3 x 4096 x 2048
    assert V4.routed_expert_params == 43 * 256 * 3 * 4096 * 2048
    assert abs(V4.total_params / 284e9 - 1) < 0.005
    assert 13e9 <= V4.activated_params < 14e9
    assert (V4.num_csa_layers, V4.num_hca_layers, V4.compress_ratios.count(0)) == (21, 20, 2)
    # FP4 experts: 0.5 B + one E8M0 scale per 32 weights
    assert V4.expert_weight_bytes == pytest.approx(V4.routed_expert_params * (0.5 + 1 / 32))
    # checkpoint: 159.6 GB incl. the 6.6B MTP block and BF16 embedding/head; without them the
    # model is 147.2 GB of experts + 7.3 GB of FP8 dense weights
    assert 150e9 < V4.expert_weight_bytes + V4.dense_weight_bytes < 159.6e9


def test_v4_kv_bytes_hand_checked():
    # 21 CSA layers: (584 B row + 132 B indexer key) / 4; 20 HCA layers: 584 / 128 -> 3,850.25
    assert V4.kv_bytes_per_token == 3851
    assert V4.kv_bytes_per_seq_fixed == 43 * 128 * 584
    v3 = get_model("deepseek-v3")
    assert v3.kv_bytes_per_token / V4.kv_bytes_per_token > 18  # 70,272 / 3,851


def test_attention_cost_grows_with_top_k_not_context():
    # L = 1,000: 43 * 128 window + 21 * 250 CSA rows + 20 * 1000/128 HCA rows
    assert V4.decode_attended_keys(1000) == pytest.approx(5504 + 5250 + 156.25)
    assert V4.decode_attended_keys(5000) == pytest.approx(17037.25)
    # past 4 * top-k only the 1/128 HCA rows grow: 10k -> 100k adds 20 * 90,000 / 128 keys
    assert V4.decode_attended_keys(100_000) - V4.decode_attended_keys(10_000) == pytest.approx(14_062.5)
    assert V4.indexer_keys(8000) == pytest.approx(21 * 2000)
    assert V4.decode_kv_read_bytes(5000) == pytest.approx(17037.25 * 584 + 21 * 1250 * 132)


@pytest.mark.parametrize("c,p", [(1, 0), (100, 0), (4096, 0), (512, 3000), (3000, 100), (20_000, 50_000)])
def test_prefill_attended_keys_against_a_sum_over_positions(c, p):
    # independent implementation: the per-position sum of decode_attended_keys(j), j = p+1 .. p+c
    j = np.arange(p + 1, p + c + 1, dtype=np.float64)
    brute = float(np.sum(V4.decode_attended_keys(j)))
    assert V4.prefill_attended_keys(c, p) == pytest.approx(brute, rel=2e-3)
    assert V4.prefill_indexer_keys(c, p) == pytest.approx(21 / 4 * causal_attn_pairs(c, p))


def test_compressed_config_errors():
    with pytest.raises(ValueError, match="one compress ratio per layer"):
        ModelSpec(name="x", num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=10, intermediate_size=0,
                  attention="compressed", num_kv_heads=1, head_dim=16, qk_rope_head_dim=4, sliding_window=8,
                  kv_row_bytes=20, compress_ratios=(0, 4))
    with pytest.raises(ValueError, match="0, 4 or 128"):
        ModelSpec(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=10, intermediate_size=0,
                  attention="compressed", num_kv_heads=1, head_dim=16, qk_rope_head_dim=4, sliding_window=8,
                  kv_row_bytes=20, compress_ratios=(0, 8))


def _plain_v4_engine(dp: int = 8) -> RooflinePerf:
    return RooflinePerf.for_engine("deepseek-v4-flash", "B200", num_dp_ranks=dp, mfu=0.5, mbu=0.7,
                                   step_overhead_s=0.0)


def test_v4_decode_rank_time_by_hand():
    # one rank's roofline: compute = dense linear (FP8) + attention pairs (BF16) + indexer (FP8);
    # memory = dense weights + KV read (attended rows + indexer keys per sequence) + KV written
    e = _plain_v4_engine()
    R = 8
    ds, L = 60.0, 5000.0
    b = e.step_time_breakdown(np.zeros(R), np.zeros(R), np.full(R, ds), np.full(R, ds * L))
    fp8, bf16, bw = 4.5e15 * 0.5, 2.25e15 * 0.5, 8e12 * 0.7
    compute = (ds * V4.dense_flops_per_token / fp8 + ds * 17037.25 * 64 * 2 * 1024 / bf16
               + ds * 26250 * 2 * 64 * 128 / fp8)
    memory = ((V4.dense_params - V4.embedding_params) * 1 + ds * V4.decode_kv_read_bytes(L)
              + ds * 3851) / bw
    assert float(b["rank"]) == pytest.approx(max(compute, memory), rel=1e-9)
    # KV per step hardly grows with context: 100k-token contexts cost far less than 20x 5k ones
    b100 = e.step_time_breakdown(np.zeros(R), np.zeros(R), np.full(R, ds), np.full(R, ds * 100_000))
    assert float(b100["rank"]) < 2.0 * float(b["rank"])


def test_verification_tokens_scale_work_but_read_kv_once():
    e = _plain_v4_engine()
    R, z, ds = 8, np.zeros(8), np.full(8, 60.0)
    one = e.step_time_breakdown(z, z, ds, ds * 5000)
    six = e.step_time_breakdown(z, z, ds, ds * 5000, decode_tokens_per_seq=6)
    # EP dispatch/combine scales with tokens; MoE compute too
    assert float(six["comm"]) == pytest.approx(6 * float(one["comm"]))
    d3 = RooflinePerf.for_engine("deepseek-v3", "H800", num_dp_ranks=32, mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    v3 = get_model("deepseek-v3")
    z, s = np.zeros(32), np.full(32, 50.0)
    # by hand: 2 tokens per sequence double the linear and attention FLOPs, the KV (50 x 4,000
    # tokens) is read once and 2 x 50 tokens are written
    two = float(d3.step_time_breakdown(z, z, s, s * 4000, decode_tokens_per_seq=2)["rank"])
    compute = 100 * v3.dense_flops_per_token / (1979e12 * 0.5) + 2 * 200_000 * v3.attn_flops_per_pair / (989e12 * 0.5)
    memory = ((v3.dense_params - v3.embedding_params) + (200_000 + 100) * 70_272) / (3.35e12 * 0.7)
    assert two == pytest.approx(max(compute, memory), rel=1e-9)
    with pytest.raises(ValueError, match="decode_tokens_per_seq"):
        d3.step_time_s(z, z, s, s, decode_tokens_per_seq=0.5)


def test_accepted_tokens_hand_check():
    assert accepted_tokens_per_step([0.8, 0.5], 2) == pytest.approx(2.2)
    assert accepted_tokens_per_step([0.8, 0.5], 0) == 1.0
    with pytest.raises(ValueError):
        accepted_tokens_per_step([0.8], 2)
    with pytest.raises(ValueError, match="one per draft position"):
        SpecDecodeConfig(draft_tokens=3, acceptance=[0.9, 0.8])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SpecDecodeConfig(draft_tokens=1, acceptance=[1.2])


def test_spec_perf_fixed_and_dynamic_formulas():
    e = _plain_v4_engine()
    acc = [0.9, 0.8, 0.7, 0.6]
    R = 8
    ds, dc = np.full((1, R), 40.0), np.full((1, R), 40.0 * 3000)
    z = np.zeros((1, R))
    t1 = float(e.step_time_s(z, z, ds, dc)[0])
    tau3 = 1 + 0.9 + 0.72 + 0.504
    fixed = SpecDecodePerf(e, SpecDecodeConfig(draft_tokens=3, acceptance=acc, drafter="sequential",
                                               draft_cost_fraction=0.1))
    t4 = float(e.step_time_s(z, z, ds, dc, decode_tokens_per_seq=4)[0])
    assert float(fixed.step_time_s(z, z, ds, dc)[0]) == pytest.approx((t4 + 3 * 0.1 * t1) / tau3)
    dyn = SpecDecodePerf(e, SpecDecodeConfig(draft_tokens=3, acceptance=acc, drafter="parallel",
                                             draft_cost_fraction=0.1, dynamic=True, max_draft_tokens=4,
                                             dynamic_overhead_s=1e-4))
    # the parallel drafter runs one forward over the 4-token block + anchor (5 positions) every
    # dynamic step, also when the scheduler verifies none of it
    block = 0.1 * float(e.step_time_s(z, z, ds, dc, decode_tokens_per_seq=5)[0])
    per = [t1 + block] + [(float(e.step_time_s(z, z, ds, dc, decode_tokens_per_seq=1 + d)[0]) + block)
                          / accepted_tokens_per_step(acc, d) for d in range(1, 5)]
    got = float(dyn.step_time_s(z, z, ds, dc)[0])
    assert got == pytest.approx(min(per) + 1e-4)
    assert int(dyn.last_draft_tokens[0]) == int(np.argmin(per))
    # a step with prefill on any rank does not speculate
    pt = z.copy()
    pt[0, 0] = 1000.0
    pp = causal_attn_pairs(pt, 0)
    assert float(dyn.step_time_s(pt, pp, ds, dc)[0]) == pytest.approx(float(e.step_time_s(pt, pp, ds, dc)[0]))


def test_dynamic_drafts_shorten_under_load():
    sc = load_scenario("deepinfer-sm100")
    e = roofline_for_pool(sc, sc.decode)
    spec = SpecDecodePerf(e, sc.speculative)
    R = sc.decode.dp_ranks
    picks = []
    for b in (8, 64, 512):
        o = np.ones((1, R))
        spec.step_time_s(0 * o, 0 * o, b * o, b * 5000 * o)
        picks.append(int(spec.last_draft_tokens[0]))
    assert picks[0] >= picks[1] >= picks[2] and picks[0] > picks[2]


def test_simulated_tpot_comes_from_accepted_tokens():
    # one decode-only sequence at a time: TPOT = time per accepted token of the spec model
    base = Scenario(model="deepseek-v4-flash", hardware="B200",
                    prefill=PoolConfig(num_engines=1, dp_ranks=2, max_decode_batch=1),
                    decode=PoolConfig(num_engines=1, dp_ranks=2),
                    perf=PerfConfig(step_overhead_s=0.0))
    spec = base.model_copy(update={"speculative": SpecDecodeConfig(draft_tokens=2, acceptance=[0.8, 0.5],
                                                                    draft_cost_fraction=0.0)})
    reqs = [Request("a", 0.0, 600, (), 201, 201)]
    t_plain = float(per_request(simulate(base, reqs))["tpot_s"][0])
    t_spec = float(per_request(simulate(spec, reqs))["tpot_s"][0])
    e = roofline_for_pool(base, base.decode)
    # decode rank 0 holds the sequence, rank 1 is idle; contexts 601..801, mean-field per token
    z, r = np.zeros(2), np.array([1.0, 0.0])
    ctx = np.arange(601, 801, dtype=np.float64)
    plain = np.mean([float(e.step_time_s(z, z, r, r * c)) for c in ctx])
    three = np.mean([float(e.step_time_s(z, z, r, r * c, decode_tokens_per_seq=3)) for c in ctx])
    assert t_plain == pytest.approx(plain, rel=1e-3)
    assert t_spec == pytest.approx(three / 2.2, rel=1e-3)
    assert t_spec < t_plain


def test_cumulative_acceptance_and_a_separate_draft_model():
    # measured rates 0.8, 0.4 of positions 1, 2 -> conditional 0.8, 0.5 -> tau(2) = 2.2 (hand check above)
    cfg = SpecDecodeConfig(draft_tokens=2, acceptance=[0.8, 0.4], acceptance_kind="cumulative")
    assert cfg.conditional_acceptance == pytest.approx([0.8, 0.5]) and cfg.tau(2) == pytest.approx(2.2)
    with pytest.raises(ValueError, match="must not increase"):
        SpecDecodeConfig(draft_tokens=2, acceptance=[0.4, 0.8], acceptance_kind="cumulative")
    # Llama-3.1-70B target with a Llama-3.1-8B draft on the same 4 x H200 TP rank
    sc = Scenario(model="llama-3.1-70b", hardware="H200", mixed=PoolConfig(dp_ranks=1, gpus_per_rank=4),
                  speculative=SpecDecodeConfig(draft_tokens=3, acceptance=[0.8, 0.7, 0.6], draft_model="llama-3.1-8b"))
    from sim.run.pool_perf import build_perf
    spec = build_perf(sc, sc.mixed)
    target = roofline_for_pool(sc, sc.mixed)
    draft = RooflinePerf.for_engine("llama-3.1-8b", "H200", num_dp_ranks=1, gpus_per_rank=4, ep_synchronous=False)
    z, ds, dc = np.zeros((1, 1)), np.full((1, 1), 32.0), np.full((1, 1), 32.0 * 2000)
    t4 = float(target.step_time_s(z, z, ds, dc, decode_tokens_per_seq=4)[0])
    td = float(draft.step_time_s(z, z, ds, dc)[0])
    assert float(spec.step_time_s(z, z, ds, dc)[0]) == pytest.approx((t4 + 3 * td) / (1 + 0.8 + 0.56 + 0.336))
    with pytest.raises(ValueError, match="draft perf model"):
        SpecDecodePerf(target, sc.speculative)


def test_speculative_fast_forward_equals_exact_step_by_step():
    sc = load_scenario("deepinfer-sm100")
    from sim.workload import poisson_workload
    reqs = poisson_workload(60, 20.0, prompt_tokens_mean=3000, output_tokens_mean=80, seed=3,
                            shared_prefix_tokens=2048, num_prefix_groups=4)
    ff = simulate(sc, reqs, "cache_aware").records
    ex = simulate(sc.model_copy(update={"fast_forward": False}), reqs, "cache_aware").records
    np.testing.assert_allclose(ff.finish_s, ex.finish_s, rtol=1e-9)
    np.testing.assert_allclose(ff.first_token_s, ex.first_token_s, rtol=1e-9)
