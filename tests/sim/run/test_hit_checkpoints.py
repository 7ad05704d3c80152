"""Retained sliding-window checkpoints (sim/run/engine/hit_checkpoints.py): where a prefix hit may end
on a hybrid-KV model under vLLM 0.28's retention rules. Expected values are hand calculations from
the rules read in vLLM 0.28.0's SlidingWindowManager / HybridKVCacheCoordinator (the module
docstring): 256-token blocks, a 64-token window block past the boundary under EAGLE/MTP."""

from __future__ import annotations

import pytest

from balancer.types import ReplicaId, Role
from sim.run.engine.hit_checkpoints import HitCheckpoints
from sim.run.engine.rank import PrefillJob, Rank

BS = 256


def hashes(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_replay_boundary_is_a_checkpoint_when_64_prompt_tokens_follow_it() -> None:
    cp = HitCheckpoints(BS, 0, 64)
    # turn 1: 1,000 tokens -> replay boundary floor(999 / 256) = 3 blocks; 1000 - 768 = 232 >= 64
    cp.record(hashes(4), 1000, hit_blocks=0, match_blocks=0)
    # turn 2 shares turn 1's prompt: blocks 0-2 match (block 3 holds turn 1's reply in turn 2)
    assert cp.usable_hit_blocks(hashes(3) + (99, 100, 101, 102, 103), 3, 2000) == 3


def test_a_prompt_ending_1_to_63_tokens_past_a_block_leaves_no_checkpoint_there() -> None:
    cp = HitCheckpoints(BS, 0, 64)
    # turn 0: 600 tokens -> boundary 599 // 256 = 2, 600 - 512 = 88 >= 64: retained (hash of block 1 = 2)
    cp.record(hashes(3), 600, 0, 0)
    # turn 1: 800 tokens extends it -> boundary 3, 800 - 768 = 32 < 64: its window block past 768
    # holds generated tokens, not retained
    cp.record(hashes(4), 800, hit_blocks=2, match_blocks=2)
    # turn 2 matches 3 blocks; 3 is no checkpoint, 2 is: the hit falls back to turn 0's boundary
    assert cp.usable_hit_blocks(hashes(3) + (50, 51, 52, 53), 3, 1800) == 2
    # without MTP (no peek) the same boundary is retained: the hit is the whole match
    cp0 = HitCheckpoints(BS, 0, 0)
    cp0.record(hashes(3), 600, 0, 0)
    cp0.record(hashes(4), 800, 2, 2)
    assert cp0.usable_hit_blocks(hashes(3) + (50, 51, 52, 53), 3, 1800) == 3


def test_dense_retention_falls_back_one_block_without_a_vouched_peek() -> None:
    cp = HitCheckpoints(BS, None, 64)
    cp.record(hashes(4), 800, 0, 0)  # boundary 3 not vouched (32 < 64)
    # the match ends at 3 blocks: block 2's window is retained (dense) and block 2 is shared: 2
    assert cp.usable_hit_blocks(hashes(3) + (60, 61, 62), 3, 1500) == 2
    cp.record(hashes(4, start=10), 1000, 0, 0)  # boundary 3 vouched (232 >= 64): hash 12
    assert cp.usable_hit_blocks(hashes(3, start=10) + (70, 71), 3, 1500) == 3
    # dense, no peek: the whole match; capped at P - 1 tokens (a 1,024-token prompt: 3 blocks)
    assert HitCheckpoints(BS, None, 0).usable_hit_blocks(hashes(4), 4, 1024) == 3


def test_interval_checkpoints_junctions_and_eviction() -> None:
    cp = HitCheckpoints(BS, 512, 64)  # every 2 blocks
    # 2,000 tokens from scratch: replay 1999 // 256 = 7 (2000 - 1792 = 208 >= 64): hash 7;
    # multiples 2, 4, 6 (up to (2000 - 64) // 256 = 7): hashes 2, 4, 6
    cp.record(hashes(8), 2000, 0, 0)
    assert len(cp) == 4
    q = hashes(5) + (90, 91, 92, 93)
    assert cp.usable_hit_blocks(q, 5, 2300) == 4  # 5 is no checkpoint, 4 is
    # the junction: q's hit (4) stopped short of its full-attention match (5): retained at 5
    cp.record(q, 2300, hit_blocks=4, match_blocks=5)
    assert cp.usable_hit_blocks(q, 5, 2300) == 5
    cp.forget([5, 4])  # those blocks left the rank's cache
    assert cp.usable_hit_blocks(q, 5, 2300) == 2


@pytest.mark.parametrize("args", [(0, 0, 0), (BS, -256, 64), (BS, 300, 64), (BS, 0, 257), (BS, 0, -1)])
def test_bad_settings_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        HitCheckpoints(*args)


def test_a_rank_takes_the_checkpointed_hit_and_pins_only_it() -> None:
    rank = Rank(ReplicaId("e", 0), 0, Role.MIXED, 100, BS, 8192, 16, share_prompt_blocks=True)
    rank.hit_checkpoints = HitCheckpoints(BS, 0, 64)
    first = PrefillJob(0, 800, 10, hashes(4))  # boundary 3 not retained (32 < 64)
    rank.enqueue_prefill(first)
    rank.plan()
    assert first.cached_tokens == 0
    rank.cache_insert(hashes(4))
    second = PrefillJob(1, 1500, 10, hashes(3) + (40, 41, 42))
    rank.enqueue_prefill(second)
    rank.prefill_queue.popleft()  # only the second is looked up
    rank.plan()
    # the full-attention match is 3 blocks, but no checkpoint retained: a miss
    assert second.cached_tokens == 0 and second.pinned_blocks == 0
    # without checkpoints the same lookup is the whole match
    plain = Rank(ReplicaId("e", 1), 1, Role.MIXED, 100, BS, 8192, 16, share_prompt_blocks=True)
    plain.cache_insert(hashes(4))
    third = PrefillJob(2, 1500, 10, hashes(3) + (40, 41, 42))
    plain.enqueue_prefill(third)
    plain.plan()
    assert third.cached_tokens == 3 * BS
