"""Scenarios: the cluster a simulation runs (model, hardware, pools, links), as validated config.

A scenario is a pydantic model, loadable from a TOML or YAML file or one of the named
:data:`PRESETS`. Runs are reproducible from ``(scenario, workload, policies, seed)``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


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
        kv_capacity_tokens: override the perf model's KV capacity per rank, in tokens.
    """

    model_config = ConfigDict(extra="forbid")

    num_engines: int = Field(1, ge=1)
    dp_ranks: int = Field(1, ge=1)
    gpus_per_rank: int = Field(1, ge=1)
    ep: bool | None = None
    max_prefill_tokens: int = Field(8192, ge=1)
    max_decode_batch: int = Field(256, ge=1)
    kv_capacity_tokens: int | None = Field(None, ge=1)

    @property
    def num_ranks(self) -> int:
        return self.num_engines * self.dp_ranks

    @property
    def num_gpus(self) -> int:
        return self.num_ranks * self.gpus_per_rank


class Scenario(BaseModel):
    """A simulated cluster.

    Either ``prefill`` and ``decode`` pools (PD disaggregation) or a ``mixed`` pool (aggregated).

    Attributes:
        name: label for reports.
        model / hardware: preset names (:mod:`sim.models`, :mod:`sim.hardware`).
        block_size: tokens per KV block (Mooncake traces: 512).
        kv_transfer_bandwidth_bytes_per_s: prefill -> decode link bandwidth per transfer.
        kv_transfer_latency_s: fixed cost per transfer.
        pd_min_uncached_tokens: conditional disaggregation threshold handed to the router.
        index_capacity_blocks: the router's prefix-index bound per replica; ``"auto"`` = the KV
            capacity of a prefill (PD) or mixed rank in blocks; ``None`` = unbounded.
        fast_forward: advance decode-only batches many steps per event (``False`` = exact
            step-by-step reference mode; both give the same times).
        sample_interval_s: per-rank load sampling period for plots; ``None`` = duration / 400.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    description: str = ""
    model: str = "deepseek-v3"
    hardware: str = "h800"
    block_size: int = Field(512, ge=1)
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    mixed: PoolConfig | None = None
    kv_transfer_bandwidth_bytes_per_s: float = Field(50e9, gt=0)
    kv_transfer_latency_s: float = Field(0.001, ge=0)
    pd_min_uncached_tokens: int = Field(0, ge=0)
    index_capacity_blocks: int | Literal["auto"] | None = "auto"
    fast_forward: bool = True
    sample_interval_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_pools(self) -> Scenario:
        pd = self.prefill is not None or self.decode is not None
        if pd and self.mixed is not None:
            raise ValueError("give either prefill+decode pools (PD) or a mixed pool (aggregated), not both")
        if pd and (self.prefill is None or self.decode is None):
            raise ValueError("a PD scenario needs both a prefill and a decode pool")
        if not pd and self.mixed is None:
            raise ValueError("a scenario needs prefill+decode pools or a mixed pool")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.mixed is None

    @property
    def num_gpus(self) -> int:
        pools = [self.prefill, self.decode] if self.disaggregated else [self.mixed]
        return sum(p.num_gpus for p in pools if p is not None)

    def with_pools(self, *, prefill_engines: int | None = None, decode_engines: int | None = None,
                   mixed_engines: int | None = None) -> Scenario:
        """A copy with other engine counts (CLI ``--prefill-engines`` etc.)."""
        upd: dict[str, PoolConfig] = {}
        for name, n in (("prefill", prefill_engines), ("decode", decode_engines), ("mixed", mixed_engines)):
            if n is None:
                continue
            pool = getattr(self, name)
            if pool is None:
                raise ValueError(f"scenario {self.name!r} has no {name} pool")
            upd[name] = pool.model_copy(update={"num_engines": n})
        return self.model_copy(update=upd)


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
        ValueError: unknown preset (the message lists them) or an invalid file (pydantic's message,
            prefixed with the file name).
    """
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.exists():
        raise ValueError(f"unknown scenario {key!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix == ".json":
            return Scenario.model_validate_json(text)
        else:
            raise ValueError(f"{path}: unknown scenario file type {path.suffix!r} (use .toml, .yaml or .json)")
        return Scenario.model_validate(data)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: {e}") from e
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: {e}") from e
