"""Closed-loop, session-based agentic workload (AgentX / aiperf trace replay, as in point 440246).

Open-loop arrival replay cannot express this load: each of ``lanes`` clients runs one agent
trajectory at a time and sends the next turn only after the previous reply has finished and a
*think time* has passed (tool execution), so the offered rate falls when the server slows down.
The closed-loop driver (:mod:`sim.run.closed_loop`) runs the lanes on pdlb's cluster simulator; this module generates what they send.

A *trajectory* (one agent session) is a chain of turns whose context grows: turn ``k``'s prompt is
turn ``k-1``'s prompt, plus turn ``k-1``'s output, plus ``new_k`` new tokens (tool results, user
text). So a turn's prompt extends the previous one; on the rank that served the previous turn
everything but ``new_k`` is a prefix hit (if still cached). Per trajectory (all draws from the
lane's own seeded RNG, lognormals given by median and log-space sigma):

* ``T = 1 + round(LogNormal(turns_median, turns_sigma))`` turns, cut where the context would pass
  ``max_context_tokens``;
* a first prompt ``C_0 ~ LogNormal(initial_context_median_tokens, initial_context_sigma)``;
* a per-trajectory scale ``s ~ LogNormal(1, new_tokens_trajectory_sigma)`` and per-turn new tokens
  ``new_k ~ s * LogNormal(new_tokens_median, new_tokens_sigma)`` (some sessions read huge files);
* outputs ``O_k ~ LogNormal(output_median_tokens, output_sigma)`` capped at ``max_output_tokens``
  (aiperf sends ``ignore_eos``, so the output length is exact);
* the replay starts at turn ``floor(u * T)``, ``u ~ U(start_min_ratio, start_max_ratio)`` (aiperf
  ``--trajectory-start-{min,max}-ratio``), and that first replayed prompt is entirely new to the
  server (aiperf ``--cache-bust first_turn_prefix`` makes every lane's copy of a trajectory
  distinct, so nothing is shared across lanes);
* think time between a reply and the lane's next request: ``think_s`` (constant), or with
  ``think_sigma > 0`` a lognormal of mean ``think_s`` capped at ``max_think_s`` (aiperf replays
  the trace's recorded idle gaps, capped at 300 s; their distribution is not published).

When a trajectory ends the lane starts the next one (with a new session id). The first
``warmup_requests_per_lane`` requests of each lane are warm-up (sent, not measured).

Fitted to point 440246's published request statistics (``sim/data/measured/agentx_440246.json``;
the fit is :func:`fit_to_published`, its result the defaults below): ``initial_context_median_tokens``,
``new_tokens_median``, ``turns_median`` and ``new_tokens_trajectory_sigma`` to the mean input
(126,019 tokens), the median input (79,102), the input std (147,063) and the theoretical
prefix-hit rate (0.9687) -- read, before session 14, as ``previous_turn_reuse_rate`` (previous
prompt and reply reusable). aiperf's own rule counts a prompt's earlier replies as misses
(:func:`replay_stats`); by it these defaults reach 0.960, i.e. 4.0% of input tokens missed against
the published 3.1% (docs/validate.md, "aiperf's code at the pin"); ``output_median_tokens``/``output_sigma``
to the published output median (441.5) and mean (984.4); ``think_s`` by Little's law from the
published completed requests and mean request latency (64 lanes / (6,608 / 3,629.1 s) - 25.48 s).
Held out (checked, not fitted): the input p75/p90/p95 (fit: 145k / 276k / 420k against the
published 145k / 270k / 500k), the output p90/p95 (2,236 / 3,552 from the lognormal against
2,221 / 3,651).
Assumed (not published): the lognormal shapes and their sigmas, a constant think time, no
subagent fan-out in the defaults (aiperf runs a trajectory's subagents concurrently: the subagent
tree below is the option that does).
The public Weka corpus of Claude Code traces (``sim/data/measured/weka_trace_shapes.json``, not
the point's corpus) checks two of them: its per-turn new tokens have median 272 and log-sigma
1.8 (the generator: 260, sqrt(1.2^2 + 1.5^2) = 1.92); its inter-turn gaps are far from constant
(median 9.7 s, p90 120 s), which ``think_quantiles_s`` can replay in shape.

aiperf's replay semantics, as options (off by default; docs/validate.md measures each):
``warmup_primer`` (the primer with ``max_tokens=1``), ``warmup_think_s`` (cache-pressure requests
without idle delays), ``warmup_max_output_tokens``, ``primer_lead_quantiles_s`` (primers spread so
that every t* falls together) and ``recycle_from_turn0`` (a drained lane replays its next trace
from turn 0; by default every trajectory starts at its own start point, cache-busted whole).

Prefix cuts (``prefix_cut_probability``, ``prefix_cut_kept_quantiles``, off by default): a turn
that keeps only part of its previous prompt (Claude Code rewrote its context); the public Weka
corpus has 6.9% such turns, and they carry half of its theoretical misses.

Subagent fan-out (``subagent_spawn_probability`` and the ``subagent_*`` laws, off by default): a
subagent is a fresh-context trajectory the lane runs between two turns of its parent (a join).
The facts it can be set from: 42% of the 062126 corpus' requests are in subagent trees (aiperf's
AgentX FAQ: about 99k requests, 57k top-level turns); in AgentX 440845's replay of the same corpus
5.2% of the measured requests reuse nothing, with a mean prompt of 30,741 tokens
(``sim/data/measured/agentx_440845_request_strata.json``). docs/validate.md measures it.

Subagent trees (``subagent_fanout_weights``, ``subagent_background_probability``,
``subagent_at_once``, off by default; :func:`lane_plans`): a spawn launches several siblings
together, each joined (the parent's next turn waits for it) or in the background (the lane holds
its slot until it drains), and with ``subagent_at_once`` the closed loop runs the siblings at once
inside the lane's slot, as aiperf's AgentX replay does (SemiAnalysisAI/aiperf's AgentX FAQ §5-6,
``weka_trace.py``: siblings "dispatched concurrently", SPAWN_JOIN at the first later parent turn at
or after the subagent's recorded end). The shapes of the public Weka corpus' 63 subagents
(:func:`weka_subagent_shapes`, ``bench/weka_subagent_shapes.py``): spawns of 1 / 2 / 3 siblings
21 / 9 / 8 times, 60 joined and 3 background, about 11 turns of 2,259 new tokens (median) from a
10,335-token first prompt. ``subagent_new_tokens_median`` gives subagents their own per-turn law.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AgenticWorkloadConfig", "Turn", "Subagent", "TrajectoryPlan", "lane_turns", "lane_plans",
           "uses_subagent_tree", "weka_subagent_shapes", "measured_turns", "replay_stats", "fit_to_published", "warmup_requests",
           "weka_think_quantiles", "weka_primer_lead_quantiles", "weka_prefix_cut_kept_quantiles",
           "weka_prefix_cut_probability", "quantile_mean", "sample_quantiles", "AIPERF_HASH_BLOCK_TOKENS"]

#: bound on the turns of one trajectory (every input-driven loop is bounded)
MAX_TURNS_PER_TRAJECTORY = 10_000
#: bound on the siblings of one spawn (``AgenticWorkloadConfig.subagent_fanout_weights``)
MAX_FANOUT = 64
#: the block size of the Weka traces' hash ids, tokens: aiperf's theoretical prefix-cache hit counts
#: whole blocks of this size (SemiAnalysisAI/aiperf ``metrics/theoretical_prefix_cache.py``)
AIPERF_HASH_BLOCK_TOKENS = 64


class AgenticWorkloadConfig(BaseModel):
    """Lanes, trajectory shape and timing of a closed-loop agentic replay. Seeded, frozen.
    Token counts in tokens, times in seconds; lognormals are (median, log-space sigma)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    lanes: int = Field(64, ge=1, le=100_000)
    duration_s: float = Field(3600.0, gt=0)
    warmup_requests_per_lane: int = Field(10, ge=0)
    start_min_ratio: float = Field(0.25, ge=0, le=1)
    start_max_ratio: float = Field(0.75, ge=0, le=1)
    turns_median: float = Field(28.0, gt=0)
    turns_sigma: float = Field(0.8, ge=0, le=5)
    initial_context_median_tokens: float = Field(10_000.0, gt=0)
    initial_context_sigma: float = Field(0.8, ge=0, le=5)
    new_tokens_median: float = Field(260.0, gt=0)
    new_tokens_sigma: float = Field(1.2, ge=0, le=5)
    new_tokens_trajectory_sigma: float = Field(1.5, ge=0, le=5)
    output_median_tokens: float = Field(441.5, gt=0)
    output_sigma: float = Field(1.267, ge=0, le=5)
    max_output_tokens: int = Field(32_768, ge=1)
    max_context_tokens: int = Field(1_048_576, ge=2)
    think_s: float = Field(9.67, ge=0)
    #: log-space sigma of a lognormal think time whose mean is ``think_s`` (drawn per turn from
    #: the lane's own RNG, capped at ``max_think_s``); 0 = every think time is ``think_s``
    think_sigma: float = Field(0.0, ge=0, le=5)
    #: longest think time, s (aiperf's agentic replay caps a trace's idle gap at 300 s)
    max_think_s: float = Field(300.0, gt=0)
    #: an empirical think-time shape: quantiles at equally spaced probabilities 0..1 (at least
    #: 2, non-decreasing, s), sampled by linear interpolation and scaled so that the mean is
    #: ``think_s`` (the shape is taken from data, the mean stays Little's law's); overrides
    #: ``think_sigma``. :func:`weka_think_quantiles` gives the public Weka corpus' gaps
    think_quantiles_s: tuple[float, ...] | None = None
    #: aiperf's priming request: each lane's first request (its first replayed turn, the whole
    #: prefix at the trajectory's start point t*) is sent with ``max_tokens=1``, so it is a
    #: prefill that never decodes, and it is not one of the ``warmup_requests_per_lane``
    #: (aiperf ``AgenticReplayStrategy``: warm-up = one primer per stream in flight at t*, then
    #: the cache-pressure requests; point 440246's warm-up completed 707 = 64 * 10 + 67 requests)
    warmup_primer: bool = False
    #: a sensitivity knob for an unpublished fact, the primers' length: each primer's prompt is its
    #: first replayed turn's times this (whole, cold; the lane's next turn still reuses only the
    #: blocks of its own previous prompt). These defaults reach the published mean input with short
    #: trajectories restarted mid-trace, so their primers average about 60k tokens (seeds 42, 1, 2,
    #: 3: 61k / 60k / 62k / 68k); aiperf's structure (traces of about 145 top-level turns, recycled
    #: from turn 0) fitted to the same statistics gives 1.6-2.8x that (docs/validate.md's V3: 107k /
    #: 98k at seeds 42 / 1; F2: 155k / 170k). 1 = the generator's. Needs ``warmup_primer``
    primer_context_scale: float = Field(1.0, ge=1.0, le=20.0)
    #: output cap of the warm-up requests after the primer (None: their recorded output; aiperf's
    #: later versions cap every warm-up request at 1 token, ``WARMUP_MAX_OUTPUT_TOKENS``, so the
    #: whole warm-up is prefill; whether the pinned version did is not stated)
    warmup_max_output_tokens: int | None = Field(None, ge=1)
    #: think time between warm-up requests, s (None: ``think_s`` and ``think_sigma`` as in the
    #: measured window; aiperf's cache-pressure warm-up replays "without idle delays": 0)
    warmup_think_s: float | None = Field(None, ge=0)
    #: aiperf's default primer spread: each lane draws a lead (how long before its t* the primed
    #: turn was sent; quantiles at equally spaced probabilities, s) and sends its first request at
    #: ``max(leads) - lead``, so that every lane's t* falls at the same instant;
    #: :func:`weka_primer_lead_quantiles` gives the leads of the public Weka corpus (capped at
    #: 300 s as aiperf caps them). None: all first requests at once (``--burst-phase-starts``)
    primer_lead_quantiles_s: tuple[float, ...] | None = None
    #: a barrier between the warm-up and the measured phase: a lane that has finished its warm-up
    #: sends nothing more until every lane has, then all lanes send their next request at once
    #: (aiperf's credit phases: "--warmup-grace-period: the grace period in seconds to wait for
    #: responses after warmup phase ends ... If not set, waits indefinitely for all warmup
    #: responses"); False: a lane goes on at once (its requests before the window are not
    #: measured). Whether the pinned AgentX scenario ran its phases seamlessly is not stated.
    #: Not with ``subagent_at_once``
    warmup_barrier: bool = False
    #: what a request's ``session_id`` (the key vllm-router's ring hashes) names: ``"session"``, the
    #: trajectory (a lane's next trajectory gets a new id and may land on another DP rank), or
    #: ``"lane"``, the lane for the whole run (``s{seed}-lane{j}``: every trajectory of a lane on one
    #: rank, the lanes' placement a fresh draw per workload seed, as random ids give). aiperf sends
    #: one correlation id per conversation; the point's corpus has about 145 top-level turns per
    #: trace (57k turns in 393 traces), so a lane replays its first trace for most of the measured
    #: hour (from its start point, 25-75% in: about 36-109 turns of about 35 s), while these
    #: defaults' trajectories (28 turns median) move every lane about 7 times an hour
    routing_key: Literal["session", "lane"] = "session"
    #: a lane's later trajectories replay from turn 0 (aiperf recycles a finished lane into the
    #: next trace "in full from turn 0", with a fresh cache-bust marker); False: every trajectory
    #: starts at its own start point like the first
    recycle_from_turn0: bool = False
    #: subagent fan-out: after each turn of a trajectory but its last, with this probability the
    #: lane runs one subagent before the trajectory's next turn (a join: the parent waits for it).
    #: A subagent is a trajectory of its own with a *fresh* context (aiperf: "in the SemiAnalysis
    #: corpora every subagent is a spawn (a fresh-context child)"): first prompt
    #: ``LogNormal(subagent_context_median_tokens, subagent_context_sigma)``, cold, then
    #: ``1 + round(LogNormal(subagent_turns_median, subagent_turns_sigma))`` turns whose new tokens,
    #: outputs and think times follow the parent's laws; its own session id. 0 = none (the default).
    #: Siblings, background subagents and subagents at once: the tree fields below (:func:`lane_plans`)
    subagent_spawn_probability: float = Field(0.0, ge=0, le=1)
    subagent_turns_median: float = Field(7.3, gt=0)
    subagent_turns_sigma: float = Field(0.8, ge=0, le=5)
    subagent_context_median_tokens: float = Field(22_300.0, gt=0)
    subagent_context_sigma: float = Field(0.8, ge=0, le=5)
    #: siblings per spawn: weights of 1, 2, 3, ... subagents launched together after a parent turn
    #: (normalized; at most 64 entries). None: one subagent per spawn. The public Weka corpus'
    #: spawns (:func:`weka_subagent_shapes`): 21 of 38 launch one, 9 two, 8 three
    subagent_fanout_weights: tuple[float, ...] | None = None
    #: per subagent, the probability that it runs in the background: the parent's next turn does
    #: not wait for it, but the lane holds its slot until it has drained (aiperf: a subagent with no
    #: later parent turn at or after its recorded end). 0: every subagent is joined
    subagent_background_probability: float = Field(0.0, ge=0, le=1)
    #: run a spawn's siblings at once, each its own stream of turns inside the lane's slot, and
    #: background subagents beside their parent (aiperf's AgentX replay: "subagents that overlapped
    #: in time are dispatched concurrently"; a lane holds its slot until the whole tree drains).
    #: False: the lane sends the siblings' turns one after another before the parent's next turn
    subagent_at_once: bool = False
    #: new tokens per subagent turn, lognormal (median, log-sigma), with no per-trajectory scale
    #: (the public Weka corpus' subagents: median 2,259, log-sigma 1.55, 8x the parents' 272: file
    #: reads and searches). None: the parent's laws (``new_tokens_*``)
    subagent_new_tokens_median: float | None = Field(None, gt=0)
    subagent_new_tokens_sigma: float = Field(1.55, ge=0, le=5)
    #: prefix cuts: with this probability a turn after its trajectory's first keeps only part of
    #: the previous prompt as its prefix (Claude Code rewrites context: a compaction, an edited
    #: earlier message, a moved system reminder); the rest of the prompt is new to the server and
    #: the prompt length is unchanged. The public Weka corpus of Claude Code traces has 6.9% such
    #: turns (:func:`weka_prefix_cut_probability`); 0 = none (no extra RNG draw)
    prefix_cut_probability: float = Field(0.0, ge=0, le=1)
    #: the kept fraction of the previous prompt on a cut turn: quantiles at equally spaced
    #: probabilities 0..1 (at least 2, non-decreasing, in [0, 1]); None: the corpus'
    #: (:func:`weka_prefix_cut_kept_quantiles`; median 0.999, p10 0.10)
    prefix_cut_kept_quantiles: tuple[float, ...] | None = None
    seed: int = Field(42, ge=0)

    @model_validator(mode="after")
    def _check(self) -> AgenticWorkloadConfig:
        for name in ("think_quantiles_s", "primer_lead_quantiles_s"):
            q = getattr(self, name)
            if q is not None and (len(q) < 2 or len(q) > 10_001 or any(b < a for a, b in zip(q, q[1:]))
                                  or q[0] < 0 or not sum(q) > 0 or q[-1] > 86_400):
                raise ValueError(f"{name}: 2..10001 non-decreasing quantiles in [0, 86400] s with a positive mean")
        w = self.subagent_fanout_weights
        if w is not None and (not 1 <= len(w) <= MAX_FANOUT or any(x < 0 for x in w) or not sum(w) > 0):
            raise ValueError(f"subagent_fanout_weights: 1..{MAX_FANOUT} non-negative weights with a positive sum")
        q = self.prefix_cut_kept_quantiles
        if q is not None and (len(q) < 2 or len(q) > 10_001 or any(b < a for a, b in zip(q, q[1:]))
                              or q[0] < 0 or q[-1] > 1):
            raise ValueError("prefix_cut_kept_quantiles: 2..10001 non-decreasing fractions in [0, 1]")
        if self.primer_context_scale != 1.0 and not self.warmup_primer:
            raise ValueError("primer_context_scale needs warmup_primer (it scales the primer's prompt)")
        if self.warmup_barrier and self.subagent_at_once:
            raise ValueError("warmup_barrier is not implemented for subagent_at_once (trajectory trees)")
        if self.start_min_ratio > self.start_max_ratio:
            raise ValueError(f"start_min_ratio ({self.start_min_ratio}) > start_max_ratio ({self.start_max_ratio})")
        return self


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a lane. ``input_tokens`` = the whole prompt; ``reusable_tokens`` = its part
    that the previous turn of the same trajectory left in the KV cache (previous prompt + previous
    output; 0 on a trajectory's first replayed turn); ``session`` names the trajectory."""

    session: str
    turn: int
    input_tokens: int
    reusable_tokens: int
    output_tokens: int
    first_of_trajectory: bool
    #: the part of ``reusable_tokens`` the server itself computed: the previous *prompt* (0 on a
    #: first turn). The previous reply in this prompt is the trace's recorded reply, not the tokens
    #: the server generated (aiperf replays recorded trajectories with ``ignore_eos``), so a server
    #: can reuse only up to the previous prompt's end
    server_reusable_tokens: int = 0
    #: a subagent's turn (its own session, fresh context), not a turn of the lane's root trajectory
    subagent: bool = False


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * math.exp(sigma * rng.standard_normal())) if sigma > 0 else float(median)


def _trajectory(rng: np.random.Generator, c: AgenticWorkloadConfig, *, subagent: bool = False
                ) -> tuple[list[int], list[int], list[int | None]]:
    """``(contexts, outputs, kept)``: every turn's prompt length and output length of one
    trajectory (``subagent``: with the subagent's turn count and first prompt), and per turn the
    tokens of the previous prompt it keeps as prefix after a prefix cut (None: no cut, the turn
    extends the previous prompt and reply; always None on the first turn)."""
    turns_median, turns_sigma = ((c.subagent_turns_median, c.subagent_turns_sigma) if subagent
                                 else (c.turns_median, c.turns_sigma))
    turns = min(MAX_TURNS_PER_TRAJECTORY, 1 + int(round(_lognormal(rng, turns_median, turns_sigma))))
    scale = _lognormal(rng, 1.0, c.new_tokens_trajectory_sigma)
    new_median, new_sigma = c.new_tokens_median, c.new_tokens_sigma
    if subagent and c.subagent_new_tokens_median is not None:  # the subagent's own law, no trajectory scale
        scale, new_median, new_sigma = 1.0, c.subagent_new_tokens_median, c.subagent_new_tokens_sigma
    ctx_median, ctx_sigma = ((c.subagent_context_median_tokens, c.subagent_context_sigma) if subagent
                             else (c.initial_context_median_tokens, c.initial_context_sigma))
    ctx = max(1, int(_lognormal(rng, ctx_median, ctx_sigma)))
    ctx = min(ctx, c.max_context_tokens - 1)
    contexts: list[int] = []
    outputs: list[int] = []
    kept: list[int | None] = []
    for _ in range(turns):
        out = max(1, min(c.max_output_tokens, int(round(_lognormal(rng, c.output_median_tokens, c.output_sigma)))))
        if ctx + out > c.max_context_tokens:
            break
        cut: int | None = None
        if contexts and c.prefix_cut_probability > 0 and rng.uniform() < c.prefix_cut_probability:
            frac = sample_quantiles(c.prefix_cut_kept_quantiles or weka_prefix_cut_kept_quantiles(), rng.uniform())
            cut = int(frac * contexts[-1])
        contexts.append(ctx)
        outputs.append(out)
        kept.append(cut)
        ctx = ctx + out + max(1, int(round(scale * _lognormal(rng, new_median, new_sigma))))
    if not contexts:  # the first prompt alone fills the context: one short turn
        contexts.append(c.max_context_tokens - 1)
        outputs.append(1)
        kept.append(None)
    return contexts, outputs, kept


def _replay(session: str, contexts: list[int], outputs: list[int], start: int,
            kept: list[int | None] | None = None, subagent: bool = False) -> Iterator[Turn]:
    for t in range(start, len(contexts)):
        if t == start:
            reusable = server = 0
        elif kept is not None and (kept_t := kept[t]) is not None:
            reusable = server = kept_t
        else:
            reusable, server = contexts[t - 1] + outputs[t - 1], contexts[t - 1]
        yield Turn(session, t, contexts[t], reusable, outputs[t], t == start, server, subagent)


def _next_trajectory(rng: np.random.Generator, config: AgenticWorkloadConfig, lane: int,
                     k: int) -> tuple[str, list[int], list[int], list[int | None], int]:
    """Lane ``lane``'s ``k``-th trajectory (:func:`_trajectory`) and the turn it starts at: uniform in
    ``[start_min_ratio, start_max_ratio)`` of its turns (aiperf's start point), turn 0 from the second
    trajectory on under ``recycle_from_turn0``. Returns (session, contexts, outputs, kept, start)."""
    contexts, outputs, kept = _trajectory(rng, config)
    u = rng.uniform(config.start_min_ratio, config.start_max_ratio)
    start = min(len(contexts) - 1, int(math.floor(u * len(contexts))))
    if k > 0 and config.recycle_from_turn0:
        start = 0
    return f"lane{lane}-traj{k}", contexts, outputs, kept, start


def lane_turns(config: AgenticWorkloadConfig, lane: int) -> Iterator[Turn]:
    """The endless sequence of turns lane ``lane`` sends (the simulator stops reading it at the
    end of the run). Deterministic: lane ``j`` draws from ``SeedSequence([seed, 7, j])``."""
    if not 0 <= lane < config.lanes:
        raise ValueError(f"lane {lane} outside [0, {config.lanes})")
    if uses_subagent_tree(config):  # the tree, flattened: each spawn's siblings one after another
        for plan in lane_plans(config, lane):
            for turn, group in zip(plan.turns, plan.spawns):
                yield turn
                for sub in group:
                    yield from sub.turns
        return
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 7, lane]))
    k = 0
    while True:
        session, contexts, outputs, kept, start = _next_trajectory(rng, config, lane, k)
        if config.subagent_spawn_probability <= 0:
            yield from _replay(session, contexts, outputs, start, kept)
        else:
            for t, turn in enumerate(_replay(session, contexts, outputs, start, kept), start):
                yield turn
                if t < len(contexts) - 1 and rng.uniform() < config.subagent_spawn_probability:
                    sub_ctx, sub_out, sub_kept = _trajectory(rng, config, subagent=True)
                    yield from _replay(f"{session}-sub{t}", sub_ctx, sub_out, 0, sub_kept, True)
        k += 1


@dataclass(frozen=True, slots=True)
class Subagent:
    """One subagent of a spawn: its turns (its own session, a fresh context: the first turn is
    cold) and whether the parent's next turn waits for it (``joined``; else it runs in the
    background and the lane holds its slot until it has drained)."""

    turns: tuple[Turn, ...]
    joined: bool


@dataclass(frozen=True, slots=True)
class TrajectoryPlan:
    """One root trajectory of a lane as a tree: ``turns`` = the parent's replayed turns;
    ``spawns[i]`` = the subagents launched together after ``turns[i]`` (siblings; empty for most
    turns, always empty after the last)."""

    turns: tuple[Turn, ...]
    spawns: tuple[tuple[Subagent, ...], ...]


def uses_subagent_tree(config: AgenticWorkloadConfig) -> bool:
    """Whether ``config`` draws its lanes as trajectory trees (:func:`lane_plans`): any of sibling
    fan-out, background subagents or siblings at once is set. Otherwise :func:`lane_turns` keeps
    its sequential stream (bit-identical to the releases before trees existed)."""
    return (config.subagent_fanout_weights is not None or config.subagent_background_probability > 0
            or config.subagent_at_once)


def lane_plans(config: AgenticWorkloadConfig, lane: int) -> Iterator[TrajectoryPlan]:
    """The endless sequence of trajectory trees lane ``lane`` replays. Per trajectory (lane ``j``'s
    own RNG, ``SeedSequence([seed, 7, j])``; the draws interleave differently from :func:`lane_turns`'
    sequential stream, so a tree config never reproduces a sequential one's draw):
    the parent (as :func:`lane_turns`: start point, turn-0 recycling, prefix cuts), then after each
    replayed parent turn but the last, with ``subagent_spawn_probability``, a spawn of ``k``
    siblings (``k`` drawn from ``subagent_fanout_weights``, default 1), each a fresh-context
    subagent trajectory (session ``<parent>-sub<turn>.<i>``), joined unless it draws background
    (``subagent_background_probability``)."""
    if not 0 <= lane < config.lanes:
        raise ValueError(f"lane {lane} outside [0, {config.lanes})")
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 7, lane]))
    w = np.asarray(config.subagent_fanout_weights or (1.0,), dtype=np.float64)
    w = w / w.sum()
    k = 0
    while True:
        session, contexts, outputs, kept, start = _next_trajectory(rng, config, lane, k)
        turns = tuple(_replay(session, contexts, outputs, start, kept))
        spawns: list[tuple[Subagent, ...]] = []
        for i, turn in enumerate(turns):
            group: list[Subagent] = []
            if i < len(turns) - 1 and rng.uniform() < config.subagent_spawn_probability:
                for j in range(1 + int(rng.choice(len(w), p=w))):
                    sub_ctx, sub_out, sub_kept = _trajectory(rng, config, subagent=True)
                    joined = bool(rng.uniform() >= config.subagent_background_probability)
                    group.append(Subagent(tuple(_replay(f"{session}-sub{turn.turn}.{j}", sub_ctx, sub_out, 0,
                                                        sub_kept, True)), joined))
            spawns.append(tuple(group))
        yield TrajectoryPlan(turns, tuple(spawns))
        k += 1


WEKA_SHAPES_PATH = Path(__file__).parent.parent / "data" / "measured" / "weka_trace_shapes.json"


def weka_think_quantiles(path: Path = WEKA_SHAPES_PATH) -> tuple[float, ...]:
    """The end-to-start inter-turn gaps of the public Weka Claude Code corpus (739 traces,
    callanjfox/kv-cache-tester, ``sim/data/measured/weka_trace_shapes.json``), clamped to aiperf's
    300 s idle cap: 51 quantiles (0, 2, ..., 100%), s. Median 9.7 s, mean 38 s, 15% over 60 s."""
    with open(path, encoding="utf-8") as f:
        return tuple(float(x) for x in json.load(f)["think_gap_s_quantiles_0_to_100_step_2"])


def weka_primer_lead_quantiles(path: Path = WEKA_SHAPES_PATH) -> tuple[float, ...]:
    """aiperf's warm-up leads on the public Weka corpus: t* uniform in 25-75% of a trace, lead =
    t* minus the start of the last request before it, capped at 300 s (51 quantiles, s; median
    41 s, mean 74 s): ``AgenticWorkloadConfig.primer_lead_quantiles_s``."""
    with open(path, encoding="utf-8") as f:
        return tuple(float(x) for x in json.load(f)["primer_lead_s_quantiles_0_to_100_step_2"])


@functools.lru_cache(maxsize=4)
def weka_prefix_cut_kept_quantiles(path: Path = WEKA_SHAPES_PATH) -> tuple[float, ...]:
    """The kept fraction of the previous prompt on the public Weka corpus' prefix cuts (root turns
    whose 64-token block hashes stop matching inside the previous prompt; 3,290 of 47,948 turns):
    51 quantiles (0, 2, ..., 100%). Bimodal: 72% keep over 98% (one 64-token block lost, median),
    28% keep under 60% (context rewritten: p10 0.10). ``sim/data/measured/weka_trace_shapes.json``."""
    with open(path, encoding="utf-8") as f:
        return tuple(float(x) for x in json.load(f)["prefix_cut"]["kept_fraction_quantiles_0_to_100_step_2"])


def weka_prefix_cut_probability(path: Path = WEKA_SHAPES_PATH) -> float:
    """The share of root turns after the first that are prefix cuts in the public Weka corpus
    (0.0686: 3,290 of 47,948): :attr:`AgenticWorkloadConfig.prefix_cut_probability`."""
    with open(path, encoding="utf-8") as f:
        return float(json.load(f)["prefix_cut"]["probability"])


@functools.lru_cache(maxsize=4)
def weka_subagent_shapes(path: Path = WEKA_SHAPES_PATH) -> dict:
    """The subagents of the public Weka corpus (``bench/weka_subagent_shapes.py``; 63 subagents in
    38 spawns of 17 traces): fan-out counts (21 spawns of one, 9 of two, 8 of three), joined vs
    background (60 / 3 by aiperf's join rule), per subagent turns (median 11), first prompt
    (median 10,335 tokens), new tokens per turn (median 2,259, log-sigma 1.55), outputs, gaps and
    durations (each a dict of n, mean, p10..p90 and the log-sigma of the positive values). Key
    ``subagents`` of ``sim/data/measured/weka_trace_shapes.json``. Do not mutate the result (cached)."""
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f)["subagents"])


def quantile_mean(q: tuple[float, ...]) -> float:
    """Mean of the piecewise-linear quantile function through ``q`` (equally spaced
    probabilities): the trapezoid rule, ``(sum(q) - (q[0] + q[-1]) / 2) / (len(q) - 1)``."""
    return (sum(q) - (q[0] + q[-1]) / 2) / (len(q) - 1)


def sample_quantiles(q: tuple[float, ...], u: float) -> float:
    """The value at probability ``u`` in [0, 1] of the piecewise-linear quantile function ``q``."""
    x = min(max(u, 0.0), 1.0) * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    return q[i] + (x - i) * (q[i + 1] - q[i])


def warmup_requests(config: AgenticWorkloadConfig) -> int:
    """Requests per lane before its measured ones: the primer (if ``warmup_primer``) plus
    ``warmup_requests_per_lane``."""
    return config.warmup_requests_per_lane + int(config.warmup_primer)


def measured_turns(config: AgenticWorkloadConfig, requests_per_lane: int) -> Iterator[Turn]:
    """The first ``requests_per_lane`` measured turns of every lane, lane by lane (each lane's
    :func:`warmup_requests` skipped): ``config.lanes * requests_per_lane`` turns."""
    warm = warmup_requests(config)
    for lane in range(config.lanes):
        it = lane_turns(config, lane)
        for i in range(warm + requests_per_lane):
            t = next(it)
            if i >= warm:
                yield t


def replay_stats(config: AgenticWorkloadConfig, requests_per_lane: int = 200) -> dict[str, float]:
    """Request-level statistics of the replayed turns (``requests_per_lane`` from every lane, the
    warm-up excluded): input mean/median/p75/p90/p95/std, output mean/median/p90/p95, and two
    reuse rates (unbounded cache, one rank per session):

    * ``theoretical_cache_hit_rate``: aiperf's theoretical prefix-cache hit, the quantity point
      440246 publishes (0.9687). aiperf stamps each request with the leading run of its 64-token
      block hashes that an earlier request of the trace already *sent* and the covered blocks
      ``in // 64``, and divides the sums (SemiAnalysisAI/aiperf, cquil11/aiperf
      ``metrics/theoretical_prefix_cache.py``, ``compute_causal_prefix_hits``). A prompt's earlier
      replies were never sent as input before, so they are misses: here the hit is the previous
      *prompt* (or its kept part after a prefix cut) in whole 64-token blocks;
    * ``previous_turn_reuse_rate``: ``sum(reusable) / sum(input)``, the previous prompt *and*
      reply counted as reusable (the statistic the defaults were fitted to before session 14).

    Weights every turn equally, as a request count does (the closed loop's pacing is not
    modelled here: a long-context turn takes longer, which the simulator accounts for)."""
    if requests_per_lane < 1:
        raise ValueError("requests_per_lane must be >= 1")
    inp, reuse, out, srv = [], [], [], []
    for t in measured_turns(config, requests_per_lane):
        inp.append(t.input_tokens)
        reuse.append(t.reusable_tokens)
        out.append(t.output_tokens)
        srv.append(t.server_reusable_tokens)
    a, r, o = np.asarray(inp, float), np.asarray(reuse, float), np.asarray(out, float)
    b = AIPERF_HASH_BLOCK_TOKENS
    covered = np.asarray(inp, np.int64) // b
    hit = np.minimum(np.asarray(srv, np.int64) // b, covered)
    q = np.percentile
    return {"mean_input_tokens": float(a.mean()), "median_input_tokens": float(q(a, 50)),
            "p75_input_tokens": float(q(a, 75)), "p90_input_tokens": float(q(a, 90)),
            "p95_input_tokens": float(q(a, 95)), "std_input_tokens": float(a.std()),
            "mean_output_tokens": float(o.mean()), "median_output_tokens": float(q(o, 50)),
            "p90_output_tokens": float(q(o, 90)), "p95_output_tokens": float(q(o, 95)),
            "theoretical_cache_hit_rate": float(hit.sum() / max(1, covered.sum())),
            "previous_turn_reuse_rate": float(r.sum() / a.sum())}


def fit_to_published(target: dict[str, float], grid: dict[str, list[float]],
                     base: AgenticWorkloadConfig | None = None, *, requests_per_lane: int = 400,
                     max_points: int = 1000) -> tuple[AgenticWorkloadConfig, float]:
    """Grid search: the config of ``grid`` (field name -> candidate values, all combinations,
    at most ``max_points``) whose :func:`replay_stats` has the smallest sum of relative errors
    against ``target`` (keys of :func:`replay_stats`; for ``theoretical_cache_hit_rate`` the
    relative error of the miss rate). Returns ``(config, error)``. The defaults of
    :class:`AgenticWorkloadConfig` come from this search over ``initial_context_median_tokens``
    {10k, 20k}, ``turns_median`` {22, 28, 34}, ``new_tokens_median`` {200, 260, 330},
    ``new_tokens_trajectory_sigma`` {1.3, 1.5} against the published mean and median input, std
    of input and theoretical hit rate, the last read as ``previous_turn_reuse_rate`` (best: 10k,
    28, 260, 1.5; sum of errors 0.15); aiperf's rule is ``theoretical_cache_hit_rate``.

    Raises:
        ValueError: an empty grid, an unknown field, or more than ``max_points`` combinations."""
    import itertools
    c0 = base or AgenticWorkloadConfig()
    names = list(grid)
    if not names or any(not grid[n] for n in names):
        raise ValueError("fit_to_published: give at least one field with at least one value")
    if math.prod(len(grid[n]) for n in names) > max_points:
        raise ValueError(f"fit_to_published: more than {max_points} grid points")
    best: tuple[float, AgenticWorkloadConfig] | None = None
    for values in itertools.product(*(grid[n] for n in names)):
        c = AgenticWorkloadConfig(**{**c0.model_dump(), **dict(zip(names, values))})
        s = replay_stats(c, requests_per_lane)
        err = 0.0
        for k, v in target.items():
            if k in ("theoretical_cache_hit_rate", "previous_turn_reuse_rate"):
                err += abs((1 - s[k]) / (1 - v) - 1)
            else:
                err += abs(s[k] / v - 1)
        if best is None or err < best[0]:
            best = (err, c)
    assert best is not None
    return best[1], best[0]
