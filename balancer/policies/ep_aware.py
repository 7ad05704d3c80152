"""``ep_aware``: pdlb's own policy: the placement with the least predicted delay in seconds.

It knows that a wide-EP engine steps at the pace of its busiest DP rank: every candidate rank is
priced with its engine's step model (:class:`balancer.cost_model.EngineCost`, from
``ctx.cost_model`` or :data:`balancer.cost_model.DEFAULT_COST_MODEL`) and the cheapest is taken.
All costs are seconds. Derivation, design choices and the measurements behind the defaults:
docs/policies/ep_aware.md.

**Prefill** (candidate ``i``; :func:`balancer.cost_model.prefill_wait_features`)::

    cost_i = wait_i + fetch_i + externality_weight ext_i + horizon_weight rho horizon_i

``wait_i``: until ``i``'s engine, stepping at its slowest rank's pace, has computed the prompt's
``u_i`` uncached tokens (HBM, host-tier and shared-store hits are cached); ``fetch_i``: the
host-tier and store fetches of the hit; ``ext_i = per_group_token u_i N_after_i``: the delay it
adds to the ``N_after_i`` requests queued on the engine's other ranks; ``horizon_i = max(0, w'_i -
max_{r != i} w_r)``: how far it extends the engine's slowest rank (``w_r`` a rank's queued work),
weighted by ``rho``, the share of the pool's ranks with queued work to the power ``horizon_power``.
On a dense engine (each rank its own step group) the group terms vanish. Dense prefill ranks'
queues count their in-service prompt's progress (:func:`in_service_queue`).

**Decode** (candidate ``i`` of engine ``e``)::

    cost_i = (out / tau) (T_after_i + externality_weight n_e (T_after_i - T_e))
             + transfer_s_per_token (prompt - matched_tokens_i)

``T_after_i``: the engine's step time with the request added (one sequence of ``prompt + out / 2``
KV tokens; ``out`` = ``Request.output_tokens`` capped at ``max_output_estimate_tokens``), ``T_e``
now, ``n_e`` its sequences; ``tau`` the output tokens a sequence gains per step
(``EngineCost.decode_tokens_per_step``: speculative decoding's acceptance length) with
``spec_decode=True``, else 1, so ``out / tau`` is the request's decode steps. **Mixed** pools add both costs (without the transfer) and the stall the
prompt's chunks cause to the batch they share steps with.

**The sequence cap** (``seq_cap=True``; off by default, docs/policies/ep_aware.md says why): where
the pool's engines run at most ``S = EngineCost.max_num_seqs`` sequences per rank (vLLM
``max_num_seqs``) and some candidate already holds ``S``, each rank runs ``min(b_r, S)`` of its
``b_r`` requests; on a full rank the request first waits for a slot,
``wait_i = (b_i + 1 - S) (out / tau) T_e / S`` (:func:`balancer.cost_model.slot_wait_s`), then takes a
finished sequence's place; the wait is added to the decode cost and, on mixed pools, to the
predicted TTFT.

**Ties and room**: costs within ``tie_tolerance`` (relative) of the cheapest tie, broken by the
least queued work, then with ``ctx.rng``; candidates without KV room for prompt + output (known
capacities) are taken only when none has room (then the one with most room).

**SLO-aware placement** (a TTFT budget ``ttft_s + per_1k * prompt / 1000`` from
``SelectContext.ttft_slo``, or the policy's own ``ttft_slo_s``; on pools with a dense engine, or on
every pool with ``slo_wide_ep``): a candidate meets it when
``slo_margin * (wait_i + fetch_i) <= budget``; the cheapest that meets it is taken. When none does
(or the prompt misses it even on an idle rank, with ``slo_intrinsic="dump"``) the request is
doomed: among the candidates within ``slo_doomed_cap`` budgets, the least harmful (``cost_i -
ttft_i`` within ``tie_tolerance``), then the longest wait for the least own work. A prompt that
misses its budget even idle is kept within ``1 + slo_doomed_tail`` times its shortest predicted TTFT
(the tail guard: such prompts make the TTFT p99).

Parameters:
    externality_weight: weight of the delay a placement adds to requests already on the engine
        (1 = count it fully, 0 = purely selfish).
    horizon_weight: weight of the slow-horizon term (0 = off).
    horizon_power: exponent of ``rho`` in the horizon weight.
    tie_tolerance: relative cost difference below which candidates tie.
    max_output_estimate_tokens: cap on the output length the decode cost projects, tokens.
    slo_aware: use the router's TTFT budget (``SelectContext.ttft_slo``) when it has one.
    ttft_slo_s, ttft_slo_per_1k_tokens_s: the policy's own TTFT budget (0 = none: the router's),
        seconds and seconds per 1,000 prompt tokens.
    slo_margin: a candidate meets the budget when ``slo_margin * predicted TTFT <= budget``;
        ``None``: 1 where the queues count in-service progress (prefill pools whose engines are
        all dense, with ``in_service_progress``), else :data:`PESSIMISTIC_SLO_MARGIN` (a
        predicted wait that counts in-flight prompts in full runs high).
    in_service_progress: subtract from a dense prefill rank's queue what its in-service prompt has
        computed since it began (:func:`in_service_queue`); not applied on wide-EP engines nor on
        mixed pools.
    slo_doomed_cap: a doomed request joins a queue of at most this many budgets (``inf`` = any).
    slo_intrinsic: ``"dump"`` or ``"blind"``: how a prompt that misses its budget even on an idle
        rank is placed (as a doomed one, or SLO-blind).
    slo_doomed_tail: the tail guard (``inf`` = off): a prompt that misses its budget even on an
        idle rank (by more than ``slo_doomed_tail_own`` budgets) is placed as a doomed one only among
        candidates whose predicted TTFT is at most ``1 + slo_doomed_tail`` times the shortest.
    slo_doomed_tail_own: budgets a prompt's own idle-rank TTFT must exceed for the guard to apply.
    slo_wide_ep: use the TTFT budget on a pool whose engines are all wide EP too (default off:
        there the placement is SLO-blind). Measured on the Mooncake traces' wide-EP rows, SLO-blind
        placement gave as much or more capacity at every budget measured and a TTFT p99 0.80-1.01x
        the SLO-aware one at the same rate; SLO-aware placement pays on dense pools (docs/policies/ep_aware.md,
        "The named losses and the tail at equal rate").
    seq_cap: price the engines' sequence cap and the slot wait (above) where the cost model knows
        the cap (``EngineCost.max_num_seqs``); False (the default) prices as if there were none.
    cadence: price vLLM's per-request chunk limit and prefill cadence (below) where the cost model
        sets them (``EngineCost.request_chunk_tokens``, ``prefill_schedule_interval``); engines
        without them are priced as before either way.
    spec_decode: price speculative decoding's accepted tokens per decode step where the cost
        model sets them (``EngineCost.decode_tokens_per_step`` > 1: a request of ``out`` tokens
        decodes in ``out / tau`` steps, in its decode cost, the slot wait and the forced prefill
        steps); False (the default) prices one token per step. Off by default: on AgentX 440246
        (MTP, 2.49 accepted) it met the SLO less often over six workload seeds
        (docs/policies/ep_aware.md, "Speculative decoding's accepted tokens"). Engines without it
        are priced the same either way.
    parallel_chunks: where the cadence's chunks run in parallel (a mixed pool with ``S L <= C``,
        below), price the prompt's group terms by that model (its group tokens delay every request
        of the engine with queued prefill, wherever it goes) instead of FIFO draining's (``N_after``
        and the horizon). Off by default: on AgentX 440246 it did not meet the SLO more often over
        eight workload seeds (level at 2x, 1.8 points lower at 1.5x; docs/policies/ep_aware.md,
        "Who waits for a prompt's group tokens"). Engines without the options are priced the same
        either way.
    session_forecast: read the router's forecast of idle sessions that will return to each rank
        (``Candidates.returning_requests``, ``returning_kv_tokens``; :mod:`balancer.session_forecast`)
        and price decode and mixed candidates as if they had returned: the terms about the
        request's life from now on (the cadence's TTFT and forced steps, the slot wait, the decode
        cost, the tie rule) see ``b + rint(R)`` requests and ``kv + rint(K)`` tokens per rank; the
        prefill terms and the batch stall price what runs and queues now. Off by default.
    prefill_at_once: read the prompts each rank prefills at once (``Candidates.prefill_inflight``,
        the router's routed prompts not yet prefilled) and, where chunks run in parallel (a mixed
        pool with ``S L <= C``), add ``externality_weight n_e ceil(u_i / L) rise_i``: the prompt's
        prefill steps each lengthened by how far it raises the engine's busiest per-step prefill
        (:func:`at_once_step_rise_s`; where the cost model has ``prefill_step_floor_s``, the step's
        rise with the floor, :func:`at_once_floor_rise_s`) for the engine's ``n_e`` running
        sequences. Off by default.
    forecast_new_sessions: with ``session_forecast``, apply the forecast only to requests whose
        prefix no rank holds for at least half the prompt (a new session, or one whose prefix is
        gone); a returning session is priced on what runs now, so the forecast balances where new
        sessions go without moving returning ones off their prefix. Off by default.
    return_horizon_s: the forecast's decay horizon ``H``, seconds (a session idle ``a`` seconds
        counts ``1 - a / H``; dropped at ``H``). With either option the router keeps these facts
        (:attr:`balancer.policies.Policy.session_facts`); without a router (hand-built candidates)
        the columns are ``None`` and both options price nothing.

**vLLM's chunk limit and prefill cadence** (``cadence=True``, the default; only where the cost
model sets ``EngineCost.request_chunk_tokens`` or ``prefill_schedule_interval``;
:mod:`balancer.prefill_cadence`): a prompt's prefill takes ``n_i = max(ceil((q_i + u_i) / C),
ceil(u_i / L))`` steps (``L`` the per-request chunk limit), ``ceil(u_i / L)`` where the sequence
cap ``S`` has ``S L <= C`` (the queue ahead then takes none of its chunks, and the predicted TTFT is
its own ``n_i`` steps' prefill instead of the queue's drain); on a mixed pool with interval ``k``
the TTFT adds the decode steps between the rank's open prefill steps, ``(k - 1)(n_i - 1/2) T_e``
(``T_e`` the engine's decode step now; 0 on an empty rank), and on a full rank the slot wait
(:func:`balancer.cost_model.slot_wait_s`); the cost adds the TTFT's change and, on a full rank (the
request would wait for admission, and the rank prefill on every step), ``externality_weight
forced_i n_e chunk_s``: the group's extra mixed steps times its running sequences times one chunk's
prefill seconds. Where the chunks run in parallel (``S L <= C``) on a mixed pool, with
``parallel_chunks`` (opt-in), the prompt's group terms are those of parallel chunks:
``cost_i = TTFT_i + externality_weight per_group_token u_i N_q,e + (the forced steps)`` (plus the
decode cost and the batch stall), ``N_q,e`` the requests of the engine on ranks with queued
prefill (:func:`balancer.prefill_cadence.queued_requests`), in place of FIFO draining's
``ext_i`` over ``N_after_i`` and the horizon, which price the prompt as starting only after its
rank's queue (in 440246 runs a miss's TTFT does not grow with the queue ahead). Ties there go to
the fewest requests, then the least decode KV.

Source: pdlb. The step models follow the simulator's roofline (DeepSeek V3 DP-attention + EP
layout); the marginal-delay (externality) term is the usual social-cost argument of queueing (the
cost of a job = its own delay + the delay it imposes on others); placing doomed requests is the
EDF-with-abandonment argument of deadline scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from balancer import kernels
from balancer.candidates import Candidates
from balancer.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    EngineCost,
    PrefillStepCost,
    engine_groups,
    engine_layout,
    prefill_wait_features,
    slot_wait_s,
)
from balancer.prefill_cadence import (at_once_tokens, cadence_gap_steps, chunks_in_parallel, forced_prefill_steps,
                                     prefill_steps, queued_requests)
from balancer.policies.base import Policy, SelectContext, argmin_random, fresh_scores, register, scores_of
from balancer.types import Choice, Request, Role, TtftSlo

def _compute_s(c: PrefillStepCost, u: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Seconds of a prompt's own prefill compute, without step overheads: ``(per_token +
    per_group_token) u + per_attn_pair (u p + u (u + 1) / 2)`` for ``u`` uncached tokens after
    ``p`` cached ones, shape ``(n,)``."""
    return (c.per_token_s + c.per_group_token_s) * u + c.per_attn_pair_s * (u * cached + u * (u + 1.0) / 2.0)


#: ``slo_margin``'s automatic value where queued prompts count in full (docs/policies/ep_aware.md)
PESSIMISTIC_SLO_MARGIN = 0.8


def in_service_queue(q: np.ndarray, a: np.ndarray, head_start_s: np.ndarray, head_tokens: np.ndarray,
                     head_pairs: np.ndarray, now_s: float, eng: EngineCost, idx: np.ndarray,
                     rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Queued prefill tokens and attention pairs per rank, shapes ``(n,)``, less what each rank's
    in-service prompt (its oldest pending one, :mod:`balancer.load`) has computed since it began.

    The engine steps at its current pace ``T``: every rank with queued work computes ``x_r =
    min(q_r, C)`` tokens (with their share ``a_r x_r / q_r`` of the pairs) per step, so ``T =
    overhead + max_r(per_token x_r + per_attn_pair a_r x_r / q_r) + per_group_token sum_r x_r``
    over a wide-EP engine's ranks (a dense rank: its own). The head, first in line (engines
    prefill first come, first served), has then computed ``d = min(u_h - 1, C floor(e / T))``
    of its ``u_h`` uncached tokens after ``e = now - start`` seconds in service (at least one
    token is left until the engine reports it done), with pairs ``d p_h + d (d + 1) / 2`` for its
    ``p_h`` cached tokens. Without this the counters hold every queued prompt in full until its
    prefill is done, and a rank far into a long prompt looks as busy as one that just took it.
    """
    elapsed = now_s - head_start_s  # -inf where no prefill is pending
    busy = (q > 0) & (elapsed > 0) & (head_tokens > 1)
    if not busy.any():
        return q, a
    c = eng.prefill
    C = float(eng.chunk_tokens)
    x = np.minimum(q, C)
    share = np.divide(x, q, out=np.zeros_like(q), where=q > 0)
    work = c.per_token_s * x + c.per_attn_pair_s * a * share
    if eng.ep_synchronous:
        n_eng = int(idx.max()) + 1 if len(idx) else 0
        step = c.overhead_s + _per_engine_max(work, idx, rows, n_eng) + c.per_group_token_s * _per_engine_sum(x, idx, n_eng)
    else:
        step = c.overhead_s + work + c.per_group_token_s * x
    u_h = head_tokens.astype(np.float64)
    steps = np.floor(np.divide(np.where(busy, elapsed, 0.0), step, out=np.zeros_like(q), where=step > 0))
    done = np.where(busy, np.minimum(u_h - 1.0, C * steps), 0.0)
    np.minimum(done, q, out=done)
    p_h = np.divide(head_pairs - u_h * (u_h + 1.0) / 2.0, u_h, out=np.zeros_like(q), where=u_h > 0)
    done_pairs = done * np.maximum(p_h, 0.0) + done * (done + 1.0) / 2.0
    return q - done, np.maximum(a - done_pairs, 0.0)


def _at_once_after_and_top(inflight: np.ndarray, C: int, L: int, idx: np.ndarray, rows: np.ndarray | None,
                           ep_synchronous: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(x_after, top)``: each rank's tokens per prefill step with the prompt added
    (:func:`balancer.prefill_cadence.at_once_tokens`) and the tokens per prefill step that set its
    engine's step now (the busiest rank's of its engine where the engine is EP-synchronous, else
    the rank's own). Both shape ``(n,)``, float64."""
    x, x_after = at_once_tokens(inflight, C, L)
    if not ep_synchronous:
        return x_after, x
    n_eng = int(idx[idx.argmax()]) + 1 if len(idx) else 0
    return x_after, _per_engine_max(x, idx, rows, n_eng)


def at_once_step_rise_s(inflight: np.ndarray, u: np.ndarray, cached: np.ndarray, c: PrefillStepCost, C: int, L: int,
                        idx: np.ndarray, rows: np.ndarray | None, ep_synchronous: bool) -> np.ndarray:
    """Seconds by which a prompt placed on each rank lengthens each prefill step of its engine while
    its chunks run, where chunks run in parallel: the rank's tokens per prefill step rise from
    ``x_i = min(C, L m_i)`` to ``min(C, L (m_i + 1))`` (``m`` the prompts each rank prefills at once,
    :func:`balancer.prefill_cadence.at_once_tokens`); a wide-EP engine's step is set by its busiest
    rank, so it lengthens by ``rise_i = max(0, min(C, L (m_i + 1)) - max_r x_r)`` over the engine's
    ranks (a dense rank: by ``x_i' - x_i``), each token costing ``per_token + per_attn_pair (p_i +
    u_i / 2)`` (the prompt's mean position). Shape ``(n,)``, float64, >= 0."""
    x_after, top = _at_once_after_and_top(inflight, C, L, idx, rows, ep_synchronous)
    rise = np.maximum(x_after - top, 0.0)
    return rise * (c.per_token_s + c.per_attn_pair_s * (cached + u / 2.0))


def at_once_floor_rise_s(inflight: np.ndarray, u: np.ndarray, cached: np.ndarray, c: PrefillStepCost, C: int, L: int,
                         idx: np.ndarray, rows: np.ndarray | None, ep_synchronous: bool, floor_s: float,
                         decode_step_s: np.ndarray) -> np.ndarray:
    """:func:`at_once_step_rise_s` on an engine whose steps with prefill last at least ``floor_s``
    (``EngineCost.prefill_step_floor_s`` > 0): seconds by which a prompt placed on each rank
    lengthens each of its engine's prefill steps while its chunks run, where chunks run in
    parallel. The engine's step with ``x`` prefill tokens on its busiest rank lasts
    ``mixed(x) = max(floor, T_d + overhead + x tok_i)`` (``T_d`` the engine's decode step now,
    ``decode_step_s``; ``tok_i = per_token + per_attn_pair (p_i + u_i / 2)`` as there), a step
    without prefill ``T_d``. With ``top`` the busiest rank's tokens per prefill step now and
    ``x_i' = min(C, L (m_i + 1))`` the candidate rank's with the prompt::

        rise_i = mixed(max(top, x_i')) - (mixed(top) if top > 0 else T_d)

    So a prompt whose chunks run while no rank of its engine prefills turns decode steps into
    mixed ones and pays the whole floor (``floor - T_d`` at least), and prompts that prefill at
    once on different ranks share one floor: a rank's tokens that stay under the floor add
    nothing. Shape ``(n,)``, float64, >= 0. Source: the eager-step floor (docs/validate.md, "The
    eager prefill step"); the step sum is the simulator's roofline's (decode and prefill parts
    add)."""
    x_after, top = _at_once_after_and_top(inflight, C, L, idx, rows, ep_synchronous)
    tok = c.per_token_s + c.per_attn_pair_s * (cached + u / 2.0)
    base = decode_step_s + c.overhead_s
    after = np.maximum(floor_s, base + np.maximum(top, x_after) * tok)
    before = np.where(top > 0, np.maximum(floor_s, base + top * tok), decode_step_s)
    return np.maximum(after - before, 0.0)


def _decode_steps(eng: EngineCost, idx: np.ndarray, rows: np.ndarray | None, b: np.ndarray, k: np.ndarray,
                  b_after: np.ndarray, k_after: np.ndarray,
                  n_added: float | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode step each candidate's engine runs now and with the request added, and the
    engine's running requests: ``(T_before, T_after, n_e)``, each ``(n,)`` (seconds, seconds,
    requests). ``b``/``k``: each rank's running requests and KV tokens; ``b_after``/``k_after``: the
    candidate rank's with the request; ``n_added``: requests the engine gains (1, or 0 on a full
    rank). A wide-EP engine steps at its busiest rank (``max`` over the engine's ranks); otherwise
    each rank is its own step. ``T = overhead + per_seq B + per_kv_token K + per_group_seq n_e``."""
    d = eng.decode
    n_eng = int(idx[idx.argmax()]) + 1 if len(idx) else 0
    if eng.ep_synchronous:
        B = _per_engine_max(b, idx, rows, n_eng)
        K = _per_engine_max(k, idx, rows, n_eng)
        n_e = _per_engine_sum(b, idx, n_eng)
    else:
        B, K, n_e = b, k, b
    before = d.overhead_s + d.per_seq_s * B + d.per_kv_token_s * K + d.per_group_seq_s * n_e
    after = (d.overhead_s + d.per_seq_s * np.maximum(B, b_after) + d.per_kv_token_s * np.maximum(K, k_after)
             + d.per_group_seq_s * (n_e + n_added))
    return before, after, n_e


def _plus_transfer(cost: np.ndarray, request: Request, cands: Candidates, model: CostModel,
                   transfer: bool) -> np.ndarray:
    """``cost`` plus, where ``transfer``, the seconds to move the prompt's KV the candidate lacks
    (``transfer_s_per_token x max(P - matched, 0)``), shape ``(n,)``."""
    if not transfer:
        return cost
    moved = request.prompt_tokens - cands.matched_tokens.astype(np.float64)
    return cost + model.transfer_s_per_token * np.maximum(moved, 0.0)


def _per_engine_max(x: np.ndarray, idx: np.ndarray, rows: np.ndarray | None, n_eng: int) -> np.ndarray:
    """Each candidate's engine maximum of ``x``, shape ``(n,)``."""
    if rows is not None:  # np.maximum.reduce: ndarray.max's Python wrapper costs about 1 us more
        return np.maximum.reduce(x[rows], axis=1)[idx]
    out = np.full(n_eng, -np.inf)
    np.maximum.at(out, idx, x)
    return out[idx]


def _per_engine_sum(x: np.ndarray, idx: np.ndarray, n_eng: int) -> np.ndarray:
    """Each candidate's engine sum of ``x``, shape ``(n,)``."""
    return np.bincount(idx, weights=x, minlength=n_eng)[idx]


@register
@dataclass(frozen=True)
class EpAware(Policy):
    """Scores are predicted costs in seconds (lower is better); see the module docstring."""

    name = "ep_aware"
    uses_cost_model = True
    uses_kernels = True  # a Router built with it loads the compiled loops (not the policy itself)
    prefill_head_roles = frozenset({Role.PREFILL})  # in-service progress: dense prefill ranks only
    externality_weight: float = 1.0
    horizon_weight: float = 4.0
    horizon_power: float = 1.0
    tie_tolerance: float = 0.05
    max_output_estimate_tokens: int = 4096
    slo_aware: bool = True
    ttft_slo_s: float = 0.0
    ttft_slo_per_1k_tokens_s: float = 0.0
    slo_margin: float | None = None
    slo_doomed_cap: float = 5.0
    slo_intrinsic: str = "dump"
    in_service_progress: bool = True
    slo_doomed_tail: float = 0.5
    slo_doomed_tail_own: float = 1.0
    slo_wide_ep: bool = False
    seq_cap: bool = False
    cadence: bool = True
    spec_decode: bool = False
    parallel_chunks: bool = False
    session_forecast: bool = False
    prefill_at_once: bool = False
    return_horizon_s: float = 60.0
    forecast_new_sessions: bool = False

    def __post_init__(self) -> None:
        if not self.externality_weight >= 0:
            raise ValueError(f"externality_weight must be >= 0, got {self.externality_weight}")
        if not 0.0 <= self.tie_tolerance < 1.0:
            raise ValueError(f"tie_tolerance must be in [0, 1), got {self.tie_tolerance}")
        if not self.horizon_power >= 0:
            raise ValueError(f"horizon_power must be >= 0, got {self.horizon_power}")
        if not self.horizon_weight >= 0:
            raise ValueError(f"horizon_weight must be >= 0, got {self.horizon_weight}")
        if self.max_output_estimate_tokens < 1:
            raise ValueError(f"max_output_estimate_tokens must be >= 1, got {self.max_output_estimate_tokens}")
        for name in ("ttft_slo_s", "ttft_slo_per_1k_tokens_s"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0 = no SLO), got {v}")
        if self.slo_margin is not None and not (np.isfinite(self.slo_margin) and self.slo_margin > 0):
            raise ValueError(f"slo_margin must be > 0, got {self.slo_margin}")
        if self.slo_intrinsic not in ("dump", "blind"):
            raise ValueError(f"slo_intrinsic must be 'dump' or 'blind', got {self.slo_intrinsic!r}")
        if not self.slo_doomed_cap >= 0:
            raise ValueError(f"slo_doomed_cap must be >= 0 (a multiple of the budget; inf = none), got {self.slo_doomed_cap}")
        if not (np.isfinite(self.slo_doomed_tail_own) and self.slo_doomed_tail_own >= 0):
            raise ValueError(f"slo_doomed_tail_own must be a finite number >= 0 (budgets), got {self.slo_doomed_tail_own}")
        if not self.slo_doomed_tail >= 0:
            raise ValueError(f"slo_doomed_tail must be >= 0 (a fraction over the shortest predicted TTFT; inf = off), "
                             f"got {self.slo_doomed_tail}")
        if not (np.isfinite(self.return_horizon_s) and self.return_horizon_s > 0):
            raise ValueError(f"return_horizon_s must be a finite number of seconds > 0, got {self.return_horizon_s}")
        if self.forecast_new_sessions and not self.session_forecast:
            raise ValueError("forecast_new_sessions needs session_forecast=true (it narrows the forecast to new sessions)")
        if self.ttft_slo_per_1k_tokens_s > 0 and self.ttft_slo_s <= 0:
            raise ValueError("ttft_slo_per_1k_tokens_s needs ttft_slo_s > 0 (the flat part of the budget)")

    @property
    def session_facts(self) -> float | None:
        """The returning-session horizon (seconds) with ``session_forecast`` or ``prefill_at_once``,
        else None (:attr:`balancer.policies.Policy.session_facts`)."""
        return self.return_horizon_s if (self.session_forecast or self.prefill_at_once) else None

    def _forecast(self, cands: Candidates, request: Request) -> Candidates:
        """``cands`` with each rank's running requests and decode KV tokens raised by the forecast of
        its returning sessions (``returning_requests``, ``returning_kv_tokens``, rounded to whole
        requests and tokens: int64 columns as the compiled paths take) with ``session_forecast``;
        ``cands`` itself otherwise, where the router gave no forecast, or, with
        ``forecast_new_sessions``, where some rank holds at least half of ``request``'s prompt (a
        returning session: priced on what runs now, so the forecast does not move it off its prefix)."""
        if not self.session_forecast or cands.returning_requests is None or cands.returning_kv_tokens is None:
            return cands
        if self.forecast_new_sessions and 2 * self._best_hit_tokens(cands) >= request.prompt_tokens:
            return cands
        add_b = np.rint(cands.returning_requests).astype(np.int64)
        if not add_b.any():
            return cands
        add_kv = np.rint(cands.returning_kv_tokens).astype(np.int64)
        return replace(cands, num_requests=cands.num_requests + add_b, decode_kv_tokens=cands.decode_kv_tokens + add_kv)

    @staticmethod
    def _best_hit_tokens(cands: Candidates) -> int:
        """The most prompt tokens any candidate holds: HBM + host + store blocks where the candidates
        carry the tiers, else ``matched_tokens``."""
        if not len(cands):
            return 0
        if cands.hbm_blocks is not None and cands.host_blocks is not None and cands.store_blocks is not None:
            blocks = cands.hbm_blocks + cands.host_blocks + cands.store_blocks
            return int(blocks[blocks.argmax()]) * cands.block_size
        return int(cands.matched_tokens[cands.matched_tokens.argmax()])

    def select(self, request: Request, cands: Candidates, ctx: SelectContext) -> Choice:
        model = ctx.cost_model if ctx.cost_model is not None else DEFAULT_COST_MODEL
        names, idx, rows = engine_groups(cands.replicas)
        ttft = None
        fc = cands  # the candidates with the returning sessions (below), for the later terms and the tie rule
        slo = self._ttft_slo(ctx) if cands.role is not Role.DECODE else None
        if slo is not None and not self.slo_wide_ep and self._all_wide_ep(model, names, cands.role):
            slo = None  # measured: SLO-blind placement is as good or better on wide EP (docs/policies/ep_aware.md)
        want = slo is not None
        if cands.role is Role.PREFILL:
            if not want and rows is not None:
                fast = self._prefill_select_compiled(request, cands, model, names, idx, rows, ctx)
                if fast is not None:  # the same choice as below, in two compiled calls (wide-EP pools)
                    return fast
            cost, ttft, own = self.prefill_cost(request, cands, model, names, idx, rows, "prefill", want, ctx.now_s)
            if self.cadence:
                cost, ttft, own = self._cadence_terms(request, cands, model, names, idx, rows, "prefill", cost, ttft,
                                                      own)
            reason = "ep_aware:prefill"
        elif cands.role is Role.DECODE:
            fc = self._forecast(cands, request)  # with the returning sessions' occupancy (session_forecast), else cands
            # (the compiled select checks KV room on its columns: only on the router's own)
            fast = self._decode_select_compiled(request, cands, model, names, idx, rows, ctx) if fc is cands else None
            if fast is not None:  # the same choice as below, in one compiled call (wide-EP pools)
                return fast
            cost = self.decode_cost(request, fc, model, names, idx, rows, transfer=True)
            reason = "ep_aware:decode"
        else:
            cost, ttft, own = self.prefill_cost(request, cands, model, names, idx, rows, "mixed", want)
            fc = self._forecast(cands, request)  # with the returning sessions' occupancy (session_forecast), else cands
            if self.cadence:
                cost, ttft, own = self._cadence_terms(request, fc, model, names, idx, rows, "mixed", cost, ttft, own)
            cost = (cost + self.decode_cost(request, fc, model, names, idx, rows, transfer=False)
                    + self.externality_weight * self._mixed_stall(request, cands, model, names, idx, rows))
            wait = self.slot_wait(request, fc, model, names, idx, rows) if want else None
            if wait is not None:  # a full rank admits the prompt only when a slot frees (in cost already)
                ttft = ttft + wait
            reason = "ep_aware:mixed"
        doomed = False
        if slo is not None:
            assert ttft is not None and own is not None  # prefill or mixed, want_own
            margin = self.slo_margin
            if margin is None:  # queues corrected for in-service progress are not pessimistic
                margin = 1.0 if self._progress_applies(cands, model, names) else PESSIMISTIC_SLO_MARGIN
            cost, doomed = self._slo(slo.budget_s(request.prompt_tokens), cost, ttft, own, margin)
        cost, feasible = self._capacity(request, cands, cost)
        if doomed:  # the longest predicted TTFT among the least harmful: no tie rule on these scores
            reason += ":slo_doomed"
            i = argmin_random(cost, ctx.rng)
        else:
            i = self._pick(cost, cands, ctx, self._cadence_tie_load(fc, model, names) if self.cadence else None)
        return Choice(cands.replicas[i], scores_of(cands, cost), reason=reason if feasible else reason + ":no_kv_room")

    def predict_prefill_s(self, request: Request, cands: Candidates, ctx: SelectContext
                          ) -> tuple[np.ndarray, np.ndarray]:
        """``(ttft_s, own_s)``, shapes ``(n,)``: per prefill (or mixed) candidate, the predicted
        seconds until ``request``'s prefill completes there (the ``ttft`` that SLO-aware placement
        tests) and its own prefill seconds on an idle rank there; what deadline admission uses
        (:class:`balancer.deadline_admission.TtftPredictor`). Pure; ``ctx.now_s`` for the dense
        ranks' in-service progress.

        Raises:
            ValueError: ``cands`` is a decode pool (nothing is prefilled there).
        """
        if cands.role is Role.DECODE:
            raise ValueError("ep_aware predicts TTFT on prefill or mixed candidates, not decode ones")
        model = ctx.cost_model if ctx.cost_model is not None else DEFAULT_COST_MODEL
        names, idx, rows = engine_groups(cands.replicas)
        if cands.role is Role.PREFILL:
            cost, ttft, own = self.prefill_cost(request, cands, model, names, idx, rows, "prefill", True, ctx.now_s)
        else:
            cost, ttft, own = self.prefill_cost(request, cands, model, names, idx, rows, "mixed", True)
        if self.cadence:
            role = "prefill" if cands.role is Role.PREFILL else "mixed"
            _, ttft, own = self._cadence_terms(request, cands, model, names, idx, rows, role, cost, ttft, own)
        if cands.role is not Role.PREFILL:
            wait = self.slot_wait(request, cands, model, names, idx, rows)
            if wait is not None:
                ttft = ttft + wait
        assert own is not None
        return ttft, own

    # ------------------------------------------------------------------ prefill
    def prefill_cost(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                     idx: np.ndarray, rows: np.ndarray | None,
                     role: str, want_own: bool = True,
                     now_s: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(cost, ttft, own)``, shapes ``(n,)``: the cost (predicted seconds until the prompt's
        prefill completes, plus the weighted externality and horizon terms), the predicted TTFT
        alone (seconds until the prefill completes, with tier fetches), and the prompt's own
        prefill seconds on an idle rank (its uncached tokens' steps and the fetches; None unless
        ``want_own``). ``now_s``: the caller's clock, for the in-service progress of a prefill
        pool's queues (None: queued prompts count in full)."""
        eng = self._uniform_engine(model, names, role)
        if eng is None:  # heterogeneous pool: price each engine's candidates with its own model
            out, ttft, own = np.empty(len(cands)), np.empty(len(cands)), np.empty(len(cands))
            for e, name in enumerate(names):
                sub = np.flatnonzero(idx == e)
                out[sub], ttft[sub], own_e = self._prefill_cost_one(request, cands, model, model.engine(name, role),
                                                                    idx, rows, sub, want_own, now_s)
                if own_e is not None:
                    own[sub] = own_e
            return out, ttft, own if want_own else None
        return self._prefill_cost_one(request, cands, model, eng, idx, rows, None, want_own, now_s)

    def _prefill_cost_one(self, request: Request, cands: Candidates, model: CostModel, eng: EngineCost,
                          idx: np.ndarray, rows: np.ndarray | None,
                          sub: np.ndarray | None,
                          want_own: bool = True,
                          now_s: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        bs = float(cands.block_size)
        P = float(request.prompt_tokens)
        q = cands.prefill_tokens.astype(np.float64)
        a = cands.prefill_attn_pairs if cands.prefill_attn_pairs is not None else np.zeros(len(q))
        if (self.in_service_progress and not eng.ep_synchronous and now_s is not None
                and cands.prefill_head_start_s is not None
                and cands.prefill_head_tokens is not None and cands.prefill_head_pairs is not None):
            q, a = in_service_queue(q, a, cands.prefill_head_start_s, cands.prefill_head_tokens,
                                    cands.prefill_head_pairs, now_s, eng, idx, rows)
        tiers = cands.hbm_blocks is not None and cands.host_blocks is not None and cands.store_blocks is not None
        w_ext = self.externality_weight * eng.prefill.per_group_token_s if eng.ep_synchronous else 0.0
        busy_pool = bool(w_ext) and q[q.argmax()] > 0  # N_after is needed (and the pool is not idle)
        if busy_pool and rows is not None and not tiers:  # all up to the matrix product compiled, when it can be
            fast = kernels.prefill_ep_cost_rows(q, a, cands.matched_tokens, cands.num_requests, P, eng.chunk_tokens,
                                                eng.prefill.per_token_s, eng.prefill.per_attn_pair_s, w_ext, idx, rows)
            if fast is not None:
                f_feats, f_horizon, f_ext, f_u, f_cached, n_busy = fast
                f_ttft = f_cost = f_feats @ eng.prefill.coef_view + 0.0  # + fetch (0.0 without tiers), as below
                if self.horizon_weight:
                    f_busy = float(n_busy) / len(q)
                    f_cost = f_cost + f_ext + (self.horizon_weight * f_busy ** self.horizon_power) * f_horizon
                else:
                    f_cost = f_cost + f_ext
                return self._with_own(f_cost, f_ttft, f_u, f_cached, 0.0, eng, sub, want_own)
        if cands.hbm_blocks is not None and cands.host_blocks is not None and cands.store_blocks is not None:  # tiers
            hbm = cands.hbm_blocks * bs
            cached = np.minimum(hbm + (cands.host_blocks + cands.store_blocks) * bs, P - 1.0)
            host_t = np.clip(np.minimum(hbm + cands.host_blocks * bs, cached) - hbm, 0.0, None)
            store_t = np.clip(cached - hbm - host_t, 0.0, None)
            fetch = host_t * model.host_fetch_s_per_token + store_t * model.store_fetch_s_per_token
        else:
            cached = np.minimum(cands.matched_tokens.astype(np.float64), P - 1.0)
            fetch = 0.0
        u = P - cached
        # both wide-EP terms in one compiled pass when there is one (same bits as the two calls below)
        n_after: np.ndarray | None
        fused = kernels.prefill_ep_rows(q, a, u, cached, cands.num_requests, eng.chunk_tokens, eng.prefill.per_token_s,
                                        eng.prefill.per_attn_pair_s, idx, rows) if busy_pool and rows is not None else None
        if fused is not None:
            feats, horizon, n_after = fused
        else:
            feats, horizon = prefill_wait_features(q, a, u, cached, eng, idx, rows)
            n_after = self._requests_after(q, cands, idx, rows) if busy_pool else None
        ttft = cost = feats @ eng.prefill.coef_view + fetch
        if eng.ep_synchronous:
            ext = w_ext * u * n_after if n_after is not None else 0.0
            if self.horizon_weight:
                busy = float(np.count_nonzero(q)) / len(q)  # the pool's share of ranks with queued work
                cost = cost + ext + (self.horizon_weight * busy ** self.horizon_power) * horizon
            else:
                cost = cost + ext
        return self._with_own(cost, ttft, u, cached, fetch, eng, sub, want_own)

    def _prefill_select_compiled(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                                 idx: np.ndarray, rows: np.ndarray, ctx: SelectContext) -> Choice | None:
        """:meth:`select` on a busy prefill pool of uniform wide-EP engines without lower KV tiers,
        SLO or cadence terms (the usual wide-EP case): :meth:`_prefill_cost_one`'s compiled call
        (:func:`balancer.kernels.prefill_ep_select_parts`: ``prefill_ep_cost_rows`` with its per-pool
        memo, into reused arrays), its matrix product (numpy's, as there), then
        the rest of the cost and :meth:`_pick` in one more compiled call
        (:func:`balancer.kernels.prefill_cost_pick`), drawing from ``ctx.rng`` as :meth:`_pick`
        does. ``None`` where that path does not apply (no kernels, an idle pool, tiers, cadence on
        these engines, the pick's numpy rule needed): :meth:`select` then runs the numpy-level
        code, which gives the same choice."""
        eng = self._uniform_engine(model, names, "prefill")
        if eng is None or not eng.ep_synchronous or cands.hbm_blocks is not None:
            return None
        if self.cadence and model.any_cadence and eng.has_cadence:  # _cadence_terms would change the costs
            return None
        w_ext = self.externality_weight * eng.prefill.per_group_token_s
        q = cands.prefill_tokens
        if not w_ext or not len(q):
            return None
        a = cands.prefill_attn_pairs if cands.prefill_attn_pairs is not None else np.zeros(len(q))
        fast = kernels.prefill_ep_select_parts(q, a, cands.matched_tokens, cands.num_requests,
                                               float(request.prompt_tokens), eng.chunk_tokens, eng.prefill.per_token_s,
                                               eng.prefill.per_attn_pair_s, w_ext, idx, rows)
        if fast is None:  # also an idle pool (no queue above 0): _prefill_cost_one's idle-pool path
            return None
        f_feats, f_horizon, f_ext, n_busy = fast
        scale = None
        if self.horizon_weight:
            scale = self.horizon_weight * (float(n_busy) / len(q)) ** self.horizon_power
        got = kernels.prefill_cost_pick(f_feats @ eng.prefill.coef_view, f_ext, f_horizon, scale, q,
                                        self.tie_tolerance)
        if got is None:
            return None
        count, cost, pos = got
        if count < 1:  # _pick's numpy rule (no tolerance, a cost that is not finite)
            i = self._pick(cost, cands, ctx)
        else:
            i = int(pos[0]) if count == 1 else int(pos[ctx.rng.randrange(count)])
        return Choice(cands.replicas[i], fresh_scores(cands, cost), reason="ep_aware:prefill")

    @staticmethod
    def _with_own(cost: np.ndarray, ttft: np.ndarray, u: np.ndarray, cached: np.ndarray, fetch: np.ndarray | float,
                  eng: EngineCost, sub: np.ndarray | None, want_own: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``_prefill_cost_one``'s answer: ``(cost, ttft, own)`` (``own`` when ``want_own``: the
        prompt's own prefill seconds on an idle rank), restricted to ``sub`` when given."""
        own = None
        if want_own:
            own = np.ceil(u / float(eng.chunk_tokens)) * eng.prefill.overhead_s + _compute_s(eng.prefill, u, cached) + fetch
        if sub is None:
            return cost, ttft, own
        return cost[sub], ttft[sub], (own[sub] if own is not None else None)

    def _ttft_slo(self, ctx: SelectContext) -> TtftSlo | None:
        """The budget routed against: the policy's own (``ttft_slo_s`` > 0), else the router's
        (``ctx.ttft_slo``) when ``slo_aware``, else None."""
        if self.ttft_slo_s > 0:
            return TtftSlo(self.ttft_slo_s, self.ttft_slo_per_1k_tokens_s)
        return ctx.ttft_slo if self.slo_aware else None

    @staticmethod
    def _all_wide_ep(model: CostModel, names: tuple[str, ...], role: Role) -> bool:
        """Whether every engine of a prefill or mixed pool steps its DP ranks together (wide EP)."""
        r = "prefill" if role is Role.PREFILL else "mixed"
        return all(model.engine(name, r).ep_synchronous for name in names)

    def _progress_applies(self, cands: Candidates, model: CostModel, names: tuple[str, ...]) -> bool:
        """Whether the prefill cost subtracts in-service progress here: a prefill pool whose
        engines are all dense (each rank its own step group) and candidates that carry it."""
        if not (self.in_service_progress and cands.role is Role.PREFILL and cands.prefill_head_start_s is not None):
            return False
        return not any(model.engine(name, "prefill").ep_synchronous for name in names)

    def _slo(self, budget: float, cost: np.ndarray, ttft: np.ndarray, own: np.ndarray,
             margin: float) -> tuple[np.ndarray, bool]:
        """SLO-aware placement (module docstring): ``(cost, doomed)``."""
        ok = ttft * margin <= budget
        if ok.all():
            return cost, False
        if ok.any():
            return np.where(ok, cost, np.inf), False
        if self.slo_intrinsic == "blind" and float(own.min()) * margin > budget:
            return cost, False
        capped = (ttft <= self.slo_doomed_cap * budget) & self._tail_guard(ttft, float(own.min()) * margin > self.slo_doomed_tail_own * budget)
        if not capped.any():  # every queue is past the cap: the least predicted TTFT
            return ttft, True
        harm = np.where(capped, cost - ttft, np.inf)  # the delay it adds to others (externality + horizon)
        least = float(harm.min())
        tol = self.tie_tolerance * max(abs(least), float(np.abs(harm[capped]).max()), 1e-9) if self.tie_tolerance > 0 else 0.0
        near = harm <= least + tol
        # the longest wait (ttft - own) for the least own work: 2 own - ttft = own - wait
        return np.where(near, 2.0 * own - ttft, np.inf), True

    def _tail_guard(self, ttft: np.ndarray, intrinsic: bool) -> np.ndarray | bool:
        """Candidates a doomed request may join, shape ``(n,)``: for a prompt that misses its budget
        ``slo_doomed_tail_own`` times over even on an idle rank (``intrinsic``), those whose predicted TTFT is at most ``1 +
        slo_doomed_tail`` times the shortest; every candidate otherwise, or when ``slo_doomed_tail`` is
        inf. Bounds the TTFT the longest prompts pay for sparing others (they make the TTFT p99),
        relative to where they would finish first; requests doomed by queueing alone keep the
        unguarded placement that gives SLO-aware routing its attainment under overload."""
        if not intrinsic or not np.isfinite(self.slo_doomed_tail):
            return True
        return ttft <= (1.0 + self.slo_doomed_tail) * float(ttft.min())

    def _mixed_stall(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                     idx: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """Mixed ranks: the prompt's chunks share steps with the rank's running decode batch (the
        whole engine's for wide EP), so every sequence there waits its compute time:
        ``n_seqs * (per_token u + per_attn_pair pairs(u, p) + per_group_token u)``, shape ``(n,)``."""
        eng = self._uniform_engine(model, names, "mixed") or model.decode
        c = eng.prefill
        P = float(request.prompt_tokens)
        cached = np.minimum(cands.matched_tokens.astype(np.float64), P - 1.0)
        u = P - cached
        own = _compute_s(c, u, cached)
        n = cands.num_requests.astype(np.float64)
        if eng.ep_synchronous:
            n = _per_engine_sum(n, idx, int(idx.max()) + 1 if len(idx) else 0)
        return n * own

    @staticmethod
    def _requests_after(q: np.ndarray, cands: Candidates, idx: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """``N_after_i``: requests of the engine's other ranks still queued when ``i`` starts the
        prompt, ``sum_{r != i} n_r clip((q_r - q_i) / q_r, 0, 1)``, shape ``(n,)``."""
        n_req = cands.num_requests.astype(np.float64)
        if rows is not None:
            got = kernels.requests_after_rows(q, n_req, idx, rows)  # the compiled loop, when there is one
            if got is not None:
                return got
            ri = engine_layout(idx, rows)[0]
            Q, N = q[ri], n_req[ri]
        else:
            same = idx[:, None] == idx[None, :]
            Q = np.where(same, q[None, :], 0.0)
            N = np.where(same, n_req[None, :], 0.0)
        # (Q - q_i) / Q <= 1 as q_i >= 0, so the clip to [0, 1] is a max with 0 (0 where Q == 0)
        frac = np.divide(Q - q[:, None], Q, out=np.zeros(Q.shape, dtype=Q.dtype), where=Q > 0)
        np.maximum(frac, 0.0, out=frac)
        return np.add.reduce(N * frac, axis=1)  # the own rank contributes 0 (q_r == q_i)

    # ------------------------------------------------------------------ vLLM's chunk limit and cadence
    def _cadence_terms(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                       idx: np.ndarray, rows: np.ndarray | None, role: str, cost: np.ndarray,
                       ttft: np.ndarray, own: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(cost, ttft, own)`` with vLLM's per-request chunk limit and prefill cadence priced
        (module docstring; :mod:`balancer.prefill_cadence`) on the engines whose cost model sets
        them: ``own`` (the idle-rank prefill, None stays None) counts ``ceil(u / min(L, C))`` step
        overheads. Unchanged (the same arrays) where no engine sets them; new arrays otherwise,
        shapes ``(n,)``."""
        if not model.any_cadence:
            return cost, ttft, own
        eng = self._uniform_engine(model, names, role)
        engs: list[tuple[int | None, EngineCost]] = (
            [(None, eng)] if eng is not None else [(e, model.engine(n, role)) for e, n in enumerate(names)])
        if not any(ec.has_cadence for _, ec in engs):
            return cost, ttft, own
        P = float(request.prompt_tokens)
        bs = float(cands.block_size)
        if cands.hbm_blocks is not None and cands.host_blocks is not None and cands.store_blocks is not None:
            hbm = cands.hbm_blocks * bs  # as the prefill cost's tiers (_prefill_cost_one)
            cached = np.minimum(hbm + (cands.host_blocks + cands.store_blocks) * bs, P - 1.0)
            host_t = np.clip(np.minimum(hbm + cands.host_blocks * bs, cached) - hbm, 0.0, None)
            store_t = np.clip(cached - hbm - host_t, 0.0, None)
            fetch: np.ndarray | float = host_t * model.host_fetch_s_per_token + store_t * model.store_fetch_s_per_token
        else:
            cached = np.minimum(cands.matched_tokens.astype(np.float64), P - 1.0)
            fetch = 0.0
        u = P - cached
        new_ttft, add_cost, add_own = ttft.copy(), np.zeros(len(cands)), np.zeros(len(cands))
        group: np.ndarray | None = None  # the parallel model's group terms; NaN: the drain model's stay
        for e, ec in engs:
            if not ec.has_cadence:
                continue
            t, c, o, g = self._cadence_one(request, cands, ec, idx, rows, role, u, cached, fetch, ttft)
            if e is None:
                new_ttft, add_cost, add_own, group = t, c, o, g
            else:
                sub = idx == e
                new_ttft[sub], add_cost[sub], add_own[sub] = t[sub], c[sub], o[sub]
                if g is not None:
                    if group is None:
                        group = np.full(len(cands), np.nan)
                    group[sub] = g[sub]
        new_cost = cost + (new_ttft - ttft) + add_cost
        if group is not None:  # chunks in parallel: the TTFT, the parallel group terms, the forced steps
            new_cost = np.where(np.isnan(group), new_cost, new_ttft + group + add_cost)
        return new_cost, new_ttft, (own + add_own if own is not None else None)

    def _cadence_tie_load(self, cands: Candidates, model: CostModel, names: tuple[str, ...]) -> np.ndarray | None:
        """The tie rule's load on a mixed pool whose engines cap the running sequences and set the
        chunk limit or cadence: requests first (``num_requests (max kv + 1) + kv``, int64, shape
        ``(n,)``: the fewest requests, then the least decode KV tokens), as a rank's free slots
        decide whether its later requests wait and force prefill on every step; None elsewhere
        (the default rule)."""
        if cands.role is not Role.MIXED or not model.any_cadence:
            return None
        eng = self._uniform_engine(model, names, "mixed")
        engs = [eng] if eng is not None else [model.engine(n, "mixed") for n in names]
        if not all(ec.has_cadence and ec.max_num_seqs is not None for ec in engs):
            return None
        kv = cands.decode_kv_tokens.astype(np.int64)
        return cands.num_requests.astype(np.int64) * (int(kv.max(initial=0)) + 1) + kv

    def _cadence_one(self, request: Request, cands: Candidates, eng: EngineCost, idx: np.ndarray,
                     rows: np.ndarray | None, role: str, u: np.ndarray, cached: np.ndarray,
                     fetch: np.ndarray | float, ttft: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """One engine cost model's ``(TTFT, cost seconds added besides the TTFT's change, idle-rank
        prefill seconds added, group)``, each ``(n,)`` (module docstring, "vLLM's chunk limit and
        prefill cadence"). ``group``: where the prompt's chunks run beside the queue ahead (a mixed
        pool with ``S L <= C``, and ``parallel_chunks``), the seconds its group tokens add to the
        engine's requests with queued prefill, ``externality_weight per_group_token u_i N_q,e``
        (:func:`balancer.prefill_cadence.queued_requests`), which then replace the FIFO drain
        model's group terms (externality over ``N_after``, horizon); None elsewhere."""
        c = eng.prefill
        C = eng.chunk_tokens
        L = eng.request_chunk_tokens
        q = cands.prefill_tokens.astype(np.float64)
        today = np.ceil((q + u) / float(C))  # the steps the features counted
        add_own = (prefill_steps(np.zeros_like(u), u, C, L) - np.ceil(u / float(C))) * c.overhead_s
        add_cost = np.zeros(len(q))
        k = eng.prefill_schedule_interval
        S = eng.max_num_seqs
        if role != "mixed":
            return ttft + (prefill_steps(q, u, C, L) - today) * c.overhead_s, add_cost, add_own, None
        b = cands.num_requests.astype(np.float64)
        kv = cands.decode_kv_tokens.astype(np.float64)
        run = np.minimum(b, float(S)) if S is not None else b
        kv_run = kv * np.divide(run, b, out=np.ones_like(b), where=b > 0)
        step_now, _, n_e = _decode_steps(eng, idx, rows, run, kv_run, run, kv_run, 0.0)
        group = None
        if chunks_in_parallel(S, L, C):  # the queue ahead takes no budget from the prompt: own steps only
            n = prefill_steps(np.zeros_like(u), u, C, L)
            new = n * c.overhead_s + _compute_s(c, u, cached)
            if eng.prefill_step_floor_s > 0.0:  # each of the n steps lasts at least the floor
                new = np.maximum(new, n * eng.prefill_step_floor_s)
            new = new + fetch
            if self.parallel_chunks:  # ... and every queued request of the engine shares steps with it
                w_ext = self.externality_weight * c.per_group_token_s if eng.ep_synchronous else 0.0
                group = w_ext * u * queued_requests(q, b, idx, eng.ep_synchronous)
            if self.prefill_at_once and cands.prefill_inflight is not None and L is not None:
                if eng.prefill_step_floor_s > 0.0:  # steps with prefill last >= the floor: prompts at once share it
                    rise = at_once_floor_rise_s(cands.prefill_inflight, u, cached, c, C, L, idx, rows,
                                                eng.ep_synchronous, eng.prefill_step_floor_s, step_now)
                else:
                    rise = at_once_step_rise_s(cands.prefill_inflight, u, cached, c, C, L, idx, rows,
                                               eng.ep_synchronous)
                add_cost = add_cost + self.externality_weight * n_e * n * rise
        else:
            n = prefill_steps(q, u, C, L)
            new = ttft + (n - today) * c.overhead_s
            if eng.prefill_step_floor_s > 0.0:  # n steps of at least the floor each (the fetch before them)
                new = np.maximum(new, n * eng.prefill_step_floor_s + fetch)
        new = new + cadence_gap_steps(n, b, k) * step_now
        if S is None:
            return new, add_cost, add_own, group
        out = float(min(request.output_tokens, self.max_output_estimate_tokens))
        tau = self._tau(eng)
        if not self.seq_cap:  # (seq_cap adds the same wait in select)
            new = new + slot_wait_s(b, step_now, out, S, tau)
        forced = forced_prefill_steps(q, b, S, C, L, out, k, tau)
        if forced.any():
            Lc = float(C if L is None else min(L, C))
            ctx = np.divide(kv, b, out=np.zeros_like(b), where=b > 0)  # the rank's mean context per request
            chunk_s = (c.overhead_s + (c.per_token_s + c.per_group_token_s) * Lc
                       + c.per_attn_pair_s * (Lc * ctx + Lc * (Lc + 1.0) / 2.0))
            if eng.prefill_step_floor_s > 0.0:  # a forced mixed step lasts at least the floor
                chunk_s = np.maximum(chunk_s, eng.prefill_step_floor_s)
            add_cost = add_cost + self.externality_weight * forced * n_e * chunk_s
        return new, add_cost, add_own, group

    # ------------------------------------------------------------------ decode
    def decode_cost(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                    idx: np.ndarray, rows: np.ndarray | None, transfer: bool) -> np.ndarray:
        """Predicted decode seconds of the request plus weighted externality and transfer, ``(n,)``."""
        role = "decode" if cands.role is Role.DECODE else "mixed"
        eng = self._uniform_engine(model, names, role)
        if eng is None:
            out = np.empty(len(cands))
            for e, name in enumerate(names):
                sub = np.flatnonzero(idx == e)
                out[sub] = self._decode_cost_one(request, cands, model, model.engine(name, role), idx, rows,
                                                 transfer)[sub]
            return out
        return self._decode_cost_one(request, cands, model, eng, idx, rows, transfer)

    def _decode_cost_one(self, request: Request, cands: Candidates, model: CostModel, eng: EngineCost,
                         idx: np.ndarray, rows: np.ndarray | None, transfer: bool) -> np.ndarray:
        d = eng.decode
        out = float(min(request.output_tokens, self.max_output_estimate_tokens))
        kv_new = request.prompt_tokens + out / 2.0
        steps = out / self._tau(eng)  # decode steps of the request (speculative decoding: fewer)
        S = eng.max_num_seqs if self.seq_cap else None
        if S is not None and len(cands) and cands.num_requests.max() >= S:  # a rank is full: slots and waits
            return self._decode_cost_capped(request, cands, model, eng, idx, rows, transfer, S)
        if eng.ep_synchronous and rows is not None:  # the compiled loop, when there is one
            got = kernels.decode_cost_rows(cands.num_requests, cands.decode_kv_tokens, cands.matched_tokens, idx, rows,
                                           steps, kv_new, request.prompt_tokens, d.overhead_s, d.per_seq_s,
                                           d.per_kv_token_s, d.per_group_seq_s, self.externality_weight,
                                           model.transfer_s_per_token, transfer)
            if got is not None:
                return got
        b = cands.num_requests.astype(np.float64)
        k = cands.decode_kv_tokens.astype(np.float64)
        before, after, n_e = _decode_steps(eng, idx, rows, b, k, b + 1.0, k + kv_new, 1.0)
        cost = steps * (after + self.externality_weight * n_e * (after - before))
        return _plus_transfer(cost, request, cands, model, transfer)

    def _decode_select_compiled(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                                idx: np.ndarray, rows: np.ndarray | None, ctx: SelectContext) -> Choice | None:
        """:meth:`select` on a decode pool of uniform wide-EP engines in one compiled call
        (:func:`balancer.kernels.decode_select_rows`: :meth:`_decode_cost_one`'s kernel, then
        :meth:`_capacity`'s and :meth:`_pick`'s), drawing from ``ctx.rng`` exactly as :meth:`_pick`
        does; ``None`` where that path does not apply (no kernels, not wide EP, a full rank under
        ``seq_cap``, a candidate without KV room, a draw among the cheapest costs): :meth:`select`
        then runs the numpy-level code, which gives the same choice."""
        eng = self._uniform_engine(model, names, "decode")
        if eng is None or not eng.ep_synchronous or rows is None:
            return None
        S = eng.max_num_seqs if self.seq_cap else None
        if S is not None and len(cands) and cands.num_requests.max() >= S:
            return None
        d = eng.decode
        out = float(min(request.output_tokens, self.max_output_estimate_tokens))
        need = request.prompt_tokens + min(request.output_tokens, self.max_output_estimate_tokens)
        got = kernels.decode_select_rows(cands.num_requests, cands.decode_kv_tokens, cands.matched_tokens,
                                         cands.kv_capacity_tokens, idx, rows, out / self._tau(eng),
                                         request.prompt_tokens + out / 2.0,
                                         request.prompt_tokens, d.overhead_s, d.per_seq_s, d.per_kv_token_s,
                                         d.per_group_seq_s, self.externality_weight, model.transfer_s_per_token, True,
                                         need, self.tie_tolerance)
        if got is None or got[0] < 1:
            return None
        count, cost, pos = got
        i = int(pos[0]) if count == 1 else int(pos[ctx.rng.randrange(count)])
        return Choice(cands.replicas[i], fresh_scores(cands, cost), reason="ep_aware:decode")

    def _decode_cost_capped(self, request: Request, cands: Candidates, model: CostModel, eng: EngineCost,
                            idx: np.ndarray, rows: np.ndarray | None, transfer: bool, S: int) -> np.ndarray:
        """The decode cost where some rank already holds ``S = max_num_seqs`` requests, ``(n,)``:
        each rank runs ``min(b_r, S)`` of its ``b_r`` requests (its KV in proportion); on a full
        rank the request first waits for a slot (:func:`balancer.cost_model.slot_wait_s`, at the
        engine's step now) and then takes a finished sequence's place, so the step it adds to is
        the rank's full one; elsewhere as :meth:`_decode_cost_one`. Cost = ``out (T_after +
        externality_weight n_e (T_after - T_e)) + wait`` (+ the transfer)."""
        out = float(min(request.output_tokens, self.max_output_estimate_tokens))
        kv_new = request.prompt_tokens + out / 2.0
        b = cands.num_requests.astype(np.float64)
        run = np.minimum(b, float(S))
        k = cands.decode_kv_tokens.astype(np.float64) * np.divide(run, b, out=np.ones_like(b), where=b > 0)
        grows = b + 1.0 <= S  # a free slot: one more running sequence; a full rank's count stays at S
        run_after = np.minimum(b + 1.0, float(S))
        # on a full rank the request takes the place of a finished sequence of the rank's mean KV
        k_after = k + kv_new - np.where(grows, 0.0, k / np.maximum(run, 1.0))
        before, after, n_e = _decode_steps(eng, idx, rows, run, k, run_after, k_after, grows)
        tau = self._tau(eng)
        cost = (out / tau * (after + self.externality_weight * n_e * (after - before))
                + slot_wait_s(b, before, out, S, tau))
        return _plus_transfer(cost, request, cands, model, transfer)

    def slot_wait(self, request: Request, cands: Candidates, model: CostModel, names: tuple[str, ...],
                  idx: np.ndarray, rows: np.ndarray | None) -> np.ndarray | None:
        """Per decode or mixed candidate, the predicted seconds ``request`` waits for a running slot
        there (:func:`balancer.cost_model.slot_wait_s`), shape ``(n,)``; None when no rank is full
        (or no cap is known, or ``seq_cap`` is off). What the mixed pool's TTFT adds."""
        if not self.seq_cap or not len(cands):
            return None
        role = "decode" if cands.role is Role.DECODE else "mixed"
        eng = self._uniform_engine(model, names, role)
        # (engine index or None for the whole pool, its cost model)
        engs: list[tuple[int | None, EngineCost]] = (
            [(None, eng)] if eng is not None else [(e, model.engine(n, role)) for e, n in enumerate(names)])
        if all(ec.max_num_seqs is None or cands.num_requests.max() < ec.max_num_seqs for _, ec in engs):
            return None
        out = float(min(request.output_tokens, self.max_output_estimate_tokens))
        wait = np.zeros(len(cands))
        for e, ec in engs:
            if ec.max_num_seqs is None:
                continue
            S = float(ec.max_num_seqs)
            b = cands.num_requests.astype(np.float64)
            run = np.minimum(b, S)
            k = cands.decode_kv_tokens.astype(np.float64) * np.divide(run, b, out=np.ones_like(b), where=b > 0)
            d = ec.decode
            n_eng = int(idx[idx.argmax()]) + 1 if len(idx) else 0
            if ec.ep_synchronous:
                step = (d.overhead_s + d.per_seq_s * _per_engine_max(run, idx, rows, n_eng)
                        + d.per_kv_token_s * _per_engine_max(k, idx, rows, n_eng)
                        + d.per_group_seq_s * _per_engine_sum(run, idx, n_eng))
            else:
                step = d.overhead_s + d.per_seq_s * run + d.per_kv_token_s * k
            w = slot_wait_s(b, step, out, ec.max_num_seqs, self._tau(ec))
            if e is None:
                wait = w
            else:
                sub = idx == e
                wait[sub] = w[sub]
        return wait

    # ------------------------------------------------------------------ helpers
    def _pick(self, cost: np.ndarray, cands: Candidates, ctx: SelectContext, load: np.ndarray | None = None) -> int:
        """The cheapest candidate; costs within ``tie_tolerance`` of the cheapest are ties, broken
        by the least queued work (prefill tokens or decode KV tokens), then at random."""
        if load is None:
            load = cands.prefill_tokens if cands.role is Role.PREFILL else cands.decode_kv_tokens
        got = kernels.tie_pick(cost, load, self.tie_tolerance)  # the compiled loop, when there is one
        if got is not None and got[0] >= 1:
            count, pos = got
            return int(pos[0]) if count == 1 else int(pos[ctx.rng.randrange(count)])
        i = int(cost.argmin())
        best = float(cost[i])
        if self.tie_tolerance <= 0 or not np.isfinite(best):
            return argmin_random(cost, ctx.rng)
        near = cost <= best * (1.0 + self.tie_tolerance)
        if np.count_nonzero(near) == 1:
            return i
        return argmin_random(load, ctx.rng, near)


    def _capacity(self, request: Request, cands: Candidates, cost: np.ndarray) -> tuple[np.ndarray, bool]:
        """Push candidates whose known KV capacity cannot take the whole sequence behind every one
        that can; when none can, prefer the most room. Returns ``(cost, any_feasible)``."""
        if cands.role is Role.PREFILL:
            return cost, True
        cap = cands.kv_capacity_tokens
        need = request.prompt_tokens + min(request.output_tokens, self.max_output_estimate_tokens)
        if kernels.count_no_room(cap, cands.decode_kv_tokens, need) in (0, -1):  # compiled: all fit, or none known
            return cost, True
        if not len(cap) or cap[cap.argmax()] <= 0:
            return cost, True
        room = cap - cands.decode_kv_tokens
        bad = (cap > 0) & (room < need)
        if not np.count_nonzero(bad):
            return cost, True
        if np.count_nonzero(bad) == len(bad):
            return cost.max() + 1.0 + (need - room).astype(np.float64), False
        cost = np.where(bad, np.inf, cost)
        return cost, True

    def _tau(self, eng: EngineCost) -> float:
        """Output tokens a decoding sequence gains per step of ``eng`` as priced:
        ``EngineCost.decode_tokens_per_step`` with ``spec_decode``, else 1."""
        return eng.decode_tokens_per_step if self.spec_decode else 1.0

    @staticmethod
    def _uniform_engine(model: CostModel, names: tuple[str, ...], role: str) -> EngineCost | None:
        if not model.engines or not any(n in model.engines for n in names):
            return model.prefill if role == "prefill" else model.decode
        return None
