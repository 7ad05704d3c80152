"""State of one simulated DP rank and the pure planning of its part of an engine step.

A rank owns a prefill queue (FIFO, chunked), a decode waiting queue (admission limited by KV
capacity and batch size), a running decode batch and a prefix cache. Planning a step returns data
(:class:`RankPlan`); applying it changes state. Neither touches SimPy, so both are unit-testable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from balancer.types import ReplicaId, Role
from sim.run.engine.hit_checkpoints import HitCheckpoints
from sim.run.engine.kv_cache import BlockCache


class PrefillJob:
    """A prompt waiting for or in (chunked) prefill on a rank."""

    __slots__ = ("index", "prompt_tokens", "output_tokens", "block_hashes", "cached_tokens", "done_tokens",
                 "reserved_blocks", "start_s", "traffic_class", "hbm_tokens", "host_tokens", "store_tokens",
                 "fetch_pending", "fetch_start_s", "fetch_end_s", "pinned_blocks")

    def __init__(self, index: int, prompt_tokens: int, output_tokens: int, block_hashes: tuple[int, ...],
                 traffic_class: str | None = None) -> None:
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.block_hashes = block_hashes
        self.traffic_class = traffic_class
        self.cached_tokens = -1  # unknown until first scheduled (= hbm + host + store tokens)
        self.done_tokens = 0  # prompt tokens whose KV exists (cached + computed)
        self.reserved_blocks = 0  # mixed ranks reserve KV for the whole sequence at prefill start
        self.pinned_blocks = 0  # shared prompt blocks: leading blocks of block_hashes it holds pinned
        self.start_s = -1.0  # when its first chunk was scheduled (set by the step group)
        self.hbm_tokens = 0  # reused from this rank's HBM prefix cache
        self.host_tokens = 0  # fetched from the rank's host tier
        self.store_tokens = 0  # fetched from the shared store
        self.fetch_pending = 0  # lower-tier transfers in flight; the job is not scheduled meanwhile
        self.fetch_start_s = -1.0
        self.fetch_end_s = -1.0


class DecodeSeq:
    """A sequence in (or waiting for) a rank's decode batch."""

    __slots__ = ("index", "kv_tokens", "remaining", "reserved_blocks", "block_hashes", "pinned")

    def __init__(self, index: int, kv_tokens: int, remaining: int, reserved_blocks: int,
                 block_hashes: tuple[int, ...] = (), pinned: bool = False) -> None:
        self.index = index
        self.kv_tokens = kv_tokens  # KV length the next step attends to
        self.remaining = remaining  # output tokens still to generate by decode steps
        self.reserved_blocks = reserved_blocks
        # prompt blocks; a decode rank caches them when it finishes; with ``pinned`` (shared prompt
        # blocks on a mixed rank) they are pinned in the rank's cache and unpinned when it finishes
        self.block_hashes = block_hashes
        self.pinned = pinned


@dataclass(slots=True)
class RankPlan:
    """One rank's work in one step (data only)."""

    prefill_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    chunks: list[tuple[PrefillJob, int]] = field(default_factory=list)
    #: prompt tokens before this step's chunks (cached or computed earlier), summed over them
    prefill_cached_tokens: int = 0
    decode_seqs: int = 0
    decode_ctx_tokens: int = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Rank:
    """One DP rank of a simulated engine.

    Args:
        replica: its id (engine name, DP rank).
        index: global rank index (row in per-rank arrays).
        role: prefill, decode or mixed.
        kv_capacity_blocks: KV blocks of the rank (running sequences + prefix cache).
        block_size: tokens per KV block.
        max_prefill_tokens: chunked-prefill token budget per step (mixed: shared with decode).
        max_decode_batch: most running decode sequences.
        share_prompt_blocks: KV accounting of a mixed rank (``Scenario.kv_accounting``). False
            ("reserve"): a sequence reserves blocks for its whole prompt + output at admission,
            apart from the prefix cache, which also holds its prompt once prefilled. True
            ("shared", vLLM / SGLang paged KV): its prompt blocks are the cache's, pinned while it
            runs (its prefix hits from admission, the rest from the end of its prefill), and it
            reserves only the blocks beyond them; when it finishes they become evictable as the
            most recently used. Prefill and decode ranks are not affected.

    Attributes:
        tiers: the rank's lower KV tiers (:class:`sim.run.engine.tiers.RankTiers`), or None.
        kv_listener: ``(medium, stored, block_hashes, rank_index)`` called when the HBM prefix
            cache stores or drops blocks (feeds KV events to the router), or None.
    """

    def __init__(
        self,
        replica: ReplicaId,
        index: int,
        role: Role,
        kv_capacity_blocks: int,
        block_size: int,
        max_prefill_tokens: int,
        max_decode_batch: int,
        share_prompt_blocks: bool = False,
    ) -> None:
        self.replica = replica
        self.share_prompt_blocks = share_prompt_blocks and role is Role.MIXED
        self.index = index
        self.role = role
        self.kv_capacity_blocks = kv_capacity_blocks
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_decode_batch = max_decode_batch
        self.prefill_queue: deque[PrefillJob] = deque()
        self.queued_prefill_tokens = 0  # uncached-or-unknown prompt tokens still to compute
        self.decode_waiting: deque[DecodeSeq] = deque()
        self.running: list[DecodeSeq] = []
        self.running_kv_tokens = 0
        # fewest decode steps any running sequence has left (0 = none running); kept by this class's
        # methods (a sequence removed from `running` directly leaves it a lower bound)
        self.min_remaining = 0
        self.reserved_blocks = 0
        self.cache = BlockCache(kv_capacity_blocks)
        #: a prefix hit is a multiple of this many tokens (hybrid KV models, ModelSpec.prefix_hit_multiple_tokens)
        self.hit_multiple_tokens = 1
        #: where a hit may end on a hybrid-KV model (vLLM's retained sliding-window checkpoints,
        #: :class:`sim.run.engine.hit_checkpoints.HitCheckpoints`); None: at the full-attention match
        self.hit_checkpoints: HitCheckpoints | None = None
        self.tiers = None  # RankTiers | None (sim.run.engine.tiers)
        self.kv_listener = None
        # vLLM scheduler options (PoolConfig; all off by default, set by the cluster):
        #: most sequences running or admitted to prefill (vLLM ``max_num_seqs``); None: only
        #: ``max_decode_batch`` bounds the running decode batch
        self.max_num_seqs: int | None = None
        #: most prompt tokens one request computes in one step (vLLM ``long_prefill_token_threshold``)
        self.max_chunk_tokens: int | None = None
        #: step-budget tokens each decoding sequence takes (1 + draft tokens under speculative
        #: decoding verified in every step, :class:`sim.perf.step_class.StepClassPerf`)
        self.verify_tokens_per_seq = 1
        #: output tokens a decoding sequence gains per step (MTP's mean acceptance length); a
        #: sequence of ``n`` tokens decodes in ``ceil(n / decode_tokens_per_step)`` steps
        self.decode_tokens_per_step = 1.0
        #: vLLM's DP prefill balancing: the last step this rank could prefill on left requests
        #: waiting for admission (it may then prefill on throttled steps too, StepGroup)
        self.prefill_capacity_bound = False
        # totals for imbalance metrics
        self.total_prefill_tokens = 0
        self.total_decode_tokens = 0

    # ------------------------------------------------------------------ queues
    def enqueue_prefill(self, job: PrefillJob) -> None:
        self.prefill_queue.append(job)
        self.queued_prefill_tokens += job.prompt_tokens

    def enqueue_decode(self, seq: DecodeSeq) -> None:
        self.decode_waiting.append(seq)

    @property
    def has_prefill_work(self) -> bool:
        return bool(self.prefill_queue)

    @property
    def has_schedulable_prefill(self) -> bool:
        """A queued job that is not waiting for lower-tier fetches."""
        return any(not job.fetch_pending for job in self.prefill_queue)

    def free_blocks(self) -> int:
        """Blocks neither reserved by a running sequence nor pinned in the cache (evictable cached
        blocks count as free)."""
        return self.kv_capacity_blocks - self.reserved_blocks - self.cache.num_pinned

    def _reserve(self, blocks: int) -> None:
        self.reserved_blocks += blocks
        self._evicted(self.cache.set_capacity(self.kv_capacity_blocks - self.reserved_blocks))

    def _release(self, blocks: int) -> None:
        self.reserved_blocks -= blocks
        self._evicted(self.cache.set_capacity(self.kv_capacity_blocks - self.reserved_blocks))

    def cache_insert(self, block_hashes: tuple[int, ...]) -> None:
        """Hold a prompt's blocks in the HBM prefix cache; evictions are demoted / announced."""
        self._evicted(self.cache.insert(block_hashes))
        if self.kv_listener is not None and block_hashes:
            self.kv_listener("hbm", True, block_hashes[:self.cache.capacity_blocks], self.index)

    def _evicted(self, evicted: list[int]) -> None:
        if not evicted:
            return
        if self.hit_checkpoints is not None:
            self.hit_checkpoints.forget(evicted)
        if self.tiers is not None:
            self.tiers.on_hbm_evicted(evicted)
        if self.kv_listener is not None:
            self.kv_listener("hbm", False, evicted, self.index)

    def _fits(self, blocks: int) -> bool:
        # A sequence larger than the whole rank is admitted alone rather than blocking forever.
        return blocks <= self.free_blocks() or (not self.running and self.reserved_blocks == 0
                                                and self.cache.num_pinned == 0)

    def admit_decode(self) -> list[DecodeSeq]:
        """Move waiting sequences into the running batch (FIFO) while KV blocks and batch slots
        allow. Returns the admitted sequences."""
        admitted: list[DecodeSeq] = []
        waiting = self.decode_waiting
        while waiting and len(self.running) < self.max_decode_batch:
            seq = waiting[0]
            if not self._fits(seq.reserved_blocks):
                break
            waiting.popleft()
            self._reserve(seq.reserved_blocks)
            self._join(seq)
            admitted.append(seq)
        return admitted

    def _join(self, seq: DecodeSeq) -> None:
        if self.decode_tokens_per_step != 1.0:  # MTP: remaining tokens -> remaining steps
            seq.remaining = -(-seq.remaining * 1000 // round(self.decode_tokens_per_step * 1000))
        self.min_remaining = min(self.min_remaining, seq.remaining) if self.running else seq.remaining
        self.running.append(seq)
        self.running_kv_tokens += seq.kv_tokens

    # ------------------------------------------------------------------ planning (pure)
    @property
    def awaiting_admission(self) -> bool:
        """A queued prompt that has not been admitted (scheduled for the first time) yet."""
        return any(job.cached_tokens < 0 for job in self.prefill_queue)

    def plan(self, allow_prefill: bool = True) -> RankPlan:
        """This rank's work for the next step: every running sequence decodes one token; the
        prefill queue fills the remaining token budget in FIFO order (chunked prefill).

        A job is *admitted* the first time it is scheduled: its prefix-cache match is looked up
        then (at least one prompt token is always computed, as engines recompute the last token
        for its logits) and, on a mixed (or decode) rank, KV blocks for its whole sequence are reserved (a job
        that does not fit waits, head of line). With lower tiers (:attr:`tiers`) the blocks HBM
        misses are looked up in the host tier and the shared store, and fetches may start
        (:meth:`sim.run.engine.tiers.RankTiers.admit`); a job with fetches in flight is skipped.
        Those admission effects are the only state this method changes; the step's progress is
        applied by :meth:`apply_prefill`/:meth:`apply_decode`.

        vLLM options (off by default): each decoding sequence takes :attr:`verify_tokens_per_seq`
        tokens of the budget; a job computes at most :attr:`max_chunk_tokens` per step; with
        :attr:`max_num_seqs` a job is admitted only while running plus admitted sequences stay
        below it. ``allow_prefill=False`` (a throttled step of vLLM's DP prefill balancing):
        decode only.
        """
        p = RankPlan(decode_seqs=len(self.running), decode_ctx_tokens=self.running_kv_tokens)
        budget = self.max_prefill_tokens - (p.decode_seqs * self.verify_tokens_per_seq
                                            if self.role is not Role.PREFILL else 0)
        if budget <= 0 or not self.prefill_queue or not allow_prefill:
            return p
        attn = 0.0
        cap = self.max_chunk_tokens
        slots = None
        if self.max_num_seqs is not None:
            slots = self.max_num_seqs - len(self.running) - sum(1 for j in self.prefill_queue if j.cached_tokens >= 0)
        for job in self.prefill_queue:
            if budget <= 0:
                break
            if job.cached_tokens < 0:
                if slots is not None:
                    if slots <= 0:
                        break
                    slots -= 1
                hbm_blocks = self.cache.match(job.block_hashes)
                if self.hit_multiple_tokens > 1:  # hybrid KV: the hit every KV cache group can serve
                    m = self.hit_multiple_tokens
                    hbm_blocks = hbm_blocks * self.block_size // m * m // self.block_size
                checkpoints = self.hit_checkpoints
                if checkpoints is not None:  # hybrid KV: the hit ends at a retained window checkpoint
                    match_blocks = min(hbm_blocks, max(0, job.prompt_tokens - 1) // self.block_size)
                    hbm_blocks = checkpoints.usable_hit_blocks(job.block_hashes, hbm_blocks, job.prompt_tokens)
                if self.role is not Role.PREFILL and not self._fits_job(job, hbm_blocks):
                    break
                if checkpoints is not None:
                    checkpoints.record(job.block_hashes, job.prompt_tokens, hbm_blocks, match_blocks)
                if self.tiers is not None:
                    job.cached_tokens = self.tiers.admit(job, hbm_blocks)
                else:
                    job.cached_tokens = job.hbm_tokens = min(hbm_blocks * self.block_size, job.prompt_tokens - 1)
                job.done_tokens = job.cached_tokens
                self.queued_prefill_tokens -= job.cached_tokens
            if job.fetch_pending:
                continue
            chunk = min(job.prompt_tokens - job.done_tokens, budget)
            if cap is not None and chunk > cap:
                chunk = cap
            budget -= chunk
            p.chunks.append((job, chunk))
            p.prefill_tokens += chunk
            p.prefill_cached_tokens += job.done_tokens
            attn += chunk * job.done_tokens + chunk * (chunk + 1) / 2.0
        p.prefill_attn_pairs = attn
        return p

    def _fits_job(self, job: PrefillJob, hbm_blocks: int) -> bool:
        need = blocks_for(job.prompt_tokens + job.output_tokens, self.block_size)
        if not self.share_prompt_blocks:
            if not self._fits(need):
                return False
            job.reserved_blocks = need
            self._reserve(need)
            return True
        # shared: the prefix hits are pinned now (those not pinned by another sequence stop being
        # evictable, so they count against the free blocks too); the rest is reserved
        hits = job.block_hashes[:hbm_blocks]
        need -= hbm_blocks
        if not self._fits(need + self.cache.count_unpinned(hits)):
            return False
        self._evicted(self.cache.pin(hits))
        job.pinned_blocks = hbm_blocks
        job.reserved_blocks = need
        self._reserve(need)
        return True

    # ------------------------------------------------------------------ applying
    def apply_decode(self, steps: int) -> list[DecodeSeq]:
        """Advance every running sequence by ``steps`` steps (``steps`` tokens, or about ``steps *
        decode_tokens_per_step`` under MTP: ``remaining`` then counts steps); returns (and
        removes) the finished."""
        if not self.running:
            return []
        n = len(self.running)
        grow = steps if self.decode_tokens_per_step == 1.0 else int(round(steps * self.decode_tokens_per_step))
        self.running_kv_tokens += n * grow
        self.total_decode_tokens += n * grow
        finished: list[DecodeSeq] = []
        keep: list[DecodeSeq] = []
        for seq in self.running:
            seq.kv_tokens += grow
            seq.remaining -= steps
            (finished if seq.remaining <= 0 else keep).append(seq)
        if not finished:
            self.min_remaining -= steps  # every sequence advanced by the same steps
        else:
            self.min_remaining = min([seq.remaining for seq in keep], default=0)
            self.running = keep
            for seq in finished:
                self.running_kv_tokens -= seq.kv_tokens
                self._release(seq.reserved_blocks)
                if seq.pinned:
                    self._unpin_prompt(seq.block_hashes)
                elif self.role is Role.DECODE and seq.block_hashes:
                    # the prompt's KV stays as evictable prefix cache (vLLM / SGLang keep freed blocks)
                    self.cache_insert(seq.block_hashes)
        return finished

    def apply_prefill(self, plan: RankPlan, steps: int = 1) -> list[PrefillJob]:
        """Apply the plan's prefill chunks ``steps`` times (``steps > 1`` only for a plan that
        repeats unchanged, i.e. one chunk that does not finish its job within those steps);
        returns the jobs whose prompt is now complete (their blocks enter the prefix cache)."""
        done: list[PrefillJob] = []
        for job, chunk in plan.chunks:
            chunk *= steps
            job.done_tokens += chunk
            self.queued_prefill_tokens -= chunk
            self.total_prefill_tokens += chunk
            if job.done_tokens >= job.prompt_tokens:
                done.append(job)
        for job in done:
            self.prefill_queue.remove(job) if self.prefill_queue[0] is not job else self.prefill_queue.popleft()
            if self.share_prompt_blocks:
                self._pin_prompt(job)
            else:
                self.cache_insert(job.block_hashes)
        return done

    def _pin_prompt(self, job: PrefillJob) -> None:
        """Shared prompt blocks: the prefilled prompt's remaining blocks move from the job's
        reservation into the cache, pinned (announced as stored, as :meth:`cache_insert`)."""
        rest = job.block_hashes[job.pinned_blocks:]
        moved = min(len(rest), job.reserved_blocks)
        job.reserved_blocks -= moved
        self._release(moved)
        self._evicted(self.cache.pin(rest))
        job.pinned_blocks = len(job.block_hashes)
        if self.kv_listener is not None and job.block_hashes:
            self.kv_listener("hbm", True, job.block_hashes, self.index)

    def _unpin_prompt(self, block_hashes: tuple[int, ...]) -> None:
        self._evicted(self.cache.unpin(block_hashes))

    def start_decode_local(self, job: PrefillJob, remaining: int) -> DecodeSeq | None:
        """Mixed rank: a prefilled job joins this rank's running batch (its KV is already
        reserved). Returns the sequence, or None if it has nothing left to decode (the
        reservation is released)."""
        if remaining <= 0:
            self._release(job.reserved_blocks)
            if self.share_prompt_blocks:
                self._unpin_prompt(job.block_hashes)
            return None
        if self.share_prompt_blocks:
            seq = DecodeSeq(job.index, job.prompt_tokens + 1, remaining, job.reserved_blocks, job.block_hashes, True)
        else:
            seq = DecodeSeq(job.index, job.prompt_tokens + 1, remaining, job.reserved_blocks)
        self._join(seq)
        return seq
