"""Speculative decoding (MTP, draft models, parallel drafters) as a step-latency model.

A decode step with a draft of ``d`` tokens per sequence costs the target's verification of
``1 + d`` tokens per sequence (:meth:`RooflinePerf.step_time_s` with ``decode_tokens_per_seq``:
more linear, expert, dispatch/combine and attention work; the KV is read once per sequence), plus
the draft's own forwards, and yields ``tau(d)`` tokens per sequence on average:

    tau(d) = 1 + sum_{i=1..d} prod_{j<=i} a_j            (the bonus token + the accepted prefix)

where ``a_j`` is the acceptance probability of draft position ``j`` given that position ``j - 1``
was accepted (:attr:`SpecDecodeConfig.acceptance`; a verifier accepts the longest correct prefix).
Draft cost, by drafter:

* sequential (MTP layers reused autoregressively, EAGLE, a separate draft model): ``d`` forwards of
  one token per sequence, each ``Tdraft(1)``;
* parallel (DSpark / DFlash backbone): ONE forward over the whole block of ``g`` drafted positions
  plus the anchor, ``Tdraft(1 + g)``, where ``g`` is the block length (``draft_tokens``, or
  ``max_draft_tokens`` under dynamic verification). The block is drafted before the verifier
  decides how much of it to verify, so a dynamic step pays the whole block even when it verifies
  fewer tokens (DSpark paper sec. 5.4 "Limitations": "DSpark still incurs a fixed draft-side cost
  to generate the initial gamma-token block via the parallel backbone"). Its cost grows with the
  block once the step is compute-bound, like the verification does.

``Tdraft(k)`` is either ``draft_cost_fraction * T(k)`` (``T(k)``: the target's step of the same
batch computing ``k`` tokens per sequence; a drafter with a fraction of the target's layers and
the same LM head) or, with ``draft_model``, that model's own roofline step for the batch on the
same GPUs (each rank runs its sequences' drafts; the slowest rank counts).

* Fixed length: ``d = draft_tokens`` every step.
* Dynamic length (``dynamic = true``; DSpark's confidence-scheduled, load-aware verification): each
  step picks the ``d`` in ``0 .. max_draft_tokens`` that minimises the time per accepted token
  ``T(d) / tau(d)`` at that step's batch -- the whole block while the engine is memory-bound, a
  pruned prefix once extra verified tokens cost real compute -- plus ``dynamic_overhead_s`` per
  step (confidence head and scheduler). With one acceptance curve this is the mean-field form of
  DSpark's scheduler: it captures the load-aware part of the gain, not the per-request part. With
  ``acceptance_classes`` (request classes with their own curves) the step admits draft positions
  across classes in decreasing survival probability and keeps the best prefix of that order
  (:func:`admission_order`; DSpark's Algorithm 1 with one confidence per class): the confident
  class keeps a longer draft than the doubtful one, the per-request part, still mean-field within
  a class. A plan verifies the same number of draft tokens on every rank, which is what a
  token-budget scheduler does (DSpark sec. 5.2: admission is "a dynamic top-K selection" under a
  capacity limit K), so uneven verification lengths create no straggler rank in wide EP; the
  accepted tokens differ between ranks and the mean field averages them. Not modelled:
  per-request confidences beyond the classes.

  Shape of the gain over fixed ``g``-token drafts when ``max_draft_tokens = g`` (DSpark's
  production setting, gamma = 5): the scheduler can only prune the block, never extend it, so the
  gain is ``0 - dynamic_overhead`` while verifying all ``g`` tokens is optimal (light load,
  memory-bound verification) and rises with the batch once the step turns compute-bound and the
  tail of the block costs more than its acceptance returns (DSpark Fig. 8: the verification budget
  per request falls smoothly with load; sec. 5.4: static MTP-3/5 drafts "strictly degrade
  aggregate throughput under high concurrency"). The block's draft cost, paid in both modes,
  dilutes the relative gain.

Mean-field time: the simulator advances every sequence by one token per step, so a speculative
step is charged ``T(d) / tau(d)`` per token: TPOT and tokens per second per sequence come from the
accepted tokens per step, while the batch composition (and the KV growth) stays deterministic.
Steps in which any rank of the group prefills do not speculate (their time is the plain step):
speculation applies to decode-only steps, i.e. to every step of a PD decode pool.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

__all__ = ["AcceptanceClass", "SpecDecodeConfig", "SpecDecodePerf", "accepted_tokens_per_step"]


class AcceptanceClass(BaseModel):
    """One class of requests in ``[speculative] acceptance_classes`` (e.g. chat, code, math).

    Attributes:
        share: fraction of the decode batch in this class (the shares add up to 1).
        acceptance: conditional acceptance per draft position, as ``SpecDecodeConfig.acceptance``.
        name: a label for reports.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    share: float = Field(gt=0, le=1)
    acceptance: list[float] = Field(min_length=1, max_length=64)
    name: str = ""


class SpecDecodeConfig(BaseModel):
    """The ``[speculative]`` table of a scenario (off when absent).

    Attributes:
        draft_tokens: draft length of fixed-length verification (>= 1).
        acceptance: per draft position 1, 2, ... (each in [0, 1]; at least
            ``max(draft_tokens, max_draft_tokens)`` entries): conditional probabilities ``a_i``
            (position ``i`` accepted given ``i - 1`` was), or with ``acceptance_kind =
            "cumulative"`` measured acceptance rates ``r_i`` (fraction of steps whose position
            ``i`` is accepted; non-increasing), converted as ``a_i = r_i / r_{i-1}``.
        acceptance_kind: ``"conditional"`` (default) or ``"cumulative"``.
        draft_model: a separate draft model (preset name or config.json path) whose roofline step
            is the draft forward's cost; ``None`` = ``draft_cost_fraction`` of the target step.
        drafter: ``"sequential"`` (one draft forward per drafted token: MTP, EAGLE, a separate
            draft model) or ``"parallel"`` (one forward for the whole block: DSpark/DFlash).
        draft_cost_fraction: seconds of one draft forward as a fraction of the target's one-token
            decode step at the same batch (an MTP layer of a 43-layer model plus the LM head and
            launch costs is ~0.1; a separate draft model: its step / the target's).
        dynamic: pick the draft length per step (see the module docstring) instead of fixed.
        max_draft_tokens: longest draft of dynamic verification (default: ``draft_tokens``).
        dynamic_overhead_s: extra seconds per dynamic step (confidence head, scheduling).
        verify: ``"mean_field"`` (default, :class:`SpecDecodePerf`: a decode step is charged its
            time per accepted token, no speculation in mixed steps) or ``"every_step"`` (vLLM's MTP
            as it runs: every decoding sequence verifies ``1 + draft_tokens`` tokens in every step
            it takes part in, mixed steps included, and gains ``tau(draft_tokens)`` tokens per step;
            :class:`sim.perf.step_class.StepClassPerf`; the drafter's forwards are inside the
            efficiencies). Fixed drafts only.
        acceptance_classes: optional request classes with their own acceptance curves
            (:class:`AcceptanceClass`; shares add up to 1). Fixed drafts then yield the
            share-weighted ``tau``, and dynamic verification admits draft positions across classes
            by survival probability (DSpark's per-request scheduler, mean-field within a class:
            the confident class keeps a longer prefix than the doubtful one). ``acceptance`` is
            then not used (write the classes' mean curve there for readers).
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # as the scenario models

    draft_tokens: int = Field(ge=1, le=64)
    acceptance: list[float] = Field(min_length=1, max_length=64)
    acceptance_kind: Literal["conditional", "cumulative"] = "conditional"
    draft_model: str | None = None
    drafter: Literal["sequential", "parallel"] = "sequential"
    draft_cost_fraction: float = Field(0.1, ge=0, le=10)
    dynamic: bool = False
    max_draft_tokens: int | None = Field(None, ge=1, le=64)
    dynamic_overhead_s: float = Field(0.0, ge=0)
    acceptance_classes: list[AcceptanceClass] | None = Field(None, min_length=1, max_length=16)
    verify: Literal["mean_field", "every_step"] = "mean_field"

    @model_serializer(mode="wrap")
    def _without_default_verify(self, handler):  # noqa: ANN001, ANN202
        """``verify`` is left out of a dump at its default, so scenario dumps (and the sweep point
        ids hashed from them) stay what they were before it existed."""
        d = handler(self)
        if isinstance(d, dict) and d.get("verify") == "mean_field":
            del d["verify"]
        return d

    @model_validator(mode="after")
    def _check(self) -> SpecDecodeConfig:
        if self.verify == "every_step" and self.dynamic:
            raise ValueError("speculative.verify = \"every_step\" verifies a fixed draft; it cannot be combined "
                             "with dynamic = true")
        if any(not 0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"speculative.acceptance: every entry must be in [0, 1], got {self.acceptance}")
        if self.acceptance_classes is not None:
            total = sum(c.share for c in self.acceptance_classes)
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"speculative.acceptance_classes: shares must add up to 1, got {total:g}")
            need_c = max(self.draft_tokens, self.max_draft_tokens or 0)
            for i, c in enumerate(self.acceptance_classes):
                if any(not 0.0 <= a <= 1.0 for a in c.acceptance):
                    raise ValueError(f"speculative.acceptance_classes[{i}].acceptance: every entry must be in "
                                     f"[0, 1], got {c.acceptance}")
                if len(c.acceptance) < need_c:
                    raise ValueError(f"speculative.acceptance_classes[{i}].acceptance: {len(c.acceptance)} "
                                     f"entries for drafts of up to {need_c} tokens; give one per draft position")
        if self.acceptance_kind == "cumulative" and any(b > a for a, b in zip(self.acceptance, self.acceptance[1:])):
            raise ValueError("speculative.acceptance: cumulative acceptance rates must not increase with the "
                             f"position, got {self.acceptance}")
        need = max(self.draft_tokens, self.max_draft_tokens or 0)
        if len(self.acceptance) < need:
            raise ValueError(f"speculative.acceptance: {len(self.acceptance)} entries for drafts of up to "
                             f"{need} tokens; give one per draft position")
        return self

    @property
    def longest_draft(self) -> int:
        return (self.max_draft_tokens or self.draft_tokens) if self.dynamic else self.draft_tokens

    @property
    def conditional_acceptance(self) -> list[float]:
        """``a_i`` per position (cumulative rates converted; a 0 rate makes later positions 0)."""
        if self.acceptance_kind == "conditional":
            return list(self.acceptance)
        out, prev = [], 1.0
        for r in self.acceptance:
            out.append(r / prev if prev > 0 else 0.0)
            prev = r
        return out

    @property
    def classes(self) -> list[tuple[float, list[float]]]:
        """``(share, conditional acceptance)`` per request class (one class of share 1 without
        ``acceptance_classes``)."""
        if self.acceptance_classes is None:
            return [(1.0, self.conditional_acceptance)]
        return [(c.share, list(c.acceptance)) for c in self.acceptance_classes]

    def tau(self, d: int) -> float:
        """Expected tokens per sequence per step when every sequence drafts ``d``: the
        share-weighted :func:`accepted_tokens_per_step` of the classes."""
        return float(sum(w * accepted_tokens_per_step(a, d) for w, a in self.classes))


def accepted_tokens_per_step(acceptance: list[float], d: int) -> float:
    """``1 + sum_{i<=d} prod_{j<=i} a_j``: the bonus token plus the expected accepted prefix of a
    ``d``-token draft. Hand check: a = (0.8, 0.5), d = 2 -> 1 + 0.8 + 0.4 = 2.2."""
    if d < 0 or d > len(acceptance):
        raise ValueError(f"draft length {d} outside 0..{len(acceptance)}")
    return 1.0 + float(np.sum(np.cumprod(np.asarray(acceptance[:d], dtype=np.float64)))) if d else 1.0


class SpecDecodePerf:
    """``PerfModel`` of an engine with speculative decoding: wraps a roofline (anything whose
    ``step_time_s`` accepts ``decode_tokens_per_seq``). See the module docstring for the formula.

    Attributes (besides the wrapped model's): ``config``; ``last_draft_tokens`` (array of the mean
    draft tokens verified per sequence in the last call's steps -- the draft length with one
    acceptance class) and ``last_tokens_per_step`` (their expected tokens per sequence, ``tau``;
    a step's wall time is the returned time per token x this), for tests and reports.
    """

    def __init__(self, base, config: SpecDecodeConfig, draft=None) -> None:  # noqa: ANN001
        """``base``: the target's roofline; ``draft``: the draft model's perf model on the same
        ranks (required iff ``config.draft_model`` is set; :func:`sim.run.pool_perf.spec_perf_for_pool` builds it)."""
        if (config.draft_model is None) != (draft is None):
            raise ValueError("a draft perf model is needed exactly when speculative.draft_model is set")
        self.base = base
        self.draft = draft
        self.config = config
        self.kv_bytes_per_token = base.kv_bytes_per_token
        self.kv_capacity_tokens_per_rank = base.kv_capacity_tokens_per_rank
        self.ep_synchronous = base.ep_synchronous
        #: its step_time_s takes the four work arrays only (the base's cached-prefix pricing is not forwarded)
        self.wants_prefill_cached_tokens = False
        #: one token per sequence and step, as far as the cluster's ranks know (this model prices
        #: the drafts and their acceptance itself)
        self.verify_tokens_per_seq = 1
        self.decode_tokens_per_step = 1.0
        self._tau = np.array([config.tau(d) for d in range(config.longest_draft + 1)])
        self._admission = admission_order(config.classes, config.longest_draft)
        self.last_draft_tokens: np.ndarray | None = None
        self.last_tokens_per_step: np.ndarray | None = None

    def __getattr__(self, name: str):  # noqa: ANN204 (model, hardware, ... of the wrapped roofline)
        return getattr(self.base, name)

    def _draft_tokens_per_forward(self) -> int:
        """Positions per sequence of one draft forward: 1 (sequential) or the block plus its
        anchor (parallel)."""
        return 1 if self.config.drafter == "sequential" else 1 + self.config.longest_draft

    def step_time_per_token_s(self, decode_seqs: ArrayLike, decode_ctx_tokens: ArrayLike, d: int) -> np.ndarray:
        """Seconds per accepted token of a decode-only step with draft length ``d`` (``T(d) /
        tau(d)``, without ``dynamic_overhead_s``); shapes as :meth:`step_time_s`."""
        ds = np.asarray(decode_seqs, dtype=np.float64)
        dc = np.asarray(decode_ctx_tokens, dtype=np.float64)
        z = np.zeros_like(ds)
        t1 = np.asarray(self.base.step_time_s(z, z, ds, dc), dtype=np.float64)
        dyn_block = self.config.dynamic and self.config.drafter == "parallel"
        return self._per_token(z, ds, dc, t1, d, self._draft_forward_s(z, ds, dc) if dyn_block else None)

    def _draft_forward_s(self, z, ds, dc):  # noqa: ANN001, ANN202
        """Seconds of one draft forward (``Tdraft(k)`` of the module docstring)."""
        k = float(self._draft_tokens_per_forward())
        if self.draft is None:
            return self.config.draft_cost_fraction * np.asarray(
                self.base.step_time_s(z, z, ds, dc, decode_tokens_per_seq=k), dtype=np.float64)
        if k == 1.0:
            return np.asarray(self.draft.step_time_s(z, z, ds, dc), dtype=np.float64)
        return np.asarray(self.draft.step_time_s(z, z, ds, dc, decode_tokens_per_seq=k), dtype=np.float64)

    def _per_token(self, z, ds, dc, t1, d, draft_block=None):  # noqa: ANN001, ANN202
        if d == 0:
            return t1 + (draft_block if draft_block is not None else 0.0)
        tv = np.asarray(self.base.step_time_s(z, z, ds, dc, decode_tokens_per_seq=1.0 + d), dtype=np.float64)
        if self.config.drafter == "sequential":
            draft = d * self._draft_forward_s(z, ds, dc)
        else:
            draft = self._draft_forward_s(z, ds, dc) if draft_block is None else draft_block
        return (tv + draft) / self._tau[d]

    def step_time_s(self, prefill_tokens: ArrayLike, prefill_attn_pairs: ArrayLike, decode_seqs: ArrayLike,
                    decode_ctx_tokens: ArrayLike, *, prefill_cached_tokens: ArrayLike | None = None) -> np.ndarray:
        """Seconds per step for per-rank work ``(..., R)``: decode-only steps are charged the time
        per accepted token of the chosen draft length, other steps the plain step
        (``prefill_cached_tokens`` goes to the target's roofline, see
        :meth:`sim.perf.roofline.RooflinePerf.step_time_s`)."""
        pt = np.asarray(prefill_tokens, dtype=np.float64)
        ds = np.asarray(decode_seqs, dtype=np.float64)
        dc = np.asarray(decode_ctx_tokens, dtype=np.float64)
        if prefill_cached_tokens is None:
            base = np.asarray(self.base.step_time_s(pt, prefill_attn_pairs, ds, dc), dtype=np.float64)
        else:
            base = np.asarray(self.base.step_time_s(pt, prefill_attn_pairs, ds, dc,
                                                    prefill_cached_tokens=prefill_cached_tokens), dtype=np.float64)
        decode_only = ~np.any(pt > 0, axis=-1) & np.any(ds > 0, axis=-1)
        if not np.any(decode_only):
            self.last_draft_tokens = np.zeros(np.shape(base))
            self.last_tokens_per_step = np.ones(np.shape(base))
            return base
        z = np.zeros_like(ds)
        cfg = self.config
        if cfg.dynamic:
            block = self._draft_forward_s(z, ds, dc) if cfg.drafter == "parallel" else None
            one = self._draft_forward_s(z, ds, dc) if cfg.drafter == "sequential" else None
            per, drafted, yields = [], [], []
            for t, acc, longest in self._admission:
                tv = base if t == 0 else np.asarray(
                    self.base.step_time_s(z, z, ds, dc, decode_tokens_per_seq=1.0 + t), dtype=np.float64)
                draft = block if block is not None else longest * one
                per.append((tv + draft) / acc)
                drafted.append(t)
                yields.append(acc)
            per_a = np.stack(per)
            best = np.argmin(per_a, axis=0)
            spec = np.take_along_axis(per_a, best[None, ...], axis=0)[0] + cfg.dynamic_overhead_s
            pick = np.asarray(drafted, dtype=np.float64)[best]
            tokens = np.asarray(yields, dtype=np.float64)[best]
        else:
            pick = np.full(np.shape(base), float(cfg.draft_tokens))
            tokens = np.full(np.shape(base), float(self._tau[cfg.draft_tokens]))
            spec = self._per_token(z, ds, dc, base, cfg.draft_tokens)
        self.last_draft_tokens = np.where(decode_only, pick, 0.0)
        self.last_tokens_per_step = np.where(decode_only, tokens, 1.0)
        return np.where(decode_only, spec, base)

    def __repr__(self) -> str:
        c = self.config
        mode = f"dynamic<= {c.longest_draft}" if c.dynamic else f"fixed {c.draft_tokens}"
        return f"SpecDecodePerf({self.base!r}, {mode}, tau({c.longest_draft})={self._tau[-1]:.3f})"


def admission_order(classes: list[tuple[float, list[float]]], longest: int) -> list[tuple[float, float, int]]:
    """Candidate verification plans of a dynamic step, in DSpark's greedy admission order.

    Every (class ``c``, position ``k <= longest``) draft slot has survival probability
    ``p_ck = prod_{j<=k} a_cj`` and weight ``w_c`` (its class share). Slots are admitted in
    decreasing ``p`` (ties: class, then position, so a class's prefix is admitted in order); the
    ``K``-th plan verifies the first ``K`` slots. Returns ``(t_K, tau_K, d_K)`` for ``K = 0, 1, ..``:
    mean draft tokens verified per sequence ``t_K = sum w``, expected tokens per sequence
    ``tau_K = 1 + sum w p`` and the longest class draft ``d_K``. With one class this is
    ``(d, tau(d), d)`` for ``d = 0 .. longest``. Hand check: classes (0.5, [0.9]), (0.5, [0.5]),
    longest 1 -> (0, 1, 0), (0.5, 1.45, 1), (1.0, 1.7, 1).
    """
    slots = []
    for ci, (w, acc) in enumerate(classes):
        p = 1.0
        for k in range(1, longest + 1):
            p *= acc[k - 1]
            slots.append((-p, ci, k, w))
    slots.sort()
    plans = [(0.0, 1.0, 0)]
    t, tau = 0.0, 1.0
    depth = [0] * len(classes)
    for negp, ci, k, w in slots:
        t += w
        tau += w * -negp
        depth[ci] = k
        plans.append((t, tau, max(depth)))
    return plans
