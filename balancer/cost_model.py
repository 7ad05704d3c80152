"""Per-engine step-time cost model for cost-based routing (``ep_aware``), and its online fitting.

An engine step is one forward pass of a *step group* (all DP ranks of a wide-EP engine, or one
rank of a dense engine). The policy needs to know, in seconds, what a placement costs, so this
module models a step as a linear function of the per-rank work (the features the simulator's
roofline, :mod:`sim.perf.roofline`, is made of)::

    prefill step_s = overhead_s + per_token_s * max_r tokens_r + per_attn_pair_s * max_r pairs_r
                     + per_group_token_s * sum_r tokens_r
    decode  step_s = overhead_s + per_seq_s * max_r seqs_r + per_kv_token_s * max_r kv_r
                     + per_group_seq_s * sum_r seqs_r

``max_r`` is the step group's slowest rank (attention, dense layers and shared experts run per
rank, and a wide-EP engine waits for the slowest one); ``sum_r`` is the routed-expert work, spread
over all GPUs of an EP group (0 for a dense engine, whose group is one rank). ``pairs`` are causal
attention (query, key) pairs: ``c * p + c * (c + 1) / 2`` for ``c`` new tokens after ``p`` cached
ones, so later chunks of a long prompt cost more. Sources: the roofline's own terms (DeepSeek's
DP-attention + EP layout, DeepSeek V3 technical report section 3.4; SGLang's large-scale EP blog).

Where the coefficients come from:

- The simulator fits them to its perf model (:func:`fit_step_cost` on ``perf.step_time_s``),
  so the policy's predictions and the simulated engines agree up to the linearisation.
- The live router starts from a config (``pdlb sim cost-model`` prints one per scenario, or
  :data:`DEFAULT_COST_MODEL`) and **learns online** (:class:`OnlineFit`): at each decision the
  router records the chosen candidate's features (:func:`prefill_wait_features`); when the hooks report
  the prefill done (or a request's decode finished) it adds ``(features, observed seconds)`` to an
  exponentially forgetting ridge regression towards the prior coefficients, ``O(k^2)`` memory
  (``k = 4``), clipped to non-negative coefficients. Absurd timings (NaN, negative, a stalled
  engine's 1000x) are turned away by a residual test against the current fit and counted; engines
  with an override in ``CostModel.engines`` are learned per engine (:class:`CostLearner`).

Everything here is pure: no clock, no I/O; arrays are numpy float64.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from balancer import kernels
from balancer.candidates import Candidates
from balancer.types import Request, Role

#: Feature names of the prefill and decode step models (the coefficient order everywhere).
PREFILL_TERMS = ("overhead_s", "per_token_s", "per_attn_pair_s", "per_group_token_s")
DECODE_TERMS = ("overhead_s", "per_seq_s", "per_kv_token_s", "per_group_seq_s")
#: Largest accepted ``EngineCost.decode_tokens_per_step`` (a draft of at most 1,023 tokens plus the bonus one).
MAX_DECODE_TOKENS_PER_STEP = 1024.0
#: Largest accepted ``EngineCost.prefill_step_floor_s``, seconds (as the simulator's eager floor).
MAX_PREFILL_STEP_FLOOR_S = 10.0


@dataclass(frozen=True)
class PrefillStepCost:
    """Linear prefill step time (module docstring), seconds per step / token / pair."""

    overhead_s: float = 0.02
    per_token_s: float = 2.0e-5
    per_attn_pair_s: float = 1.0e-10
    per_group_token_s: float = 0.0

    def coef(self) -> np.ndarray:
        """The coefficients in :data:`PREFILL_TERMS` order, shape ``(4,)``: a new array (the
        caller may change it); :attr:`coef_view` is the same values, read-only and built once."""
        return np.array([self.overhead_s, self.per_token_s, self.per_attn_pair_s, self.per_group_token_s])

    @cached_property
    def coef_view(self) -> np.ndarray:
        """:meth:`coef` built once per instance (the instance is frozen), read-only: the per-decision
        hot path (``features @ coef_view``) does not rebuild it."""
        c = self.coef()
        c.flags.writeable = False
        return c

    @classmethod
    def from_coef(cls, c: np.ndarray) -> PrefillStepCost:
        return cls(*(float(x) for x in c))


@dataclass(frozen=True)
class DecodeStepCost:
    """Linear decode step time (module docstring), seconds per step / sequence / KV token."""

    overhead_s: float = 0.02
    per_seq_s: float = 5.0e-5
    per_kv_token_s: float = 2.0e-9
    per_group_seq_s: float = 0.0

    def coef(self) -> np.ndarray:
        return np.array([self.overhead_s, self.per_seq_s, self.per_kv_token_s, self.per_group_seq_s])

    @classmethod
    def from_coef(cls, c: np.ndarray) -> DecodeStepCost:
        return cls(*(float(x) for x in c))


@dataclass(frozen=True)
class EngineCost:
    """Cost model of one engine kind (all engines of a pool, unless overridden per engine).

    Attributes:
        prefill / decode: step models.
        chunk_tokens: chunked-prefill budget per rank per step (``max_prefill_tokens``).
        ep_synchronous: all DP ranks of the engine step together (wide EP).
        max_num_seqs: most sequences one rank runs at once (vLLM ``max_num_seqs``, SGLang
            ``max_running_requests``); a request beyond it waits in the rank's waiting queue for a
            slot. ``None``: no cap known (the pricing is then as without one). Only decode and
            mixed pools use it (:func:`slot_wait_s`).
        request_chunk_tokens: most prompt tokens one request computes per step (vLLM
            ``--long-prefill-token-threshold``), tokens; ``None``: only ``chunk_tokens`` bounds a
            chunk. A prompt of ``u`` uncached tokens then needs at least ``ceil(u /
            request_chunk_tokens)`` prefill steps (:mod:`balancer.prefill_cadence`).
        prefill_schedule_interval: vLLM's DP prefill balancing (``--prefill-schedule-interval``):
            a rank that is decoding prefills only on every ``k``-th step of its engine, unless it
            has a request waiting for admission (then on every step); 1 (the default) = every step.
            Only mixed pools use it (:mod:`balancer.prefill_cadence`).
        decode_tokens_per_step: output tokens one decoding sequence gains per decode step on
            average (speculative decoding / MTP: the acceptance length, the bonus token
            included; vLLM with ``num_speculative_tokens = 3`` and acceptance 2.49 on AgentX
            440246), in ``[1, 1024]``; 1.0 (the default) = one token per step. The ``decode``
            step model stays the seconds of one real step (the verification included), so a
            request of ``out`` tokens decodes in ``out / decode_tokens_per_step`` steps
            (``ep_aware``'s decode cost and slot wait; :func:`slot_wait_s`). Only decode and
            mixed pools use it.
        prefill_step_floor_s: seconds, the shortest a step that carries prefill can last (an
            engine that runs such steps eagerly, vLLM ``cudagraph_mode FULL_DECODE_ONLY``: the
            host's kernel launches bound the step; AgentX 440246 about 0.116 s, the simulator's
            :class:`sim.perf.step_class.StepClassPerf` ``eager_floor_s``), in ``[0, 10]``; 0 (the
            default) = no floor. ``ep_aware`` prices it in its chunk-limit and cadence terms
            (:meth:`balancer.policies.ep_aware.EpAwarePolicy` ``_cadence_one``: a prompt's ``n``
            prefill steps take at least ``n`` floors, a forced mixed step at least one), so only
            on engines with :attr:`has_cadence`; elsewhere it is carried but not priced.
    """

    prefill: PrefillStepCost = field(default_factory=PrefillStepCost)
    decode: DecodeStepCost = field(default_factory=DecodeStepCost)
    chunk_tokens: int = 8192
    ep_synchronous: bool = True
    max_num_seqs: int | None = None
    request_chunk_tokens: int | None = None
    prefill_schedule_interval: int = 1
    decode_tokens_per_step: float = 1.0
    prefill_step_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        fl = self.prefill_step_floor_s
        if isinstance(fl, bool) or not isinstance(fl, numbers.Real) or not 0.0 <= float(fl) <= MAX_PREFILL_STEP_FLOOR_S:
            raise ValueError(f"prefill_step_floor_s must be a number in [0, {MAX_PREFILL_STEP_FLOOR_S:g}] s (the "
                             f"shortest step with prefill; 0 = none), got {fl!r}"[:200])
        tau = self.decode_tokens_per_step
        if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 1.0 <= float(tau) <= MAX_DECODE_TOKENS_PER_STEP:
            raise ValueError(f"decode_tokens_per_step must be a number in [1, {MAX_DECODE_TOKENS_PER_STEP:g}] (accepted "
                             f"tokens per decode step; 1 = no speculative decoding), got {tau!r}"[:200])
        for name, lo, optional in (("max_num_seqs", 1, True), ("request_chunk_tokens", 1, True),
                                   ("prefill_schedule_interval", 1, False)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}{' or None' if optional else ''}, got {v!r}")

    @property
    def has_cadence(self) -> bool:
        """Whether vLLM's per-request chunk limit or prefill cadence is set (either changes how
        ``ep_aware`` prices a prefill: :mod:`balancer.prefill_cadence`)."""
        return self.request_chunk_tokens is not None or self.prefill_schedule_interval > 1

    def prefill_time_s(self, tokens: float, context_tokens: float = 0.0) -> float:
        """Seconds for one rank of an otherwise idle engine to prefill ``tokens`` new tokens after
        ``context_tokens`` cached ones, in ``ceil(tokens / chunk_tokens)`` chunked steps."""
        tokens = max(float(tokens), 1.0)
        steps = math.ceil(tokens / self.chunk_tokens)
        p = self.prefill
        pairs = tokens * context_tokens + tokens * (tokens + 1.0) / 2.0
        return (steps * p.overhead_s + (p.per_token_s + p.per_group_token_s) * tokens
                + p.per_attn_pair_s * pairs)

    def decode_step_time_s(self, batch: float, kv_tokens: float) -> float:
        """Seconds of one decode step of one rank with ``batch`` sequences attending to
        ``kv_tokens`` KV tokens in total (the other ranks of the engine idle)."""
        d = self.decode
        return d.overhead_s + (d.per_seq_s + d.per_group_seq_s) * batch + d.per_kv_token_s * kv_tokens


@dataclass(frozen=True)
class CostModel:
    """What a cost-based policy needs to price a placement in seconds.

    Attributes:
        prefill: the prefill pool's engines (PD).
        decode: the decode pool's engines (or the mixed pool's, aggregated).
        engines: per-engine overrides by engine name (heterogeneous pools), else the pool's.
        transfer_latency_s / transfer_s_per_token: prefill -> decode KV transfer,
            ``latency + tokens * kv_bytes_per_token / bandwidth``.
        host_fetch_s_per_token / store_fetch_s_per_token: loading one cached token's KV from the
            host-DRAM tier / the shared store.
    """

    prefill: EngineCost = field(default_factory=EngineCost)
    decode: EngineCost = field(default_factory=EngineCost)
    engines: Mapping[str, EngineCost] = field(default_factory=dict)
    transfer_latency_s: float = 0.0
    transfer_s_per_token: float = 0.0
    host_fetch_s_per_token: float = 0.0
    store_fetch_s_per_token: float = 0.0

    @cached_property
    def any_cadence(self) -> bool:
        """Whether any engine (pool default or override) sets vLLM's per-request chunk limit or
        prefill cadence (:attr:`EngineCost.has_cadence`): computed once per instance (frozen), so a
        policy skips the cadence terms at the cost of one attribute read where none does."""
        return (self.prefill.has_cadence or self.decode.has_cadence
                or any(e.has_cadence for e in self.engines.values()))

    def engine(self, name: str, role: str) -> EngineCost:
        """The cost of engine ``name`` of pool ``role`` (``"prefill"``, ``"decode"``, ``"mixed"``)."""
        got = self.engines.get(name)
        if got is not None:
            return got
        return self.prefill if role == "prefill" else self.decode

    def to_dict(self) -> dict:
        """Plain dict (TOML/JSON-friendly) that :meth:`from_dict` reads back."""
        def eng(e: EngineCost) -> dict:
            out: dict[str, int | float | bool] = {"chunk_tokens": e.chunk_tokens, "ep_synchronous": e.ep_synchronous}
            if e.max_num_seqs is not None:  # absent = no cap (TOML has no null)
                out["max_num_seqs"] = e.max_num_seqs
            if e.request_chunk_tokens is not None:  # absent = no per-request limit
                out["request_chunk_tokens"] = e.request_chunk_tokens
            if e.prefill_schedule_interval != 1:  # absent = every step
                out["prefill_schedule_interval"] = e.prefill_schedule_interval
            if e.decode_tokens_per_step != 1.0:  # absent = one token per step
                out["decode_tokens_per_step"] = float(e.decode_tokens_per_step)
            if e.prefill_step_floor_s != 0.0:  # absent = no floor
                out["prefill_step_floor_s"] = float(e.prefill_step_floor_s)
            return {**out, "prefill": dict(zip(PREFILL_TERMS, e.prefill.coef().tolist())),
                    "decode": dict(zip(DECODE_TERMS, e.decode.coef().tolist()))}
        out = {"prefill": eng(self.prefill), "decode": eng(self.decode),
               "transfer_latency_s": self.transfer_latency_s, "transfer_s_per_token": self.transfer_s_per_token,
               "host_fetch_s_per_token": self.host_fetch_s_per_token,
               "store_fetch_s_per_token": self.store_fetch_s_per_token}
        if self.engines:
            out["engines"] = {k: eng(v) for k, v in self.engines.items()}
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> CostModel:
        """Inverse of :meth:`to_dict`; missing keys take the defaults.

        Raises:
            ValueError: a non-table where a table belongs, unknown keys, a coefficient that is not
                a finite number >= 0 (booleans and strings included), a non-integer or
                non-positive ``chunk_tokens``, ``max_num_seqs``, ``request_chunk_tokens`` or
                ``prefill_schedule_interval``, a ``decode_tokens_per_step`` outside ``[1, 1024]``, a
                ``prefill_step_floor_s`` outside ``[0, 10]``,
                a non-boolean ``ep_synchronous``; the message names
                the key by its dotted path (``cost_model.decode.decode.per_seq_s``).
        """
        def table(x: object, where: str) -> Mapping:
            if not isinstance(x, Mapping):
                raise ValueError(f"{where}: expected a table, got {type(x).__name__} {x!r}"[:200])
            return x

        def eng(x: object, where: str) -> EngineCost:
            x = table(x, where)
            unknown = set(x) - {"chunk_tokens", "ep_synchronous", "max_num_seqs", "request_chunk_tokens",
                                "prefill_schedule_interval", "decode_tokens_per_step", "prefill_step_floor_s",
                                "prefill", "decode"}
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                                 "valid: chunk_tokens, decode, decode_tokens_per_step, ep_synchronous, max_num_seqs, "
                                 "prefill, prefill_schedule_interval, prefill_step_floor_s, request_chunk_tokens")
            p = _terms(table(x.get("prefill", {}), f"{where}.prefill"), PREFILL_TERMS, f"{where}.prefill")
            dd = _terms(table(x.get("decode", {}), f"{where}.decode"), DECODE_TERMS, f"{where}.decode")
            chunk = x.get("chunk_tokens", 8192)
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
                raise ValueError(f"{where}.chunk_tokens must be an integer >= 1, got {chunk!r}")
            ep = x.get("ep_synchronous", True)
            if not isinstance(ep, bool):
                raise ValueError(f"{where}.ep_synchronous must be true or false, got {ep!r}")
            seqs = x.get("max_num_seqs")
            if seqs is not None and (isinstance(seqs, bool) or not isinstance(seqs, int) or not 1 <= seqs <= 1 << 20):
                raise ValueError(f"{where}.max_num_seqs must be an integer in [1, 1048576] (omit it for no cap), "
                                 f"got {seqs!r}"[:200])
            limit = x.get("request_chunk_tokens")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1 << 30):
                raise ValueError(f"{where}.request_chunk_tokens must be an integer in [1, 1073741824] (omit it for "
                                 f"no per-request limit), got {limit!r}"[:200])
            interval = x.get("prefill_schedule_interval", 1)
            if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 1 << 16:
                raise ValueError(f"{where}.prefill_schedule_interval must be an integer in [1, 65536] (1 = prefill "
                                 f"on every step), got {interval!r}"[:200])
            tau = x.get("decode_tokens_per_step", 1.0)
            if (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau)
                    or not 1.0 <= tau <= MAX_DECODE_TOKENS_PER_STEP):
                raise ValueError(f"{where}.decode_tokens_per_step must be a number in [1, "
                                 f"{MAX_DECODE_TOKENS_PER_STEP:g}] (accepted tokens per decode step, e.g. MTP's "
                                 f"acceptance length; 1 = no speculative decoding), got {tau!r}"[:200])
            floor = x.get("prefill_step_floor_s", 0.0)
            if (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor)
                    or not 0.0 <= floor <= MAX_PREFILL_STEP_FLOOR_S):
                raise ValueError(f"{where}.prefill_step_floor_s must be a number in [0, "
                                 f"{MAX_PREFILL_STEP_FLOOR_S:g}] s (the shortest step with prefill; omit it for "
                                 f"none), got {floor!r}"[:200])
            return EngineCost(PrefillStepCost(**p), DecodeStepCost(**dd), chunk, ep, seqs, limit, interval,
                              float(tau), float(floor))

        d = table(d, "cost_model")
        scalars = ("transfer_latency_s", "transfer_s_per_token", "host_fetch_s_per_token", "store_fetch_s_per_token")
        unknown = set(d) - {"prefill", "decode", "engines", *scalars}
        if unknown:
            raise ValueError(f"cost_model: unknown key(s) {', '.join(sorted(map(str, unknown)))}; valid: decode, "
                             f"engines, prefill, {', '.join(scalars)}")
        kw = {k: _number(d[k], f"cost_model.{k}") for k in scalars if k in d}
        engines = table(d.get("engines", {}), "cost_model.engines")
        return cls(prefill=eng(d.get("prefill", {}), "cost_model.prefill"),
                   decode=eng(d.get("decode", {}), "cost_model.decode"),
                   engines={str(k): eng(v, f"cost_model.engines.{k}") for k, v in engines.items()}, **kw)


def _number(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where} must be a finite number >= 0, got {v!r}"[:200])
    return float(v)


def _terms(x: Mapping, names: tuple[str, ...], where: str) -> dict[str, float]:
    unknown = set(x) - set(names)
    if unknown:
        raise ValueError(f"{where}: unknown term(s) {', '.join(sorted(map(str, unknown)))}; valid: {', '.join(names)}")
    return {k: _number(v, f"{where}.{k}") for k, v in x.items()}


#: A generic starting point for a live router with no configured model: DeepSeek-V3-class wide-EP
#: engines on H200-class GPUs, ``pdlb sim cost-model --scenario dsv3-pd-h200`` rounded to two
#: significant digits (tests/balancer/test_ep_aware.py keeps it within 5% of that fit). The online fit
#: adapts it to the real engines.
DEFAULT_COST_MODEL = CostModel(
    prefill=EngineCost(PrefillStepCost(0.0, 5.1e-5, 1.0e-8, 4.2e-6), DecodeStepCost(), 8192, True),
    decode=EngineCost(PrefillStepCost(0.0, 5.1e-5, 1.0e-8, 4.2e-6), DecodeStepCost(0.025, 5.2e-5, 3.5e-8, 0.0), 8192, True),
    transfer_latency_s=0.001, transfer_s_per_token=1.4e-6,
)


# ---------------------------------------------------------------------- the sequence cap
def slot_wait_s(num_requests: np.ndarray, step_s: np.ndarray | float, out_tokens: float,
                max_num_seqs: int, tokens_per_step: float = 1.0) -> np.ndarray:
    """Predicted seconds a request placed on each rank waits for a running slot, shape ``(n,)``.

    A rank runs at most ``S = max_num_seqs`` sequences; a request beyond them waits, first come
    first served, in the rank's waiting queue (vLLM's scheduler: ``max_num_seqs``, its
    ``waiting`` deque). With ``b_i`` requests on rank ``i`` (``num_requests``: running and
    waiting), the new one is ``k_i = max(0, b_i + 1 - S)``-th in that queue. Slots free as
    running sequences finish: ``S`` sequences of ``out`` output tokens on average, ``tau``
    tokens per step of ``step_s`` seconds (``tokens_per_step``: 1 without speculative decoding,
    the acceptance length with it), finish at the renewal rate ``S tau / (out step_s)``, so the
    ``k``-th slot frees after::

        wait_i = k_i * (out_tokens / tau) * step_s_i / S

    ``step_s``: the rank's (its engine's, for wide EP) decode step now, a scalar or ``(n,)``;
    ``out_tokens``: the mean output of a running sequence (the caller's estimate, tokens).
    0 where the rank has a free slot. Pure. Source: pdlb (vLLM's scheduling rule; the renewal
    argument of queueing).

    Raises:
        ValueError: ``max_num_seqs`` < 1, ``out_tokens`` < 0 or ``tokens_per_step`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not out_tokens >= 0:
        raise ValueError(f"out_tokens must be >= 0, got {out_tokens}")
    if not tokens_per_step >= 1.0:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    k = np.maximum(np.asarray(num_requests, dtype=np.float64) + 1.0 - max_num_seqs, 0.0)
    return k * (float(out_tokens) / float(tokens_per_step) / max_num_seqs) * np.asarray(step_s, dtype=np.float64)


# ---------------------------------------------------------------------- fitting to a step-time model
def fit_step_cost(
    step_time_s: Callable[..., np.ndarray],
    num_ranks: int,
    chunk_tokens: int,
    *,
    max_decode_batch: int = 256,
    max_context_tokens: int = 32_768,
    ep_synchronous: bool = True,
    samples: int = 768,
    seed: int = 0,
) -> EngineCost:
    """Fit :class:`EngineCost` by least squares to a step-time function of the
    :class:`sim.perf.base.PerfModel` shape ``step_time_s(prefill_tokens, prefill_attn_pairs,
    decode_seqs, decode_ctx_tokens)`` (arrays ``(n, R)`` -> ``(n,)``), sampled on ``samples``
    random steps of ``R = num_ranks`` ranks (``1`` for a dense engine) each: prefill steps with
    per-rank chunks up to ``chunk_tokens`` after up to ``max_context_tokens`` cached tokens, some
    ranks idle; decode steps with up to ``max_decode_batch`` sequences of up to
    ``max_context_tokens`` KV each. Non-negative least squares by clipping and refitting the rest.
    Deterministic for a given ``seed``.
    """
    rng = np.random.default_rng(seed)
    R = max(1, int(num_ranks))
    n = int(samples)
    # prefill: per-rank fill fractions, with a share of idle ranks (imbalanced EP steps)
    busy = rng.random((n, R)) < rng.uniform(0.2, 1.0, (n, 1))
    busy[np.arange(n), rng.integers(0, R, n)] = True
    tok = np.where(busy, np.ceil(rng.uniform(0.05, 1.0, (n, R)) * chunk_tokens), 0.0)
    ctx = np.floor(rng.uniform(0.0, 1.0, (n, R)) ** 2 * max_context_tokens)
    pairs = tok * ctx + tok * (tok + 1.0) / 2.0
    zeros = np.zeros((n, R))
    y = np.asarray(step_time_s(tok, pairs, zeros, zeros), dtype=np.float64)
    X = prefill_design(tok, pairs, ep_synchronous and R > 1)
    p = PrefillStepCost.from_coef(_nnls(X, y))
    # decode
    b = np.where(busy, np.ceil(rng.uniform(0.02, 1.0, (n, R)) * max_decode_batch), 0.0)
    kv = b * np.floor(rng.uniform(0.05, 1.0, (n, R)) * max_context_tokens)
    y = np.asarray(step_time_s(zeros, zeros, b, kv), dtype=np.float64)
    X = decode_design(b, kv, ep_synchronous and R > 1)
    d = DecodeStepCost.from_coef(_nnls(X, y))
    return EngineCost(p, d, int(chunk_tokens), bool(ep_synchronous and R > 1))


def prefill_design(tokens: np.ndarray, pairs: np.ndarray, ep: bool) -> np.ndarray:
    """Design matrix ``(n, 4)`` of prefill steps ``(n, R)``: ``[1, max tokens, max pairs, sum tokens]``
    (sum 0 for a dense engine, whose per-token cost is all in ``per_token_s``)."""
    ones = np.ones(len(tokens))
    s = tokens.sum(axis=1) if ep else np.zeros(len(tokens))
    return np.column_stack([ones, tokens.max(axis=1), pairs.max(axis=1), s])


def decode_design(seqs: np.ndarray, kv: np.ndarray, ep: bool) -> np.ndarray:
    """Design matrix ``(n, 4)`` of decode steps ``(n, R)``: ``[1, max seqs, max kv, sum seqs]``."""
    ones = np.ones(len(seqs))
    s = seqs.sum(axis=1) if ep else np.zeros(len(seqs))
    return np.column_stack([ones, seqs.max(axis=1), kv.max(axis=1), s])


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients clipped at 0 (refit without the clipped columns, a few
    rounds): enough for 4 well-scaled columns. Columns that are all zero get 0."""
    k = X.shape[1]
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    active = np.array([bool(np.any(X[:, j])) for j in range(k)])
    coef = np.zeros(k)
    for _ in range(k):
        c, *_ = np.linalg.lstsq(Xs[:, active], y, rcond=None)
        coef[:] = 0.0
        coef[active] = c
        neg = coef < 0
        if not neg.any():
            break
        active &= ~neg
    return np.maximum(coef, 0.0) / scale


# ---------------------------------------------------------------------- features of a placement
_GROUPS: dict[int, tuple] = {}
_GROUPS_MAX = 64


def engine_groups(replicas: tuple) -> tuple[tuple[str, ...], np.ndarray, np.ndarray | None]:
    """``(engine names, engine index per candidate (n,) int64, rows (E, R) or None)`` of a tuple
    of :class:`~balancer.types.ReplicaId`: ``rows[e]`` are the positions of engine ``e``'s
    candidates when every engine has ``R`` consecutive ones (the router sorts by engine), else
    ``None``. Cached per tuple object (bounded), as the router reuses its pools' tuples."""
    got = _GROUPS.get(id(replicas))
    if got is not None and got[0] is replicas:
        return got[1], got[2], got[3]
    names: list[str] = []
    pos: dict[str, int] = {}
    idx = np.empty(len(replicas), dtype=np.int64)
    for k, r in enumerate(replicas):
        e = pos.get(r.engine)
        if e is None:
            e = pos[r.engine] = len(names)
            names.append(r.engine)
        idx[k] = e
    rows = None
    n_eng = len(names)
    if n_eng and len(replicas) % n_eng == 0:
        R = len(replicas) // n_eng
        if np.array_equal(idx, np.repeat(np.arange(n_eng), R)):
            rows = np.arange(len(replicas)).reshape(n_eng, R)
    if len(_GROUPS) >= _GROUPS_MAX:
        _GROUPS.clear()
    _GROUPS[id(replicas)] = (replicas, tuple(names), idx, rows)
    return tuple(names), idx, rows


_LAYOUT: dict[tuple[int, int, int], tuple] = {}


def engine_layout(idx: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows[idx], arange(n), arange(n) % R)`` for :func:`engine_groups`' ``idx`` (n,) and
    ``rows`` (E, R): each candidate's engine's positions (n, R), the candidates' positions and each
    one's column in its engine's row. Read-only, cached per (``idx``, ``rows``) object pair (the
    groups are cached per candidate tuple, so the same pair comes back every decision)."""
    key = (id(idx), id(rows), len(idx))
    got = _LAYOUT.get(key)
    if got is not None and got[0] is idx and got[1] is rows:
        return got[2], got[3], got[4]
    n, R = len(idx), rows.shape[1]
    ri, ar, own = rows[idx], np.arange(n), np.arange(n) % R
    for a in (ri, ar, own):
        a.flags.writeable = False
    if len(_LAYOUT) >= _GROUPS_MAX:
        _LAYOUT.clear()
    _LAYOUT[key] = (idx, rows, ri, ar, own)
    return ri, ar, own


def _columns(n: int, c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray | float) -> np.ndarray:
    """``np.column_stack([c0, c1, c2, c3])`` (a scalar ``c3`` fills its column), shape ``(n, 4)``,
    float64, C order: the same array without ``column_stack``'s Python-level work."""
    out = np.empty((n, 4))
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = c0, c1, c2, c3
    return out


def prefill_wait_features(queued: np.ndarray, queued_pairs: np.ndarray, new_tokens: np.ndarray,
                          cached_tokens: np.ndarray, cost: EngineCost, idx: np.ndarray,
                          rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Features ``(n, 4)`` of the time until a new prompt's prefill completes on each candidate,
    such that ``features @ cost.prefill.coef()`` is that time in seconds; and the "slow
    horizon" ``(n,)``: rank-local work seconds by which the placement extends the engine's
    busiest rank (0 when another rank stays the slowest, and on an engine whose other ranks are
    idle).

    Candidate ``i`` has ``q_i`` queued uncached tokens with ``a_i`` attention pairs; the prompt
    has ``u_i`` uncached tokens after ``p_i`` cached ones there (pairs ``u_i p_i + u_i (u_i + 1) / 2``).
    The rank needs ``S_i = ceil((q_i + u_i) / C)`` steps. During them each rank ``r`` of the engine
    processes ``f_r = min(1, S_i C / q_r)`` of its queue; a wide-EP engine steps at its slowest
    rank, the one with the most rank-local work ``f_r (per_token q_r + per_attn_pair a_r)`` (``i``
    itself with the prompt added), so features are ``[S_i, f* q*, f* a*, sum_r min(q'_r, S_i C)]``
    with ``*`` that rank (the group sum feeds the routed-expert term). A dense engine (each rank its
    own step group): ``[S_i, q'_i, a'_i, 0]``. Shapes ``(n,)``; ``idx``/``rows`` from
    :func:`engine_groups`.
    """
    c = cost.prefill
    C = float(cost.chunk_tokens)
    q = queued
    a = queued_pairs
    u = new_tokens
    idle = cost.ep_synchronous and q[q.argmax()] <= 0 and a[a.argmax()] <= 0
    if cost.ep_synchronous and rows is not None and not idle:  # the compiled loop, when there is one
        got = kernels.prefill_wait_rows(q, a, u, cached_tokens, C, c.per_token_s, c.per_attn_pair_s, idx, rows)
        if got is not None:
            return got
    own_pairs = u * cached_tokens + u * (u + 1.0) / 2.0
    q_new = q + u
    a_new = a + own_pairs
    steps = np.ceil(q_new / C)
    n = len(q)
    if not cost.ep_synchronous:
        return _columns(n, steps, q_new, a_new, 0.0), np.zeros(n)
    if idle:  # an idle pool: each candidate's own rank is the slowest
        return _columns(n, steps, q_new, a_new, q_new), np.zeros(n)
    X = steps * C
    w = c.per_token_s * q + c.per_attn_pair_s * a
    w_new = c.per_token_s * q_new + c.per_attn_pair_s * a_new
    # (ufunc calls and reductions below instead of ndarray methods and broadcast_to: the same
    # values without their Python-level wrappers, about 1-4 us each at this size)
    if rows is not None:
        ri, ar, own = engine_layout(idx, rows)
        Q, A, W = q[ri], a[ri], w[ri]  # (n, R): each candidate's engine
    else:
        same = idx[:, None] == idx[None, :]
        Q = np.where(same, q[None, :], 0.0)
        A = np.where(same, a[None, :], 0.0)
        W = np.where(same, w[None, :], 0.0)
        ar = own = np.arange(n)
    frac = np.divide(X[:, None], Q, out=np.zeros(Q.shape, dtype=Q.dtype), where=Q > 0)
    np.minimum(frac, 1.0, out=frac)
    work = W * frac
    work[ar, own] = -1.0  # the candidate's own rank counts with the prompt added
    j = work.argmax(axis=1)
    other = work[ar, j]
    use_own = w_new >= other
    frac_j = frac[ar, j]
    tok = np.where(use_own, q_new, Q[ar, j] * frac_j)
    pairs = np.where(use_own, a_new, A[ar, j] * frac_j)
    clip = np.add.reduce(np.minimum(Q, X[:, None]), axis=1) - np.minimum(q, X) + q_new
    W_other = W.copy()
    W_other[ar, own] = 0.0
    busiest_other = np.maximum.reduce(W_other, axis=1)
    # an idle engine has no slow pace to extend: starting one is not a horizon (and charging it
    # would pile shared-prefix bursts onto busy engines while others idle)
    horizon = np.where(busiest_other > 0, np.maximum(w_new - busiest_other, 0.0), 0.0)
    feats = np.empty((n, 4))
    feats[:, 0], feats[:, 1], feats[:, 2], feats[:, 3] = steps, tok, pairs, clip
    return feats, horizon


# ---------------------------------------------------------------------- online fitting
#: Why :class:`OnlineFit` turned an observation away (keys of :attr:`OnlineFit.rejected`).
REJECT_REASONS = ("invalid", "out_of_range", "outlier")
#: The spread of log residuals, tracked as the median of ``|z|``: ``median |z| = 0.6745 sigma`` for
#: Gaussian ``z``; multiplicative steps of 5% per observation; at least 0.1% (noise-free timings).
_MAD_PER_SIGMA = 0.6745
_SPREAD_STEP = 1.05
_MIN_SPREAD = 1e-3
#: Random subsets tried by the warm-up's least-median start.
_LMEDS_SUBSETS = 24
#: Largest credible feature value: attention pairs of a 1M-token context are ~5e11; beyond 1e18 a
#: value is a bug, and rescaling the fit's sums to it would lose their precision (factors < 1e-18 squared).
MAX_FEATURE = 1e18


class OnlineFit:
    """Exponentially forgetting ridge regression of a linear cost model, robust to absurd timings,
    bounded memory.

    Minimises ``sum_j lam^(t - j) (y_j - x_j . c)^2 + rho * sum_k m_k (c_k - prior_k)^2`` over the
    accepted observations, where ``m_k`` is the decayed mean of ``x_k^2`` (so ``rho`` counts
    "pseudo-observations" of the prior). Features differ by many orders of magnitude (steps ~1,
    tokens ~1e4, attention pairs ~1e9), so the sums are kept for features divided by their
    running maximum magnitude (rescaled in place when it grows) and the ``k x k`` system is solved
    in those units. Coefficients are clipped to ``>= 0``.

    Which observations count (each turned-away one is counted in :attr:`rejected` by reason):

    - ``invalid``: a feature or the time is NaN or infinite, a feature is negative, or the time is
      ``<= 0`` (a clock step, a hook called twice). Such an observation changes nothing else.
    - ``out_of_range``: the time is outside ``[min_value, max_value]`` (default 1 us to 3,600 s: no
      step is faster, no step or prefill takes an hour) or a feature exceeds :data:`MAX_FEATURE`
      (rescaling the sums to it would wipe their precision).
    - ``outlier``: a residual test against the current fit, in log space (timings err by factors):
      ``z = ln(y / x.c)``; rejected when ``|z| > max(ln gate_ratio, gate_sigmas * sigma)``, ``sigma``
      the robust spread ``median |z| / 0.6745`` (a running median over every residual, so outliers
      cannot widen the gate that should drop them). With the defaults a timing 4x above or below
      the prediction is dropped (a stalled engine's 10x or 1000x, a timestamp from another
      request), ordinary noise is not; very noisy timings widen the gate (sigma 0.6: 8x).
    - Warm-up: the first ``warmup`` valid observations are held (bounded) and screened together
      before any enters the fit: each is compared with the median ratio ``y / (x . c)`` of the
      batch (so a prior that is off by a constant factor does not reject everything), those
      within ``warmup_gate_ratio`` of it are fitted robustly (the least-median-of-squares fit of
      random subsets, Rousseeuw 1984, as least squares breaks down on a few 10x timings), then
      trimmed twice by the residual test against that fit and refitted. Outliers cannot steer the
      start.
    - Change, not outliers: after ``reset_after`` consecutive outliers the engine has changed (or
      the prior was far off): the fit restarts its warm-up from its current coefficients with the
      last rejected observations (held, at most ``reset_after``) as the first ones, and
      :attr:`num_resets` counts it. 10% independent outliers reach 16 in a row with probability
      1e-16 per observation.

    State is ``O(k^2 + (warmup + reset_after) k)``; a solve every ``refit_every`` accepted
    observations.

    Args:
        prior: starting coefficients, shape ``(k,)``, non-negative.
        forgetting: ``lam`` in (0, 1]; 0.999 keeps an effective window of ~1,000 observations.
        prior_weight: ``rho``, in observations. Small (default 0.01): features are nearly
            collinear (steps grow with tokens), and a stronger pull towards a wrong prior shifts
            the fit a long way along that direction; it mostly keeps the solve well-posed for a
            feature that never varies (e.g. the group term of a dense engine stays at its prior).
        refit_every: accepted observations between solves.
        gate_ratio / gate_sigmas: the residual test (above); ``gate_ratio`` > 1.
        warmup / warmup_gate_ratio: the warm-up screen (above); ``warmup`` 0 turns it off.
        reset_after: consecutive outliers that restart the fit (0: never).
        min_value / max_value: the credible range of an observation (seconds).

    Raises:
        ValueError: a parameter out of range, a prior that is not finite and ``>= 0``.
    """

    def __init__(self, prior: np.ndarray, *, forgetting: float = 0.999, prior_weight: float = 0.01,
                 refit_every: int = 16, gate_ratio: float = 4.0, gate_sigmas: float = 3.5, warmup: int = 32,
                 warmup_gate_ratio: float = 10.0, reset_after: int = 16, max_value: float = 3600.0,
                 min_value: float = 1e-6) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if not (gate_ratio > 1.0 and warmup_gate_ratio > 1.0 and gate_sigmas > 0 and 0 < min_value < max_value):
            raise ValueError("gate_ratio and warmup_gate_ratio must be > 1, gate_sigmas > 0, "
                             "0 < min_value < max_value")
        if warmup < 0 or reset_after < 0:
            raise ValueError("warmup and reset_after must be >= 0")
        self.prior = np.asarray(prior, dtype=np.float64).copy()
        if not (np.all(np.isfinite(self.prior)) and np.all(self.prior >= 0)):
            raise ValueError(f"prior coefficients must be finite and >= 0, got {self.prior.tolist()}")
        self.coef = self.prior.copy()
        self.forgetting = forgetting
        self.prior_weight = float(prior_weight)
        self.refit_every = max(1, int(refit_every))
        self.log_gate = math.log(gate_ratio)
        self.gate_sigmas = float(gate_sigmas)
        self.warmup = int(warmup)
        self.log_warmup_gate = math.log(warmup_gate_ratio)
        self.reset_after = int(reset_after)
        self.max_value = float(max_value)
        self.min_value = float(min_value)
        #: observations turned away, by reason (:data:`REJECT_REASONS`)
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        #: restarts after ``reset_after`` consecutive outliers
        self.num_resets = 0
        #: accepted observations in the fit (warm-up ones once screened)
        self.num_observations = 0
        #: bumped by every solve that changed :attr:`coef` (for publishers)
        self.version = 0
        self._clear()

    def _clear(self) -> None:
        k = len(self.prior)
        self._scale = np.ones(k)
        self._gram = np.zeros((k, k))  # of x / scale
        self._xy = np.zeros(k)
        self._feat_sq = np.zeros(k)
        self._weight = 0.0
        self._med_abs_z = _MIN_SPREAD  # running median of |z| (robust: outliers move it by one step)
        self._warm: list[tuple[np.ndarray, float]] | None = [] if self.warmup > 0 else None
        self._streak: list[tuple[np.ndarray, float]] = []  # consecutive outliers, newest last

    @property
    def num_pending(self) -> int:
        """Observations held by the warm-up screen, not yet in the fit."""
        return len(self._warm) if self._warm is not None else 0

    def _check(self, x: np.ndarray, y: float) -> str | None:
        if x.shape != self.prior.shape or not (np.all(np.isfinite(x)) and math.isfinite(y)) or y <= 0 \
                or np.any(x < 0):
            return "invalid"
        if not self.min_value <= y <= self.max_value or np.any(x > MAX_FEATURE):
            return "out_of_range"
        return None

    def observe(self, x: np.ndarray, y: float) -> str | None:
        """Offer one observation (features ``(k,)``, seconds); returns None if it entered the fit
        (or the warm-up screen), else the reason it was turned away (:data:`REJECT_REASONS`)."""
        try:
            x = np.asarray(x, dtype=np.float64).reshape(-1)
            y = float(y)
        except (TypeError, ValueError):
            self.rejected["invalid"] += 1
            return "invalid"
        why = self._check(x, y)
        if why is None and self._warm is not None:
            self._warm.append((x, y))
            if len(self._warm) >= self.warmup:
                self._end_warmup()
            return None
        if why is None:
            z = self._log_residual(x, y)
            outlier = z is not None and abs(z) > self._gate()
            if z is not None:
                self._track_spread(z)
            if outlier:
                why = "outlier"
                if self.reset_after:  # held for a restart; nothing is held when restarts are off
                    self._streak.append((x, y))
                if self.reset_after and len(self._streak) >= self.reset_after:
                    self.rejected[why] += 1
                    self._reset()  # this one and the held streak restart the fit
                    return None
            else:
                self._streak.clear()
                self._add(x, y, z)
                return None
        self.rejected[why] += 1
        return why

    def _gate(self) -> float:
        return max(self.log_gate, self.gate_sigmas * self._med_abs_z / _MAD_PER_SIGMA)

    def _track_spread(self, z: float) -> None:
        """One step of a multiplicative stochastic-approximation median of ``|z|`` (its fixed point
        has as many ``|z|`` above as below), fed every residual, accepted or not."""
        m = self._med_abs_z * (_SPREAD_STEP if abs(z) > self._med_abs_z else 1.0 / _SPREAD_STEP)
        self._med_abs_z = min(max(m, _MIN_SPREAD), 50.0)

    def _log_residual(self, x: np.ndarray, y: float, coef: np.ndarray | None = None) -> float | None:
        pred = float(x @ (self.coef if coef is None else coef))
        return math.log(y) - math.log(pred) if pred > 0 else None

    def _reset(self) -> None:
        """Restart from the current coefficients, the held outliers as the first observations."""
        held = self._streak[-self.warmup:] if self.warmup else list(self._streak)
        self.rejected["outlier"] -= len(held)  # not outliers after all: the new regime's first observations
        coef = self.coef.copy()
        self._clear()
        self.coef = coef
        self.num_resets += 1
        if self._warm is None:
            for x, y in held:
                self._add(x, y, self._log_residual(x, y))
            return
        self._warm.extend(held)
        if len(self._warm) >= self.warmup:
            self._end_warmup()

    def _end_warmup(self) -> None:
        batch, self._warm = self._warm or [], None
        X = np.array([b[0] for b in batch])
        Y = np.array([b[1] for b in batch])
        pred = X @ self.coef
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(pred > 0, np.log(Y) - np.log(np.where(pred > 0, pred, 1.0)), np.nan)
        known = np.isfinite(z)
        keep = np.ones(len(Y), dtype=bool)
        if known.any():  # against the median ratio: a constant-factor error of the prior is no outlier
            keep = ~known | (np.abs(z - np.median(z[known])) <= self.log_warmup_gate)
        # A least-squares start is not robust (three 10x timings among 32 put the fit 2x off), so
        # start from the least-median fit (LMedS, Rousseeuw 1984): least squares on random subsets
        # of 2k screened observations, keeping the fit with the smallest median |log residual| over
        # the screened batch. With 10% outliers a subset of 8 is clean with p = 0.43; 24 subsets all
        # miss with p < 2e-6. Seeded by the batch size: deterministic.
        idx = np.flatnonzero(keep)
        k = len(self.prior)
        coef = self._solve_batch(X[keep], Y[keep])
        best = self._median_abs_z(X[idx], Y[idx], coef)
        if len(idx) > 2 * k:
            rng = np.random.default_rng(len(idx))
            for _ in range(_LMEDS_SUBSETS):
                sub = rng.choice(idx, size=2 * k, replace=False)
                c = self._solve_batch(X[sub], Y[sub])
                med = self._median_abs_z(X[idx], Y[idx], c)
                if med < best:
                    coef, best = c, med
        for _ in range(2):  # trim by the residual test against the current fit, refit what is left
            p = X @ coef
            with np.errstate(divide="ignore", invalid="ignore"):
                zz = np.where(p > 0, np.log(Y) - np.log(np.where(p > 0, p, 1.0)), 0.0)
            scale = float(np.median(np.abs(zz[keep]))) if keep.any() else 0.0
            gate = max(self.log_gate, self.gate_sigmas * scale / _MAD_PER_SIGMA)
            new_keep = keep & (np.abs(zz) <= gate)
            if new_keep.sum() <= k:  # too few left to trust a trim: keep the screen's
                break
            keep = new_keep
            coef = self._solve_batch(X[keep], Y[keep])
        self.rejected["outlier"] += int((~keep).sum())
        for i in np.flatnonzero(keep):
            self._add(X[i], float(Y[i]), None)
        self.refit()
        p = X[keep] @ self.coef
        with np.errstate(divide="ignore", invalid="ignore"):
            zk = (np.log(Y[keep]) - np.log(p))[p > 0]
        self._med_abs_z = max(float(np.median(np.abs(zk))) if len(zk) else 0.0, _MIN_SPREAD)

    @staticmethod
    def _median_abs_z(X: np.ndarray, Y: np.ndarray, coef: np.ndarray) -> float:
        p = X @ coef
        if not np.all(p > 0):
            return math.inf
        return float(np.median(np.abs(np.log(Y) - np.log(p))))

    def _solve_batch(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """Coefficients of ``(X, Y)`` alone, by the same ridge towards the prior (no state change)."""
        if len(Y) == 0:
            return self.coef
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
        Z = X / scale
        typical = (Z * Z).mean(axis=0)
        typical[typical <= 0] = 1.0
        D = max(self.prior_weight, 1e-9) * np.diag(typical)
        try:
            c = np.linalg.solve(Z.T @ Z + D, Z.T @ Y + D @ (self.prior * scale))
        except np.linalg.LinAlgError:
            return self.coef
        return np.maximum(c / scale, 0.0)

    def _add(self, x: np.ndarray, y: float, z: float | None) -> None:
        mag = np.abs(x)
        grow = mag > self._scale
        if grow.any():
            new = np.where(grow, mag, self._scale)
            r = self._scale / new
            self._gram *= np.outer(r, r)
            self._xy *= r
            self._feat_sq *= r * r
            self._scale = new
        zx = x / self._scale
        lam = self.forgetting
        self._gram *= lam
        self._xy *= lam
        self._feat_sq *= lam
        self._weight = self._weight * lam + 1.0
        self._gram += np.outer(zx, zx)
        self._xy += zx * y
        self._feat_sq += zx * zx
        self.num_observations += 1
        if self.num_observations % self.refit_every == 0:
            self.refit()

    def refit(self) -> np.ndarray:
        """Solve now; returns the coefficients (in the features' own units)."""
        if self._weight <= 0:
            return self.coef
        typical = self._feat_sq / self._weight
        typical[typical <= 0] = 1.0
        D = self.prior_weight * np.diag(typical)
        prior_z = self.prior * self._scale
        try:
            c = np.linalg.solve(self._gram + D, self._xy + D @ prior_z)
        except np.linalg.LinAlgError:
            return self.coef
        if not np.all(np.isfinite(c)):
            return self.coef
        self.coef = np.maximum(c / self._scale, 0.0)
        self.version += 1
        return self.coef


class CostLearner:
    """Learns a :class:`CostModel` online from a router's hook timestamps (bounded memory).

    The router calls :meth:`on_prefill_dispatch` with the chosen prefill candidate's features
    (:func:`prefill_wait_features` row), the dispatch time, the pool that prefills (``"prefill"``,
    or ``"decode"`` for an aggregated pool, whose mixed engines' prefill model is then fitted) and
    the engine; :meth:`on_prefill_done` with the time the prefill finished; :meth:`on_decode_dispatch`
    with the decode engine's step features (``[1, max seqs, max kv, sum seqs]`` after the placement),
    :meth:`on_first_token` and :meth:`on_decode_finished` with the finish time and the output
    length, observing the mean inter-token latency times the engine's
    :attr:`EngineCost.decode_tokens_per_step` (one decode step's seconds: with speculative
    decoding a step yields several tokens). Each observation goes through an
    :class:`OnlineFit`, which turns absurd ones away (NaN, negative, a stalled engine's 1000x;
    counted in :meth:`stats`, which ``Router.metrics()["cost_learning"]`` reports).

    Which fit an observation feeds:

    - ``prefill``: the prefill pool's prefill model (``model.prefill.prefill``);
    - ``mixed``: an aggregated pool's prefill model (``model.decode.prefill``);
    - ``decode``: the decode (or mixed) pool's decode step model (``model.decode.decode``);
    - per engine: an engine with an override in ``prior.engines`` (a heterogeneous pool, e.g. a
      long-prompt pool's engines with their own ``pdlb sim cost-model`` table) has fits of its own,
      ``<engine>/prefill`` (its prefill model, from prefill- or mixed-pool prefills) and
      ``<engine>/decode``, published as ``model.engines[engine]``; its observations do not enter the
      pool's fits, and engines without an override share their pool's. The fits are made once
      from the prior, so their number (3 + 2 per override) is bounded by the config.

    Pending records are bounded (``max_pending``, oldest dropped). :attr:`model` is the current
    model (a new frozen object after each refit that changed a coefficient).

    Args:
        prior: the starting model; its ``engines`` overrides are learned per engine.
        forgetting / prior_weight: see :class:`OnlineFit`.
        max_pending: dispatched requests remembered per kind until their hook comes.
        **fit_options: further :class:`OnlineFit` options (``gate_ratio``, ``warmup``, ...).
    """

    def __init__(self, prior: CostModel, *, forgetting: float = 0.999, prior_weight: float = 0.01,
                 max_pending: int = 65_536, **fit_options: float) -> None:
        self.model = prior

        def fit(coef: np.ndarray) -> OnlineFit:
            return OnlineFit(coef, forgetting=forgetting, prior_weight=prior_weight, **fit_options)  # type: ignore[arg-type]

        self._fits = {"prefill": fit(prior.prefill.prefill.coef()), "mixed": fit(prior.decode.prefill.coef()),
                      "decode": fit(prior.decode.decode.coef())}
        self._engine_fits = {str(name): {"prefill": fit(e.prefill.coef()), "decode": fit(e.decode.coef())}
                             for name, e in prior.engines.items()}
        self._pending_prefill: OrderedDict[str, tuple[np.ndarray, float, str, str | None]] = OrderedDict()
        self._pending_decode: OrderedDict[str, list] = OrderedDict()
        self.max_pending = max(1, int(max_pending))

    @property
    def fits(self) -> dict[str, OnlineFit]:
        """Every fit by name: ``prefill``, ``mixed``, ``decode``, ``<engine>/prefill``, ``<engine>/decode``."""
        out = dict(self._fits)
        for name, f in self._engine_fits.items():
            out[f"{name}/prefill"], out[f"{name}/decode"] = f["prefill"], f["decode"]
        return out

    @staticmethod
    def _put(d: OrderedDict, key: str, value: object, bound: int) -> None:
        d[key] = value
        while len(d) > bound:
            d.popitem(last=False)

    def _fit_of(self, which: str, engine: str | None) -> OnlineFit:
        own = self._engine_fits.get(engine) if engine is not None else None
        if own is not None:
            return own["decode" if which == "decode" else "prefill"]
        return self._fits[which]

    def _observe(self, which: str, engine: str | None, x: np.ndarray, y: float) -> None:
        fit = self._fit_of(which, engine)
        before = fit.version
        fit.observe(x, y)
        if fit.version != before:
            self._publish()

    def on_prefill_dispatch(self, request_id: str, features: np.ndarray, now_s: float, pool: str = "prefill",
                            engine: str | None = None) -> None:
        if pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be 'prefill' or 'decode', got {pool!r}")
        self._put(self._pending_prefill, request_id,
                  (np.asarray(features, dtype=np.float64), now_s, "prefill" if pool == "prefill" else "mixed", engine),
                  self.max_pending)

    def on_prefill_done(self, request_id: str, now_s: float) -> None:
        got = self._pending_prefill.pop(request_id, None)
        if got is not None:
            x, t0, which, engine = got
            self._observe(which, engine, x, now_s - t0)

    def on_decode_dispatch(self, request_id: str, features: np.ndarray, engine: str | None = None) -> None:
        self._put(self._pending_decode, request_id, [np.asarray(features, dtype=np.float64), None, engine],
                  self.max_pending)

    def on_first_token(self, request_id: str, now_s: float) -> None:
        rec = self._pending_decode.get(request_id)
        if rec is not None and rec[1] is None:
            rec[1] = now_s

    def on_dispatch(self, request: Request, now_s: float, decode: Candidates, decode_pos: int,
                    prefill: Candidates | None, prefill_pos: int) -> None:
        """A routed request (:class:`balancer.parts.CostLearnerPart`): the chosen placements'
        features (:func:`placement_features`) for the fits. A request served decode-only by a PD
        router (``prefill`` None, ``decode`` not a mixed pool) observes no prefill model."""
        model = self.model
        out = float(request.output_tokens)
        d_name = decode.replicas[decode_pos].engine
        px, dx = placement_features(request.prompt_tokens, out, decode, decode_pos, model.engine(d_name, "decode"))
        self.on_decode_dispatch(request.request_id, dx, d_name)
        if prefill is not None:
            p_name = prefill.replicas[prefill_pos].engine
            px, _ = placement_features(request.prompt_tokens, out, prefill, prefill_pos, model.engine(p_name, "prefill"))
            self.on_prefill_dispatch(request.request_id, px, now_s, "prefill", p_name)
        elif decode.role is Role.MIXED:
            self.on_prefill_dispatch(request.request_id, px, now_s, "decode", d_name)

    def on_finished(self, request_id: str, now_s: float, num_output_tokens: int | None) -> None:
        """The request finished (:class:`balancer.parts.CostLearnerPart`): :meth:`on_decode_finished`."""
        self.on_decode_finished(request_id, now_s, num_output_tokens)

    def on_decode_finished(self, request_id: str, now_s: float, num_output_tokens: int | None) -> None:
        rec = self._pending_decode.pop(request_id, None)
        self._pending_prefill.pop(request_id, None)
        if rec is None or rec[1] is None or not num_output_tokens or num_output_tokens < 2:
            return
        x, first_token_s, engine = rec
        # the decode model is per step: a step of an engine that decodes tau tokens per step (speculative
        # decoding) lasts tau inter-token latencies (x 1.0 where none: the same bits)
        tau = self.model.engine(engine, "decode").decode_tokens_per_step if engine is not None else \
            self.model.decode.decode_tokens_per_step
        self._observe("decode", engine, x, (now_s - first_token_s) / (num_output_tokens - 1) * tau)

    def _publish(self) -> None:
        m = self.model
        f = self._fits
        dc = replace(m.decode, decode=DecodeStepCost.from_coef(f["decode"].coef),
                     prefill=PrefillStepCost.from_coef(f["mixed"].coef))
        engines = dict(m.engines)
        for name, ef in self._engine_fits.items():
            engines[name] = replace(engines[name], prefill=PrefillStepCost.from_coef(ef["prefill"].coef),
                                    decode=DecodeStepCost.from_coef(ef["decode"].coef))
        self.model = replace(m, prefill=replace(m.prefill, prefill=PrefillStepCost.from_coef(f["prefill"].coef)),
                             decode=dc, engines=engines)

    @property
    def num_observations(self) -> dict[str, int]:
        """Observations taken so far per fit (:attr:`fits` names; in the fit or held by its
        warm-up screen): ``prefill`` (prefill pool), ``mixed`` (aggregated prefill), ``decode``
        (inter-token latency), and per overridden engine."""
        return {k: v.num_observations + v.num_pending for k, v in self.fits.items()}

    def stats(self) -> dict[str, dict]:
        """Plain counters for metrics: ``observations`` (as :attr:`num_observations`),
        ``rejected`` ``{fit: {reason: n}}`` (:data:`REJECT_REASONS`), ``resets`` ``{fit: n}``,
        ``pending`` ``{"prefill": n, "decode": n}`` dispatched requests awaiting their hook."""
        fits = self.fits
        return {"observations": self.num_observations,
                "rejected": {k: dict(v.rejected) for k, v in fits.items()},
                "resets": {k: v.num_resets for k, v in fits.items()},
                "pending": {"prefill": len(self._pending_prefill), "decode": len(self._pending_decode)}}


# ---------------------------------------------------------------------- features of one placement
def placement_features(request_prompt_tokens: int, output_tokens: float, cands, i: int,
                       eng: EngineCost) -> tuple[np.ndarray, np.ndarray]:
    """``(prefill_x, decode_x)``, each ``(4,)``: the features of placing a request on candidate
    ``i`` of ``cands`` (:class:`balancer.candidates.Candidates`), for the online fit: prefill
    as :func:`prefill_wait_features` with the HBM match as the cached part; decode
    ``[1, max seqs, max kv, sum seqs]`` of the engine after the placement (one more sequence on
    ``i`` with ``prompt + output / 2`` KV tokens)."""
    names, idx, rows = engine_groups(cands.replicas)
    same = idx == idx[i]
    sel = np.flatnonzero(same)
    k = int(np.searchsorted(sel, i))
    sub_idx = np.zeros(len(sel), dtype=np.int64)
    q = cands.prefill_tokens[sel].astype(np.float64)
    a = (cands.prefill_attn_pairs[sel] if cands.prefill_attn_pairs is not None else np.zeros(len(sel)))
    matched = (cands.hbm_blocks[sel] * float(cands.block_size) if cands.hbm_blocks is not None
               else cands.matched_tokens[sel].astype(np.float64))
    cached = np.minimum(matched, request_prompt_tokens - 1.0)
    u = request_prompt_tokens - cached
    eng_here = eng if len(sel) > 1 else replace(eng, ep_synchronous=False)
    px = prefill_wait_features(q, np.asarray(a, dtype=np.float64), u, cached, eng_here, sub_idx,
                               np.arange(len(sel))[None, :])[0][k]
    b = cands.num_requests[sel].astype(np.float64)
    kv = cands.decode_kv_tokens[sel].astype(np.float64)
    b[k] += 1.0
    kv[k] += request_prompt_tokens + output_tokens / 2.0
    dx = decode_design(b[None, :], kv[None, :], eng.ep_synchronous and len(sel) > 1)[0]
    return px, dx
