"""Writing request lists as Mooncake-style JSONL, readable by :func:`sim.workload.read_mooncake`.

One JSON object per line::

    {"timestamp": 1500, "input_length": 1300, "output_length": 200,
     "hash_ids": [h0, h1, p2], "session_id": "s3", "traffic_class": "chatbot"}

* ``timestamp``: arrival in milliseconds (an integer when the arrival is a whole millisecond,
  as in :func:`sim.workload.session_workload`, else a float);
* ``hash_ids``: one id per ``block_size``-token block, ``ceil(input_length / block_size)`` of
  them. Full blocks are written as the request's block hashes; when the request holds only its
  full blocks (hashed token ids) and the prompt ends in a partial block, that block gets an id
  that is unique to the line (a hash of the last full block's hash and the line number), since a
  partial block is never reused from a paged KV cache;
* ``session_id`` / ``traffic_class``: written when set.

The reader chains the ids again (:func:`balancer.hashing.chain_block_ids`), so the hashes it
returns are a relabelling of the written ones: two prompts share their first ``k`` read-back
hashes iff they shared their first ``k`` written hashes. Prefix hit rates are therefore unchanged
by a round trip; the hash values are not.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from typing import IO

import xxhash

from balancer.hashing import ROOT_HASH
from balancer.types import Request

from ._checks import check_positive_int

__all__ = ["write_mooncake"]


def write_mooncake(requests: Iterable[Request], path: str | os.PathLike[str], *, block_size: int = 512) -> int:
    """Write ``requests`` as Mooncake JSONL (gzip-compressed if ``path`` ends in ``.gz``).

    Args:
        requests: in arrival order (non-decreasing ``arrival_time_s``, >= 0).
        path: output file; overwritten.
        block_size: tokens per ``hash_ids`` entry (must be the block size the hashes were made
            with; pass the same to :func:`sim.workload.read_mooncake`).

    Returns:
        The number of lines written.

    Raises:
        ValueError: arrivals out of order or negative, or a request whose ``block_hashes`` has
            neither ``prompt_tokens // block_size`` nor ``ceil(prompt_tokens / block_size)``
            entries (nothing is silently truncated); the message names the request.
        OSError: the file cannot be written.
    """
    check_positive_int(block_size, "block_size")
    p = os.fspath(path)
    fh: IO[str]
    fh = gzip.open(p, "wt", encoding="utf-8") if p.endswith(".gz") else open(p, "w", encoding="utf-8")
    n = 0
    prev = 0.0
    with fh:
        for r in requests:
            if r.arrival_time_s < prev:
                raise ValueError(f"request {r.request_id}: arrival {r.arrival_time_s} s is before the previous "
                                 f"{prev} s (or negative); sort requests by arrival first")
            prev = r.arrival_time_s
            full, total = r.prompt_tokens // block_size, -(-r.prompt_tokens // block_size)
            ids = list(r.block_hashes)
            if len(ids) == full and total > full:
                parent = ids[-1] if ids else ROOT_HASH
                ids.append(xxhash.xxh3_64_intdigest(f"pdlb/partial/{parent}/{n}".encode()))
            elif len(ids) != total:
                raise ValueError(f"request {r.request_id}: {len(ids)} block hashes for {r.prompt_tokens} tokens; "
                                 f"expected {full} (full blocks) or {total} (with the partial block) at "
                                 f"block_size {block_size}")
            ms = r.arrival_time_s * 1000.0
            rec: dict[str, object] = {
                "timestamp": int(ms) if ms == int(ms) else ms,
                "input_length": r.prompt_tokens,
                "output_length": r.output_tokens,
                "hash_ids": ids,
            }
            if r.session_id is not None:
                rec["session_id"] = r.session_id
            if r.traffic_class is not None:
                rec["traffic_class"] = r.traffic_class
            if r.priority is not None:
                rec["priority"] = r.priority
            fh.write(json.dumps(rec, separators=(",", ":")))
            fh.write("\n")
            n += 1
    return n
