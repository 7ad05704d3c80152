#!/usr/bin/env python3
"""Benchmark: routing decision latency per policy, and prefix-index memory.

For 8, 64 and 512 decode replicas (plus as many prefill replicas), prompts of 1k and 32k tokens
(512-token blocks, half of them sharing a prefix with earlier requests), measures
``Router.route`` wall time per request, p50 / p99, after a warm-up that routes until the prefix
index is full (2,048 blocks = 1M tokens per replica, about one GPU's KV; then every insert
evicts, as in a long-running router) or 20,000 decisions were made. The "index fill" column
says how full it got: policies that keep prompts on few replicas, and short prompts on many
replicas, leave most replicas' indexes partly empty. Baseline in the same run: ``round_robin`` (the cheapest policy), so the ratio column
shows what each policy costs on top of the router's fixed work. Then the prefix index alone
(one match and two inserts per decision) for the radix tree (``PrefixIndex``) against the flat
per-block index (``BlockIndex``) as the same-run baseline, and both indexes' bytes per million
held blocks (tracemalloc).

    .venv/bin/python bench/route_latency.py [--requests 2000]

Goal (issue 4): p99 <= 100 us at 64 replicas, <= 300 us at 512.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balancer.block_index import BlockIndex  # noqa: E402
from balancer.hashing import chain_block_ids  # noqa: E402
from balancer.policies import available_policies  # noqa: E402
from balancer.prefix_index import PrefixIndex  # noqa: E402
from balancer.router import Router  # noqa: E402
from balancer.types import ReplicaId, Request  # noqa: E402

BLOCK = 512


def make_requests(n: int, prompt_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    blocks = -(-prompt_tokens // BLOCK)
    roots = [[rng.getrandbits(40) for _ in range(blocks // 2)] for _ in range(32)]
    out = []
    for i in range(n):
        ids = rng.choice(roots) + [rng.getrandbits(40) for _ in range(blocks - blocks // 2)]
        out.append(Request(f"r{i}", 0.0, prompt_tokens, tuple(chain_block_ids(ids)), 128, 128))
    return out


#: Prefix-index bound per replica in the bench: 2,048 blocks = 1M tokens, about one GPU's HBM KV.
INDEX_CAPACITY_BLOCKS = 2048
#: Most warm-up decisions (short prompts at 512 replicas would need millions to fill the index).
MAX_WARM = 20_000


def bench(policy: str, replicas: int, prompt_tokens: int, n: int) -> tuple[float, float, float]:
    """p50 and p99 decision latency (us) and the index fill (held / capacity) when measured.

    Warm-up first routes (and finishes) requests until every replica's index is full or
    :data:`MAX_WARM` decisions were made, so the measurement sees the steady state of a
    long-running router (LRU eviction on every insert, no dict growth), not a growing index.
    """
    router = Router(policy, policy, block_size=BLOCK, index_capacity_blocks=INDEX_CAPACITY_BLOCKS, seed=0)
    for i in range(replicas):
        router.add_replica(ReplicaId(f"p{i // 8}", i % 8), "prefill")
        router.add_replica(ReplicaId(f"d{i // 8}", i % 8), "decode", kv_capacity_tokens=1_000_000)
    blocks = -(-prompt_tokens // BLOCK)
    n_warm = min(MAX_WARM, max(n, 3 * replicas * INDEX_CAPACITY_BLOCKS // blocks))
    for r in make_requests(n_warm, prompt_tokens, seed=1):
        router.route(r, 0.0)
        router.on_finished(r.request_id, 0.0)
    fill = router.index.num_blocks() / (2 * replicas * INDEX_CAPACITY_BLOCKS)
    reqs = [Request("m" + r.request_id, 0.0, r.prompt_tokens, r.block_hashes, 128, 128)
            for r in make_requests(n, prompt_tokens, seed=2)]
    lat = np.empty(n)
    clock = time.perf_counter
    for k, r in enumerate(reqs):
        t0 = clock()
        router.route(r, 1.0)
        lat[k] = clock() - t0
        router.on_finished(r.request_id, 1.0)
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6), fill


def index_bytes_per_million_blocks(index_cls: Callable[[], object], num_blocks: int = 200_000, replicas: int = 8) -> float:
    """Bytes per million held blocks (replica, block pairs) when every replica holds its own
    distinct 32-block prompts: no sharing, the tree's worst case per block."""
    rng = random.Random(0)
    prompts = [tuple(chain_block_ids([rng.getrandbits(40) for _ in range(32)]))
               for _ in range(num_blocks // 32)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    idx = index_cls()
    for k, p in enumerate(prompts):
        idx.insert(ReplicaId("e", k % replicas), p)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(st.size_diff for st in after.compare_to(before, "filename"))
    return used / idx.num_blocks() * 1e6


def index_only(index_cls: type, replicas: int, prompt_tokens: int, n: int) -> tuple[float, float]:
    """p50 / p99 (us) of the prefix-index work of one PD decision alone (one match, two inserts
    on random replicas), in steady state (index full, every insert evicts)."""
    idx = index_cls(INDEX_CAPACITY_BLOCKS)
    reps = [ReplicaId(f"e{i // 8}", i % 8) for i in range(replicas)]
    rng = random.Random(0)
    blocks = -(-prompt_tokens // BLOCK)
    n_warm = min(MAX_WARM, max(n, 3 * replicas * INDEX_CAPACITY_BLOCKS // (2 * blocks)))
    for r in make_requests(n_warm, prompt_tokens, seed=1):
        a, b = rng.sample(reps, 2)
        idx.insert(a, r.block_hashes)
        idx.insert(b, r.block_hashes)
    # the tree answers the router's vectorised query; the flat index its per-replica dict
    match = idx.match_depths if isinstance(idx, PrefixIndex) else idx.match
    lat = np.empty(n)
    clock = time.perf_counter
    for k, r in enumerate(make_requests(n, prompt_tokens, seed=2)):
        a, b = rng.sample(reps, 2)
        t0 = clock()
        match(r.block_hashes)
        idx.insert(a, r.block_hashes, 1.0)
        idx.insert(b, r.block_hashes, 1.0)
        lat[k] = clock() - t0
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="measured decisions per configuration (default 2000)")
    ap.add_argument("--replicas", default="8,64,512", help="comma-separated replica counts per pool (default 8,64,512)")
    args = ap.parse_args()
    print(f"{'policy':<16}{'replicas':>9}{'prompt':>8}{'p50 us':>9}{'p99 us':>9}{'p99 / round_robin':>19}"
          f"{'index fill':>12}")
    for replicas in (int(x) for x in args.replicas.split(",")):
        for prompt in (1024, 32768):
            base = bench("round_robin", replicas, prompt, args.requests)
            for policy in available_policies():
                p50, p99, fill = base if policy == "round_robin" else bench(policy, replicas, prompt, args.requests)
                print(f"{policy:<16}{replicas:>9}{prompt:>8}{p50:>9.1f}{p99:>9.1f}{p99 / base[1]:>19.2f}"
                      f"{100 * fill:>11.0f}%")
    print()
    print("prefix index alone, one PD decision (match + 2 inserts), steady state; baseline: the flat"
          " BlockIndex in the same run")
    print(f"{'replicas':>9}{'prompt':>8}{'tree p50':>10}{'tree p99':>10}{'flat p50':>10}{'flat p99':>10}"
          f"{'p50 tree/flat':>15}")
    for replicas in (int(x) for x in args.replicas.split(",")):
        for prompt in (1024, 32768):
            t50, t99 = index_only(PrefixIndex, replicas, prompt, args.requests)
            f50, f99 = index_only(BlockIndex, replicas, prompt, args.requests)
            print(f"{replicas:>9}{prompt:>8}{t50:>10.1f}{t99:>10.1f}{f50:>10.1f}{f99:>10.1f}{t50 / f50:>15.2f}")
    flat_mb = index_bytes_per_million_blocks(BlockIndex) / 1e6
    tree_mb = index_bytes_per_million_blocks(PrefixIndex) / 1e6
    mapped_mb = index_bytes_per_million_blocks(functools.partial(PrefixIndex, block_map=True)) / 1e6
    print(f"memory per million held blocks (unshared 32-block prompts): flat {flat_mb:.1f} MB; tree {tree_mb:.1f} MB"
          f" ({tree_mb / flat_mb:.2f}x), tree with its block map (events mode) {mapped_mb:.1f} MB"
          f" ({mapped_mb / flat_mb:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
