"""Per-request and per-rank records of one simulation run, in compact numpy arrays.

Every timestamp is simulated seconds; ``NaN`` means "not reached". Summaries, tables and plots are
computed from these arrays (:mod:`sim.run.metrics`), never from counters kept inside engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Float64 timestamp columns, in the order a request passes them.
TIME_FIELDS = (
    "arrival_s",        # request arrives at the router
    "fetch_start_s",    # lower-tier KV fetch started (admission on the prefill rank; NaN: no fetch)
    "fetch_end_s",      # every lower-tier fetch of the request done
    "prefill_start_s",  # first prefill chunk scheduled
    "prefill_end_s",    # last prefill chunk done (PD: KV ready to transfer)
    "transfer_end_s",   # KV arrived at the decode rank (PD only)
    "first_token_s",    # first output token emitted
    "finish_s",         # last output token emitted
)
#: Int64 columns.
INT_FIELDS = (
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",      # prompt tokens reused, not recomputed: hbm + host + store hit tokens
    "hbm_hit_tokens",     # ... from the prefill rank's HBM prefix cache
    "host_hit_tokens",    # ... fetched from the rank's host-DRAM tier
    "store_hit_tokens",   # ... fetched from the shared store
    "transfer_bytes",     # KV bytes moved prefill -> decode (blocks the decode rank lacked); 0 if none
    "prefill_rank",       # global rank index of the prefill (or mixed) rank, -1 if none
    "decode_rank",        # global rank index of the decode (or mixed) rank
    "router_matched_tokens",  # prefix tokens the router believed the prefill rank held
)


class RequestRecords:
    """Columnar per-request records; row ``i`` is the ``i``-th request of the workload."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests
        for name in TIME_FIELDS:
            setattr(self, name, np.full(num_requests, np.nan))
        for name in INT_FIELDS:
            setattr(self, name, np.full(num_requests, -1, dtype=np.int64))
        self.cached_tokens[:] = 0
        self.hbm_hit_tokens[:] = 0
        self.host_hit_tokens[:] = 0
        self.store_hit_tokens[:] = 0
        self.transfer_bytes[:] = 0
        self.router_matched_tokens[:] = 0
        self.num_routed = 0
        self.num_finished = 0
        self.num_shed = 0  # refused by the deadline gate (sim.run.deadline_gate), never simulated

    # declared for type checkers
    arrival_s: np.ndarray
    fetch_start_s: np.ndarray
    fetch_end_s: np.ndarray
    prefill_start_s: np.ndarray
    prefill_end_s: np.ndarray
    transfer_end_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    hbm_hit_tokens: np.ndarray
    host_hit_tokens: np.ndarray
    store_hit_tokens: np.ndarray
    transfer_bytes: np.ndarray
    prefill_rank: np.ndarray
    decode_rank: np.ndarray
    router_matched_tokens: np.ndarray

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in TIME_FIELDS + INT_FIELDS}

    def grow(self, num_requests: int) -> None:
        """Extend every column to ``num_requests`` rows (new rows as a fresh record's; closed-loop
        runs, whose request count is not known in advance). Raises ValueError when shrinking."""
        extra = num_requests - self.num_requests
        if extra < 0:
            raise ValueError(f"cannot shrink records from {self.num_requests} to {num_requests} rows")
        fresh = RequestRecords(extra)
        for name in TIME_FIELDS + INT_FIELDS:
            setattr(self, name, np.concatenate([getattr(self, name), getattr(fresh, name)]))
        self.num_requests = num_requests


#: Most load samples kept per run; beyond it the sampler thins them and doubles its period.
MAX_LOAD_SAMPLES = 4096


@dataclass
class LoadSamples:
    """Per-rank load sampled every ``interval_s``: arrays of shape ``(num_samples, num_ranks)``."""

    interval_s: float
    times_s: list[float] = field(default_factory=list)
    prefill_queued_tokens: list[np.ndarray] = field(default_factory=list)
    decode_running: list[np.ndarray] = field(default_factory=list)
    decode_kv_tokens: list[np.ndarray] = field(default_factory=list)

    def thin(self) -> None:
        """Keep every other sample and double ``interval_s`` (the samples stay evenly spaced when
        the count is even). Bounds memory and sampler events when a run lasts far longer than its
        arrivals span (e.g. very long outputs): see :data:`MAX_LOAD_SAMPLES`."""
        for xs in (self.times_s, self.prefill_queued_tokens, self.decode_running, self.decode_kv_tokens):
            del xs[1::2]
        self.interval_s *= 2.0

    def as_arrays(self) -> dict[str, np.ndarray]:
        def stack(xs: list[np.ndarray]) -> np.ndarray:
            return np.vstack(xs) if xs else np.zeros((0, 0))
        return {
            "times_s": np.asarray(self.times_s),
            "prefill_queued_tokens": stack(self.prefill_queued_tokens),
            "decode_running": stack(self.decode_running),
            "decode_kv_tokens": stack(self.decode_kv_tokens),
        }
