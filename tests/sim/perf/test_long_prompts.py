"""Long prompts: context-parallel prefill (roofline) and a separate long-prompt prefill pool."""

from __future__ import annotations

import numpy as np
import pytest

from balancer.policies import available_policies
from balancer.types import Request
from sim.run.cluster import simulate
from sim.run.metrics import per_request
from sim.models.presets import get_model
from sim.perf.base import causal_attn_pairs
from sim.perf.roofline import RooflinePerf
from sim.scenario import PoolConfig, Scenario


def test_cp_prefill_by_hand():
    # Llama-3.1-8B on 4 H100 as one context-parallel rank: compute / 4, every GPU streams all weights,
    # KV / 4, ring exchange of the other 3/4 of the chunk's KV hidden behind compute
    m = get_model("llama-3.1-8b")
    cp = RooflinePerf.for_engine(m, "H100", num_dp_ranks=1, gpus_per_rank=4, context_parallel=True,
                                 mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    c = 32768.0
    one = np.array([c]), np.array([causal_attn_pairs(c, 0)]), np.zeros(1), np.zeros(1)
    got = float(cp.step_time_breakdown(*one)["rank"])
    compute = (c * m.linear_flops_per_token + causal_attn_pairs(c, 0) * m.prefill_attn_flops_per_pair) / 4 / (989e12 * 0.5)
    ring = c * m.kv_bytes_per_token * 3 / 4 / (450e9 * 0.8)
    memory = ((m.dense_params - m.embedding_params) * 2 + c * m.kv_bytes_per_token / 4) / (3.35e12 * 0.7)
    assert got == pytest.approx(max(compute, ring, memory), rel=1e-9)
    assert ring < compute  # the exchange hides behind attention at this length
    single = RooflinePerf.for_engine(m, "H100", num_dp_ranks=1, mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    assert float(single.step_time_breakdown(*one)["rank"]) == pytest.approx(4 * compute, rel=1e-9)
    # weights are replicated: 16 GB on each GPU, not 4 GB
    assert cp.weight_bytes_per_gpu == pytest.approx(m.dense_weight_bytes)


def _scenario(long_pool: bool) -> Scenario:
    extra = dict(long_prefill=PoolConfig(num_engines=1, dp_ranks=1, gpus_per_rank=4, context_parallel=True,
                                         max_prefill_tokens=16384, max_decode_batch=1),
                 long_prompt_threshold_tokens=16384) if long_pool else {}
    return Scenario(model="llama-3.1-8b", hardware="H100", block_size=512,
                    prefill=PoolConfig(num_engines=2, max_prefill_tokens=8192, max_decode_batch=1),
                    decode=PoolConfig(num_engines=2, max_decode_batch=64), **extra)


def _workload() -> list[Request]:
    reqs, t = [], 0.0
    for i in range(40):
        t += 0.05
        long = i % 10 == 3
        n = 60_000 if long else 1000
        blocks = tuple(range(i * 1000, i * 1000 + -(-n // 512)))
        reqs.append(Request(f"{'L' if long else 's'}{i}", t, n, blocks, 16, 16))
    return reqs


@pytest.mark.parametrize("policy", available_policies())
def test_long_prompts_go_to_the_long_pool_under_every_policy(policy):
    sc = _scenario(True)
    reqs = _workload()
    res = simulate(sc, reqs, policy)
    # ranks: prefill 0-1, decode 2-3, long-prefill 4
    pr = res.records.prefill_rank
    for i, r in enumerate(reqs):
        assert (pr[i] == 4) == (r.prompt_tokens >= 16384), (r.request_id, pr[i])
    assert np.all(np.isfinite(res.records.finish_s))


def test_long_pool_keeps_short_prompts_fast():
    reqs = _workload()
    short = np.array([r.prompt_tokens < 16384 for r in reqs])
    ttft = {lp: per_request(simulate(_scenario(lp), reqs, "least_load"))["ttft_s"] for lp in (False, True)}
    # without the pool a 60k-token prompt occupies a prefill rank for seconds and the short prompts
    # queued behind it wait; with it they never share a rank with a long one
    assert np.mean(ttft[True][short]) < 0.5 * np.mean(ttft[False][short])
    # and the long prompts themselves get the 4-GPU CP rank: faster than one GPU
    assert np.mean(ttft[True][~short]) < np.mean(ttft[False][~short])


def test_long_pool_validation():
    with pytest.raises(ValueError, match="long_prefill needs a PD scenario"):
        Scenario(model="llama-3.1-8b", hardware="H100", mixed=PoolConfig(), long_prefill=PoolConfig())
    with pytest.raises(ValueError, match="context_parallel needs gpus_per_rank >= 2"):
        Scenario(model="llama-3.1-8b", hardware="H100", prefill=PoolConfig(), decode=PoolConfig(),
                 long_prefill=PoolConfig(context_parallel=True))
