"""Hybrid KV cache groups (full attention + sliding window / Mamba / chunked local, DeepSeek-V4's
compressed MLA and sliding-window MLA groups): what a prefix hit needs per group, per-group
removals, null blocks skipped (balancer/kv_translate.py, module docstring).

Expected values are hand-computed from vLLM 0.33's hit rule (``SlidingWindowManager.
find_longest_cache_hit``: a hit ending at L needs the ``ceil((window - 1) / block_size)`` blocks
before L; full attention every block of [0, L)); router hashes from ``hash_token_blocks``. The
last test feeds events made by vLLM's own ``BlockPool`` code (loaded from its wheel, slow)."""

from __future__ import annotations

import os
import time

import msgpack
import pytest

from balancer.hashing import hash_token_blocks
from balancer.kv_events import BlockRemoved, BlockStored
from balancer.kv_translate import KvEventTranslator
from balancer.kv_wire import (EngineBlockRemoved, EngineBlockStored, KvWireError, decode_batch, is_full_attention,
                              kv_group_class)
from balancer.prefix_index import PrefixIndex

B = 16
TOKENS = list(range(1000, 1000 + 8 * B))  # 8 blocks of 16 tokens
RH = hash_token_blocks(TOKENS, B)  # the router's hashes of its 8 blocks
EH = [101 + i for i in range(8)]  # engine hashes of the same 8 blocks (every group names a block alike)


def full(hashes, tokens, parent=None, group=0, kind="mla_attention", bs=B):  # noqa: ANN001, ANN201
    return EngineBlockStored(tuple(hashes), parent, tokens, bs, group_idx=group, kv_cache_spec_kind=kind)


def swa(hashes, tokens, window=33, group=1, kind="sliding_window_mla", parent=None, bs=B):  # noqa: ANN001, ANN201
    return EngineBlockStored(tuple(hashes), parent, tokens, bs, group_idx=group, kv_cache_spec_kind=kind,
                             kv_cache_spec_sliding_window=window)


def apply(index: PrefixIndex, events) -> None:  # noqa: ANN001
    for e in events:
        if isinstance(e, BlockStored):
            index.insert("r", e.block_hashes, parent_block_hash=e.parent_block_hash)
        elif isinstance(e, BlockRemoved):
            index.remove("r", e.block_hashes)


def run(tr: KvEventTranslator, index: PrefixIndex, *engine_events) -> list:  # noqa: ANN002
    out = []
    for ev in engine_events:
        got = tr.translate(ev)
        apply(index, got)
        out.extend(got)
    return out


@pytest.mark.parametrize("kind, cls", [
    (None, "full"), ("full_attention", "full"), ("mla_attention", "full"), ("sink_full_attention", "full"),
    ("sliding_window", "window"), ("sliding_window_mla", "window"), ("SLIDING_WINDOW_MLA", "window"),
    ("mamba", "last"), ("chunked_local_attention", "last"), ("cross_attention", "other"),
    ("encoder_only_attention", "other"), ("unknown", "other"), ("some_future_full_kind", "full"),
])
def test_group_kinds_are_classed_by_what_a_hit_needs(kind, cls):
    # the issue's bug: "mla" in kind took sliding_window_mla for full attention
    assert kv_group_class(kind) == cls and is_full_attention(kind) == (cls == "full")


def test_sliding_window_group_needs_only_its_last_window():
    # window 33, blocks of 16: a hit ending at L needs the ceil(32/16) = 2 blocks before L
    tr, index = KvEventTranslator(B), PrefixIndex()
    out = run(tr, index, full(EH, TOKENS))  # not hybrid yet: announced at once, as for any model
    assert out == [BlockStored(tuple(RH), None, None)]
    # the window group holds blocks 7 and 8 only (null blocks 1-6 skipped, token_ids spans all 8)
    out = run(tr, index, swa(EH[6:], TOKENS))
    # turning hybrid withdraws everything, then the one valid end (L = 128: blocks 7, 8 held)
    # announces blocks 1..8 again
    assert out == [BlockRemoved(tuple(RH), None), BlockStored(tuple(RH), None, None)]
    assert index.match_replica("r", RH) == 8
    assert tr.stats.valid_ends == 1 and tr.stats.group_blocks_stored == 2


def test_a_window_group_removal_never_drops_the_full_groups_blocks():
    tr, index = KvEventTranslator(B), PrefixIndex()
    # window group first this time (vLLM sends groups in any order): ends at 64 and 128 become valid
    run(tr, index, swa([EH[2], EH[3]], TOKENS[:4 * B]), swa([EH[6], EH[7]], TOKENS[4 * B:], parent=EH[3]))
    out = run(tr, index, full(EH, TOKENS))
    assert out == [BlockStored(tuple(RH), None, None)]  # ends 64 and 128, one announcement
    assert index.match_replica("r", RH) == 8
    # the window group evicts block 8 (same engine hash as the full group's block 8, other group):
    # the end at 128 is invalid, the end at 64 still is: router blocks 5..8 go, 1..4 stay
    out = run(tr, index, EngineBlockRemoved((EH[7],), "GPU", 1))
    assert out == [BlockRemoved(tuple(reversed(RH[4:])), "GPU")]
    assert index.match_replica("r", RH) == 4
    assert tr.num_blocks() == 8  # the full group still holds all 8, as the engine does
    assert tr.stats.invalidated_ends == 1 and tr.stats.group_blocks_removed == 1
    # the window group caches block 8 again (its previous block is known from the first event)
    out = run(tr, index, swa([EH[7]], TOKENS[7 * B:], parent=EH[6]))
    assert out == [BlockStored(tuple(RH[4:]), None, RH[3])] and index.match_replica("r", RH) == 8


def test_evicting_a_window_in_the_middle_keeps_deeper_hits():
    # a long conversation's early window ages out while its tail stays: the hit at 128 is intact
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS), swa([EH[2], EH[3]], TOKENS[:4 * B]),
        swa([EH[6], EH[7]], TOKENS[4 * B:], parent=EH[3]))
    assert index.match_replica("r", RH) == 8
    assert run(tr, index, EngineBlockRemoved((EH[2],), "GPU", 1)) == []  # end 64 gone, end 128 still valid
    assert index.match_replica("r", RH) == 8
    out = run(tr, index, EngineBlockRemoved((EH[6],), "GPU", 1))  # now no valid end is left
    assert out == [BlockRemoved(tuple(reversed(RH)), "GPU")] and index.match_replica("r", RH) == 0


def test_a_missing_block_inside_the_window_makes_the_end_invalid():
    # window 49: 3 blocks before L; the group holds blocks 6 and 8 of one chain (7 evicted)
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS))
    out = run(tr, index, swa(EH[5:], TOKENS[5 * B:], window=49, parent=EH[4]),
              EngineBlockRemoved((EH[6],), "GPU", 1))
    assert out[0] == BlockRemoved(tuple(RH), None)  # turned hybrid
    assert out[1] == BlockStored(tuple(RH), None, None)  # end 128: blocks 6, 7, 8 held
    assert out[2] == BlockRemoved(tuple(reversed(RH)), "GPU")  # block 7 gone: no valid end
    # a short prompt: L = 32 < 3 blocks, so the window clips at 0 (vLLM: a run from block 0 is a hit)
    run(tr, index, swa([EH[0], EH[1]], TOKENS[:2 * B], window=49))
    assert index.match_replica("r", RH) == 2


def test_mamba_and_coarser_groups_need_the_block_ending_the_hit():
    # a Mamba group of 32-token blocks: a hit ends at a multiple of 32 where its state block is held
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS, kind="full_attention"))
    # vLLM names a 32-token block by the hash of its last 16-token piece (BlockHashListWithBlockSize)
    out = run(tr, index, EngineBlockStored((EH[5],), None, TOKENS[:6 * B], 2 * B, group_idx=1,
                                           kv_cache_spec_kind="mamba"))
    assert out[-1] == BlockStored(tuple(RH[:6]), None, None) and index.match_replica("r", RH) == 6
    # a held state block at 16-token offset 5*16 = 80 is no end (80 is not a multiple of 32)
    out = run(tr, index, EngineBlockStored((EH[4],), None, TOKENS[:5 * B], B, group_idx=2,
                                           kv_cache_spec_kind="mamba"))
    assert out == []


def test_a_second_full_attention_group_counts_like_its_last_block():
    # DeepSeek-V4: several full-attention MLA groups (compressed KV, other state sizes)
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS, group=0))
    out = run(tr, index, full(EH[:4], TOKENS[:4 * B], group=3))
    assert out == [BlockRemoved(tuple(RH), None), BlockStored(tuple(RH[:4]), None, None)]
    out = run(tr, index, EngineBlockRemoved((EH[3],), "GPU", 3))  # that group evicts block 4
    # ends at 16, 32, 48 are valid too (the group holds blocks 1-3): only block 4 goes
    assert out == [BlockRemoved((RH[3],), "GPU")] and index.match_replica("r", RH) == 3


def test_the_issues_v4_batch_decodes_and_keeps_its_full_attention_event():
    # the issue: a sliding_window_mla event with 8 hashes for 256 tokens failed the length check
    # and dropped the whole batch, the full-attention group's BlockStored with it
    toks = list(range(256))
    ev_full = {"type": "BlockStored", "block_hashes": list(range(1, 17)), "parent_block_hash": None,
               "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
               "group_idx": 0, "kv_cache_spec_kind": "mla_attention"}
    ev_swa = ev_full | {"block_hashes": list(range(9, 17)), "group_idx": 1, "kv_cache_spec_kind": "sliding_window_mla",
                        "kv_cache_spec_sliding_window": 128}
    batch = decode_batch(msgpack.packb([time.time(), [ev_full, ev_swa], 0]))
    tr, index = KvEventTranslator(64), PrefixIndex()
    for ev in batch.events:
        apply(index, tr.translate(ev))
    # window 128 of 16-token blocks: 8 blocks before L = 256, all held: the whole prompt hits
    assert index.match_replica("r", hash_token_blocks(toks, 64)) == 4
    # a window group's event with fewer tokens than its hashes, or a partial block, stays malformed
    with pytest.raises(KvWireError, match="or whole blocks more for a sliding_window_mla group"):
        decode_batch(msgpack.packb([0.0, [ev_swa | {"token_ids": toks[:120]}]]))
    with pytest.raises(KvWireError, match="expected 128, or whole blocks more"):
        KvEventTranslator(16).translate(EngineBlockStored(tuple(range(8)), None, toks[:100], 16, group_idx=1,
                                                          kv_cache_spec_kind="sliding_window"))


def test_removals_of_an_unseen_group_and_non_prefix_groups_are_counted_not_applied():
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS))
    assert run(tr, index, EngineBlockRemoved((EH[7],), "GPU", 5)) == []  # group 5 never stored anything
    assert tr.stats.unknown_removed_blocks == 1 and index.match_replica("r", RH) == 8
    assert run(tr, index, swa(EH, TOKENS, kind="cross_attention")) == []
    assert tr.stats.skipped_group_events == 1 and not tr.hybrid


def test_clear_and_reset_forget_groups():
    tr, index = KvEventTranslator(B), PrefixIndex()
    run(tr, index, full(EH, TOKENS), swa(EH[6:], TOKENS))
    tr.reset()
    assert not tr.hybrid and tr.num_blocks() == 0
    assert run(tr, index, full(EH, TOKENS)) == [BlockStored(tuple(RH), None, None)]  # one group again


# ---------------------------------------------------------------------- vLLM's own code
@pytest.mark.slow
def test_events_made_by_vllms_own_block_pool_for_a_hybrid_model():
    """vLLM 0.33's ``BlockPool`` (from its wheel) caches a request in a full-attention group and a
    sliding-window group (window 33 tokens, 16-token blocks; the window group's blocks outside the
    window are null, as ``SlidingWindowManager.remove_skipped_blocks`` leaves them); its events
    are annotated with each group's kind as ``KVCacheManager.take_events`` does, encoded with its
    msgspec structs and decoded by pdlb. vLLM's modules and block hasher come from
    tests/engine_publishers.py. Takes ~5 s (plus a one-time 340 MB wheel download)."""
    msgspec = pytest.importorskip("msgspec")
    from tests.engine_publishers import _VllmRequest, load_vllm
    v = load_vllm()
    hash_fn = v.hashing.sha256_cbor  # vLLM's default prefix-caching hash
    v.kv_cache_utils.init_none_hash(hash_fn)
    hasher = v.kv_cache_utils.get_request_block_hasher(B, hash_fn)

    def FakeRequest(v, tokens, bs):  # noqa: ANN001, ANN202, N802 - vLLM's Request fields, hashed by vLLM
        req = _VllmRequest(tokens)
        req.block_hashes = hasher(req)
        return req

    kinds = [("full_attention", None), ("sliding_window", 33)]  # KVCacheManager.kv_cache_event_metadata

    def take(bp):  # noqa: ANN001, ANN202
        events = bp.take_events()
        for e in events:  # vLLM's KVCacheManager.take_events annotation
            if isinstance(e, v.kv_events.BlockStored) and e.group_idx is not None:
                e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window = kinds[e.group_idx]
        payload = msgspec.msgpack.encode(v.kv_events.KVEventBatch(ts=time.time(), events=events))
        return decode_batch(payload).events

    bp = v.block_pool.BlockPool(40, True, B, enable_kv_cache_events=True)
    tr, index = KvEventTranslator(B), PrefixIndex()
    req = FakeRequest(v, TOKENS, B)
    g0 = bp.get_new_blocks(8)
    g1 = [bp.null_block] * 6 + bp.get_new_blocks(2)
    bp.cache_full_blocks(req, g0, 0, 8, B, 0)
    bp.cache_full_blocks(req, g1, 0, 8, B, 1)
    evs = take(bp)
    assert [len(e.block_hashes) for e in evs] == [8, 2] and len(evs[1].token_ids) == 8 * B  # nulls skipped
    for e in evs:
        apply(index, tr.translate(e))
    assert index.match_replica("r", RH) == 8  # the end at 128 is valid: blocks 7, 8 held in the window group
    # a second prompt sharing 4 blocks, cached by both groups in full (no block skipped)
    other = TOKENS[:4 * B] + list(range(5000, 5000 + 2 * B))
    req2 = FakeRequest(v, other, B)
    bp.cache_full_blocks(req2, g0[:4] + bp.get_new_blocks(2), 4, 6, B, 0)
    bp.cache_full_blocks(req2, [bp.null_block] * 4 + bp.get_new_blocks(2), 4, 6, B, 1)
    for e in take(bp):
        apply(index, tr.translate(e))
    rh2 = hash_token_blocks(other, B)
    assert index.match_replica("r", rh2) == 6 and index.match_replica("r", RH) == 8
    # request 1 ends; vLLM frees its window blocks, then a burst of new blocks evicts them
    # (BlockRemoved with group_idx 1, the same engine hashes as the full group's blocks 7, 8)
    bp.free_blocks(reversed(g1[6:]))
    free_now = bp.get_num_free_blocks()
    bp.get_new_blocks(free_now)
    evs = take(bp)
    assert {(e.group_idx, len(e.block_hashes)) for e in evs} == {(1, 1)} and len(evs) == 2
    for e in evs:
        apply(index, tr.translate(e))
    # the full group still holds request 1's prefix, but no window is left for a hit at 128, so
    # router blocks 5-8 are gone. Blocks 1-4 stay: they lead to request 2's valid end at 96. By
    # vLLM's rule prompt 1 now hits 0 (the window group never cached blocks 3, 4, so 64 is no end):
    # the router's 4 is the documented overestimate for a prompt that leaves a chain between ends
    assert index.match_replica("r", RH) == 4 and index.match_replica("r", rh2) == 6
    assert tr.num_blocks() == 10  # the full group's 8 + 2 blocks, untouched by the window group's removals


# ---------------------------------------------------------------------- the simulator's V4 models
def test_a_v4_ranks_prefix_hit_is_a_multiple_of_256_tokens():
    # hand: 7 cached blocks of 64 tokens = 448 tokens; DeepSeek-V4's MLA groups keep 256-token
    # blocks (vLLM 0.33), so the hit every group can serve is 256; a dense model's is 448
    from balancer.types import ReplicaId, Role
    from sim.run.engine.rank import PrefillJob, Rank
    from sim.models.presets import get_model
    hashes = tuple(range(1, 9))
    got = {}
    for model in ("deepseek-v4-flash", "deepseek-v3"):
        rank = Rank(ReplicaId("p", 0), 0, Role.PREFILL, kv_capacity_blocks=100, block_size=64,
                    max_prefill_tokens=4096, max_decode_batch=1)
        rank.hit_multiple_tokens = get_model(model).prefix_hit_multiple_tokens
        rank.cache.insert(hashes[:7])
        job = PrefillJob(0, 512, 1, hashes)
        rank.enqueue_prefill(job)
        rank.plan()
        got[model] = job.cached_tokens
    assert got == {"deepseek-v4-flash": 256, "deepseek-v3": 448}
    assert get_model("deepseek-v4.1-flash").prefix_hit_multiple_tokens == 256


def test_simulated_v4_hits_change_only_below_256_token_blocks():
    # the same shared-prefix workload on V4-Flash: with 512-token blocks (the default) every hit is
    # already a multiple of 256 and nothing changes; with 64-token blocks each hit is rounded down
    from sim.run.cluster import simulate
    from sim.models.presets import get_model
    from sim.scenario import PoolConfig, Scenario
    from sim.workload import poisson_workload
    assert get_model("deepseek-v4-flash").prefix_hit_multiple_tokens == 256
    for bs in (64, 512):
        sc = Scenario(model="deepseek-v4-flash", hardware="H200", block_size=bs,
                      mixed=PoolConfig(dp_ranks=1, gpus_per_rank=8))
        reqs = poisson_workload(30, 5.0, prompt_tokens_mean=1500, output_tokens_mean=4, seed=1,
                                shared_prefix_tokens=1344, num_prefix_groups=1, block_size=bs)
        hits = simulate(sc, reqs, "round_robin").records.hbm_hit_tokens
        assert (hits % 256 == 0).all() and hits.max() > 0
        if bs == 64:  # the 1344-token shared prefix (21 blocks of 64) hits 1280 = 5 * 256, not 1344
            assert hits.max() == 1280


def test_hybrid_state_is_bounded_by_the_translator_capacity():
    # 200 distinct 2-block prompts through a translator that remembers 8 engine blocks per tier:
    # its ends, support counts and group records stay within that bound, whatever the traffic
    tr = KvEventTranslator(B, capacity_blocks=8)
    for p in range(200):
        toks = [p * 100 + t for t in range(2 * B)]
        hs = [10_000 + 2 * p, 10_001 + 2 * p]
        tr.translate(full(hs, toks))
        tr.translate(swa(hs, toks))
    assert tr.num_blocks() == 8 and tr.stats.valid_ends == 400  # ends at 16 (window clipped at 0) and 32, per prompt
    assert len(tr._held[("hbm", 1)]) <= 8 and len(tr._ends["hbm"]) <= 8
    # each end depends on at most need = 2 window blocks; each supports at most its 2 router blocks
    assert len(tr._support["hbm"]) <= 16 and sum(len(v) for v in tr._end_deps["hbm"].values()) <= 8 * 2


@pytest.mark.slow
def test_vllm_publisher_hybrid_groups_route_to_the_engine_that_can_serve_the_hit():
    """vLLM 0.33's own ``ZmqEventPublisher`` and event classes (tests/engine_publishers.py), two
    engines of a hybrid model (group 0 ``mla_attention``, group 1 ``sliding_window_mla`` with a
    33-token window: a hit needs the 2 window blocks before its end), pdlb's subscriber and an
    events-mode router. Each engine caches 6 prompts of its own in both groups (the window group's
    event lists only the blocks of its windows at 128 and 256 tokens, nulls skipped, one batch with
    the full group's event), then its window group evicts the early window (``BlockRemoved``,
    ``group_idx`` 1). Each engine also holds the other's prompts in the full group, but its window
    group evicted the tail window: no hit there by vLLM's rule. Every probe must route to the
    engine that can serve it, with nothing credited to the other. ~15 s."""
    from tests.service.test_engine_conformance import PROBES_PER_ENGINE, Cluster, prompt

    full_kw = {"group_idx": 0, "kv_cache_spec_kind": "mla_attention"}

    class HybridCluster(Cluster):
        def connected(self) -> None:  # the marker as a hybrid engine sends it (group-tagged)
            assert self.sub is not None
            end = time.monotonic() + 10
            marker = prompt(999, tag=99)
            while time.monotonic() < end:
                before = {k: self.stats(k)["batches"] for k in "ab"}
                for e in (self.a, self.b):
                    e.store(marker, **full_kw)
                time.sleep(0.2)
                for e in (self.a, self.b):
                    e.publish([e.removed_event(marker, group_idx=0)])
                time.sleep(0.1)
                if all(self.stats(k)["batches"] >= before[k] + 2 for k in "ab"):
                    return
            raise AssertionError(f"subscriber not connected: {self.sub.stats()}")

    def cache(e, tokens, windows_at, evict_at) -> None:  # noqa: ANN001
        m, hs = e.mod, e.hashes(tokens)
        win = [hs[i] for end in windows_at for i in (end // 16 - 2, end // 16 - 1)]
        swa_ev = m.BlockStored(block_hashes=win, parent_block_hash=None, token_ids=list(tokens[:len(hs) * 16]),
                               block_size=16, lora_id=None, medium=e.medium("gpu"), lora_name=None, group_idx=1,
                               kv_cache_spec_kind="sliding_window_mla", kv_cache_spec_sliding_window=33)
        e.publish([e.stored_event(tokens, **full_kw), swa_ev])
        gone = [hs[i] for end in evict_at for i in (end // 16 - 2, end // 16 - 1)]
        e.publish([m.BlockRemoved(block_hashes=gone, medium=e.medium("gpu"), group_idx=1)])

    c = HybridCluster("vllm")
    try:
        c.connected()
        want = {"a": [prompt(i, 7) for i in range(PROBES_PER_ENGINE)],
                "b": [prompt(100 + i, 7) for i in range(PROBES_PER_ENGINE)]}
        since = time.monotonic()
        for k, e, other in (("a", c.a, "b"), ("b", c.b, "a")):
            for t in want[k]:
                cache(e, t, windows_at=(128, 256), evict_at=(128,))  # its own: the tail window stays
            for t in want[other]:
                cache(e, t, windows_at=(256,), evict_at=(256,))  # the other's: no window left
        c.wait_routed(want, since, what="hybrid groups")
        for k in "ab":
            assert c.stats(k)["decode_errors"] == 0
    finally:
        c.close()


def test_events_without_a_group_number_are_the_primary_groups():
    # SGLang sends no group_idx; a tier whose publisher sends none beside vLLM's group-0 GPU events
    # (the conformance harness's CPU/STORAGE events) is the same chain, not a second full group
    tr, index = KvEventTranslator(B), PrefixIndex()
    assert run(tr, index, full(EH[:4], TOKENS[:4 * B], group=None, kind=None)) == [
        BlockStored(tuple(RH[:4]), None, None)]
    out = run(tr, index, full(EH[4:], TOKENS[4 * B:], parent=EH[3], group=0, kind="full_attention"))
    assert out == [BlockStored(tuple(RH[4:]), None, RH[3])] and not tr.hybrid  # group 0 adopted as the primary
    assert run(tr, index, full([7, 8], TOKENS[:2 * B], group=None, kind=None)) == [
        BlockStored(tuple(RH[:2]), None, None)]
    assert run(tr, index, EngineBlockRemoved((EH[7],), "GPU", 0)) == [BlockRemoved((RH[7],), "GPU")]
    assert run(tr, index, EngineBlockRemoved((EH[6],), "GPU", None)) == [BlockRemoved((RH[6],), "GPU")]
