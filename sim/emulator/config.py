"""Configuration of an emulated engine (``pdlb engine``), validated with pydantic."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sim.models.hardware import get_hardware
from sim.models.presets import get_model

MAX_BOOTSTRAP_WAIT_S = 3600.0
"""Longest wait of an SGLang bootstrap long poll (``bootstrap_timeout_s``, and the ``timeout_s``
a ``GET /bootstrap/{room}`` may ask for), seconds."""


class FaultConfig(BaseModel):
    """Fault knobs for tests (also settable at run time with ``POST /emulator/faults``).

    Attributes:
        error_rate: fraction of generation requests answered with ``error_status`` at once.
        error_status: HTTP status of injected errors (503 by default).
        hang: accept generation requests and never answer (until the client goes away).
        hang_after_headers: streamed answers send their headers and then nothing (until the client
            goes away); non-streamed answers are unaffected.
        die_after_tokens: after streaming this many output tokens in total (over all requests, not
            per request), the process exits abruptly (in-process apps drop every connection and
            refuse new ones instead).
        seed: seed of the error-rate coin.
    """

    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(0.0, ge=0.0, le=1.0)
    error_status: int = Field(503, ge=400, le=599)
    hang: bool = False
    hang_after_headers: bool = False
    die_after_tokens: int | None = Field(None, ge=0)
    seed: int = 0


class EmulatorConfig(BaseModel):
    """An emulated SGLang/vLLM engine of one role, timed by the simulator's perf model.

    Attributes:
        role: ``prefill``, ``decode`` or ``mixed``.
        model / hardware: :mod:`sim.models.presets` and :mod:`sim.models.hardware` preset names.
        dp_ranks / gpus_per_rank / ep: engine layout, as :class:`sim.scenario.PoolConfig`.
        block_size: tokens per KV block of the engine's prefix cache.
        max_prefill_tokens / max_decode_batch / kv_capacity_tokens: scheduler limits per rank.
        speed: time compression (2.0 = twice as fast as the perf model says).
        zero_delay: answer at once with no perf model (router overhead benchmarks).
        chars_per_token: text prompts count ``ceil(chars / chars_per_token)`` tokens.
        served_model_name: the model id in responses and ``/v1/models``.
        kv_transfer_bandwidth_bytes_per_s / kv_transfer_latency_s: the PD KV transfer a decode
            leg waits for (same meaning as in :class:`sim.scenario.Scenario`).
        bootstrap_timeout_s: how long an SGLang decode leg waits for its prefill leg, seconds
            (at most :data:`MAX_BOOTSTRAP_WAIT_S`).
        engine_id: id reported as vLLM ``remote_engine_id`` (default: derived from the port).
        default_max_tokens: output length when a request gives none.
        max_model_len: most prompt + output tokens a request may ask for (reported by
            ``/v1/models``); a request over it is answered HTTP 400, as vLLM and SGLang do
            (default 131,072: Llama 3.1's context).
        stream_format: how streamed chat answers are framed: ``openai`` (the role rides on the
            first token's chunk; a finish chunk with ``usage``; ``data: [DONE]``), or
            ``transformers`` (as ``transformers serve`` 5.17: a role-only chunk at once, before
            prefill; the finish chunk carries ``usage``; no ``[DONE]``; completions likewise
            without ``[DONE]``).
        kv_events_endpoint: publish KV cache events on vLLM's wire (:mod:`sim.emulator.kv_events`)
            from this ZMQ endpoint, ``tcp://HOST:PORT`` (DP rank ``r`` on PORT + ``r``); None: none.
        kv_events_replay_endpoint: the replay ROUTER endpoint (same offsets); None: no replay.
    """

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "mixed"] = "mixed"
    model: str = "llama-3.1-8b"
    hardware: str = "h100"
    dp_ranks: int = Field(1, ge=1)
    gpus_per_rank: int = Field(1, ge=1)
    ep: bool | None = None
    block_size: int = Field(64, ge=1)
    max_prefill_tokens: int = Field(8192, ge=1)
    max_decode_batch: int = Field(256, ge=1)
    kv_capacity_tokens: int | None = Field(None, ge=1)
    speed: float = Field(1.0, gt=0)
    zero_delay: bool = False
    chars_per_token: float = Field(4.0, gt=0)
    served_model_name: str = "pdlb-emulated"
    kv_transfer_bandwidth_bytes_per_s: float = Field(50e9, gt=0)
    kv_transfer_latency_s: float = Field(0.001, ge=0)
    bootstrap_timeout_s: float = Field(30.0, gt=0, le=MAX_BOOTSTRAP_WAIT_S)
    engine_id: str | None = None
    default_max_tokens: int = Field(16, ge=1)
    max_model_len: int = Field(131_072, ge=2, le=1 << 30)
    stream_format: Literal["openai", "transformers"] = "openai"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    faults: FaultConfig = FaultConfig()

    @model_validator(mode="after")
    def _check_kv_events(self) -> EmulatorConfig:
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (--kv-events)")
        if self.kv_events_endpoint is not None and self.zero_delay:
            raise ValueError("kv_events_endpoint: a zero-delay engine has no prefix cache to publish (drop --zero-delay)")
        return self

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            from sim.emulator.kv_events import offset_endpoint

            offset_endpoint(v, 0)  # ValueError: expected tcp://HOST:PORT
            if int(v.rpartition(":")[2]) > 65535:
                raise ValueError(f"KV events endpoint {v!r}: port above 65535")
        return v

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        get_model(v)  # ValueError listing the valid names
        return v

    @field_validator("hardware")
    @classmethod
    def _check_hardware(cls, v: str) -> str:
        get_hardware(v)  # ValueError listing the valid names (case-insensitive)
        return v
