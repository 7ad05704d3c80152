"""KV tiers below a rank's HBM prefix cache: a host-DRAM tier per DP rank and a shared store.

Lookup on prefill admission (:meth:`RankTiers.admit`), from the first block the HBM prefix cache
misses: walk the prompt's block hashes, taking a run of consecutive blocks from the host tier
when it holds the next block, else from the shared store, until neither holds the next block.
Each run is a *segment* ``(tier, blocks)``. Tokens are capped so that at least one prompt token is
computed (the engine recomputes the last token for its logits), the cap taken from the deepest
segment.

**Fetch or recompute** (``kv_fetch_rule``), segment by segment in prompt order, stopping at the
first segment not fetched (KV must be a contiguous prefix):

- ``"faster"``: fetch iff ``bytes / rate_estimate < compute_time_saved``, where ``bytes`` =
  blocks x block bytes, ``rate_estimate`` is the bandwidth a new transfer would get on that tier's
  link right now (the max-min fair share below, so contention counts), and
  ``compute_time_saved`` is the perf model's time for prefilling those tokens on this rank after
  the prefix before them, chunked at the rank's ``max_prefill_tokens``, minus the same number of
  empty steps (the marginal step time of the work). Per segment, independently.
- ``"always"``: fetch every segment (Mooncake and LMCache load whatever the store holds).

A job whose blocks are being fetched is skipped by the rank's scheduler (vLLM's
``WAITING_FOR_REMOTE_KVS``) and becomes schedulable when every fetch finished; other jobs run
meanwhile. Fetched blocks enter HBM with the rest of the prompt when its prefill finishes.

**Writes.** HBM evictions are *demoted* to the rank's host tier (SGLang HiCache ``write_back``):
blocks not already there are written over the host link and become visible when the write
completes. Newly prefilled prompts are written to the shared store (blocks not live and not
already being written; live ones are touched, refreshing their TTL) over the engine's store
write link; a block is visible to every rank once its write completes (a write backlog).

**Bandwidth contention** (:class:`FairShareLinks`): concurrent transfers of one direction share
bandwidth max-min fairly (processor sharing): a transfer of group ``g`` (an engine) is capped at
``group_bytes_per_s / n_g`` (``n_g`` transfers of the group), and all transfers together at
``aggregate_bytes_per_s``, water-filled. Rates are recomputed whenever a transfer starts or ends,
so a lone transfer of ``b`` bytes takes ``b / min(group, aggregate)`` and two equal ones started
together on one group take ``2 b / group`` each. Reads and writes are separate directions.
Host tiers: one link per DP rank (per-engine bandwidth / DP ranks, its GPU's PCIe link).

Sources: SGLang HiCache (host tier, write-back/write-through), vLLM KV connector async loads,
Mooncake store / LMCache (fetch whatever hits), DeepSeek 3FS KV cache (shared store, TTL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.run.engine.kv_store import KvStore
from sim.perf.base import PerfModel, causal_attn_pairs

#: Tier names (records, metrics, KV event media).
HBM, HOST, STORE = "hbm", "host", "store"


def max_min_share(caps: Sequence[float], total: float) -> list[float]:
    """Max-min fair rates for flows with per-flow ``caps`` sharing ``total`` (water-filling).

    Flows whose cap is below the fair level get their cap; the rest split what is left equally.
    Hand check: caps (10, 100, 100), total 90 -> 10, 40, 40.
    """
    n = len(caps)
    rates = [0.0] * n
    left = float(total)
    order = sorted(range(n), key=caps.__getitem__)
    for k, i in enumerate(order):
        share = left / (n - k)
        if caps[i] <= share:
            rates[i] = float(caps[i])
            left -= caps[i]
        else:
            for j in order[k:]:
                rates[j] = share
            break
    return rates


class _Flow:
    __slots__ = ("group", "remaining", "nbytes", "rate", "on_done")

    def __init__(self, group: Hashable, nbytes: float, on_done: Callable[[float], None]) -> None:
        self.group = group
        self.remaining = float(nbytes)
        self.nbytes = float(nbytes)
        self.rate = 0.0
        self.on_done = on_done


class FairShareLinks:
    """One transfer direction shared by groups of transfers (see the module docstring).

    Args:
        env: the SimPy environment (its clock times the transfers).
        aggregate_bytes_per_s: cap on all transfers together (> 0).
        group_bytes_per_s: cap on the transfers of one group together (> 0).

    Attributes:
        bytes_done: bytes of completed transfers.
        num_done: completed transfers.
    """

    def __init__(self, env: simpy.Environment, aggregate_bytes_per_s: float, group_bytes_per_s: float) -> None:
        if not aggregate_bytes_per_s > 0 or not group_bytes_per_s > 0:
            raise ValueError("link bandwidths must be > 0 bytes/s")
        self.env = env
        self.aggregate_bytes_per_s = float(aggregate_bytes_per_s)
        self.group_bytes_per_s = float(group_bytes_per_s)
        self._flows: list[_Flow] = []
        self._last_s = 0.0
        self._version = 0
        self.bytes_done = 0.0
        self.num_done = 0

    @property
    def num_active(self) -> int:
        return len(self._flows)

    def _caps(self, extra_group: Hashable | None = None) -> tuple[list[float], float | None]:
        counts: dict[Hashable, int] = {}
        for f in self._flows:
            counts[f.group] = counts.get(f.group, 0) + 1
        if extra_group is not None:
            counts[extra_group] = counts.get(extra_group, 0) + 1
        g = self.group_bytes_per_s
        caps = [g / counts[f.group] for f in self._flows]
        extra = g / counts[extra_group] if extra_group is not None else None
        return caps, extra

    def rate_estimate(self, group: Hashable) -> float:
        """Bytes/s a transfer of ``group`` started now would get (until the next start or end)."""
        caps, extra = self._caps(group)
        assert extra is not None
        return max_min_share([*caps, extra], self.aggregate_bytes_per_s)[-1]

    def start(self, group: Hashable, nbytes: float, on_done: Callable[[float], None]) -> None:
        """Start moving ``nbytes`` (> 0) for ``group``; ``on_done(now_s)`` runs when it completes."""
        if not nbytes > 0:
            raise ValueError(f"transfer size must be > 0 bytes, got {nbytes}")
        self._advance()
        self._flows.append(_Flow(group, nbytes, on_done))
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_s
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
        self._last_s = now

    def _reschedule(self) -> None:
        self._version += 1
        if not self._flows:
            return
        caps, _ = self._caps()
        rates = max_min_share(caps, self.aggregate_bytes_per_s)
        nxt = math.inf
        for f, r in zip(self._flows, rates):
            f.rate = r
            nxt = min(nxt, max(f.remaining, 0.0) / r)
        v = self._version
        ev = self.env.timeout(nxt)
        ev.callbacks.append(lambda _ev, v=v: self._on_timer(v))

    def _on_timer(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later start/end
        self._advance()
        now = self.env.now
        # done: the rest is within rounding, or too small for the clock to advance by its
        # transfer time at ``now`` (float64 has ~1e-13 s resolution at 1,000 s: a leftover of a
        # few mB at 50 GB/s would otherwise reschedule itself at the same instant for ever)
        finished = [f.remaining <= 1e-9 * f.nbytes + 1e-6 or (f.rate > 0 and now + f.remaining / f.rate <= now)
                    for f in self._flows]
        done = [f for f, d in zip(self._flows, finished) if d]
        self._flows = [f for f, d in zip(self._flows, finished) if not d]
        self._reschedule()
        for f in done:
            self.bytes_done += f.nbytes
            self.num_done += 1
            f.on_done(now)


#: ``listener(medium, stored, block_hashes, rank_index)``: a tier stored (``stored=True``) or
#: dropped blocks; for the shared store ``rank_index`` is the rank whose write caused the change
#: (the store is global; the event names a publisher). Feeds KV events to the router.
TierListener = Callable[[str, bool, Sequence[int], int], None]


@dataclass
class TierStats:
    """Cluster-wide tier traffic of one run (bytes and blocks)."""

    host_fetch_bytes: float = 0.0
    store_fetch_bytes: float = 0.0
    host_write_bytes: float = 0.0
    store_write_bytes: float = 0.0
    host_written_blocks: int = 0
    store_written_blocks: int = 0
    host_fetched_blocks: int = 0
    store_fetched_blocks: int = 0
    recompute_blocks: int = 0  # lower-tier blocks the rule chose to recompute
    extra: dict = field(default_factory=dict)


class HostTier:
    """One DP rank's host-DRAM tier: an LRU :class:`KvStore` plus its PCIe link (read and write)."""

    def __init__(self, env: simpy.Environment, capacity_blocks: int | None, bandwidth_bytes_per_s: float) -> None:
        self.store = KvStore(capacity_blocks)
        self.read = FairShareLinks(env, bandwidth_bytes_per_s, bandwidth_bytes_per_s)
        self.write = FairShareLinks(env, bandwidth_bytes_per_s, bandwidth_bytes_per_s)
        self.pending: set[int] = set()


class SharedStore:
    """The cluster-wide store: a TTL/LRU :class:`KvStore` plus per-engine and aggregate links."""

    def __init__(self, env: simpy.Environment, capacity_blocks: int | None, ttl_s: float | None,
                 class_ttl_s: dict[str, float], read_bytes_per_s: float, write_bytes_per_s: float,
                 engine_read_bytes_per_s: float, engine_write_bytes_per_s: float) -> None:
        self.store = KvStore(capacity_blocks, ttl_s, class_ttl_s)
        self.read = FairShareLinks(env, read_bytes_per_s, engine_read_bytes_per_s)
        self.write = FairShareLinks(env, write_bytes_per_s, engine_write_bytes_per_s)
        self.pending: set[int] = set()


class RankTiers:
    """The lower tiers one prefill (or mixed) DP rank reads and writes; see the module docstring.

    Args:
        env: SimPy environment.
        rank_index: global rank index (KV event source).
        engine: the rank's engine name (its store bandwidth group).
        host: this rank's host tier, or None.
        store: the shared store, or None.
        perf: the engine's perf model (compute time saved by a fetch).
        group_size / position: ranks in the rank's step group and this rank's column in it.
        block_size: tokens per block; block_bytes: KV bytes per block.
        max_prefill_tokens: the rank's chunk budget (compute-time estimate is chunked like it).
        fetch_rule: ``"faster"`` or ``"always"``.
        stats: shared counters; listener: KV-change callback (events mode), or None.
    """

    def __init__(self, env: simpy.Environment, rank_index: int, engine: str, host: HostTier | None,
                 store: SharedStore | None, perf: PerfModel, group_size: int, position: int,
                 block_size: int, block_bytes: int, max_prefill_tokens: int, fetch_rule: str,
                 stats: TierStats, listener: TierListener | None = None) -> None:
        if fetch_rule not in ("faster", "always"):
            raise ValueError(f"unknown kv_fetch_rule {fetch_rule!r}; valid: faster, always")
        self.env = env
        self.rank_index = rank_index
        self.engine = engine
        self.host = host
        self.store = store
        self.perf = perf
        self.group_size = group_size
        self.position = position
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.max_prefill_tokens = max_prefill_tokens
        self.fetch_rule = fetch_rule
        self.stats = stats
        self.listener = listener
        self.on_ready: Callable[[object, float], None] | None = None  # set by the cluster
        zero = np.zeros(group_size)
        self._empty_step_s = float(perf.step_time_s(zero, zero, zero, zero))

    # ------------------------------------------------------------------ decisions
    def compute_time_s(self, tokens: int, prefix_tokens: int) -> float:
        """Marginal perf-model time to prefill ``tokens`` after ``prefix_tokens`` on this rank,
        in chunks of ``max_prefill_tokens`` (each chunk a step with the other ranks idle)."""
        if tokens <= 0:
            return 0.0
        c = self.max_prefill_tokens
        sizes = np.full(tokens // c, c, dtype=np.float64)
        if tokens % c:
            sizes = np.append(sizes, tokens % c)
        before = prefix_tokens + np.concatenate(([0.0], np.cumsum(sizes)[:-1]))
        k = len(sizes)
        pt = np.zeros((k, self.group_size))
        pa = np.zeros((k, self.group_size))
        pt[:, self.position] = sizes
        pa[:, self.position] = causal_attn_pairs(sizes, before)
        z = np.zeros((k, self.group_size))
        return float(np.sum(self.perf.step_time_s(pt, pa, z, z))) - k * self._empty_step_s

    def fetch_time_estimate_s(self, tier: str, blocks: int) -> float:
        """``blocks x block_bytes / rate_estimate`` on the tier's read link for this rank."""
        link = self.host.read if tier == HOST else self.store.read  # type: ignore[union-attr]
        return blocks * self.block_bytes / link.rate_estimate(self.engine if tier == STORE else 0)

    def segments(self, block_hashes: Sequence[int], start: int, now_s: float) -> list[tuple[str, int]]:
        """Runs of consecutive blocks from ``start`` found in the host tier, else the store."""
        out: list[tuple[str, int]] = []
        n = len(block_hashes)
        pos = start
        while pos < n:
            rest = block_hashes[pos:]
            k = self.host.store.match(rest, now_s) if self.host is not None else 0
            tier = HOST
            if k == 0 and self.store is not None:
                k = self.store.store.match(rest, now_s)
                tier = STORE
            if k == 0:
                break
            out.append((tier, k))
            pos += k
        return out

    def admit(self, job, hbm_blocks: int) -> int:  # noqa: ANN001 (PrefillJob; avoids an import cycle)
        """Look the job up below HBM, decide fetch vs recompute, start the fetches.

        Sets ``job.hbm_tokens``, ``job.host_tokens``, ``job.store_tokens`` and
        ``job.fetch_pending`` (transfers in flight); returns the cached tokens (reused KV).
        """
        now = self.env.now
        bs = self.block_size
        limit = job.prompt_tokens - 1
        covered = min(hbm_blocks * bs, limit)
        job.hbm_tokens = covered
        pos = hbm_blocks
        fetch_blocks = {HOST: 0, STORE: 0}
        for tier, k in self.segments(job.block_hashes, hbm_blocks, now):
            tokens = min(k * bs, limit - covered)
            if tokens <= 0:
                break
            used = -(-tokens // bs)
            if self.fetch_rule == "faster":
                if self.fetch_time_estimate_s(tier, used) >= self.compute_time_s(tokens, covered):
                    rest = sum(kk for _, kk in self.segments(job.block_hashes, pos, now))
                    self.stats.recompute_blocks += rest
                    break
            hashes = job.block_hashes[pos:pos + used]
            if tier == HOST:
                self.host.store.touch(hashes, now)  # type: ignore[union-attr]
                job.host_tokens += tokens
            else:
                self.store.store.touch(hashes, now, job.traffic_class)  # type: ignore[union-attr]
                job.store_tokens += tokens
            fetch_blocks[tier] += used
            covered += tokens
            pos += k
        for tier, blocks in fetch_blocks.items():
            if blocks == 0:
                continue
            nbytes = blocks * self.block_bytes
            if tier == HOST:
                self.stats.host_fetch_bytes += nbytes
                self.stats.host_fetched_blocks += blocks
                link, group = self.host.read, 0  # type: ignore[union-attr]
            else:
                self.stats.store_fetch_bytes += nbytes
                self.stats.store_fetched_blocks += blocks
                link, group = self.store.read, self.engine  # type: ignore[union-attr]
            job.fetch_pending += 1
            job.fetch_start_s = now
            link.start(group, nbytes, lambda t, job=job: self._fetched(job, t))
        return covered

    def _fetched(self, job, now_s: float) -> None:  # noqa: ANN001
        job.fetch_pending -= 1
        if job.fetch_pending == 0:
            job.fetch_end_s = now_s
            if self.on_ready is not None:
                self.on_ready(job, now_s)

    # ------------------------------------------------------------------ writes
    def on_hbm_evicted(self, block_hashes: Sequence[int]) -> None:
        """Demote blocks HBM evicted to the host tier (async write over the host link)."""
        host = self.host
        if host is None or not block_hashes:
            return
        now = self.env.now
        new = [h for h in block_hashes if h not in host.pending and not host.store.is_live(h, now)]
        if not new:
            return
        host.pending.update(new)
        nbytes = len(new) * self.block_bytes
        self.stats.host_write_bytes += nbytes
        host.write.start(0, nbytes, lambda t, new=new: self._host_written(new, t))

    def _host_written(self, blocks: list[int], now_s: float) -> None:
        host = self.host
        assert host is not None
        host.pending.difference_update(blocks)
        removed = host.store.insert(blocks, now_s)
        self.stats.host_written_blocks += len(blocks)
        if self.listener is not None:
            self.listener(HOST, True, blocks, self.rank_index)
            if removed:
                self.listener(HOST, False, removed, self.rank_index)

    def on_prefill_done(self, job) -> None:  # noqa: ANN001
        """Write the prompt's blocks to the shared store (new ones) and touch the live ones."""
        st = self.store
        if st is None or not job.block_hashes:
            return
        now = self.env.now
        expired = st.store.expire(now)  # sweep what the TTL ended (a store deletes them)
        if expired and self.listener is not None:
            self.listener(STORE, False, expired, self.rank_index)
        live = st.store.is_live
        new = [h for h in job.block_hashes if h not in st.pending and not live(h, now)]
        old = [h for h in job.block_hashes if live(h, now)]
        if old:
            st.store.touch(old, now, job.traffic_class)
        if not new:
            return
        st.pending.update(new)
        nbytes = len(new) * self.block_bytes
        self.stats.store_write_bytes += nbytes
        cls = job.traffic_class
        st.write.start(self.engine, nbytes, lambda t, new=new, cls=cls: self._store_written(new, cls, t))

    def _store_written(self, blocks: list[int], traffic_class: str | None, now_s: float) -> None:
        st = self.store
        assert st is not None
        st.pending.difference_update(blocks)
        removed = st.store.insert(blocks, now_s, traffic_class)
        self.stats.store_written_blocks += len(blocks)
        if self.listener is not None:
            self.listener(STORE, True, blocks, self.rank_index)
            if removed:
                self.listener(STORE, False, removed, self.rank_index)
