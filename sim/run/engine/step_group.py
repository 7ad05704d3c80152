"""The SimPy process that steps a group of DP ranks together.

A *step group* is the set of DP ranks that run each forward step together: all ranks of a wide-EP
engine (their MoE dispatch/combine synchronises them, so a step lasts as long as the most loaded
rank), or a single rank of a dense engine. One process per group.

Two ways to advance time:

- **step by step** (always, with ``fast_forward=False``, the exact reference mode): plan one step
  per rank, ask the perf model for its duration, wait, apply. Jobs waiting for lower-tier KV
  fetches are not work: a step in which every admitted job is fetching is not taken (the group
  waits for the fetch to notify it).
- **fast-forward** (default): while the group's composition cannot change, ``n`` steps are
  computed in one vectorised perf-model call (shape ``(n, R)``) and the process waits once.

  * Decode: every running sequence adds one token of KV per step, so ``decode_ctx_tokens`` grows
    by the batch size per step; the batch is unchanged until the first sequence finishes
    (``n <= min(remaining)``, the finishing step included).
  * Chunked prefill: a step in which no prefill job finishes schedules exactly one job per rank
    (FIFO chunking gives every earlier job its whole remainder, which would finish it; jobs waiting
    for KV fetches are skipped) and gives it the whole token budget ``c``; while that holds, the
    next steps repeat it with the job's prefix growing by ``c`` tokens per step (attention pairs
    ``c * (done + j * c) + c * (c + 1) / 2`` at step ``j``). A rank contributes
    ``(remaining - 1) // c`` such steps; the step in which a job finishes is planned and taken on
    its own at its real start time, so admissions (prefix-cache lookup, KV reservation, tier
    fetches) of the jobs behind it and its prefill-done callback happen exactly when the
    step-by-step mode has them. Mixed ranks are covered by the same rule (their budget is
    ``max_prefill_tokens`` minus the constant decode batch).

  With vLLM's DP prefill balancing (``prefill_schedule_interval > 1``) a group with queued prefill
  goes step by step (decode-only segments without queued prefill still fast-forward).

  An EP group steps at the max over ranks per step (inside the perf model); a segment lasts the
  fewest steps any rank allows. New work (arrival, KV transfer, fetch completion) interrupts the
  wait; the step in progress then completes and the group re-plans, exactly where the
  step-by-step mode would re-plan. Events per request therefore do not grow with output length
  or prompt length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np
import simpy

from sim.run.engine.rank import DecodeSeq, PrefillJob, Rank, RankPlan
from sim.perf.base import PerfModel

#: Longest segment evaluated in one vectorised call (bounds memory: steps x ranks floats).
MAX_SEGMENT_STEPS = 4096
#: Step classes of :meth:`StepGroup.iteration_times` (a rank's part of one step).
STEP_CLASSES = ("prefill_only", "decode_only", "mixed")

_running = attrgetter("running")
_running_kv_tokens = attrgetter("running_kv_tokens")
_decode_waiting = attrgetter("decode_waiting")
_prefill_queue = attrgetter("prefill_queue")


class StepGroup:
    """Steps ``ranks`` together with ``perf`` timing.

    Callbacks (all receive the rank, the job/sequence and ``env.now``):
        on_prefill_done(rank, job, now_s): a prompt finished prefill on the rank.
        on_decode_admitted(rank, seq, now_s): a waiting sequence joined the running batch.
        on_decode_finished(rank, seq, now_s): a sequence generated its last token.

    Attributes:
        num_steps: forward steps simulated (equal in both modes).
        num_waits: SimPy waits (events) the process made.
        busy_s: seconds the group spent stepping.
        prefill_busy_s / decode_busy_s: seconds of steps with prefill work / of decode-only steps.
        prefill_imbalance_s / decode_imbalance_s: the same steps' seconds weighted by the step's
            ``max_r work_r / mean_r work_r`` (work = prefill tokens computed in a prefill step,
            decode KV tokens attended in a decode-only step): their ratio to the busy seconds is
            the time-weighted imbalance of the work that sets the step (1 = balanced, ``R`` = one
            rank does everything).
        prefill_wait_s / decode_wait_s: ``sum_steps dt * (1 - mean_r work_r / max_r work_r)``: the
            average rank's seconds spent waiting for the slowest one (0 for a group of one rank).
        open_prefill_steps / bound_prefill_steps / idle_prefill_steps: with
            ``prefill_schedule_interval > 1``, the steps that carried prefill on some rank: on a
            step open to prefill; on a step between them because a rank was capacity bound (a
            prompt waited for admission after its last prefill-capable step) and prefilled; else
            because a rank with nothing to decode prefilled. Each such step is a mixed step for
            the whole group (0 with interval 1).

    Options (off by default):
        prefill_schedule_interval: vLLM's DP prefill balancing (``--prefill-schedule-interval``):
            every ``k``-th step (counted from the group's first) is open to prefill; on the steps
            between, a rank defers all prefill (running chunks and admissions) when it has a
            sequence decoding and its last prefill-capable step left no prompt waiting for
            admission (:attr:`Rank.prefill_capacity_bound`); a rank with nothing to decode
            prefills on every step (in an EP group its step then sets every rank's step time).
        record_iterations: keep one record per rank per step (the step's seconds and the rank's
            class: prefill-only, decode-only, mixed; idle ranks are not recorded), as vLLM's
            forward-pass metrics do: :meth:`iteration_times`.
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
        prefill_schedule_interval: int = 1,
        record_iterations: bool = False,
    ) -> None:
        if prefill_schedule_interval < 1:
            raise ValueError(f"prefill_schedule_interval must be >= 1, got {prefill_schedule_interval}")
        self.env = env
        self.ranks = list(ranks)
        self.perf = perf
        self.on_prefill_done = on_prefill_done
        self.on_decode_admitted = on_decode_admitted
        self.on_decode_finished = on_decode_finished
        self.fast_forward = fast_forward
        # a causal encoder-decoder roofline (V4.1) prices a step by its chunk count (a replay window
        # each), which it recovers from the cached prefix (RooflinePerf.wants_prefill_cached_tokens)
        self._pass_cached = bool(perf.wants_prefill_cached_tokens)
        self._wake = env.event()
        self.num_steps = 0
        self.num_waits = 0
        self.busy_s = 0.0
        self.prefill_busy_s = self.decode_busy_s = 0.0
        self.prefill_imbalance_s = self.decode_imbalance_s = 0.0
        self.prefill_wait_s = self.decode_wait_s = 0.0
        self.open_prefill_steps = self.bound_prefill_steps = self.idle_prefill_steps = 0
        self.prefill_schedule_interval = prefill_schedule_interval
        self.record_iterations = record_iterations
        #: per recorded step or segment: step seconds ``(k,)`` and ranks per class ``(k, 3)``
        self._iter_times: list[np.ndarray] = []
        self._iter_counts: list[np.ndarray] = []
        #: with ``record_iterations``: per rank, recorded steps by class ``(ranks, 3)`` (prefill-only,
        #: decode-only, mixed) and the seconds of the steps in which the rank had work ``(ranks,)``
        self.rank_class_steps = np.zeros((len(self.ranks), len(STEP_CLASSES)), dtype=np.int64)
        self.rank_active_s = np.zeros(len(self.ranks), dtype=np.float64)
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
            for rank in filter(_decode_waiting, ranks):
                for seq in rank.admit_decode():
                    self.on_decode_admitted(rank, seq, now)
            has_prefill = any(r.has_schedulable_prefill for r in filter(_prefill_queue, ranks))
            interval = self.prefill_schedule_interval
            if not has_prefill:
                if not any(map(_running, ranks)):
                    self.num_waits += 1
                    yield self._wake
                    continue
                if self.fast_forward:
                    n = min(r.min_remaining for r in ranks if r.running)
                    yield from self._segment(None, max(1, min(n, MAX_SEGMENT_STEPS)))
                    continue
            if interval == 1:
                plans = [r.plan() for r in ranks]
            else:
                open_step = self.num_steps % interval == 0
                plans = []
                bound = idle = False  # a capacity-bound / an idle rank prefills on a step between open ones
                for r in ranks:
                    was_bound = r.prefill_capacity_bound
                    allow = open_step or was_bound or not r.running
                    plan = r.plan(allow)
                    plans.append(plan)
                    if allow:
                        r.prefill_capacity_bound = r.awaiting_admission
                        if plan.chunks and not open_step:
                            if was_bound:
                                bound = True
                            else:
                                idle = True
                if open_step:
                    if any(p.chunks for p in plans):
                        self.open_prefill_steps += 1
                elif bound:
                    self.bound_prefill_steps += 1
                elif idle:
                    self.idle_prefill_steps += 1
            if not any(p.chunks or p.decode_seqs for p in plans):
                # every admitted job is fetching from a lower KV tier (and the next one may wait
                # for KV blocks those fetching jobs reserved): a fetch completion notifies us
                self.num_waits += 1
                yield self._wake
                continue
            for plan in plans:
                for job, _ in plan.chunks:
                    if job.start_s < 0:
                        job.start_s = now
            n = self._steady_steps(plans) if self.fast_forward and interval == 1 else 1
            if n > 1:
                yield from self._segment(plans, n)
                continue
            pt = np.array([p.prefill_tokens for p in plans], dtype=np.float64)
            dc = np.array([p.decode_ctx_tokens for p in plans], dtype=np.float64)
            args = (pt, np.array([p.prefill_attn_pairs for p in plans], dtype=np.float64),
                    np.array([p.decode_seqs for p in plans], dtype=np.float64), dc)
            if self._pass_cached:
                # several prompts in one rank's step: the pairs alone do not say how many
                dt = float(self.perf.step_time_s(*args, prefill_cached_tokens=np.array(
                    [p.prefill_cached_tokens for p in plans], dtype=np.float64)))
            else:
                dt = float(self.perf.step_time_s(*args))
            if len(plans) > 1:
                self._account_one(pt, dc, dt)
            if self.record_iterations:
                ds = args[2]
                self._iter_times.append(np.array([dt]))
                self._iter_counts.append(np.array([[np.sum((pt > 0) & (ds == 0)), np.sum((pt == 0) & (ds > 0)),
                                                    np.sum((pt > 0) & (ds > 0))]], dtype=np.int64))
                self._rank_record(pt > 0, ds > 0, 1, dt)
            self.num_waits += 1
            yield env.timeout(dt)
            self.num_steps += 1
            self.busy_s += dt
            self._apply(plans, 1)

    def iteration_times(self) -> dict[str, np.ndarray]:
        """Recorded per-rank step seconds by class (``STEP_CLASSES``), one entry per rank per
        step in which the rank had work (``record_iterations``; empty arrays otherwise)."""
        if not self._iter_times:
            return {c: np.zeros(0) for c in STEP_CLASSES}
        t = np.concatenate(self._iter_times)
        c = np.concatenate(self._iter_counts)
        return {name: np.repeat(t, c[:, j]) for j, name in enumerate(STEP_CLASSES)}

    def _steady_steps(self, plans: list[RankPlan]) -> int:
        """Steps from now (this one included) for which every rank's plan repeats with only its
        prefix and KV lengths growing: no prefill job finishes in them and no decode sequence
        finishes before the last. 1 when this step itself changes the composition."""
        n = MAX_SEGMENT_STEPS
        for rank, plan in zip(self.ranks, plans):
            if plan.chunks:
                if len(plan.chunks) > 1:
                    return 1  # an earlier job finishes in this step
                job, chunk = plan.chunks[0]
                n = min(n, (job.prompt_tokens - job.done_tokens - 1) // chunk)
            if rank.running:
                n = min(n, rank.min_remaining)
            if n <= 1:
                return 1
        return n

    def _apply(self, plans: list[RankPlan] | None, steps: int) -> None:
        now = self.env.now
        for i, rank in enumerate(self.ranks):
            if rank.running:
                for seq in rank.apply_decode(steps):
                    self.on_decode_finished(rank, seq, now)
            if plans is not None and plans[i].chunks:
                for job in rank.apply_prefill(plans[i], steps):
                    self.on_prefill_done(rank, job, now)

    def _segment(self, plans: list[RankPlan] | None, n: int):  # noqa: ANN202
        """Fast-forward: up to ``n`` steps in one wait. ``plans`` are this step's plans when a
        rank prefills (every rank's plan then steady for ``n`` steps, see :meth:`_steady_steps`),
        or None for a decode-only group (``n`` <= steps until the first sequence finishes)."""
        env = self.env
        ranks = self.ranks
        batch = np.array(list(map(len, map(_running, ranks))), dtype=np.float64)
        ctx0 = np.array(list(map(_running_kv_tokens, ranks)), dtype=np.float64)
        k = np.arange(n, dtype=np.float64)[:, None]
        tau = ranks[0].decode_tokens_per_step  # KV tokens a sequence gains per step (MTP: > 1)
        ctx = ctx0 + k * batch * tau if tau != 1.0 else ctx0 + k * batch
        seqs = np.empty_like(ctx)
        seqs[:] = batch
        if plans is None:
            tokens = pairs = np.zeros_like(ctx)
        else:
            chunk = np.array([p.prefill_tokens for p in plans], dtype=np.float64)
            done0 = np.array([p.chunks[0][0].done_tokens if p.chunks else 0 for p in plans], dtype=np.float64)
            tokens = np.empty_like(ctx)
            tokens[:] = chunk
            pairs = chunk * (done0 + k * chunk) + chunk * (chunk + 1.0) / 2.0  # causal_attn_pairs
        times = np.asarray(self.perf.step_time_s(tokens, pairs, seqs, ctx), dtype=np.float64)
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
        if self.record_iterations:
            has_d = batch > 0
            has_p = (chunk > 0) if plans is not None else np.zeros_like(has_d)
            cls = np.array([[np.sum(has_p & ~has_d), np.sum(~has_p & has_d), np.sum(has_p & has_d)]], dtype=np.int64)
            self._iter_times.append(times[:steps].copy())
            self._iter_counts.append(np.repeat(cls, steps, axis=0))
            self._rank_record(has_p, has_d, steps, float(cum[steps - 1]))
        if len(ranks) > 1:
            if plans is None:
                self._account("decode", ctx[:steps], times[:steps])
            else:
                self._account("prefill", tokens[:steps], times[:steps])
        self._apply(plans, steps)

    def _rank_record(self, has_p: np.ndarray, has_d: np.ndarray, steps: int, seconds: float) -> None:
        """Per-rank records of ``steps`` steps lasting ``seconds`` in all, in which rank ``r`` prefills
        ``has_p[r]`` and decodes ``has_d[r]`` (bool arrays, shape ``(ranks,)``)."""
        self.rank_class_steps[:, 0] += steps * (has_p & ~has_d)
        self.rank_class_steps[:, 1] += steps * (~has_p & has_d)
        self.rank_class_steps[:, 2] += steps * (has_p & has_d)
        self.rank_active_s += seconds * (has_p | has_d)

    def _account_one(self, pt: np.ndarray, dc: np.ndarray, dt: float) -> None:
        """:meth:`_account` of one step, in plain floats (the per-event path)."""
        if pt[pt.argmax()] > 0:
            w, kind = pt, "prefill"
        else:
            w, kind = dc, "decode"
        mx = float(w[w.argmax()])
        if mx <= 0:
            return
        ratio = float(w.sum()) / (len(w) * mx)
        setattr(self, f"{kind}_busy_s", getattr(self, f"{kind}_busy_s") + dt)
        setattr(self, f"{kind}_imbalance_s", getattr(self, f"{kind}_imbalance_s") + dt / ratio)
        setattr(self, f"{kind}_wait_s", getattr(self, f"{kind}_wait_s") + dt * (1.0 - ratio))

    def _account(self, kind: str, work: np.ndarray, times: np.ndarray) -> None:
        """Imbalance counters (class docstring) of ``k`` steps of one kind: ``work`` ``(k, R)``
        (prefill tokens of a prefill segment, KV tokens of a decode-only one), ``times`` ``(k,)`` s."""
        R = work.shape[-1]
        if R < 2:
            return
        mx = work.max(axis=1)
        if mx[mx.argmin()] <= 0:  # some steps without work (not in steady segments; kept exact)
            ok = mx > 0
            work, mx, times = work[ok], mx[ok], times[ok]
            if not len(mx):
                return
        ratio = work.sum(axis=1) / (R * mx)  # mean / max in (0, 1]
        busy = float(times.sum())
        weighted = float((times / ratio).sum())
        if kind == "prefill":
            self.prefill_busy_s += busy
            self.prefill_imbalance_s += weighted
            self.prefill_wait_s += busy - float((times * ratio).sum())
        else:
            self.decode_busy_s += busy
            self.decode_imbalance_s += weighted
            self.decode_wait_s += busy - float((times * ratio).sum())
