"""Closed-loop agentic lanes on pdlb's simulated cluster (:class:`sim.run.cluster.Cluster`).

Each of ``workload.lanes`` clients (:mod:`sim.workload.agentic`) sends one request, waits for
its last token, thinks ``think_s`` seconds and sends its next turn, so the offered load follows
the server's speed. Every request goes through the cluster's :class:`~balancer.router.Router`
(any pdlb policy; ``Request.session_id`` carries the trajectory, as vllm-router's
``x-session-id``) and the same ranks, step groups, KV caches and tiers as :func:`sim.run.cluster.simulate`.

Bounded: the records grow up to ``max_requests`` requests and a run raises if the lanes would
send more; no queue outside the engines' own (a lane has at most one request in flight).

Timeline (as aiperf's agentic replay): the first ``warmup_requests_per_lane`` requests of each
lane are warm-up; the measured window opens when the last lane finishes its warm-up and lasts
``duration_s``; requests sent in it by lanes past their warm-up are measured; no request is sent
after it; those not finished ``drain_s`` after its end are cancelled (counted, not recorded).

Subagents at once (``AgenticWorkloadConfig.subagent_at_once``): a lane replays trajectory trees
(:func:`sim.workload.agentic.lane_plans`). After a parent turn that spawns, each sibling is a stream
of its own (think time, then its turns one by one, each after the previous one's last token and a
think time), all at once; the parent's next turn waits for the joined siblings' last turns (then a
think time); background siblings run beside the parent, and the lane starts its next trajectory
only when the whole tree has drained. So a lane may have several requests in flight (aiperf: "the
instantaneous in-flight request count can exceed N during fan-out bursts"). Warm-up: a lane's
first ``warmup_requests`` sends are warm-up, and its warm-up ends when as many of its requests
have finished.

Block hashes: a turn's prompt repeats the previous turn's prompt (whole blocks only; the previous
reply in it is the trace's recorded reply, not the generated tokens, so the shared prefix ends
where the previous prompt ended: ``Turn.server_reusable_tokens``); every other block is new and
unique to the lane.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from balancer.config import PolicySpec
from balancer.policies import Policy
from balancer.router import Router
from balancer.types import Request, Role, TtftSlo
from sim.run.admission import admit
from sim.run.cluster import Cluster, RankInfo
from sim.run.engine.step_group import STEP_CLASSES
from sim.perf.base import PerfModel
from sim.run.pool_perf import build_perf
from sim.run.records import RequestRecords
from sim.run.router_config import RankCacheBlocks, router_config_for
from sim.run.router_config import router_factory as make_router_factory
from sim.scenario import PoolConfig, Scenario
from sim.workload.agentic import (AgenticWorkloadConfig, Subagent, TrajectoryPlan, Turn, lane_plans, lane_turns,
                                  quantile_mean, sample_quantiles, warmup_requests)

__all__ = ["ClosedLoopResult", "simulate_closed_loop", "DEFAULT_MAX_REQUESTS"]

#: default bound on the requests of one run
DEFAULT_MAX_REQUESTS = 2_000_000
#: longest simulated time before the warm-up must have ended, s (bounds a stuck run)
MAX_WARMUP_S = 1e6
#: sessions per lane whose last prompt's blocks are remembered for the next turn's prefix (a parent
#: and the subagent it waits on, ``AgenticWorkloadConfig.subagent_spawn_probability``)
MAX_SESSIONS_PER_LANE = 4


@dataclass
class ClosedLoopResult:
    """A closed-loop run's measured requests and per-rank iteration records.

    ``requests``: rows ``(send_s, ttft_s, e2e_s, input_tokens, output_tokens, cached_tokens)`` of
    the measured requests that finished in time; ``iterations``: ``{class: step seconds}`` (one
    entry per rank per step, :meth:`sim.run.engine.step_group.StepGroup.iteration_times`, whole run).
    """

    requests: np.ndarray
    iterations: dict[str, np.ndarray]
    measure_start_s: float
    last_done_s: float
    num_gpus: int
    gpu_hit_rate: float
    records: RequestRecords
    ranks: list[RankInfo]
    policy: str
    cancelled: int = 0
    rejected: int = 0
    wall_s: float = 0.0
    rank_requests: list[int] = field(default_factory=list)
    num_steps: int = 0
    #: the session id of every submitted request, in record order (row ``i`` of ``records``)
    sessions: list[str] = field(default_factory=list)
    #: per rank of the step groups (in group order, then the group's rank order): recorded steps by
    #: class ``(ranks, 3)``, columns as ``iterations``' keys (prefill-only, decode-only, mixed), whole run
    rank_class_steps: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    #: per rank (same order): seconds of the steps in which the rank had work, whole run ``(ranks,)``
    rank_active_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: simulated seconds from the first send to the end of the run (the drain's end)
    end_s: float = 0.0
    #: ``rank_class_steps`` and ``rank_active_s`` as they stood when the measured window opened
    #: (the warm-up's share; empty arrays for a run without groups)
    warmup_rank_class_steps: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    warmup_rank_active_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def metrics(self) -> dict[str, float]:
        """Metrics under the names point 440246 publishes (seconds; ITL in s per token:
        ``(e2e - ttft) / (output - 1)`` per request; iteration percentiles in ms).

        Raises:
            ValueError: no measured request completed."""
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
        m["tput_per_gpu"] = m["total_tput_tps"] / self.num_gpus
        m["output_tput_per_gpu"] = m["output_tput_tps"] / self.num_gpus
        for name, v in (("ttft", ttft), ("itl", itl), ("e2el", e2e)):
            m[f"mean_{name}"] = float(v.mean())
            m[f"median_{name}"] = float(q(v, 50))
            m[f"p90_{name}"] = float(q(v, 90))
            m[f"p95_{name}"] = float(q(v, 95))
            m[f"p99_{name}"] = float(q(v, 99))
        for cls, v in self.iterations.items():
            if len(v):
                m[f"{cls}_p50_ms"] = float(q(v, 50) * 1e3)
                m[f"{cls}_p90_ms"] = float(q(v, 90) * 1e3)
                m[f"{cls}_count"] = float(len(v))
        return m


def simulate_closed_loop(
    scenario: Scenario,
    workload: AgenticWorkloadConfig,
    policy: str | Policy = "dp_consistent_hash",
    *,
    perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = build_perf,
    seed: int = 0,
    drain_s: float = 30.0,
    index_mode: str = "approximate",
    max_requests: int = DEFAULT_MAX_REQUESTS,
    router_factory: Callable[[RankCacheBlocks], Router] | None = None,
    cluster_hook: Callable[[Cluster], None] | None = None,
    ttft_slo: TtftSlo | None = None,
    frontend_s_per_token: float = 0.0,
) -> ClosedLoopResult:
    """Run ``workload``'s lanes through ``scenario`` routed by ``policy`` (both roles; an aggregated
    scenario routes among its mixed ranks). The router is built as :func:`sim.run.cluster.simulate`
    builds it (the scenario's cost model and KV-tier views), unless ``router_factory`` is given.
    ``cluster_hook``: called with the built cluster before the first request (sensitivity runs
    change engine attributes there, e.g. ``Rank.hit_multiple_tokens``). ``frontend_s_per_token``:
    the API server's work per prompt token before the request reaches the engine (chat template
    and tokenization of the whole prompt, which the server repeats on every turn), s; a request
    reaches the router ``frontend_s_per_token * input_tokens`` after its lane sent it, and its
    TTFT and latency count from the send. ``ttft_slo``: the TTFT budget the router routes against
    (SLO-aware policies; ``None``: none). Deterministic for given inputs.

    Raises:
        ValueError: ``drain_s`` < 0, ``max_requests`` < 1, ``frontend_s_per_token`` outside [0, 1e-3].
        RuntimeError: the lanes would send more than ``max_requests`` requests, or the warm-up does
            not end within :data:`MAX_WARMUP_S` simulated seconds.
    """
    if drain_s < 0 or max_requests < 1:
        raise ValueError("drain_s must be >= 0 and max_requests >= 1")
    if not 0.0 <= frontend_s_per_token <= 1e-3:
        raise ValueError(f"frontend_s_per_token must be in [0, 1e-3] s, got {frontend_s_per_token!r}")
    wl = workload
    bs = scenario.block_size
    if router_factory is None:
        spec = PolicySpec.parse(policy) if isinstance(policy, str) else policy
        router_factory = make_router_factory(
            scenario, router_config_for(scenario, seed=seed, index_mode=index_mode, perf_factory=perf_factory,
                                        ttft_slo=ttft_slo), spec, spec)

    t0 = time.perf_counter()
    cluster = Cluster(scenario, router_factory, perf_factory, record_iterations=True)
    if cluster_hook is not None:
        cluster_hook(cluster)
    env = cluster.env
    cluster.begin_dynamic(max_requests)
    roles = (Role.DECODE, Role.MIXED)
    decode_cap = max(r.kv_capacity_blocks * bs for r in cluster.ranks if r.role in roles)
    prefill_cap = (max(r.kv_capacity_blocks * bs for r in cluster.ranks if r.role is Role.PREFILL)
                   if scenario.disaggregated else None)
    max_len = scenario.effective_max_model_len

    at_once = wl.subagent_at_once
    # one after another, a parent and all siblings of a spawn interleave in the lane: remember them all
    max_sessions = max(MAX_SESSIONS_PER_LANE, 1 + len(wl.subagent_fanout_weights or ()))
    lanes = [lane_turns(wl, j) for j in range(wl.lanes)] if not at_once else []
    sent = [0] * wl.lanes
    # per lane, the block hashes of its most recent sessions' last prompts (a parent and the subagent
    # it waits on interleave; at most MAX_SESSIONS_PER_LANE are kept, oldest dropped first)
    prev: list[dict[str, tuple[int, ...]]] = [{} for _ in range(wl.lanes)]
    lane_of: list[int] = []
    sessions: list[str] = []
    measured: list[bool] = []
    sent_at: list[float] = []  # the lane's send time of each record (before the frontend's work)
    fresh = itertools.count(1 << 40)  # block hashes unique to one lane's trajectory
    n_warm = warmup_requests(wl)
    state = {"warm_left": wl.lanes if n_warm > 0 else 0,
             "start": math.inf if n_warm > 0 else 0.0, "rejected": 0}

    def end_s() -> float:
        return state["start"] + wl.duration_s

    warm_steps: list[np.ndarray] = []  # per-rank step classes and active seconds when the window opens

    def open_window(now: float) -> None:
        state["start"] = now
        warm_steps.extend([np.concatenate([g.rank_class_steps for g in cluster.groups]).copy(),
                           np.concatenate([g.rank_active_s for g in cluster.groups]).copy()]
                          if cluster.groups else [])

    def issue(lane: int, turn: Turn, remember: bool, evict: bool,
              on_refused: Callable[[float], None], on_done: Callable[[float], None] | None = None) -> None:
        """Send ``turn`` for ``lane`` now: its block hashes (the session's remembered prefix, then fresh
        blocks), aiperf's primer and warm-up output cap, the frontend's delay; a refused request
        calls ``on_refused(now)``. ``remember``: keep the prompt's hashes for the session's next turn;
        ``evict``: then drop the lane's oldest session beyond ``max_sessions``; ``on_done``: kept per
        record for the trees' finish callback (subagents at once only)."""
        now = env.now
        sent[lane] += 1
        if wl.warmup_primer and sent[lane] == 1 and wl.primer_context_scale != 1.0:  # a longer primer
            turn = dataclasses.replace(turn, input_tokens=min(max_len - 1,
                                                              round(turn.input_tokens * wl.primer_context_scale)))
        n_blocks = -(-turn.input_tokens // bs)
        known = prev[lane]
        old = known.pop(turn.session, ())
        keep = min(turn.server_reusable_tokens // bs, len(old))
        hashes = old[:keep] + tuple(itertools.islice(fresh, n_blocks - keep))
        if remember:
            known[turn.session] = hashes
            if evict and len(known) > max_sessions:
                del known[next(iter(known))]
        # aiperf's primer: the whole prefix at t* with max_tokens=1 (a prefill that never decodes)
        out = 1 if wl.warmup_primer and sent[lane] == 1 else turn.output_tokens
        if wl.warmup_max_output_tokens is not None and sent[lane] <= n_warm:
            out = min(out, wl.warmup_max_output_tokens)
        is_measured = sent[lane] > n_warm and now >= state["start"]

        def submit(_ev: object = None) -> None:
            at = env.now
            req = Request(f"{turn.session}-t{turn.turn}-{sent[lane]}", float(at), turn.input_tokens, hashes,
                          max_output_tokens=out, expected_output_tokens=out,
                          session_id=turn.session if wl.routing_key == "session" else f"s{wl.seed}-lane{lane}",
                          traffic_class="agent")
            ok, _ = admit([req], max_len, decode_cap, prefill_cap)
            if not ok:  # refused at arrival, as an engine would: the stream moves on after its think time
                state["rejected"] += 1
                on_refused(at)
                return
            i = cluster.submit(req)
            lane_of.append(lane)
            if on_done is not None:
                done_of.append(on_done)
            sessions.append(turn.session)
            measured.append(is_measured)
            sent_at.append(now)
            assert len(lane_of) == i + 1

        delay = frontend_s_per_token * turn.input_tokens
        if delay > 0:
            env.timeout(delay).callbacks.append(submit)
        else:
            submit()

    def send(lane: int) -> None:
        if env.now >= end_s():
            return  # the measured window is over: the lane stops
        issue(lane, next(lanes[lane]), True, True, lambda at: finished_lane(lane, at))

    # --- subagents at once: trajectory trees, one stream per parent and per subagent ---
    plans = [lane_plans(wl, j) for j in range(wl.lanes)] if at_once else []
    done_count = [0] * wl.lanes
    tree: list[dict] = [{} for _ in range(wl.lanes)]  # per lane: plan, parent index, joined / background left

    def dispatch(lane: int, turn: Turn, last: bool, on_done: Callable[[float], None]) -> None:
        """Send ``turn`` for ``lane`` now (as ``send`` does); ``on_done(now)`` when it finishes or is
        refused; ``last``: the session's last turn (its remembered blocks are dropped)."""
        issue(lane, turn, not last, False, lambda at: tree_done(lane, at, on_done), on_done)

    def tree_done(lane: int, now: float, on_done: Callable[[float], None]) -> None:
        done_count[lane] += 1
        if state["warm_left"] and done_count[lane] == n_warm:
            state["warm_left"] -= 1
            if state["warm_left"] == 0:
                open_window(now)
        on_done(now)

    def later(lane: int, fn: Callable[[], None]) -> None:
        """``fn()`` after one think time of ``lane``, unless the measured window is over by then."""
        def go(_ev: object) -> None:
            if env.now < end_s():
                fn()
        env.timeout(think_s(lane)).callbacks.append(go)

    def start_tree(lane: int) -> None:
        plan: TrajectoryPlan = next(plans[lane])
        tree[lane] = {"plan": plan, "i": 0, "joined": 0, "background": 0}
        send_parent(lane)

    def send_parent(lane: int) -> None:
        st = tree[lane]
        turns = st["plan"].turns
        dispatch(lane, turns[st["i"]], st["i"] == len(turns) - 1, lambda now: parent_done(lane))

    def parent_done(lane: int) -> None:
        st = tree[lane]
        for sub in st["plan"].spawns[st["i"]]:
            st["joined" if sub.joined else "background"] += 1
            later(lane, functools.partial(send_sub, lane, sub, 0))
        st["i"] += 1
        if st["i"] < len(st["plan"].turns):
            if st["joined"] == 0:
                later(lane, lambda: send_parent(lane))
        elif st["background"] == 0:
            later(lane, lambda: start_tree(lane))

    def send_sub(lane: int, sub: Subagent, k: int) -> None:
        dispatch(lane, sub.turns[k], k == len(sub.turns) - 1, lambda now: sub_done(lane, sub, k))

    def sub_done(lane: int, sub: Subagent, k: int) -> None:
        if k + 1 < len(sub.turns):
            later(lane, lambda: send_sub(lane, sub, k + 1))
            return
        st = tree[lane]
        n_parent = len(st["plan"].turns)
        if sub.joined:
            st["joined"] -= 1
            if st["joined"] == 0 and st["i"] < n_parent:
                later(lane, lambda: send_parent(lane))
        else:
            st["background"] -= 1
        if st["i"] >= n_parent and st["joined"] == 0 and st["background"] == 0:
            later(lane, lambda: start_tree(lane))

    done_of: list[Callable[[float], None]] = []

    think_rngs = ([np.random.default_rng(np.random.SeedSequence([wl.seed, 11, j])) for j in range(wl.lanes)]
                  if wl.think_sigma > 0 or wl.think_quantiles_s is not None else None)
    q_scale = wl.think_s / quantile_mean(wl.think_quantiles_s) if wl.think_quantiles_s is not None else 0.0
    think_mu = math.log(wl.think_s) - wl.think_sigma ** 2 / 2 if wl.think_s > 0 else -math.inf

    def think_s(lane: int) -> float:
        if wl.warmup_think_s is not None and sent[lane] < n_warm:
            return wl.warmup_think_s  # between two warm-up requests (aiperf: no idle delays)
        if think_rngs is None or wl.think_s == 0:
            return wl.think_s
        if wl.think_quantiles_s is not None:  # the empirical shape, scaled to the mean think_s
            return q_scale * sample_quantiles(wl.think_quantiles_s, float(think_rngs[lane].random()))
        return min(wl.max_think_s, math.exp(think_mu + wl.think_sigma * think_rngs[lane].standard_normal()))

    held: list[int] = []  # warmup_barrier: lanes done with their warm-up, waiting for the others

    def finished_lane(lane: int, now: float) -> None:
        if state["warm_left"] and sent[lane] == n_warm:
            state["warm_left"] -= 1
            if state["warm_left"] == 0:
                open_window(now)
                if wl.warmup_barrier:  # the measured phase opens: every lane sends at once
                    for j in held + [lane]:
                        send(j)
                    held.clear()
                    return
            elif wl.warmup_barrier:
                held.append(lane)
                return
        ev = env.timeout(think_s(lane))
        ev.callbacks.append(lambda _ev, lane=lane: send(lane))

    if at_once:
        cluster.on_request_finished = lambda i, now: tree_done(lane_of[i], now, done_of[i])
        first = start_tree
    else:
        cluster.on_request_finished = lambda i, now: finished_lane(lane_of[i], now)
        first = send
    if wl.primer_lead_quantiles_s is not None:  # aiperf's spread: lane j at max(lead) - lead_j
        u = np.random.default_rng(np.random.SeedSequence([wl.seed, 13])).random(wl.lanes)
        leads = [sample_quantiles(wl.primer_lead_quantiles_s, float(x)) for x in u]
        for j in range(wl.lanes):
            env.timeout(max(leads) - leads[j]).callbacks.append(lambda _ev, j=j: first(j))
    else:
        for j in range(wl.lanes):
            first(j)
    while math.isinf(state["start"]):
        if env.now > MAX_WARMUP_S:
            raise RuntimeError(f"the warm-up did not end within {MAX_WARMUP_S:g} simulated seconds")
        env.run(until=env.now + 60.0)
    # the warm-up runs in 60 s chunks, so the clock may already be past the window's end plus the
    # drain (a window shorter than the rest of the chunk): then nothing more runs
    deadline = end_s() + drain_s
    if deadline > env.now:
        env.run(until=deadline)

    n = len(lane_of)
    rec = cluster.records
    idx = np.flatnonzero(np.asarray(measured, dtype=bool))
    fin = rec.finish_s[idx] <= deadline  # NaN (not finished) compares False: cancelled
    done, cancelled = idx[fin], int((~fin).sum())
    arr = np.asarray(sent_at, dtype=np.float64)[done]
    rows = np.column_stack([arr, rec.first_token_s[done] - arr, rec.finish_s[done] - arr,
                            rec.prompt_tokens[done], rec.output_tokens[done], rec.cached_tokens[done]]).astype(np.float64)
    last_done = float(rec.finish_s[done].max()) if len(done) else state["start"]
    prefilled = ~np.isnan(rec.prefill_end_s[:n])
    hit = float(rec.hbm_hit_tokens[:n][prefilled].sum() / max(1, rec.prompt_tokens[:n][prefilled].sum()))
    its: dict[str, list[np.ndarray]] = {c: [] for c in STEP_CLASSES}
    for g in cluster.groups:
        for c, v in g.iteration_times().items():
            its[c].append(v)
    iterations = {c: np.concatenate(v) if v else np.zeros(0) for c, v in its.items()}
    rank_requests = np.bincount(rec.prefill_rank[:n][rec.prefill_rank[:n] >= 0], minlength=len(cluster.ranks))
    name = policy if isinstance(policy, str) else policy.name
    rank_steps = (np.concatenate([g.rank_class_steps for g in cluster.groups]) if cluster.groups
                  else np.zeros((0, 3), dtype=np.int64))
    rank_active = np.concatenate([g.rank_active_s for g in cluster.groups]) if cluster.groups else np.zeros(0)
    return ClosedLoopResult(rows, iterations, state["start"], last_done, scenario.num_gpus, hit, rec,
                            [RankInfo(r.replica, r.role, r.kv_capacity_blocks * bs) for r in cluster.ranks], name,
                            cancelled, state["rejected"], time.perf_counter() - t0, rank_requests.tolist(),
                            sum(g.num_steps for g in cluster.groups), sessions, rank_steps, rank_active,
                            float(env.now), *(warm_steps or [np.zeros_like(rank_steps), np.zeros_like(rank_active)]))
