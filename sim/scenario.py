"""Scenarios: the cluster a simulation runs (model, hardware, pools, links), as validated config.

A scenario is a pydantic model, loadable from a TOML or YAML file or one of the named
:data:`PRESETS`. Runs are reproducible from ``(scenario, workload, policies, seed)``.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator, model_serializer

from balancer.config import RouterConfig
from balancer.validation import format_validation_error, syntax_error_line
from sim.models.hardware import get_hardware
from sim.models.presets import MODELS, get_model
from sim.perf.config import PerfConfig
from sim.perf.spec import SpecDecodeConfig


#: Scenario models are strict: counts must be integers (not booleans or strings), numbers finite
#: (no infinite bandwidth), unknown fields refused.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
#: Bounds on sizes, so that no scenario can ask for more objects or loop iterations than a
#: simulation on one machine can hold (all far above real clusters).
MAX_RANKS = 65_536
"""Most DP ranks over all pools of a scenario."""
MAX_TOKENS = 1 << 24
"""Largest token count of a setting (prefill budget, KV capacity per rank is separate), 16.8M."""
MAX_KV_CAPACITY_TOKENS = 1 << 40
MAX_BYTES = 1e18
MAX_BANDWIDTH_BYTES_PER_S = 1e16
#: Slowest link accepted (1 kB/s, far below any datacenter link; hand-timed test scenarios use
#: 100 kB/s): 1e-300 B/s made every transfer take ``inf`` seconds and the run report TTFT ``inf``
#: with exit status 0.
MIN_BANDWIDTH_BYTES_PER_S = 1e3
#: Shortest load-sampling period (1 ms): a smaller one asks for billions of samples.
MIN_SAMPLE_INTERVAL_S = 1e-3
#: Default ``max_model_len`` per model (tokens of prompt + output an engine accepts): the models'
#: ``max_position_embeddings`` (DeepSeek-V3 config.json: 163,840; Llama 3.1: 131,072).
DEFAULT_MAX_MODEL_LEN = {"deepseek-v3": 163_840, "deepseek-v4.1-flash": 163_840,
                         "llama-3.1-8b": 131_072, "llama-3.1-70b": 131_072}
FALLBACK_MAX_MODEL_LEN = 131_072


# ---------------------------------------------------------------------- KV tiers (host DRAM, shared store)
#: Seconds per day, for TTLs given in days.
DAY_S = 86_400.0


class HostTierConfig(BaseModel):
    """A host-DRAM KV tier under each engine's HBM prefix cache (SGLang HiCache, vLLM CPU offload).

    Values are per engine and split evenly over its DP ranks: with DP attention every DP rank is its
    own scheduler with its own host pool, and (one GPU per rank) its own PCIe link. Blocks reach the
    tier when HBM evicts them (write-back demotion over the link); a prefill fetches them back.

    Attributes:
        capacity_bytes / capacity_blocks: host KV capacity per engine (give exactly one).
        bandwidth_bytes_per_s: host <-> GPU bandwidth per engine, per direction (default 8 x 50 GB/s:
            PCIe Gen5 x16 is 64 GB/s per direction per GPU, ~50 GB/s achieved).
    """

    model_config = _STRICT

    capacity_bytes: float | None = Field(None, gt=0, le=MAX_BYTES)
    capacity_blocks: int | None = Field(None, ge=1, le=MAX_KV_CAPACITY_TOKENS)
    bandwidth_bytes_per_s: float = Field(400e9, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)

    @model_validator(mode="after")
    def _one_capacity(self) -> HostTierConfig:
        if (self.capacity_bytes is None) == (self.capacity_blocks is None):
            raise ValueError("host_tier: give exactly one of capacity_bytes or capacity_blocks")
        return self


class SharedStoreConfig(BaseModel):
    """A cluster-wide shared KV store (DeepSeek's 3FS KV cache, Mooncake store, LMCache remote).

    Prefill (and mixed) ranks read blocks from it and write newly computed blocks back
    asynchronously; a block becomes visible to other ranks once its write completes. Concurrent
    transfers share bandwidth max-min fairly under a per-engine cap and an aggregate cap (read and
    write are separate directions); see :mod:`sim.run.engine.tiers`.

    Attributes:
        capacity_bytes / capacity_blocks: store capacity (at most one; neither = unbounded).
        read_bandwidth_bytes_per_s / write_bandwidth_bytes_per_s: aggregate over the cluster
            (default 6.6e12 read: 3FS's 180-node read test reached 6.6 TiB/s; write 1e12).
        engine_read_bandwidth_bytes_per_s / engine_write_bandwidth_bytes_per_s: per engine (default
            40e9 read, 20e9 write: DeepSeek reports up to 40 GiB/s of KV reads per 3FS client node).
        ttl_s: TTL from last access for classes not in ``class_ttl_s`` (``None`` = never expire).
        class_ttl_s: TTL per traffic class, e.g. ``{agent = 259200, chatbot = 604800}`` (DeepSeek:
            about 3 days for agent traffic, 7 days for chatbot).
    """

    model_config = _STRICT

    capacity_bytes: float | None = Field(None, gt=0, le=MAX_BYTES)
    capacity_blocks: int | None = Field(None, ge=1, le=MAX_KV_CAPACITY_TOKENS)
    read_bandwidth_bytes_per_s: float = Field(6.6e12, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)
    write_bandwidth_bytes_per_s: float = Field(1e12, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)
    engine_read_bandwidth_bytes_per_s: float = Field(40e9, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)
    engine_write_bandwidth_bytes_per_s: float = Field(20e9, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)
    ttl_s: float | None = Field(None, gt=0)
    class_ttl_s: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> SharedStoreConfig:
        if self.capacity_bytes is not None and self.capacity_blocks is not None:
            raise ValueError("shared_store: give at most one of capacity_bytes or capacity_blocks")
        bad = {c: t for c, t in self.class_ttl_s.items() if not t > 0}
        if bad:
            raise ValueError(f"shared_store.class_ttl_s: TTLs must be > 0 seconds, got {bad}")
        return self


def tier_capacity_blocks(capacity_bytes: float | None, capacity_blocks: int | None,
                         block_bytes: int) -> int | None:
    """Capacity in blocks from a config's bytes-or-blocks pair (``None`` = unbounded)."""
    if capacity_blocks is not None:
        return capacity_blocks
    if capacity_bytes is not None:
        return int(capacity_bytes // block_bytes)
    return None


#: PoolConfig's vLLM scheduler options and their "off" values (left out of dumps when off)
_VLLM_OPTION_DEFAULTS = (("max_num_seqs", None), ("max_chunk_tokens", None), ("prefill_schedule_interval", 1),
                         ("prefix_cache_retention_interval_tokens", None))


class PoolConfig(BaseModel):
    """One pool of identical engines.

    Attributes:
        num_engines: engines in the pool.
        dp_ranks: attention DP ranks per engine (the unit the balancer places requests on).
        gpus_per_rank: GPUs per DP rank (attention tensor parallelism; 1 for DP attention).
        ep: whether all DP ranks of an engine step together (wide EP). Default: the model is MoE
            and ``dp_ranks > 1``.
        max_prefill_tokens: chunked-prefill token budget per rank per step (mixed/decode ranks
            share it with decode tokens).
        max_decode_batch: most running decode sequences per rank.
        kv_capacity_tokens: override the perf model's KV capacity per rank, in tokens (default:
            GPU memory minus weights and activation reserve, ``PerfModel.kv_capacity_tokens_per_rank``).
        host_tier: this pool's host-DRAM tier (overrides the scenario's; prefill/mixed pools only).
        context_parallel: the ``gpus_per_rank`` GPUs of a rank split each prompt by sequence
            (context-parallel prefill, ring attention) instead of sharding weights (TP): compute and
            KV are divided over them, every GPU holds and streams the full dense weights, and each
            step exchanges the chunk's KV between them (:mod:`sim.perf.roofline`).
        max_num_seqs: vLLM ``max_num_seqs``: most sequences per rank running or admitted to
            prefill (``None``: only ``max_decode_batch`` bounds the decode batch).
        max_chunk_tokens: vLLM ``long_prefill_token_threshold``: most prompt tokens one request
            computes per step (``None``: only the step budget bounds a chunk).
        prefill_schedule_interval: vLLM ``--prefill-schedule-interval`` (DP prefill balancing,
            :class:`sim.run.engine.step_group.StepGroup`): 1 = prefill on every step.
        prefix_cache_retention_interval_tokens: vLLM ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` on a
            model with cached sliding-window KV groups (DeepSeek-V4): a prefix hit ends only at a
            retained window checkpoint (:mod:`sim.run.engine.hit_checkpoints`; under EAGLE/MTP
            speculative decoding one window block past it must be shared too). ``"dense"``: vLLM's
            default (every block boundary); ``0``: only each request's replay boundary and
            shared-prefix junctions; ``N > 0``: also every multiple of ``N`` tokens (a multiple of
            ``block_size``). ``None`` (default): not modelled, a hit is the whole cached prefix.
    """

    model_config = _STRICT

    num_engines: int = Field(1, ge=1, le=MAX_RANKS)
    dp_ranks: int = Field(1, ge=1, le=4096)
    gpus_per_rank: int = Field(1, ge=1, le=64)
    ep: bool | None = None
    max_prefill_tokens: int = Field(8192, ge=1, le=MAX_TOKENS)
    max_decode_batch: int = Field(256, ge=1, le=1 << 20)
    kv_capacity_tokens: int | None = Field(None, ge=1, le=MAX_KV_CAPACITY_TOKENS)
    host_tier: HostTierConfig | None = None
    context_parallel: bool = False
    max_num_seqs: int | None = Field(None, ge=1, le=1 << 20)
    max_chunk_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    prefill_schedule_interval: int = Field(1, ge=1, le=1 << 16)
    prefix_cache_retention_interval_tokens: int | Literal["dense"] | None = Field(None, union_mode="left_to_right")

    @model_serializer(mode="wrap")
    def _without_default_vllm_options(self, handler):  # noqa: ANN001, ANN202
        """The vLLM scheduler options are left out of a dump while at their defaults (off), so
        scenario dumps, and the sweep point ids hashed from them, stay what they were before the
        options existed (the results are the same)."""
        d = handler(self)
        if isinstance(d, dict):
            for key, default in _VLLM_OPTION_DEFAULTS:
                if key in d and d[key] == default:
                    del d[key]
        return d

    @property
    def num_ranks(self) -> int:
        return self.num_engines * self.dp_ranks

    @property
    def num_gpus(self) -> int:
        return self.num_ranks * self.gpus_per_rank


#: :class:`~balancer.config.RouterConfig` settings a scenario's ``router:`` section may not set,
#: and where they are set instead.
ROUTER_SECTION_ELSEWHERE = {
    "block_size": "the scenario's top-level block_size (its trace's block size)",
    "pd_min_uncached_tokens": "the scenario's top-level pd_min_uncached_tokens",
    "index_capacity_blocks": "the scenario's top-level index_capacity_blocks (which also takes 'auto')",
    "prefill_policy": "the run's policies (sim run --policy, compare --policies, a sweep's policies)",
    "decode_policy": "the run's policies (sim run --decode-policy, compare --policies, a sweep's policies)",
    "index_mode": "the run's --index-mode",
    "seed": "the run's --seed",
    "ttft_slo": "the run's SLO (--route-slo)",
}


class Scenario(BaseModel):
    """A simulated cluster.

    Either ``prefill`` and ``decode`` pools (PD disaggregation) or a ``mixed`` pool (aggregated).

    Attributes:
        name: label for reports.
        model / hardware: preset names (:mod:`sim.models.presets`, :mod:`sim.models.hardware`).
        block_size: tokens per KV block (Mooncake traces: 512).
        kv_transfer_bandwidth_bytes_per_s: prefill -> decode link bandwidth per transfer.
        kv_transfer_latency_s: fixed cost per transfer.
        pd_min_uncached_tokens: conditional disaggregation threshold handed to the router.
        index_capacity_blocks: the router's prefix-index bound per replica; ``"auto"`` = the KV
            capacity of a prefill (PD) or mixed rank in blocks (with ``index_mode="events"``: of
            the largest rank, so the view never drops blocks an engine still holds); ``None`` =
            unbounded.
        fast_forward: while a step group's work does not change (no arrival, admission, finish
            or fetch completion), advance many decode steps and chunked-prefill steps per event
            with vectorised step times (``False`` = exact step-by-step reference mode; both give
            the same times, tested).
        sample_interval_s: per-rank load sampling period for plots; ``None`` = duration / 400.
        host_tier: host-DRAM KV tier of every prefill/mixed engine (``None`` = none; a pool's own
            ``host_tier`` overrides it).
        shared_store: cluster-wide shared KV store (``None`` = none).
        kv_fetch_rule: when a prefill loads blocks found in a lower tier: ``"faster"`` fetches a
            tier's blocks iff their estimated fetch time is below the prefill compute time they
            save (perf model); ``"always"`` always fetches (Mooncake / LMCache behaviour).
        perf: roofline settings (efficiencies, TBO, FP8 weights, GPUs per node;
            :class:`sim.perf.config.PerfConfig`); ``None`` = the roofline's defaults.
        long_prefill: a separate prefill pool for long prompts (PD only): requests of at least
            ``long_prompt_threshold_tokens`` prompt tokens are routed among its ranks, all others
            among the ``prefill`` pool's (the same router and policy, restricted per request), so
            one long prompt never stalls the EP group that serves short ones. Combine with
            ``context_parallel`` to split each long prompt over several GPUs.
        long_prompt_threshold_tokens: the length threshold of ``long_prefill`` (prompt tokens).
        speculative: speculative decoding / MTP of the decode (and mixed) pools: draft length,
            per-position acceptance, draft cost, fixed or dynamic verification
            (:class:`sim.perf.spec.SpecDecodeConfig`); ``None`` = off.
        max_model_len: most prompt + output tokens an engine accepts; longer requests are
            rejected at arrival (counted in the summary's ``num_rejected``), as real engines
            refuse them. ``None`` = the model's context (:attr:`effective_max_model_len`).
        kv_accounting: how a mixed (aggregated) rank counts the KV of running sequences against
            its prefix cache. ``"reserve"``: a sequence reserves blocks for its whole prompt +
            output at admission, apart from the cache, which also gets its prompt blocks (as most
            recently used) when its prefill ends, so a running prompt's blocks count twice.
            ``"shared"`` (vLLM's and SGLang's paged KV): its prompt blocks are the cache's,
            counted once and pinned (not evictable) while it runs, and it reserves only the blocks
            beyond them (output); when it finishes they become evictable as the most recently
            used. Both reserve the output at admission (no preemption). Prefill and decode ranks
            (PD) are the same under both.
        router: the router's settings (:class:`~balancer.config.RouterConfig`, the ``[router]``
            table), each given one replacing what the simulator sets
            (:mod:`sim.run.router_config`: the library's defaults, except the scenario's block size,
            its exact cost model and no online fit, no total index bound). Only the settings
            given count and are written back (a scenario without the table dumps as before, so
            sweep point ids do not move); those a scenario or run sets elsewhere
            (:data:`ROUTER_SECTION_ELSEWHERE`: block size, policies, index mode, ...) are refused.

    All counts must be integers and all numbers finite; sizes are bounded (:data:`MAX_RANKS`
    DP ranks in all, ...), so that no scenario can hang or exhaust memory.
    """

    model_config = _STRICT

    name: str = "custom"
    description: str = ""
    model: str = "deepseek-v3"
    hardware: str = "h800"
    block_size: int = Field(512, ge=1, le=1 << 16)
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    mixed: PoolConfig | None = None
    kv_transfer_bandwidth_bytes_per_s: float = Field(50e9, ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S)
    kv_transfer_latency_s: float = Field(0.001, ge=0, le=3600)
    pd_min_uncached_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    index_capacity_blocks: int | Literal["auto"] | None = Field("auto", union_mode="left_to_right")
    fast_forward: bool = True
    sample_interval_s: float | None = Field(None, ge=MIN_SAMPLE_INTERVAL_S, le=1e6)
    host_tier: HostTierConfig | None = None
    shared_store: SharedStoreConfig | None = None
    kv_fetch_rule: Literal["faster", "always"] = "faster"
    perf: PerfConfig | None = None
    speculative: SpecDecodeConfig | None = None
    long_prefill: PoolConfig | None = None
    long_prompt_threshold_tokens: int = Field(32768, ge=1)
    max_model_len: int | None = Field(None, ge=2, le=MAX_TOKENS)
    kv_accounting: Literal["reserve", "shared"] = "shared"
    router: RouterConfig = Field(default_factory=RouterConfig)

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: str) -> str:
        # checked here so that the error names the scenario file and the field, as every other bad
        # scenario value does (was: "prefill pool: unknown hardware ..." from the perf build, no file)
        get_hardware(v)
        return v

    @field_validator("router", mode="before")
    @classmethod
    def _router_section(cls, v: object) -> object:
        if isinstance(v, dict):
            elsewhere = [k for k in v if k in ROUTER_SECTION_ELSEWHERE]
            if elsewhere:
                raise ValueError("; ".join(f"router.{k} is not a scenario router setting: set it in "
                                           f"{ROUTER_SECTION_ELSEWHERE[k]}" for k in elsewhere))
            allowed = [k for k in RouterConfig.model_fields if k not in ROUTER_SECTION_ELSEWHERE]
            for k in v:  # a typo of a refused key: point where it belongs, not at the refused key
                if isinstance(k, str) and k not in RouterConfig.model_fields \
                        and not difflib.get_close_matches(k, allowed, n=1) \
                        and (near := difflib.get_close_matches(k, list(ROUTER_SECTION_ELSEWHERE), n=1)):
                    raise ValueError(f"router.{k}: unknown field; the nearest, {near[0]}, is not a scenario router "
                                     f"setting: set it in {ROUTER_SECTION_ELSEWHERE[near[0]]}")
            return RouterConfig.model_validate(v)
        if isinstance(v, RouterConfig):
            elsewhere = sorted(v.model_fields_set & set(ROUTER_SECTION_ELSEWHERE))
            if elsewhere:
                raise ValueError(f"router settings {', '.join(elsewhere)} are not scenario settings "
                                 f"(see sim.scenario.ROUTER_SECTION_ELSEWHERE)")
        return v

    @property
    def router_settings(self) -> dict[str, object]:
        """The ``router:`` settings given (field name -> value), the ones the simulator applies."""
        return {k: getattr(self.router, k) for k in sorted(self.router.model_fields_set)}

    @model_serializer(mode="wrap")
    def _router_as_given(self, handler):  # noqa: ANN001, ANN202
        """The ``router`` section dumps the settings given only, and not at all when none is (so a
        scenario's dump, and the sweep point ids hashed from it, stay as before the section)."""
        d = handler(self)
        if isinstance(d, dict) and "router" in d:
            given = {}
            for k, v in self.router_settings.items():
                if k == "cost_model" and v is not None:
                    v = v.to_dict()  # type: ignore[attr-defined]
                given[k] = v
            if given:
                d["router"] = given
            else:
                del d["router"]
        return d

    @property
    def effective_max_model_len(self) -> int:
        """``max_model_len``, else the model's context: :data:`DEFAULT_MAX_MODEL_LEN` for the
        built-in models, a Hugging Face config's ``max_position_embeddings``, else
        :data:`FALLBACK_MAX_MODEL_LEN`."""
        if self.max_model_len is not None:
            return self.max_model_len
        if self.model in DEFAULT_MAX_MODEL_LEN:
            return DEFAULT_MAX_MODEL_LEN[self.model]
        try:  # a Hugging Face config (a path, or a shipped one): its max_position_embeddings
            context = get_model(self.model).max_position_embeddings
        except (ValueError, OSError):  # an unknown model is reported where the perf model is built
            context = 0
        return context or FALLBACK_MAX_MODEL_LEN

    @model_validator(mode="after")
    def _check_pools(self) -> Scenario:
        ranks = sum(p.num_ranks for p in (self.prefill, self.decode, self.mixed) if p is not None)
        if ranks > MAX_RANKS:
            raise ValueError(f"the pools have {ranks} DP ranks in all; at most {MAX_RANKS} can be simulated")
        if isinstance(self.index_capacity_blocks, int) and not 1 <= self.index_capacity_blocks <= MAX_KV_CAPACITY_TOKENS:
            raise ValueError(f"index_capacity_blocks must be 1..{MAX_KV_CAPACITY_TOKENS}, 'auto' or null")
        pd = self.prefill is not None or self.decode is not None
        if pd and self.mixed is not None:
            raise ValueError("give either prefill+decode pools (PD) or a mixed pool (aggregated), not both")
        if pd and (self.prefill is None or self.decode is None):
            raise ValueError("a PD scenario needs both a prefill and a decode pool")
        if not pd and self.mixed is None:
            raise ValueError("a scenario needs prefill+decode pools or a mixed pool")
        if self.decode is not None and self.decode.host_tier is not None:
            raise ValueError("host_tier on the decode pool is not modelled (decode ranks receive KV by transfer)")
        if self.long_prefill is not None and not pd:
            raise ValueError("long_prefill needs a PD scenario (prefill + decode pools)")
        for name, p in (("prefill", self.prefill), ("decode", self.decode), ("mixed", self.mixed),
                        ("long_prefill", self.long_prefill)):
            if p is not None and p.context_parallel and p.gpus_per_rank < 2:
                raise ValueError(f"{name}.context_parallel needs gpus_per_rank >= 2 (the CP degree)")
            ret = p.prefix_cache_retention_interval_tokens if p is not None else None
            if isinstance(ret, int) and (ret < 0 or ret % self.block_size or ret > MAX_TOKENS):
                raise ValueError(f"{name}.prefix_cache_retention_interval_tokens = {ret}: give 0, a positive "
                                 f"multiple of block_size ({self.block_size}) up to {MAX_TOKENS}, or \"dense\"")
            if ret is not None:
                try:
                    window = get_model(self.model).sliding_window_block_tokens
                except (ValueError, OSError):  # an unknown model is reported where the perf model is built
                    window = 1
                if window == 0:
                    raise ValueError(f"{name}.prefix_cache_retention_interval_tokens is set but model {self.model!r} "
                                     "has no cached sliding-window KV group, so retention has no effect (as vLLM "
                                     "refuses it); remove the key (or the --prefix-cache-retention flag)")
        return self

    def host_tier_of(self, pool: PoolConfig) -> HostTierConfig | None:
        """The host tier of ``pool``'s engines: the pool's own, else the scenario's (prefill/mixed)."""
        if pool is self.decode:
            return None
        return pool.host_tier if pool.host_tier is not None else self.host_tier

    @property
    def has_kv_tiers(self) -> bool:
        """True when a host tier or a shared store is configured."""
        pools = [self.prefill, self.mixed]
        return self.shared_store is not None or self.host_tier is not None or any(
            p is not None and p.host_tier is not None for p in pools)

    @property
    def disaggregated(self) -> bool:
        return self.mixed is None

    @property
    def num_gpus(self) -> int:
        pools = [self.prefill, self.decode, self.long_prefill] if self.disaggregated else [self.mixed]
        return sum(p.num_gpus for p in pools if p is not None)

    def with_pools(self, *, prefill_engines: int | None = None, decode_engines: int | None = None,
                   mixed_engines: int | None = None) -> Scenario:
        """A validated copy with other engine counts (CLI ``--prefill-engines`` etc.).

        The copy's ``description`` becomes the new pool shape (:func:`describe_pools`) followed by
        ``"(overridden: 8 prefill engines)"``, so reports never show the preset's old counts.

        Raises:
            ValueError: a count is not an int >= 1 (the message names the keyword, e.g.
                ``prefill_engines``), the scenario has no such pool, or the copy is invalid.
        """
        upd: dict[str, object] = {}
        changed: list[str] = []
        for name, n in (("prefill", prefill_engines), ("decode", decode_engines), ("mixed", mixed_engines)):
            if n is None:
                continue
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}_engines must be an int >= 1, got {n!r}")
            pool = getattr(self, name)
            if pool is None:
                raise ValueError(f"scenario {self.name!r} has no {name} pool")
            upd[name] = pool.model_dump() | {"num_engines": n}
            changed.append(f"{n} {name} engine{'s' if n != 1 else ''}")
        if not upd:
            return self
        # model_copy(update=...) skips validation: rebuild from a dump so every check runs again
        try:
            sc = Scenario.model_validate(self.model_dump() | upd)
        except ValidationError as e:
            raise ValueError(format_validation_error(e, source=f"scenario {self.name!r}", model=Scenario)) from None
        return sc.model_copy(update={"description": f"{describe_pools(sc)} (overridden: {', '.join(changed)})"})


def describe_pools(sc: Scenario) -> str:
    """The cluster shape in words, e.g. ``"deepseek-v3 PD on h200: 6 prefill engines x 8 DP ranks,
    1 decode engine x 8 DP ranks"`` (``x TP4`` when a rank spans several GPUs)."""

    def pool(role: str, p: PoolConfig) -> str:
        text = f"{p.num_engines} {role} engine{'s' if p.num_engines != 1 else ''}"
        if p.dp_ranks > 1:
            text += f" x {p.dp_ranks} DP ranks"
        par = "CP" if p.context_parallel else "TP"
        return text + (f" x {par}{p.gpus_per_rank}" if p.gpus_per_rank > 1 else "")

    pools = [("prefill", sc.prefill), ("decode", sc.decode), ("mixed", sc.mixed)]
    if sc.long_prefill is not None:
        pools.append((f"long-prompt (>= {sc.long_prompt_threshold_tokens:,} tokens) prefill", sc.long_prefill))
    kind = "PD" if sc.disaggregated else "aggregated"
    return f"{sc.model} {kind} on {sc.hardware}: " + ", ".join(pool(r, p) for r, p in pools if p is not None)


#: Named scenarios. Numbers are chosen so that the embedded Mooncake trace loads the cluster
#: enough for routing policies to differ (see README, "Default scenario").
PRESETS: dict[str, Scenario] = {
    "dsv3-pd-h200": Scenario(
        name="dsv3-pd-h200",
        description="DeepSeek-V3 PD on H200: 6 prefill engines EP8 (48 DP ranks), 1 decode engine EP8",
        model="deepseek-v3",
        hardware="h200",
        prefill=PoolConfig(num_engines=6, dp_ranks=8, max_prefill_tokens=8192, max_decode_batch=1),
        decode=PoolConfig(num_engines=1, dp_ranks=8, max_decode_batch=256),
    ),
    "dsv3-pd-h800": Scenario(
        name="dsv3-pd-h800",
        description="DeepSeek-V3 PD on H800: 3 prefill engines EP16 (48 DP ranks), 1 decode engine EP16",
        model="deepseek-v3",
        hardware="h800",
        prefill=PoolConfig(num_engines=3, dp_ranks=16, max_prefill_tokens=8192, max_decode_batch=1),
        decode=PoolConfig(num_engines=1, dp_ranks=16, max_decode_batch=256),
    ),
    "llama70b-pd-h100": Scenario(
        name="llama70b-pd-h100",
        description="Llama-3.1-70B PD on H100: 4 prefill ranks TP4, 2 decode ranks TP4 (dense, independent ranks)",
        model="llama-3.1-70b",
        hardware="h100",
        prefill=PoolConfig(num_engines=4, dp_ranks=1, gpus_per_rank=4, max_prefill_tokens=8192, max_decode_batch=1),
        decode=PoolConfig(num_engines=2, dp_ranks=1, gpus_per_rank=4, max_decode_batch=256),
    ),
    "llama8b-agg-h100": Scenario(
        name="llama8b-agg-h100",
        description="Llama-3.1-8B aggregated on H100: 8 mixed engines, 1 GPU each (chunked prefill 2048)",
        model="llama-3.1-8b",
        hardware="h100",
        mixed=PoolConfig(num_engines=8, dp_ranks=1, gpus_per_rank=1, max_prefill_tokens=2048, max_decode_batch=256),
    ),
}

DEFAULT_PRESET = "dsv3-pd-h200"


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A preset by name, or a scenario file (``.toml``, ``.yaml``/``.yml``, ``.json``).

    Raises:
        ValueError: unknown preset (the message lists them), an unreadable file, or an invalid
            one: one line, ``"<file>: <field.path>: <message>"`` per problem joined by ``"; "``
            (:func:`balancer.validation.format_validation_error`, with "did you mean" for unknown
            fields), or ``"<file>: <parser message>"`` for TOML/YAML syntax errors.
    """
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.exists():
        raise ValueError(f"unknown scenario {key!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a file")
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError(f"{path}: unknown scenario file type {path.suffix!r} (use .toml, .yaml or .json)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)  # TOML itself forbids duplicate keys
        elif path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping of scenario fields")
        if isinstance(data.get("model"), str):
            data["model"] = resolve_model_path(data["model"], path)
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source=str(path), model=Scenario)) from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(syntax_error_line(str(path), e)) from None
    except _BadText as e:
        raise ValueError(f"{path}: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply") from None


def resolve_model_path(model: str, source: Path) -> str:
    """A scenario file's ``model``: a preset name as it is; a Hugging Face config path (``.json``
    or a folder) relative to the scenario file's folder, as sweeps resolve their traces, else from
    the current directory; an absolute path as it is.

    Raises:
        ValueError: a config path found in neither place; the message names both.
    """
    text = model.strip()
    looks_like_path = text.endswith(".json") or "/" in text or os.sep in text
    if not looks_like_path or text.lower() in (k.lower() for k in MODELS) or Path(text).is_absolute():
        return model
    beside = source.parent / text
    if beside.exists():
        return str(beside)
    if Path(text).exists():
        return text
    raise ValueError(f"{source}: model {model!r}: no such file: looked in {source.parent.resolve()}/ (the scenario "
                     f"file's folder) and {Path.cwd()}/ (the current directory)")


class _BadText(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _BadText(f"key {k!r} given twice")
        out[k] = v
    return out


def _no_constant(name: str) -> float:
    raise _BadText(f"{name} is not a number (numbers must be finite)")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN201
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise _BadText(f"line {key_node.start_mark.line + 1}: keys must be plain names")
            if key in seen:
                raise _BadText(f"line {key_node.start_mark.line + 1}: key {key!r} given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


#: Shipped preset files (package data ``sim/data/presets/*.toml``); every number in them carries a
#: comment naming its source. They join :data:`PRESETS` under their file name.
PRESET_DIR = Path(__file__).parent / "data" / "presets"


def _load_shipped_presets() -> dict[str, Scenario]:
    """The scenarios of :data:`PRESET_DIR`, keyed by name (= file stem).

    Raises:
        ValueError: a file is invalid, its ``name`` differs from its file name, or it shadows a
            built-in preset.
    """
    out: dict[str, Scenario] = {}
    for path in sorted(PRESET_DIR.glob("*.toml")):
        sc = load_scenario(path)
        if sc.name != path.stem:
            raise ValueError(f"{path}: name {sc.name!r} must equal the file name {path.stem!r}")
        if sc.name in PRESETS:
            raise ValueError(f"{path}: preset {sc.name!r} is already defined in sim/scenario.py")
        out[sc.name] = sc
    return out


PRESETS.update(_load_shipped_presets())
