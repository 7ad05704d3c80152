"""What a simulated cluster refuses at arrival, as real engines do, and workload/scenario mismatches.

Real engines reject a request whose prompt plus output limit exceeds ``max_model_len`` (vLLM and
SGLang answer 400), and a request that could never fit a rank's KV cache cannot run there.
Admitted, a 300k + 100k request on a 370k-token rank would "finish" after 33 simulated minutes and
stall its EP engine, and 10**12 output tokens would never end.

:func:`admit` splits a workload into the requests a scenario accepts and counts of the refused
ones by reason (:data:`REJECT_REASONS`); :func:`sim.run.cluster.simulate` runs only the accepted ones
and reports the counts (``SimResult.extra["rejected"]``, the summary's ``num_rejected``).
:func:`check_block_size` refuses a workload whose block hashes were made for another block size
(a trace's block size is part of the trace: Mooncake ``hash_ids`` cover 512 tokens each).
"""

from __future__ import annotations

from collections.abc import Sequence

from balancer.types import Request

__all__ = ["REJECT_REASONS", "admit", "check_block_size"]

REJECT_REASONS = ("max_model_len", "kv_capacity")
"""``max_model_len``: prompt + output tokens above the scenario's ``max_model_len``;
``kv_capacity``: the prompt (prefill rank) or prompt + output (decode or mixed rank) exceeds the
KV capacity of every rank that would have to hold it."""


def admit(requests: Sequence[Request], max_model_len: int, decode_capacity_tokens: int,
          prefill_capacity_tokens: int | None) -> tuple[list[Request], dict[str, int]]:
    """The requests a cluster accepts, and counts of the others by reason.

    Args:
        requests: the workload.
        max_model_len: most prompt + output tokens per request.
        decode_capacity_tokens: the largest KV capacity of a decode (or mixed) rank, in tokens:
            a request's prompt and output must fit one.
        prefill_capacity_tokens: the largest KV capacity of a prefill rank (PD), or ``None``
            (aggregated): a prompt must fit one.

    Returns:
        ``(accepted, {reason: count})``, ``accepted`` in the input's order; reasons with a count
        of 0 are left out.
    """
    accepted: list[Request] = []
    rejected: dict[str, int] = {}
    for r in requests:
        total = r.prompt_tokens + r.output_tokens
        if total > max_model_len:
            reason = "max_model_len"
        elif total > decode_capacity_tokens or (prefill_capacity_tokens is not None
                                                and r.prompt_tokens > prefill_capacity_tokens):
            reason = "kv_capacity"
        else:
            accepted.append(r)
            continue
        rejected[reason] = rejected.get(reason, 0) + 1
    return accepted, rejected


def check_block_size(requests: Sequence[Request], block_size: int, source: str = "the workload") -> None:
    """Refuse requests whose block hashes were made for another block size.

    A request of ``p`` prompt tokens hashed at ``block_size`` has ``floor(p / block_size)`` (full
    blocks only) or ``ceil(p / block_size)`` (with the partial last block) hashes, or none (no
    prefix information). Any other count means the workload's blocks are not the scenario's: the
    prefix hits would be wrong (a Mooncake trace at block size 16 showed 0.1% hits instead of
    63%), so this raises instead. Checks the first 1,000 requests with hashes (O(1) each).

    Raises:
        ValueError: naming the request, its hash count and the block size it suggests.
    """
    checked = 0
    for r in requests:
        n = len(r.block_hashes)
        if not n:
            continue
        lo, hi = r.prompt_tokens // block_size, -(-r.prompt_tokens // block_size)
        if not lo <= n <= hi:
            guess = -(-r.prompt_tokens // n)
            raise ValueError(
                f"{source}: request {r.request_id} has {r.prompt_tokens} prompt tokens and {n} block hashes, "
                f"which does not fit block_size {block_size} (it fits about {guess}); a trace's block size is part "
                f"of the trace (Mooncake: 512): set the scenario's block_size to the trace's")
        checked += 1
        if checked >= 1000:
            return
