"""The emulated engine's scheduler: the simulator's DP ranks stepped in real time.

:class:`EngineCore` owns ``dp_ranks`` :class:`sim.run.engine.rank.Rank` objects (the very planning
code the simulator runs: FIFO chunked prefill, KV-capacity admission, prefix cache) grouped into
step groups as in :mod:`sim.run.engine.step_group` (all ranks together for a wide-EP engine, one group
per rank otherwise). One asyncio task per group loops::

    admit waiting decode sequences -> plan one step per rank -> dt = perf.step_time_s(...)
    -> sleep until the step's end -> apply (emit one token per running sequence, finish prompts)

Time is kept on a *virtual* clock that advances by exactly ``dt / speed`` per step and resyncs to
the real clock only when the group was idle, so timer jitter does not accumulate: a stream of
``n`` tokens takes the perf model's time (divided by ``speed``) plus one sleep's jitter.
If the host falls more than ``MAX_LAG_S`` behind, the virtual clock jumps forward (the engine
stays slower rather than bursting).

Request kinds (``mode``):

* ``"local"``: prefill and decode here (mixed engine, or a decode engine serving a request alone);
  the first token is emitted when prefill finishes.
* ``"prefill"``: prefill only (a PD prefill leg); one token, then done.
* ``"remote"``: a PD decode leg whose KV was transferred; the sequence joins decode admission and
  its first token is emitted at admission (as in :mod:`sim.run.cluster`).

Events are pushed to each request's ``asyncio.Queue`` as ``("token", k)``, ``("done", reason)``.
No HTTP here; :mod:`sim.emulator.app` owns I/O.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from balancer.types import ReplicaId, Role
from sim.run.engine.rank import DecodeSeq, PrefillJob, Rank, blocks_for
from sim.perf.base import PerfModel

# sim.run.engine.rank decode ranks cache a finished sequence's prompt blocks when DecodeSeq carries them
_DECODE_CACHES_PROMPTS = "block_hashes" in getattr(DecodeSeq, "__slots__", ())

#: Largest real-clock lag (seconds) a step group catches up on before its virtual clock jumps.
MAX_LAG_S = 0.02


@dataclass(eq=False)
class EngineRequest:
    """One request inside the core.

    Attributes:
        rid: the request id (SGLang ``rid`` / vLLM ``X-Request-Id``).
        prompt_tokens / output_tokens: lengths in tokens (``output_tokens`` are generated exactly).
        block_hashes: chained prompt block hashes (the rank's prefix cache matches them).
        mode: ``"local"``, ``"prefill"`` or ``"remote"`` (module docstring).
        rank: the DP rank serving it.
        events: the stream of ``("token", k)`` / ``("done", reason)`` tuples.
        cached_tokens: prefix tokens reused from the rank's cache (known once prefill starts).
    """

    rid: str
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    mode: str
    rank: Rank
    index: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    emitted: int = 0
    cached_tokens: int = 0
    done: bool = False
    job: PrefillJob | None = None
    seq: DecodeSeq | None = None


class _Group:
    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None


class EngineCore:
    """Real-time engine scheduler driven by a :class:`~sim.perf.base.PerfModel`.

    Args:
        perf: step-latency model of the whole engine (``R = dp_ranks`` ranks).
        role: prefill, decode or mixed.
        dp_ranks: attention DP ranks.
        block_size: tokens per KV block (prefix cache granularity).
        max_prefill_tokens / max_decode_batch: per-rank scheduler limits (as :class:`sim.scenario.PoolConfig`).
        kv_capacity_tokens: KV capacity per rank; default the perf model's.
        speed: time compression: the engine runs ``speed`` times faster than the model says.

    Raises:
        ValueError: ``speed`` <= 0 or ``dp_ranks`` < 1.
    """

    def __init__(self, perf: PerfModel, role: Role | str, *, dp_ranks: int = 1, block_size: int = 64,
                 max_prefill_tokens: int = 8192, max_decode_batch: int = 256,
                 kv_capacity_tokens: int | None = None, speed: float = 1.0, name: str = "engine") -> None:
        if speed <= 0 or dp_ranks < 1:
            raise ValueError("speed must be > 0 and dp_ranks >= 1")
        self.perf = perf
        self.role = Role(role)
        self.speed = float(speed)
        self.block_size = block_size
        cap_tokens = kv_capacity_tokens or perf.kv_capacity_tokens_per_rank
        cap_blocks = max(1, cap_tokens // block_size)
        self.ranks = [Rank(ReplicaId(name, d), d, self.role, cap_blocks, block_size, max_prefill_tokens,
                           max_decode_batch) for d in range(dp_ranks)]
        ep = perf.ep_synchronous
        self.groups = [_Group(self.ranks)] if ep else [_Group([r]) for r in self.ranks]
        self._group_of = {id(r): g for g in self.groups for r in g.ranks}
        self._reqs: dict[int, EngineRequest] = {}
        self._by_rid: dict[str, EngineRequest] = {}
        self._aborts: deque[EngineRequest] = deque()
        self._ids = itertools.count()
        self._rr = itertools.count()
        self.num_finished = 0
        self.num_aborted = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start one stepping task per step group (call inside the running loop)."""
        for g in self.groups:
            if g.task is None:
                g.task = asyncio.create_task(self._run(g))

    async def stop(self) -> None:
        for g in self.groups:
            if g.task is not None:
                g.task.cancel()
        await asyncio.gather(*(g.task for g in self.groups if g.task is not None), return_exceptions=True)
        for g in self.groups:
            g.task = None

    # ------------------------------------------------------------------ requests
    def pick_rank(self, dp_rank: int | None = None) -> Rank:
        """The requested DP rank, else the rank with the fewest requests (round robin on ties)."""
        if dp_rank is not None:
            return self.ranks[int(dp_rank) % len(self.ranks)]
        start = next(self._rr)
        n = len(self.ranks)
        order = [self.ranks[(start + k) % n] for k in range(n)]
        return min(order, key=lambda r: len(r.prefill_queue) + len(r.running) + len(r.decode_waiting))

    def held_tokens(self, block_hashes: tuple[int, ...], dp_rank: int | None = None) -> int:
        """Prompt tokens whose blocks the rank's prefix cache holds now (``dp_rank``, or the only
        rank; 0 with several ranks and no ``dp_rank``)."""
        if dp_rank is None and len(self.ranks) > 1:
            return 0
        rank = self.ranks[0 if dp_rank is None else int(dp_rank) % len(self.ranks)]
        return rank.cache.match(block_hashes) * self.block_size

    def submit(self, rid: str, prompt_tokens: int, output_tokens: int, block_hashes: tuple[int, ...],
               mode: str = "local", dp_rank: int | None = None) -> EngineRequest:
        """Queue a request; returns its handle (read ``handle.events``).

        Raises:
            ValueError: unknown mode, lengths < 1, or ``rid`` already running.
        """
        if mode not in ("local", "prefill", "remote"):
            raise ValueError(f"unknown mode {mode!r}")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        if rid in self._by_rid:
            raise ValueError(f"request {rid!r} is already running")
        rank = self.pick_rank(dp_rank)
        i = next(self._ids)
        req = EngineRequest(rid, prompt_tokens, output_tokens if mode != "prefill" else 1, block_hashes, mode, rank, i)
        self._reqs[i] = req
        self._by_rid[rid] = req
        if mode == "remote":
            if req.output_tokens <= 1:  # the transferred prefill token is the whole output
                self._emit(req, 1)
                self._finish(req, "length")
                return req
            reserved = blocks_for(prompt_tokens + req.output_tokens, self.block_size)
            req.seq = DecodeSeq(i, prompt_tokens + 1, req.output_tokens - 1, reserved)
            if _DECODE_CACHES_PROMPTS:  # the decode rank keeps the prompt's blocks when it finishes
                req.seq.block_hashes = block_hashes
            rank.enqueue_decode(req.seq)
        else:
            req.job = PrefillJob(i, prompt_tokens, req.output_tokens, block_hashes)
            rank.enqueue_prefill(req.job)
        self._group_of[id(rank)].wake.set()
        return req

    def abort(self, rid: str) -> bool:
        """Abort a running request at the next step boundary; returns whether it was running."""
        req = self._by_rid.get(rid)
        if req is None or req.done:
            return False
        self._aborts.append(req)
        self._finish(req, "abort")
        self.num_aborted += 1
        self._group_of[id(req.rank)].wake.set()
        return True

    # ------------------------------------------------------------------ load (for /metrics)
    @property
    def num_running(self) -> int:
        return sum(len(r.running) + sum(1 for j in r.prefill_queue if j.cached_tokens >= 0) for r in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(len(r.decode_waiting) + sum(1 for j in r.prefill_queue if j.cached_tokens < 0) for r in self.ranks)

    @property
    def kv_usage(self) -> float:
        """Reserved KV blocks / capacity over all ranks, in [0, 1]."""
        cap = sum(r.kv_capacity_blocks for r in self.ranks)
        return min(1.0, sum(r.reserved_blocks for r in self.ranks) / cap) if cap else 0.0

    # ------------------------------------------------------------------ internals
    def _emit(self, req: EngineRequest, k: int) -> None:
        if not req.done:
            req.emitted += k
            req.events.put_nowait(("token", k))

    def _finish(self, req: EngineRequest, reason: str) -> None:
        if req.done:
            return
        req.done = True
        if reason != "abort":
            self.num_finished += 1
            self._forget(req)
        req.events.put_nowait(("done", reason))

    def _forget(self, req: EngineRequest) -> None:
        self._reqs.pop(req.index, None)
        if self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]

    def _remove(self, req: EngineRequest) -> None:
        """Take an aborted request off its rank (only between steps)."""
        rank = req.rank
        job, seq = req.job, req.seq
        if job is not None and job in rank.prefill_queue:
            rank.prefill_queue.remove(job)
            rank.queued_prefill_tokens -= job.prompt_tokens - max(job.done_tokens, 0)
            if job.reserved_blocks:
                rank._release(job.reserved_blocks)
        if seq is not None:
            if seq in rank.decode_waiting:
                rank.decode_waiting.remove(seq)
            elif seq in rank.running:
                rank.running.remove(seq)
                rank.running_kv_tokens -= seq.kv_tokens
                rank._release(seq.reserved_blocks)
        self._forget(req)

    async def _run(self, g: _Group) -> None:
        loop = asyncio.get_running_loop()
        perf, speed = self.perf, self.speed
        vt = loop.time()
        while True:
            while self._aborts:
                self._remove(self._aborts.popleft())
            for rank in g.ranks:
                for seq in rank.admit_decode():
                    req = self._reqs.get(seq.index)
                    if req is not None:
                        self._emit(req, 1)  # the transferred prefill token
            if not any(r.prefill_queue or r.running for r in g.ranks):
                g.wake.clear()
                await g.wake.wait()
                vt = max(vt, loop.time())
                continue
            vt = max(vt, loop.time() - MAX_LAG_S)
            plans = [r.plan() for r in g.ranks]
            work = (np.array([p.prefill_tokens for p in plans], dtype=np.float64),
                    np.array([p.prefill_attn_pairs for p in plans], dtype=np.float64),
                    np.array([p.decode_seqs for p in plans], dtype=np.float64),
                    np.array([p.decode_ctx_tokens for p in plans], dtype=np.float64))
            if perf.wants_prefill_cached_tokens:  # as sim.run.engine.step_group
                dt = float(perf.step_time_s(*work, prefill_cached_tokens=np.array(
                    [p.prefill_cached_tokens for p in plans], dtype=np.float64)))
            else:
                dt = float(perf.step_time_s(*work))
            vt += dt / speed
            delay = vt - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            for rank, plan in zip(g.ranks, plans):
                for seq in rank.running:
                    req = self._reqs.get(seq.index)
                    if req is not None:
                        self._emit(req, 1)
                for seq in rank.apply_decode(1):
                    req = self._reqs.get(seq.index)
                    if req is not None:
                        self._finish(req, "length")
                if plan.chunks:
                    for job in rank.apply_prefill(plan):
                        self._on_prefill_done(rank, job)

    def _on_prefill_done(self, rank: Rank, job: PrefillJob) -> None:
        req = self._reqs.get(job.index)
        if req is None:  # aborted during the step: undo a local reservation
            if job.reserved_blocks:
                rank._release(job.reserved_blocks)
            return
        req.cached_tokens = job.cached_tokens
        self._emit(req, 1)
        if req.mode == "prefill" or rank.role is Role.PREFILL:
            self._finish(req, "length")
            return
        req.seq = rank.start_decode_local(job, req.output_tokens - 1)
        if req.seq is None:
            self._finish(req, "length")
