"""The benchmark workload generators refuse sizes they could not build before allocating or hashing
anything (shared-prefix groups, load ramps); messages and the clipping probability by hand.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("kwargs, message", [
    # was: a 74.5 GiB numpy allocation and a traceback (1e10 requests), or minutes of hashing
    ({"num_groups": 100_000, "prompts_per_group": 100_000}, "10,000,000,000 requests, more than max_requests=10,000,000"),
    ({"system_prompt_tokens": 10 ** 11, "question_tokens": 0},
     "system_prompt_tokens + question_tokens must be <= 16,777,216 tokens (the longest a trace may give), "
     "got 100,000,000,000"),
    ({"output_tokens": 1 << 25},
     "output_tokens must be <= 16,777,216 tokens (the longest a trace may give), got 33,554,432"),
    # 10,000 x 1,000 prompts of ceil(10,128 / 512) = 20 blocks = 2e8 blocks
    ({"num_groups": 10_000, "prompts_per_group": 1_000, "system_prompt_tokens": 10_000},
     "200,000,000 prompt blocks in all, more than 50,000,000; fewer requests, shorter prompts or a larger block size"),
])
def test_shared_prefix_workload_is_bounded_before_it_allocates(kwargs, message) -> None:
    from sim.workload import shared_prefix_workload
    with pytest.raises(ValueError) as ei:
        shared_prefix_workload(**kwargs)
    assert str(ei.value) == message


def test_load_ramp_is_bounded_before_it_hashes() -> None:
    from sim.workload import load_ramp_workload
    with pytest.raises(ValueError) as ei:  # was: hung hashing 2e9 blocks per request
        load_ramp_workload([1.0], 10.0, prompt_tokens_mean=1e12)
    assert str(ei.value) == ("prompt_tokens_mean must be <= 16,777,216 tokens (the longest a trace may give), "
                             "got 1,000,000,000,000")
    # a wide lognormal is clipped at 2^24 tokens per prompt: mean 1e7, sigma 2 (the most allowed) puts
    # P(draw > 2^24) = P(Z > (ln 2^24 - ln 1e7 + 2) / 2) = P(Z > 1.26) ~ 10% of ~100 requests
    reqs = load_ramp_workload([10.0], 10.0, prompt_tokens_mean=1e7, prompt_tokens_sigma=2.0, seed=1)
    assert max(r.prompt_tokens for r in reqs) == 1 << 24
    assert all(len(r.block_hashes) == -(-r.prompt_tokens // 512) for r in reqs)
