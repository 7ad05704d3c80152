"""The SimPy process that steps a group of DP ranks together.

A *step group* is the set of DP ranks that run each forward step together: all ranks of a wide-EP
engine (their MoE dispatch/combine synchronises them, so a step lasts as long as the most loaded
rank), or a single rank of a dense engine. One process per group.

Two ways to advance time:

- **step by step** while any rank has prefill work (or always, with ``fast_forward=False``, the
  exact reference mode): plan one step per rank, ask the perf model for its duration, wait, apply.
  Jobs waiting for lower-tier KV fetches are not work: a step in which every admitted job is
  fetching is not taken (the group waits for the fetch to notify it).
- **decode fast-forward** when the group only decodes: the batch composition cannot change until
  the next sequence finishes (``n = min(remaining)`` steps) unless new work arrives, so the ``n``
  step times are computed in one vectorised perf-model call (KV lengths grow by one token per
  sequence per step) and the process waits once. New work interrupts the wait; the step in
  progress then completes and the batch is re-planned, exactly where the step-by-step mode would
  re-plan. Events per request therefore do not grow with output length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import simpy

from sim.engine.rank import DecodeSeq, PrefillJob, Rank, RankPlan
from sim.perf.base import PerfModel

#: Longest decode segment evaluated in one vectorised call (bounds memory: steps x ranks floats).
MAX_SEGMENT_STEPS = 4096


class StepGroup:
    """Steps ``ranks`` together with ``perf`` timing.

    Callbacks (all receive the rank, the job/sequence and ``env.now``):
        on_prefill_done(rank, job, now_s): a prompt finished prefill on the rank.
        on_decode_admitted(rank, seq, now_s): a waiting sequence joined the running batch.
        on_decode_finished(rank, seq, now_s): a sequence generated its last token.
    """

    def __init__(
        self,
        env: simpy.Environment,
        ranks: Sequence[Rank],
        perf: PerfModel,
        *,
        on_prefill_done: Callable[[Rank, PrefillJob, float], None],
        on_decode_admitted: Callable[[Rank, DecodeSeq, float], None],
        on_decode_finished: Callable[[Rank, DecodeSeq, float], None],
        fast_forward: bool = True,
    ) -> None:
        self.env = env
        self.ranks = list(ranks)
        self.perf = perf
        self.on_prefill_done = on_prefill_done
        self.on_decode_admitted = on_decode_admitted
        self.on_decode_finished = on_decode_finished
        self.fast_forward = fast_forward
        self._wake = env.event()
        self.num_steps = 0  # forward steps simulated
        self.num_waits = 0  # SimPy waits (events) this process made
        self.busy_s = 0.0
        self.process = env.process(self._run())

    def notify(self) -> None:
        """New work arrived on one of the group's ranks: re-plan at the next step boundary."""
        if not self._wake.triggered:
            self._wake.succeed()

    # ------------------------------------------------------------------ the process
    def _run(self):  # noqa: ANN202 (SimPy generator)
        env = self.env
        ranks = self.ranks
        while True:
            if self._wake.triggered:
                self._wake = env.event()
            now = env.now
            for rank in ranks:
                for seq in rank.admit_decode():
                    self.on_decode_admitted(rank, seq, now)
            has_prefill = any(r.has_schedulable_prefill for r in ranks)
            has_decode = any(r.running for r in ranks)
            if not has_prefill and not has_decode:
                self.num_waits += 1
                yield self._wake
                continue
            if has_prefill or not self.fast_forward:
                plans = [r.plan() for r in ranks]
                if not any(p.chunks or p.decode_seqs for p in plans):
                    continue  # every admitted job is fetching from a lower KV tier: wait for it
                for plan in plans:
                    for job, _ in plan.chunks:
                        if job.start_s < 0:
                            job.start_s = now
                dt = float(
                    self.perf.step_time_s(
                        np.array([p.prefill_tokens for p in plans], dtype=np.float64),
                        np.array([p.prefill_attn_pairs for p in plans], dtype=np.float64),
                        np.array([p.decode_seqs for p in plans], dtype=np.float64),
                        np.array([p.decode_ctx_tokens for p in plans], dtype=np.float64),
                    )
                )
                self.num_waits += 1
                yield env.timeout(dt)
                self.num_steps += 1
                self.busy_s += dt
                self._apply(plans, 1)
            else:
                yield from self._decode_segment()

    def _apply(self, plans: list[RankPlan] | None, steps: int) -> None:
        now = self.env.now
        for i, rank in enumerate(self.ranks):
            finished = rank.apply_decode(steps)
            for seq in finished:
                self.on_decode_finished(rank, seq, now)
            if plans is not None and plans[i].chunks:
                for job in rank.apply_prefill(plans[i]):
                    self.on_prefill_done(rank, job, now)

    def _decode_segment(self):  # noqa: ANN202
        env = self.env
        ranks = self.ranks
        batch = np.array([len(r.running) for r in ranks], dtype=np.float64)
        ctx0 = np.array([r.running_kv_tokens for r in ranks], dtype=np.float64)
        n = min(min(s.remaining for s in r.running) for r in ranks if r.running)
        n = max(1, min(n, MAX_SEGMENT_STEPS))
        k = np.arange(n, dtype=np.float64)[:, None]
        ctx = ctx0[None, :] + k * batch[None, :]
        zeros = np.zeros_like(ctx)
        times = np.asarray(self.perf.step_time_s(zeros, zeros, np.broadcast_to(batch, ctx.shape), ctx), dtype=np.float64)
        cum = np.cumsum(times)
        start = env.now
        wake = self._wake
        self.num_waits += 1
        done = env.timeout(float(cum[-1]))
        yield done | wake
        steps = n
        if not done.processed and wake.triggered:
            elapsed = env.now - start
            completed = int(np.searchsorted(cum, elapsed, side="right"))
            steps = min(completed + 1, n)  # the step in progress completes
            rest = float(cum[steps - 1]) - elapsed
            if rest > 0:
                self.num_waits += 1
                yield env.timeout(rest)
        self.num_steps += steps
        self.busy_s += float(cum[steps - 1])
        self._apply(None, steps)
