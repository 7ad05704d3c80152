"""Core value types shared by the router library, the router service and the simulator.

Everything here is plain data: no I/O, no clocks. Times are seconds on whatever clock the
caller uses (``time.monotonic()`` in the service, ``env.now`` in the simulator).
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple


def is_finite_seconds(value: object) -> bool:
    """True for a finite real number of seconds (an int, a float, a numpy scalar); False for NaN,
    the infinities, bools, strings and anything else (the check behind every ``*_s`` argument
    of the router library)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(value)


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong type (a string or a float where a count belongs): a ``TypeError`` for
    the library's callers, and a ``ValueError`` so that pydantic reports it, raised in a
    validator, as its ``ValidationError`` naming the field (a plain ``TypeError`` escapes
    pydantic as a traceback)."""


def checked_count(name: str, value: object, minimum: int, where: str = "") -> int:
    """``value`` as an ``int`` (a Python or numpy integer) >= ``minimum``: the check behind the
    router library's token, block and rank counts. ``where`` prefixes the message
    (``"request r1: "``).

    Raises:
        WrongTypeError: (a ``TypeError`` and a ``ValueError``) not an integer (a bool, a float such
            as ``10.5`` or ``10.0``, a string, None); the message names the type: ``got str '64'``.
        ValueError: below ``minimum``.
    """
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise WrongTypeError(f"{where}{name} must be an integer >= {minimum}, "
                                 f"got {type(value).__name__} {value!r}"[:200])
        value = int(value)
    if value < minimum:
        raise ValueError(f"{where}{name} must be an integer >= {minimum}, got {value}")
    return value


def checked_ttl_s(name: str, value: object) -> float | None:
    """``value`` as a float > 0 (``math.inf`` allowed: never expire), or ``None``: the check
    behind the library's TTLs and timeouts.

    Raises:
        ValueError: NaN, 0, negative, or not a real number (a bool, a string).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:  # False for NaN
        raise ValueError(f"{name} must be a number of seconds > 0 or None, got {value!r}")
    return float(value)


class Role(str, enum.Enum):
    """What a replica does in a prefill/decode (PD) disaggregated deployment.

    ``MIXED`` replicas serve aggregated traffic: they prefill and decode the same request.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class _ReplicaIdFields(NamedTuple):
    engine: str
    dp_rank: int = 0


class ReplicaId(_ReplicaIdFields):
    """One attention data-parallel (DP) rank of one engine: the unit requests are placed on.

    ``engine`` names the serving process group (e.g. ``"decode-0"``, or a worker URL in the
    service); ``dp_rank`` is the DP rank inside it (0 for engines without DP attention). A tuple
    ``(engine, dp_rank)``: it compares, hashes and pickles as one.

    Raises:
        TypeError: ``engine`` is not a string, or ``dp_rank`` is not an integer (a bool is not;
            numpy integers are taken as Python ints).
        ValueError: ``dp_rank`` is negative (DP ranks count from 0).
    """

    __slots__ = ()

    def __new__(cls, engine: str, dp_rank: int = 0) -> ReplicaId:
        if not isinstance(engine, str):
            raise TypeError(f"ReplicaId engine must be a string, got {type(engine).__name__} {engine!r}")
        if type(dp_rank) is not int:
            if isinstance(dp_rank, bool) or not hasattr(dp_rank, "__index__"):
                raise TypeError(f"ReplicaId dp_rank must be an integer, got {type(dp_rank).__name__} {dp_rank!r}")
            dp_rank = operator.index(dp_rank)
        if dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank} for engine {engine!r}")
        return super().__new__(cls, engine, dp_rank)

    @classmethod
    def _make(cls, iterable):  # noqa: ANN001, ANN206 - as NamedTuple's, but checked (``_replace`` uses it)
        return cls(*iterable)

    def __str__(self) -> str:
        return f"{self.engine}/dp{self.dp_rank}"


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the balancer sees it.

    Attributes:
        request_id: unique id (string) within a run / router lifetime.
        arrival_time_s: arrival time in seconds on the caller's clock.
        prompt_tokens: prompt length in tokens (>= 1).
        block_hashes: chained hashes of the prompt's KV blocks, shape ``(ceil(prompt_tokens /
            block_size),)`` or shorter (only full blocks when hashing token ids). Equal hashes at
            the same position mean equal prefixes (see :mod:`balancer.hashing`).
        max_output_tokens: output token limit (>= 1); the simulator generates exactly
            ``expected_output_tokens`` if given, else this many.
        expected_output_tokens: the output length known in advance (traces) or predicted, if any.
        session_id: conversation / agent session id, if known (used by ``consistent_hash``).
        traffic_class: e.g. ``"chatbot"`` or ``"agent"``; used for KV TTLs and reporting.
        priority: the deadline-admission class (:mod:`balancer.deadline_admission`: ``"high"``,
            ``"normal"``, ``"low"`` by default), if the caller names one; None or an unknown name =
            the configured default class.

    Raises:
        ValueError: ``arrival_time_s`` is not a finite number (NaN, an infinity, a bool, a
            string), ``prompt_tokens``, ``max_output_tokens`` or ``expected_output_tokens`` is
            below 1.
        TypeError: a token count is not an integer (a bool, a float, a string; numpy integers
            are made ``int``), or ``block_hashes`` is not a sequence of integers (a string,
            floats). A list or array of hashes is checked and stored as a tuple of ``int``; a
            tuple whose first hash is an ``int`` is taken as it is (the per-request cost stays
            O(1) for the hashes the library and the simulator make).
    """

    request_id: str
    arrival_time_s: float
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    max_output_tokens: int = 1
    expected_output_tokens: int | None = None
    session_id: str | None = None
    traffic_class: str | None = None
    priority: str | None = None

    def __post_init__(self) -> None:
        t = self.arrival_time_s
        if not (type(t) is float and math.isfinite(t)) and not is_finite_seconds(t):
            raise ValueError(f"request {self.request_id}: arrival_time_s must be a finite number of seconds, got {t!r}")
        where = f"request {self.request_id}: "
        n, m, e = self.prompt_tokens, self.max_output_tokens, self.expected_output_tokens
        if type(n) is not int or n < 1:
            object.__setattr__(self, "prompt_tokens", checked_count("prompt_tokens", n, 1, where))
        if type(m) is not int or m < 1:
            object.__setattr__(self, "max_output_tokens", checked_count("max_output_tokens", m, 1, where))
        if e is not None and (type(e) is not int or e < 1):
            object.__setattr__(self, "expected_output_tokens", checked_count("expected_output_tokens", e, 1, where))
        hashes = self.block_hashes  # a tuple is checked by its first hash (per request, on the hot path)
        if type(hashes) is not tuple or (hashes and type(hashes[0]) is not int):
            object.__setattr__(self, "block_hashes", _checked_hashes(hashes, where))

    @property
    def output_tokens(self) -> int:
        """Output tokens the request will generate (expected if known, else the maximum)."""
        return self.expected_output_tokens if self.expected_output_tokens is not None else self.max_output_tokens


def _checked_hashes(hashes: object, where: str) -> tuple[int, ...]:
    """``hashes`` (any sequence or array of integers) as a tuple of ``int``; see :class:`Request`."""
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise TypeError(f"{where}block_hashes must be a sequence of integers, got {type(hashes).__name__} {hashes!r:.80}")
    out = []
    for i, h in enumerate(hashes):
        if type(h) is not int:
            if isinstance(h, bool) or not isinstance(h, numbers.Integral):
                raise TypeError(f"{where}block_hashes[{i}] must be an integer, got {type(h).__name__} {h!r:.80}")
            h = int(h)
        out.append(h)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """Read-only snapshot of one candidate replica, built by the :class:`~balancer.router.Router`
    for one routing decision. Policies read only this.

    Load fields are the router's own *projected* accounting, counted from dispatch
    (see :mod:`balancer.load`), optionally refined by engine load reports.

    Attributes:
        replica: which DP rank.
        role: the pool it belongs to.
        num_requests: requests routed here and not yet released (queued + running).
        prefill_tokens: uncached prompt tokens routed here whose prefill has not finished.
        decode_kv_tokens: KV tokens of sequences routed here for decode and not finished.
        kv_capacity_tokens: KV cache capacity of the rank in tokens (0 = unknown).
        matched_blocks: leading prompt blocks this replica is believed to hold (prefix hit).
        matched_tokens: ``min(matched_blocks * block_size, prompt_tokens)``.
        block_size: tokens per KV block of the index that produced ``matched_blocks``.
        host_blocks: blocks after the HBM match held in the replica's host-DRAM tier (0 when no
            host tier is configured); ``matched_blocks`` is then the tier-weighted effective match.
        store_blocks: blocks after the HBM and host matches held in the shared KV store.
    """

    replica: ReplicaId
    role: Role
    num_requests: int = 0
    prefill_tokens: int = 0
    decode_kv_tokens: int = 0
    kv_capacity_tokens: int = 0
    matched_blocks: int = 0
    matched_tokens: int = 0
    block_size: int = 1
    host_blocks: int = 0
    store_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV capacity in use by decode sequences, in [0, 1]; 0 when capacity unknown."""
        if self.kv_capacity_tokens <= 0:
            return 0.0
        return min(1.0, self.decode_kv_tokens / self.kv_capacity_tokens)


# Read-only by contract. Not frozen: one is built per routing decision, and a frozen __init__ is ~3x slower.
@dataclass(frozen=True, slots=True)
class TtftSlo:
    """A TTFT budget the router may route against (SLO-aware policies: ``ep_aware``).

    The budget of a request with ``P`` prompt tokens is ``ttft_s + per_1k_prompt_tokens_s * P /
    1000`` seconds (the form of :class:`sim.search.point.SLO`; DistServe's per-request TTFT SLO with a
    length-proportional part, as long prompts cannot meet a flat budget).

    Raises:
        ValueError: ``ttft_s`` not finite and > 0, or ``per_1k_prompt_tokens_s`` negative.
    """

    ttft_s: float
    per_1k_prompt_tokens_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.ttft_s, (int, float)) and not isinstance(self.ttft_s, bool)
                and math.isfinite(self.ttft_s) and self.ttft_s > 0):
            raise ValueError(f"TtftSlo ttft_s must be a finite number > 0, got {self.ttft_s!r}")
        v = self.per_1k_prompt_tokens_s
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise ValueError(f"TtftSlo per_1k_prompt_tokens_s must be a finite number >= 0, got {v!r}")

    def budget_s(self, prompt_tokens):  # noqa: ANN001, ANN201 - int -> float, or an array -> array
        """The TTFT budget in seconds of a request of ``prompt_tokens`` (an int, or a numpy array
        of them: then an array of the same shape)."""
        return self.ttft_s + self.per_1k_prompt_tokens_s * prompt_tokens / 1000.0


@dataclass(slots=True)
class Choice:
    """A policy's answer: the chosen replica and the scores it computed (for logs/explanation).

    ``scores`` maps each candidate replica to the policy's score for it (lower-is-better costs or
    higher-is-better scores; the policy's docstring says which; empty for policies that compute
    none, e.g. ``random``; policies return a lazily built mapping). ``reason`` is a short tag
    such as ``"cache_hit"``, ``"imbalanced"`` or ``"least_load"``.
    """

    replica: ReplicaId
    scores: Mapping[ReplicaId, float] = field(default_factory=dict)
    reason: str = ""


# Read-only by contract. Not frozen: one is built per routing decision, and a frozen __init__ is ~3x slower.
@dataclass(slots=True)
class Route:
    """Where one request goes.

    Attributes:
        request_id: the routed request.
        prefill: the prefill DP rank, or ``None`` for aggregated serving or when the request runs
            on the decode replica alone (conditional disaggregation).
        decode: the decode (or mixed) DP rank that produces the output.
        prefill_matched_tokens: prefix tokens the prefill replica is believed to hold.
        decode_matched_tokens: prefix tokens the decode replica is believed to hold.
        prefill_choice / decode_choice: the policies' full answers (scores, reason).
        touch_id: the router's number for this route, carried by the prefix-index entries it
            recorded (:meth:`~balancer.router.Router.on_rejected` forgets only those); ``None``
            for a route the router did not build.
    """

    request_id: str
    prefill: ReplicaId | None
    decode: ReplicaId
    prefill_matched_tokens: int = 0
    decode_matched_tokens: int = 0
    prefill_choice: Choice | None = None
    decode_choice: Choice | None = None
    touch_id: int | None = None

    def explain(self) -> dict[str, Any]:
        """A JSON-friendly description of the decision."""
        out: dict[str, Any] = {"request_id": self.request_id, "decode": str(self.decode)}
        if self.decode_choice is not None:
            out["decode_reason"] = self.decode_choice.reason
            out["decode_scores"] = {str(r): v for r, v in self.decode_choice.scores.items()}
        out["decode_matched_tokens"] = self.decode_matched_tokens
        if self.prefill is not None:
            out["prefill"] = str(self.prefill)
            out["prefill_matched_tokens"] = self.prefill_matched_tokens
            if self.prefill_choice is not None:
                out["prefill_reason"] = self.prefill_choice.reason
                out["prefill_scores"] = {str(r): v for r, v in self.prefill_choice.scores.items()}
        return out
