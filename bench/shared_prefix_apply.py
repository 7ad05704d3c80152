"""What sharing one routing decision costs with ``pdlb serve --processes N`` in approximate mode
(issue 26: the O(N) term): the routing process's ``PrefixShare.publish`` (msgpack, ring write),
and in EACH of the N - 1 other processes a drain that reads it and records it in that process's
prefix index (``Router.record_routed``: one insert). Distinct prompts, so nothing folds (a hot
prompt routed by every process folds into one insert per drain: see the module docstring of
``balancer.service.processes.shared_prefix``). CPU time (``time.process_time``) in one process,
both sides in turn, ``--per-pass`` decisions per drain.

Run by hand::

    .venv/bin/python bench/shared_prefix_apply.py
    .venv/bin/python bench/shared_prefix_apply.py --blocks 8,32,128,512 --decisions 4000 --policy ep_aware

Prints, per prompt length, microseconds per decision: publish, and drain + insert per reader; the
total per request of N processes is ``publish + (N - 1) x drain``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from balancer.router import Router  # noqa: E402
from balancer.service.processes.shared_prefix import PrefixShare  # noqa: E402
from balancer.types import ReplicaId, Role  # noqa: E402
from pdlb_cli.comma_lists import list_arg  # noqa: E402


def measure(blocks: int, decisions: int, per_pass: int, policy: str, replicas: int, block_size: int) -> tuple[float, float]:
    """(publish us, drain + insert us per reader) per decision."""
    reps = [ReplicaId(f"http://e{i}", 0) for i in range(replicas)]
    reader_router = Router(policy, policy, block_size=block_size)
    for rep in reps:
        reader_router.add_replica(rep, Role.MIXED)
    rng = random.Random(blocks)
    prompts = [tuple(rng.getrandbits(63) for _ in range(blocks)) for _ in range(decisions)]
    with tempfile.TemporaryDirectory() as d:
        reader = PrefixShare(d, 2, 0, record=reader_router.record_routed, forget=reader_router.forget_recorded)
        writer = PrefixShare(d, 2, 1)
        pub = drain = 0.0
        for i in range(0, decisions, per_pass):
            a = time.process_time()
            for k in range(i, min(decisions, i + per_pass)):
                writer.publish((reps[k % replicas],), prompts[k], 1.0 + k * 1e-3)
            b = time.process_time()
            reader.drain()
            drain += time.process_time() - b
            pub += b - a
        assert reader.received == decisions and reader.folded == 0
        asyncio.run(reader.close())
        asyncio.run(writer.close())
    return pub / decisions * 1e6, drain / decisions * 1e6


def main() -> int:
    from pdlb_cli.arg_types import positive_int
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="8,32,128,512", help="prompt lengths in blocks, comma list (default 8,32,128,512)")
    ap.add_argument("--decisions", type=positive_int, default=4000, help="distinct decisions per length (default 4000)")
    ap.add_argument("--per-pass", type=positive_int, default=4, help="decisions written per drain (default 4)")
    ap.add_argument("--policy", default="ep_aware", help="the routers' policy, both stages (default ep_aware)")
    ap.add_argument("--replicas", type=positive_int, default=8, help="mixed replicas (default 8)")
    ap.add_argument("--block-size", type=positive_int, default=64, help="tokens per block (default 64)")
    args = ap.parse_args()
    lengths = list_arg(ap, "--blocks", args.blocks, "prompt lengths in blocks", int)
    if not lengths or min(lengths) < 1 or args.decisions < 1 or args.per_pass < 1 or args.replicas < 1 or args.block_size < 1:
        ap.error("--blocks, --decisions, --per-pass, --replicas and --block-size must be >= 1")
    print(f"{args.replicas} mixed replicas, {args.block_size}-token blocks, {args.decisions} distinct decisions, "
          f"{args.per_pass} per drain; CPU us per decision")
    print(f"{'blocks':>7} {'tokens':>7} {'publish':>8} {'drain+insert (each reader)':>27} {'total at N=2':>13} {'N=8':>8}")
    for b in lengths:
        p, d = measure(b, args.decisions, args.per_pass, args.policy, args.replicas, args.block_size)
        print(f"{b:>7} {b * args.block_size:>7} {p:>8.1f} {d:>27.1f} {p + d:>13.1f} {p + 7 * d:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
