"""Closed-loop simulation of one vLLM DP/EP engine under an agentic replay (AgentX point 440246).

One engine of ``dp_ranks`` DP-attention ranks sharing wide-EP experts, driven by the closed-loop
lanes of :mod:`sim.workload.agentic`, routed to ranks by a rank-choice function (default:
vllm-router's DP-aware consistent hashing, :mod:`balancer.policies.dp_consistent_hash`). Time in
seconds, token counts in tokens.

The engine, as the 440246 launcher configures vLLM (``sim/data/agentx_440246.json``):

* **lockstep ranks**: under expert parallelism every DP rank runs every forward (a rank with
  nothing to do runs a dummy batch), so a step of the engine lasts as long as its slowest rank
  (:meth:`RooflinePerf.step_time_breakdown` over the rank axis) and every rank records that
  duration (the published per-rank record counts agree within 0.2%: lockstep);
* **scheduler per rank** (vLLM V1): decoding sequences first, ``1 + spec_tokens`` tokens each
  (MTP verifies the drafts in one forward), then prefill chunks first-come-first-served from the
  budget ``max_num_batched_tokens``, at most ``max_num_seqs`` running sequences;
* **prefill cadence** (``--prefill-schedule-interval 8``, vLLM's "DP prefill balancing" as its
  scheduler implements it): every ``prefill_schedule_interval``-th step is open; on the steps
  between, a rank defers all prefill (running chunks and admissions) only if it has a decoding
  sequence to protect and its last open step left its waiting queue empty
  (``prefill_capacity_bound``); a rank with nothing to decode prefills on every step (and, in
  lockstep, makes the other ranks' decode steps that long);
* ``--long-prefill-token-threshold 512``: a request computes at most 512 prompt tokens per step
  (vLLM V1 caps running and waiting requests alike), several requests share the 8,192 budget;
* **speculative decoding**: MTP with 3 draft tokens at the published acceptance length 2.49
  (synthetic acceptance): each decode step gives a sequence ``2`` or ``3`` tokens, 3 with
  probability 0.49; the drafter's own forwards (one MTP layer, 3 times) are not a separate term
  (inside the calibrated efficiency);
* **prefix cache**: per rank, an LRU over sessions of the tokens each left cached (prompt + output
  of its last turn), bounded by the GPU pool plus the CPU offload tier (both published; loading a
  CPU hit is not charged: 128 GiB/rank at ~50 GB/s PCIe is ms per turn). A turn reuses, on the
  rank that served its session, the previous turn's *prompt* in whole 256-token blocks: the
  previous reply in its prompt is the trace's recorded reply, not the tokens the server generated
  (aiperf replays recorded trajectories with ``ignore_eos``), so the prefix diverges at the
  previous prompt's end (``Turn.server_reusable_tokens``); on another rank nothing is reused;
* no preemption (the running contexts, 8 lanes x ~130k tokens per rank, fit the ~2.7M-token pool).

Step times: the roofline of :mod:`sim.perf.roofline` for the model and GPU, with TWO fitted
numbers, each a common derating of its default peak fractions (MFU, MBU, link efficiency): 0.74
for decode-only steps, fitted (:func:`calibrate`) so that the simulated decode-only iteration p50
equals the published 31.15 ms, and 0.64 for steps that carry prefill, fitted on the published
mixed-step p50 (160 ms) (both from :func:`calibrate`, rounded). With one common derating the
model cannot meet both (0.74 for all: mixed p50 about 140 ms; 0.64 for all: decode-only p50 about
36 ms, step time ~ 1 / derating): the achieved fraction of peak differs between
the memory-bound MTP decode batches and the compute-bound chunked prefills. Everything else
(prefill-only p50/p90, mixed p90, decode-only p90, TTFT, ITL, latency, throughput) is held out.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sim.perf.base import causal_attn_pairs
from sim.perf.roofline import DEFAULT_COMM_EFFICIENCY, DEFAULT_MBU, DEFAULT_MFU, RooflinePerf
from sim.workload.agentic import AgenticWorkloadConfig, Turn, lane_turns

__all__ = ["EngineConfig", "RankLoads", "RunResult", "simulate_agentic", "calibrate", "policy_chooser",
           "consistent_hash_chooser", "DEFAULT_EFFICIENCY_SCALE"]

#: fitted by :func:`calibrate` on the published decode-only p50 (31.15 ms); see module docstring
DEFAULT_EFFICIENCY_SCALE = 0.74
#: fitted on the published mixed-step p50 (160 ms): steps that carry prefill reach 0.64 of the
#: roofline defaults, decode-only steps 0.74 (see module docstring)
DEFAULT_PREFILL_EFFICIENCY_SCALE = 0.64
#: most engine steps one run may take (bounds the loop)
MAX_STEPS = 5_000_000


@dataclass(frozen=True)
class EngineConfig:
    """One vLLM DP/EP engine as point 440246 ran it (defaults: the published launcher values)."""

    model: str = "deepseek-v4-pro"
    hardware: str = "B200"
    dp_ranks: int = 8
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    prefill_schedule_interval: int = 8
    spec_tokens: int = 3
    acceptance_length: float = 2.49
    #: the published ``kv_cache_pool_tokens`` (21,965,416) over 8 ranks
    gpu_kv_tokens_per_rank: int = 21_965_416 // 8
    #: 128 GiB CPU offload per rank (the aisimulate reproduction; 440246 itself had 356 GB)
    cpu_kv_bytes_per_rank: float = 137_438_953_472.0
    #: most prompt tokens one request computes in one step (vLLM ``long_prefill_token_threshold``);
    #: ``None``: only the step budget limits a chunk
    long_prefill_token_threshold: int | None = 512
    #: a prefix hit resumes at a multiple of this many tokens (vLLM caches whole 256-token blocks;
    #: a coarser value models V4's sliding-window layers, whose KV vLLM keeps only sparsely)
    prefix_hit_granularity_tokens: int = 256
    efficiency_scale: float = DEFAULT_EFFICIENCY_SCALE
    #: the derating of steps that carry prefill (fitted on the mixed-step p50, 160 ms); ``None``:
    #: ``efficiency_scale``
    prefill_efficiency_scale: float | None = DEFAULT_PREFILL_EFFICIENCY_SCALE
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        if self.prefix_hit_granularity_tokens < 1:
            raise ValueError("prefix_hit_granularity_tokens must be >= 1")
        if self.dp_ranks < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("dp_ranks, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.prefill_schedule_interval < 1 or self.spec_tokens < 0:
            raise ValueError("prefill_schedule_interval must be >= 1 and spec_tokens >= 0")
        if not 1.0 <= self.acceptance_length <= 1 + self.spec_tokens:
            raise ValueError(f"acceptance_length must be in [1, {1 + self.spec_tokens}]")
        top = 1 / max(DEFAULT_MFU, DEFAULT_MBU, DEFAULT_COMM_EFFICIENCY)
        if not 0 < self.efficiency_scale <= top or not 0 < (self.prefill_efficiency_scale or 1) <= top:
            raise ValueError("efficiency_scale / prefill_efficiency_scale out of range (the scaled fractions must stay <= 1)")

    def roofline(self, prefill: bool = False) -> RooflinePerf:
        """The step-time model of decode-only steps (``prefill=False``) or prefill-bearing ones."""
        s = self.prefill_efficiency_scale if prefill and self.prefill_efficiency_scale else self.efficiency_scale
        return RooflinePerf(self.model, self.hardware, num_dp_ranks=self.dp_ranks, gpus_per_rank=1,
                            ep_synchronous=True, mfu=DEFAULT_MFU * s, mbu=DEFAULT_MBU * s,
                            comm_efficiency=DEFAULT_COMM_EFFICIENCY * s, step_overhead_s=self.step_overhead_s)


@dataclass
class _Req:
    lane: int
    turn: Turn
    send_s: float
    measured: bool
    rank: int = -1
    cached: int = 0
    to_prefill: int = 0
    generated: int = 0
    first_s: float = math.nan


@dataclass
class RunResult:
    """Per-request records (measured requests that completed) and per-record iteration times.

    ``requests``: rows ``(send_s, ttft_s, e2e_s, input_tokens, output_tokens, cached_tokens)``.
    ``iterations``: ``{class: array of step seconds}``, one entry per rank per step, classes
    ``prefill_only``, ``decode_only``, ``mixed`` (idle ranks' records are not kept).
    """

    requests: np.ndarray
    iterations: dict[str, np.ndarray]
    measure_start_s: float
    last_done_s: float
    dp_ranks: int
    gpu_hit_rate: float
    cancelled: int = 0
    rank_requests: list[int] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The published metric names of point 440246 (seconds; ITL in seconds per token)."""
        r = self.requests
        if len(r) == 0:
            raise ValueError("no measured request completed")
        ttft, e2e, inp, out = r[:, 1], r[:, 2], r[:, 3], r[:, 4]
        itl = (e2e - ttft) / np.maximum(out - 1, 1)
        dur = self.last_done_s - self.measure_start_s
        q = np.percentile
        m = {"total_requests_completed": float(len(r)), "duration_seconds": dur,
             "total_tput_tps": float((inp.sum() + out.sum()) / dur), "output_tput_tps": float(out.sum() / dur),
             "mean_input_tokens": float(inp.mean()), "mean_output_tokens_actual": float(out.mean()),
             "server_gpu_cache_hit_rate": self.gpu_hit_rate}
        m["tput_per_gpu"] = m["total_tput_tps"] / self.dp_ranks
        m["output_tput_per_gpu"] = m["output_tput_tps"] / self.dp_ranks
        for name, v in (("ttft", ttft), ("itl", itl), ("e2el", e2e)):
            m[f"mean_{name}"] = float(v.mean())
            m[f"median_{name}"] = float(q(v, 50))
            m[f"p90_{name}"] = float(q(v, 90))
            m[f"p95_{name}"] = float(q(v, 95))
        for cls, v in self.iterations.items():
            if len(v):
                m[f"{cls}_p50_ms"] = float(q(v, 50) * 1e3)
                m[f"{cls}_p90_ms"] = float(q(v, 90) * 1e3)
                m[f"{cls}_count"] = float(len(v))
        return m


@dataclass(frozen=True)
class RankLoads:
    """What a router may know about the ranks when a turn arrives (per rank, shape ``(R,)``):
    requests queued or running, uncached prompt tokens still to prefill, KV tokens of decoding
    sequences, and this turn's reusable cached tokens (whole blocks) on each rank."""

    num_requests: np.ndarray
    prefill_tokens: np.ndarray
    decode_kv_tokens: np.ndarray
    cached_tokens: np.ndarray
    now_s: float


RankChooser = Callable[[Turn, RankLoads], int]


def policy_chooser(spec: str, dp_ranks: int, kv_capacity_tokens: int = 0, block_size: int = 256,
                   engine: str = "engine0", seed: int = 0) -> RankChooser:
    """A rank chooser running a pdlb routing policy (``NAME`` or ``NAME:K=V,...``, any of
    :func:`balancer.policies.available_policies`) on the ranks of one aggregated (``MIXED``)
    engine, from :class:`RankLoads` (the router's projected load and an exact prefix index)."""
    import random

    from balancer.candidates import Candidates
    from balancer.policies.base import SelectContext
    from balancer.policies.spec import build_policy
    from balancer.types import ReplicaId, ReplicaView, Request, Role
    pol = build_policy(spec)
    reps = [ReplicaId(engine, r) for r in range(dp_ranks)]
    rng = random.Random(seed)
    counter = [0]

    def choose(turn: Turn, loads: RankLoads) -> int:
        views = [ReplicaView(replica=reps[r], role=Role.MIXED, num_requests=int(loads.num_requests[r]),
                             prefill_tokens=int(loads.prefill_tokens[r]),
                             decode_kv_tokens=int(loads.decode_kv_tokens[r]),
                             kv_capacity_tokens=kv_capacity_tokens,
                             matched_blocks=int(loads.cached_tokens[r]) // block_size,
                             matched_tokens=int(loads.cached_tokens[r]), block_size=block_size)
                 for r in range(dp_ranks)]
        counter[0] += 1
        req = Request(request_id=f"{turn.session}-{turn.turn}", arrival_time_s=loads.now_s,
                      prompt_tokens=turn.input_tokens, session_id=turn.session,
                      max_output_tokens=max(1, turn.output_tokens))
        choice = pol.select(req, Candidates.from_views(views), SelectContext(rng, loads.now_s, counter[0]))
        return choice.replica.dp_rank
    return choose


def consistent_hash_chooser(dp_ranks: int, engine: str = "engine0") -> RankChooser:
    """vllm-router's DP-aware consistent hashing over ``dp_ranks`` ranks, keyed on the session."""
    from balancer.policies.dp_consistent_hash import VIRTUAL_NODES_PER_WORKER, build_ring, ring_choice
    from balancer.types import ReplicaId
    replicas = tuple(ReplicaId(engine, r) for r in range(dp_ranks))
    pos, owner = build_ring(replicas, VIRTUAL_NODES_PER_WORKER)
    cache: dict[str, int] = {}

    def choose(turn: Turn, _loads: RankLoads) -> int:
        r = cache.get(turn.session)
        if r is None:
            r = cache[turn.session] = ring_choice(b"header:x-session-id:" + turn.session.encode(), pos, owner)
        return r
    return choose


def simulate_agentic(workload: AgenticWorkloadConfig | None = None, engine: EngineConfig | None = None,
                     chooser: RankChooser | None = None, *, drain_s: float = 30.0, seed: int = 0) -> RunResult:
    """Run the closed loop: warm-up (``warmup_requests_per_lane`` per lane), then ``duration_s``
    measured seconds from the moment the last lane finished its warm-up (requests sent in that
    window are measured; those not done ``drain_s`` after it are cancelled, as aiperf does).

    Raises:
        ValueError: bad configs; RuntimeError if the run exceeds :data:`MAX_STEPS` steps."""
    wl = workload or AgenticWorkloadConfig()
    eng = engine or EngineConfig()
    R = eng.dp_ranks
    choose = chooser or consistent_hash_chooser(R)
    perf = eng.roofline()
    perf_pf = eng.roofline(prefill=True)
    cpu_tokens = int(eng.cpu_kv_bytes_per_rank / max(1, perf.kv_bytes_per_token))
    cache_cap = eng.gpu_kv_tokens_per_rank + cpu_tokens
    rng = np.random.default_rng(np.random.SeedSequence([seed, 11]))
    p_extra = eng.acceptance_length - math.floor(eng.acceptance_length)
    base_tokens = int(math.floor(eng.acceptance_length))
    verify = 1 + eng.spec_tokens
    cap = eng.long_prefill_token_threshold or eng.max_num_batched_tokens

    lanes = [lane_turns(wl, j) for j in range(wl.lanes)]
    sent = [0] * wl.lanes
    warm_left = wl.lanes if wl.warmup_requests_per_lane > 0 else 0
    measure_start = math.inf if warm_left else 0.0
    arrivals: list[tuple[float, int]] = [(0.0, j) for j in range(wl.lanes)]
    heapq.heapify(arrivals)
    waiting: list[deque[_Req]] = [deque() for _ in range(R)]
    running: list[list[_Req]] = [[] for _ in range(R)]
    caches: list[OrderedDict[str, int]] = [OrderedDict() for _ in range(R)]
    cache_used = [0] * R
    rank_reqs = [0] * R
    capacity_bound = [False] * R
    records: list[tuple[float, float, float, int, int, int]] = []
    it_cls: dict[str, list[float]] = {"prefill_only": [], "decode_only": [], "mixed": []}
    hit_tokens = prompt_tokens = 0
    t, step = 0.0, 0
    cancelled = 0

    def end_s() -> float:
        return measure_start + wl.duration_s

    def _reusable(r: int, turn: Turn) -> int:
        """Cached tokens ``turn`` finds on rank ``r``: whole blocks of the previous prompt (its last
        partial block also holds generated tokens), at a multiple of the hit granularity."""
        if not turn.server_reusable_tokens:
            return 0
        g = eng.prefix_hit_granularity_tokens
        usable = min(caches[r].get(turn.session, 0), turn.server_reusable_tokens) // g
        return min(usable * g, turn.input_tokens - 1)

    def send(lane: int, now: float) -> None:
        nonlocal warm_left, measure_start
        turn = next(lanes[lane])
        sent[lane] += 1
        measured = sent[lane] > wl.warmup_requests_per_lane and now >= measure_start
        req = _Req(lane, turn, now, measured)
        loads = RankLoads(
            np.array([len(waiting[r]) + len(running[r]) for r in range(R)]),
            np.array([sum(q.to_prefill for q in waiting[r]) + sum(q.to_prefill for q in running[r]) for r in range(R)]),
            np.array([sum(q.turn.input_tokens + q.generated for q in running[r] if q.to_prefill == 0) for r in range(R)]),
            np.array([_reusable(r, turn) for r in range(R)]), now)
        r = int(choose(turn, loads))
        if not 0 <= r < R:
            raise ValueError(f"rank chooser returned {r}, outside [0, {R})")
        req.rank = r
        rank_reqs[r] += 1
        req.cached = _reusable(r, turn)
        req.to_prefill = turn.input_tokens - req.cached
        waiting[r].append(req)

    def finish_cache(req: _Req) -> None:
        c = caches[req.rank]
        old = c.pop(req.turn.session, 0)
        keep = req.turn.input_tokens + req.generated
        c[req.turn.session] = keep
        cache_used[req.rank] += keep - old
        while cache_used[req.rank] > cache_cap and len(c) > 1:
            _, v = c.popitem(last=False)
            cache_used[req.rank] -= v

    while True:
        if step >= MAX_STEPS:
            raise RuntimeError(f"agentic simulation exceeded {MAX_STEPS} steps")
        while arrivals and arrivals[0][0] <= t:
            at, lane = heapq.heappop(arrivals)
            if at >= end_s():
                continue
            send(lane, at)
        busy = any(waiting[r] or running[r] for r in range(R))
        if not busy:
            if not arrivals:
                break
            t = max(t, arrivals[0][0])
            continue
        if t >= end_s() + drain_s:
            for r in range(R):
                cancelled += sum(1 for q in list(waiting[r]) + running[r] if q.measured)
            break
        prefill_step = step % eng.prefill_schedule_interval == 0
        pt = np.zeros(R)
        pc = np.zeros(R)
        pp = np.zeros(R)
        ds = np.zeros(R)
        dc = np.zeros(R)
        chunks: list[list[tuple[_Req, int]]] = [[] for _ in range(R)]
        decoders: list[list[_Req]] = [[] for _ in range(R)]
        for r in range(R):
            budget = eng.max_num_batched_tokens
            for q in running[r]:
                if q.to_prefill == 0:
                    decoders[r].append(q)
                    budget -= verify
                    dc[r] += q.turn.input_tokens + q.generated
            ds[r] = len(decoders[r])
            # vLLM's DP prefill balancing: a throttled step defers prefill only when the rank has
            # a decode to protect and its last open step drained the waiting queue
            if prefill_step or capacity_bound[r] or not decoders[r]:
                for q in running[r]:
                    if q.to_prefill > 0 and budget > 0:
                        n = min(q.to_prefill, budget, cap)
                        chunks[r].append((q, n))
                        budget -= n
                while waiting[r] and budget > 0 and len(running[r]) < eng.max_num_seqs:
                    q = waiting[r].popleft()
                    running[r].append(q)
                    prompt_tokens += q.turn.input_tokens
                    hit_tokens += q.cached
                    n = min(q.to_prefill, budget, cap)
                    chunks[r].append((q, n))
                    budget -= n
                capacity_bound[r] = bool(waiting[r])
                for q, n in chunks[r]:
                    done_before = q.turn.input_tokens - q.to_prefill
                    pt[r] += n
                    pc[r] += done_before
                    pp[r] += float(causal_attn_pairs(n, done_before))
        b = (perf_pf if pt.any() else perf).step_time_breakdown(pt, pp, ds, dc, prefill_cached_tokens=pc, decode_tokens_per_seq=float(verify))
        dt = float(np.ravel(b["total"])[0])
        t += dt
        step += 1
        for r in range(R):
            has_p, has_d = pt[r] > 0, ds[r] > 0
            if has_p or has_d:
                it_cls["mixed" if has_p and has_d else "prefill_only" if has_p else "decode_only"].append(dt)
            for q, n in chunks[r]:
                q.to_prefill -= n
                if q.to_prefill == 0:  # the last chunk's forward samples the first token
                    q.first_s = t
                    q.generated = 1
            extra = rng.random(len(decoders[r])) < p_extra if decoders[r] else ()
            for q, e in zip(decoders[r], extra):
                q.generated += base_tokens + int(e)
            still = []
            for q in running[r]:
                if q.to_prefill == 0 and q.generated >= q.turn.output_tokens:
                    q.generated = q.turn.output_tokens
                    finish_cache(q)
                    if q.measured and t <= end_s() + drain_s:
                        records.append((q.send_s, q.first_s - q.send_s, t - q.send_s, q.turn.input_tokens,
                                        q.turn.output_tokens, q.cached))
                    if sent[q.lane] == wl.warmup_requests_per_lane and warm_left:
                        warm_left -= 1
                        if warm_left == 0:
                            measure_start = t
                    heapq.heappush(arrivals, (t + wl.think_s, q.lane))
                else:
                    still.append(q)
            running[r] = still
    reqs = np.asarray(records, dtype=np.float64).reshape(-1, 6)
    last_done = float((reqs[:, 0] + reqs[:, 2]).max()) if len(reqs) else measure_start
    return RunResult(reqs, {k: np.asarray(v) for k, v in it_cls.items()}, measure_start, last_done, R,
                     hit_tokens / prompt_tokens if prompt_tokens else 0.0, cancelled, rank_reqs)


def calibrate(target_decode_p50_s: float = 0.03115, target_mixed_p50_s: float = 0.15998,
              workload: AgenticWorkloadConfig | None = None, engine: EngineConfig | None = None, *,
              iterations: int = 4, seed: int = 0) -> tuple[float, float]:
    """``(efficiency_scale, prefill_efficiency_scale)`` at which the simulated decode-only and mixed
    iteration-time p50 equal the targets (the published 31.15 / 159.98 ms): a few rounds of
    proportional updates (a step time is ~ inversely proportional to its derating), each one run of
    ``workload`` (default: the published hour). Seconds of CPU per round."""
    wl = workload or AgenticWorkloadConfig()
    eng = engine or EngineConfig()
    top = 1 / max(DEFAULT_MFU, DEFAULT_MBU, DEFAULT_COMM_EFFICIENCY)
    s, sp = eng.efficiency_scale, eng.prefill_efficiency_scale or eng.efficiency_scale
    for _ in range(max(1, min(iterations, 20))):
        e = EngineConfig(**{**eng.__dict__, "efficiency_scale": s, "prefill_efficiency_scale": sp})
        it = simulate_agentic(wl, e, seed=seed).iterations
        s = min(top, s * float(np.percentile(it["decode_only"], 50)) / target_decode_p50_s)
        sp = min(top, sp * float(np.percentile(it["mixed"], 50)) / target_mixed_p50_s)
    return s, sp
