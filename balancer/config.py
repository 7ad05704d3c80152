"""The router's configuration: one frozen :class:`RouterConfig`, one :class:`PolicySpec`, and the
defaults, stated once here for the library, ``pdlb serve`` and ``pdlb sim``.

Every router is built from a :class:`RouterConfig` (:meth:`balancer.router.Router.from_config`):
the service's config file holds one as its ``router:`` section
(:class:`balancer.service.config.ServiceConfig`), a simulator scenario holds one as its ``router:``
section (:class:`sim.scenario.Scenario`: the settings it names replace the simulator's, which take
the block size and index bound from the scenario, :mod:`sim.run.router_config`), and an embedding
gateway writes one in code::

    from balancer import Router, RouterConfig

    router = Router.from_config(RouterConfig(prefill_policy="cache_aware", decode_policy="least_load:metric=kv_tokens"))

Defaults (one set; the service and the simulator use them unless told otherwise):

=============================== ============== ==============================================
setting                         default        why
=============================== ============== ==============================================
``prefill_policy``              ``ep_aware``   the policy pdlb is built around (cost model of
``decode_policy``               ``ep_aware``   wide-EP engines, SLO-aware); both pools
``block_size``                  64 tokens      the live router hashes prompts itself: smaller
                                               blocks catch shorter shared prefixes (system
                                               prompts); a simulated trace brings its own
                                               (Mooncake: 512), set by the scenario
``index_capacity_blocks``       262,144        per replica (134M tokens at 512-token blocks,
                                               16M at 64: more than any GPU's HBM holds)
``index_total_capacity_blocks`` 4,194,304      over all replicas (about 1 GiB of index), so
                                               no fleet grows the index without bound
``index_mode``                  approximate    no engine support needed (SGLang's, llm-d's)
``learn_cost_model``            auto (None)    refit the cost model online from the hooks'
                                               timings when a policy reads it (``ep_aware``)
``tier_weights``                host 0.75,     Dynamo's host-hit weight; a store fetch crosses
                                store 0.5      the network
=============================== ============== ==============================================

The simulator sets some of them from the scenario rather than taking them: ``block_size`` (the
trace's) and ``learn_cost_model`` (off: it hands the router the scenario's exact cost model, so a
fit could only add noise); ``index_capacity_blocks: auto`` (a scenario's default) bounds the
index by one rank's KV cache, with no total bound; a scenario's ``[router]`` table may set the
online fit and the total bound back, and any other setting but the block size, the per-replica
index bound and ``pd_min_uncached_tokens`` (top-level scenario keys), the policies, index mode,
seed and SLO (the run's; :data:`sim.scenario.ROUTER_SECTION_ELSEWHERE`, :mod:`sim.run.router_config`).

A policy with parameters is a :class:`PolicySpec`; its text form (``name`` or
``name:param=value,...``) and the errors are those of :mod:`balancer.policies.spec`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from balancer.cost_model import CostModel
from balancer.policies.base import Policy, policy_class
from balancer.policies.spec import check_policy_params, format_policy_spec, parse_policy_spec
from balancer.types import TtftSlo, WrongTypeError, checked_count, checked_ttl_s

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_INDEX_CAPACITY_BLOCKS", "DEFAULT_INDEX_TOTAL_CAPACITY_BLOCKS", "DEFAULT_POLICY",
    "DEFAULT_SPECULATIVE_TTL_S", "DEFAULT_TIER_WEIGHTS", "INDEX_MODES", "PolicySpec", "RouterConfig",
]

#: The default policy of both pools.
DEFAULT_POLICY = "ep_aware"
#: Default tokens per KV block of the requests' block hashes.
DEFAULT_BLOCK_SIZE = 64
#: Default prefix-index bound per replica (LRU), in blocks.
DEFAULT_INDEX_CAPACITY_BLOCKS = 262_144
#: Default prefix-index bound over all replicas together, in blocks.
DEFAULT_INDEX_TOTAL_CAPACITY_BLOCKS = 4_194_304
#: Default lifetime of the hybrid mode's own routed-prompt entries: long enough for an engine to
#: prefill and announce a prompt under load, short enough not to outlive its real cache entry.
DEFAULT_SPECULATIVE_TTL_S = 5.0
#: Default weights of lower-tier hits relative to an HBM hit (1.0): Dynamo's KV router weighs host
#: (CPU) hits at 0.75 of device hits; a shared-store hit pays a network fetch, so 0.5.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"host": 0.75, "store": 0.5}
#: The prefix index's modes (see :mod:`balancer.router`).
INDEX_MODES = ("approximate", "events", "hybrid")


class PolicySpec(BaseModel):
    """A registered policy with its parameters: the one form of "a policy with parameters".

    Built from its text form (``PolicySpec.parse("cache_aware:cache_threshold=0.5")``), from a
    table (``{"name": ..., "params": {...}}``, as in config files), or by fields. Validated at
    construction: an unknown policy or parameter, a value of the wrong type or the policy's own
    check raise :class:`ValueError` (pydantic's ``ValidationError`` inside a model) with the
    message of :mod:`balancer.policies.spec`. Frozen and hashable (parameters are kept as sorted
    ``(name, value)`` pairs).

    Attributes:
        name: a registered policy name (:func:`balancer.policies.available_policies`).
        params: ``((parameter, value), ...)`` sorted by parameter name; given as a mapping or pairs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        if isinstance(data, str):
            name, params = parse_policy_spec(data)
            return {"name": name, "params": params}
        if isinstance(data, Policy):
            return {"name": data.name, "params": data.params()}
        return data

    @field_validator("params", mode="before")
    @classmethod
    def _sorted_pairs(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            v = v.items()
        return tuple(sorted((tuple(p) for p in v), key=lambda p: str(p[0]))) if v is not None else ()

    @model_validator(mode="after")
    def _check(self) -> PolicySpec:
        check_policy_params(self.name, dict(self.params))  # unknown name / params (accepted listed), own checks
        return self

    @classmethod
    def parse(cls, text: str | PolicySpec) -> PolicySpec:
        """``"cache_aware:cache_threshold=0.5"`` -> a spec (a spec passes through).

        Raises:
            ValueError: see :func:`balancer.policies.spec.parse_policy_spec` (one line, the
                message of that module, not pydantic's).
        """
        if isinstance(text, PolicySpec):
            return text
        name, params = parse_policy_spec(text)
        return cls(name=name, params=tuple(params.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The parameters as keyword arguments of the policy class."""
        return dict(self.params)

    @property
    def label(self) -> str:
        """``cache_aware`` or ``cache_aware(cache_threshold=0.5)`` (result tables, file names)."""
        return format_policy_spec(self.name, self.kwargs)

    @property
    def text(self) -> str:
        """The text form, ``name`` or ``name:k=v,...``, that :meth:`parse` reads back."""
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params) if self.params else "")

    def build(self) -> Policy:
        """A new policy object of this spec."""
        return policy_class(self.name)(**self.kwargs)


_TTFT_SLO_KEYS = frozenset({"ttft_s", "per_1k_prompt_tokens_s"})
_TTFT_SLO_FORM = ("give a table {ttft_s = SECONDS, per_1k_prompt_tokens_s = SECONDS} "
                  "(YAML: {ttft_s: 2, per_1k_prompt_tokens_s: 0.1}), a balancer.TtftSlo, or none")


def _shown(v: object) -> str:
    """``str '64'``, ``bool True``: a value with its type, cut to 80 characters, for messages."""
    return f"{type(v).__name__} {v!r}"[:80]


def _count(name: str, v: object, minimum: int) -> int:
    """:func:`balancer.types.checked_count`, whose ``WrongTypeError`` is a ``ValueError`` that
    pydantic reports as its ``ValidationError`` naming the field."""
    return checked_count(name, v, minimum)


class RouterConfig(BaseModel):
    """Everything a :class:`~balancer.router.Router` is built from (frozen, validated at
    construction; unknown keys are errors). Defaults: see the module docstring.

    Attributes:
        prefill_policy / decode_policy: :class:`PolicySpec` (or its text form, or a table). The
            decode policy also routes aggregated (mixed) pools.
        block_size: tokens per KV block of the requests' ``block_hashes`` (>= 1).
        index_mode: ``"approximate"``, ``"events"`` or ``"hybrid"`` (see :mod:`balancer.router`).
        index_capacity_blocks: prefix-index bound per replica (LRU), ``None`` = unbounded.
        index_total_capacity_blocks: bound over all replicas together (each replica gets an even
            share when it is lower than ``index_capacity_blocks``), ``None`` = none.
        index_ttl_s: prefix-index TTL in seconds, ``None`` = none (Dynamo's approximate mode: 120).
        speculative_ttl_s: hybrid mode: seconds a routed prompt counts as cached on its replicas.
        pd_min_uncached_tokens: below this many uncached prompt tokens on the chosen decode
            replica, skip the prefill pool (0 = always disaggregate).
        seed: seed of the router's ``random.Random`` (the only randomness policies may use).
        host_tier / host_index_capacity_blocks: keep a view of each replica's host-DRAM KV tier,
            bounded per replica (``None`` = unbounded).
        shared_store / store_index_capacity_blocks / store_ttl_s: keep a view of a cluster-wide
            shared KV store, bounded (``None`` = unbounded), entries living ``store_ttl_s``.
        tier_weights: ``{"host": w, "store": w}``, each in [0, 1]; missing keys take
            :data:`DEFAULT_TIER_WEIGHTS`; ``None``: the defaults.
        cost_model: step-time model handed to cost-based policies (``ep_aware``): a
            :class:`~balancer.cost_model.CostModel` or its dict form; ``None``: the policy's default.
        learn_cost_model: refit the cost model online from the hooks' timings
            (:class:`~balancer.cost_model.CostLearner`): ``True`` always, ``False`` never,
            ``None`` (default) when a policy reads it (:attr:`Policy.uses_cost_model`: for other
            policies the fit is work whose result no decision reads).
        ttft_slo: the TTFT budget to route against (:class:`~balancer.types.TtftSlo`, or
            ``{ttft_s, per_1k_prompt_tokens_s}``); ``None``: SLO-blind routing.
        inflight_timeout_s: release requests still in flight this long after dispatch (a lost
            ``on_finished``); ``None``: never.
        load_report_max_age_s: engine load reports older than this stop counting; ``None``: a
            report counts until the next one.

    Raises:
        ValueError (pydantic's ``ValidationError``): a bad value, naming the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    prefill_policy: PolicySpec = PolicySpec(name=DEFAULT_POLICY)
    decode_policy: PolicySpec = PolicySpec(name=DEFAULT_POLICY)
    block_size: int = DEFAULT_BLOCK_SIZE
    index_mode: str = "approximate"
    index_capacity_blocks: int | None = DEFAULT_INDEX_CAPACITY_BLOCKS
    index_total_capacity_blocks: int | None = DEFAULT_INDEX_TOTAL_CAPACITY_BLOCKS
    index_ttl_s: float | None = None
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    pd_min_uncached_tokens: int = 0
    seed: int = 0
    host_tier: bool = False
    host_index_capacity_blocks: int | None = DEFAULT_INDEX_CAPACITY_BLOCKS
    shared_store: bool = False
    store_index_capacity_blocks: int | None = None
    store_ttl_s: float | None = None
    tier_weights: dict[str, float] | None = None
    cost_model: CostModel | None = None
    learn_cost_model: bool | None = None
    ttft_slo: TtftSlo | None = None
    inflight_timeout_s: float | None = None
    load_report_max_age_s: float | None = None

    # The checks (and their messages) are the router library's own (balancer.types), run before
    # pydantic's coercion so that 16.5 or True is refused, not rounded. A wrong type is a
    # WrongTypeError (TypeError and ValueError): pydantic reports only a ValueError raised in a
    # validator as a ValidationError; a plain TypeError escaped it as a traceback.
    @field_validator("block_size", mode="before")
    @classmethod
    def _block_size(cls, v: Any) -> int:
        return _count("block_size", v, 1)  # a float (16.5) or a string was taken

    @field_validator("pd_min_uncached_tokens", mode="before")
    @classmethod
    def _pd_min(cls, v: Any) -> int:
        return _count("pd_min_uncached_tokens", v, 0)

    @field_validator("index_capacity_blocks", "index_total_capacity_blocks", "host_index_capacity_blocks",
                     "store_index_capacity_blocks", mode="before")
    @classmethod
    def _capacity(cls, v: Any, info: ValidationInfo) -> int | None:
        return None if v is None else _count(str(info.field_name), v, 1)

    @field_validator("index_mode", mode="before")
    @classmethod
    def _index_mode(cls, v: Any) -> str:
        if v not in INDEX_MODES:
            raise ValueError(f"unknown index_mode {v!r}; valid: {', '.join(INDEX_MODES)}")
        return v

    @field_validator("index_ttl_s", "store_ttl_s", mode="before")
    @classmethod
    def _ttl(cls, v: Any, info: ValidationInfo) -> float | None:
        return checked_ttl_s(str(info.field_name), v)

    @field_validator("speculative_ttl_s", "inflight_timeout_s", "load_report_max_age_s", mode="before")
    @classmethod
    def _positive(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.field_name != "speculative_ttl_s":
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not float(v) > 0:  # False for NaN
            raise ValueError(f"{info.field_name} must be a number of seconds > 0, got {_shown(v)}")
        return float(v)

    @field_validator("tier_weights", mode="before")
    @classmethod
    def _check_weights(cls, v: Any) -> dict[str, float] | None:
        if v is None:
            return None
        if not isinstance(v, Mapping):
            raise ValueError("tier_weights must be a table of tier weights such as {host = 0.75, store = 0.5}, "
                             f"got {_shown(v)}")
        out = {}
        for k, w in v.items():
            if k not in DEFAULT_TIER_WEIGHTS:
                raise ValueError(f"unknown tier {k!r} in tier_weights; valid: {', '.join(DEFAULT_TIER_WEIGHTS)}")
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0.0 <= float(w) <= 1.0:  # NaN too
                raise ValueError(f"tier_weights[{k!r}] must be a number in [0, 1], got {_shown(w)}")
            out[k] = float(w)
        return out

    @field_validator("cost_model", mode="before")
    @classmethod
    def _cost_model(cls, v: Any) -> Any:
        return CostModel.from_dict(v) if isinstance(v, Mapping) else v

    @field_validator("ttft_slo", mode="before")
    @classmethod
    def _ttft_slo(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            unknown = sorted(map(str, set(v) - _TTFT_SLO_KEYS))
            if unknown or "ttft_s" not in v:
                what = f"unknown key(s) {', '.join(unknown)}" if unknown else "ttft_s missing"
                raise ValueError(f"ttft_slo: {what}; {_TTFT_SLO_FORM}")
            return TtftSlo(**v)
        if v is not None and not isinstance(v, TtftSlo):
            raise WrongTypeError(f"ttft_slo must be {_TTFT_SLO_FORM.removeprefix('give ')}; got {_shown(v)}")
        return v

    @property
    def weights(self) -> dict[str, float]:
        """:attr:`tier_weights` with the defaults filled in."""
        return {**DEFAULT_TIER_WEIGHTS, **(self.tier_weights or {})}

    def with_(self, **changes: Any) -> RouterConfig:
        """A copy with ``changes`` applied and validated (``model_copy`` does not validate).

        Raises:
            ValueError: a bad or unknown setting.
        """
        return RouterConfig.model_validate({**{k: getattr(self, k) for k in type(self).model_fields}, **changes})
