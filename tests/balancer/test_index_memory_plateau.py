"""What the router keeps of a request after it ends: its prompt's blocks in the prefix index, a
bounded cache (issue 25, item 1: "per-request memory is bounded").

Every routed prompt's block hashes stay in the index (the router's guess at what each engine's
KV cache holds) until the replica's least recently used blocks make room, so a stream of distinct
prompts grows the router's memory up to the index bounds (``index_capacity_blocks`` per replica,
``index_total_capacity_blocks`` over all) and no further. docs/serving.md, "Limits and
hardening", states the bound in bytes from the figure measured here (about 56 bytes per block
held, hashes included; at most 80 asserted).
"""

from __future__ import annotations

import gc
import tracemalloc

from balancer.hashing import chain_block_ids
from balancer.router import Router
from balancer.types import ReplicaId, Request, Role

CAP_BLOCKS = 20_000
BYTES_PER_BLOCK_MAX = 80


def test_distinct_prompts_grow_the_router_up_to_the_index_bound_and_no_further():
    router = Router(index_capacity_blocks=CAP_BLOCKS)
    replicas = [ReplicaId(f"d{k}", 0) for k in range(4)]
    for r in replicas:
        router.add_replica(r, Role.DECODE)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = []
        for i in range(40):  # 40 distinct prompts of 5,000 blocks: 200,000 blocks offered, 80,000 fit
            hashes = tuple(chain_block_ids(range(i * 10**7, i * 10**7 + 5_000)))
            router.route(Request(f"q{i}", float(i), 5_000 * 64, hashes, max_output_tokens=4), float(i))
            router.on_finished(f"q{i}", i + 0.5, 0)
            del hashes
            if i in (23, 39):
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    # hand: 4 replicas x 20,000 blocks; 24 prompts x 5,000 = 120,000 offered fill every replica already
    assert all(router.index.num_blocks(r) <= CAP_BLOCKS for r in replicas)
    assert router.index.num_blocks() == 4 * CAP_BLOCKS
    assert abs(held[1] - held[0]) <= 0.02 * held[0], held  # 16 more prompts: a plateau, not growth
    assert held[1] / router.index.num_blocks() <= BYTES_PER_BLOCK_MAX, held
