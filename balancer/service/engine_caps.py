"""What each engine behind the router can do, asked once when it is registered (issue 30).

Probes (``GET``, each bounded by ``timeout_s``, all four at once):

* ``/v1/models``: the names the engine serves (``data[].id``). vLLM lists its
  ``--served-model-name`` aliases and LoRA adapters, SGLang its model path or served name;
  ``transformers serve`` answers 500 unless a Hugging Face cache folder exists, and accepts only the
  folder it was started with.
* ``/server_info`` (SGLang; older releases ``/get_server_info``): the engine is SGLang, which has
  ``POST /abort_request``.
* ``/version`` answering ``{"version": ...}`` and no ``/server_info``: vLLM (no abort endpoint: a
  closed connection aborts).
* ``/metrics`` answering Prometheus text (``# HELP`` / ``# TYPE``): what ``--scrape-load`` reads.

``engine`` is ``sglang``, ``vllm``, ``openai`` (answered, but neither: transformers' server, a
gateway) or ``unknown`` (no probe got an answer below 500 yet, as from an engine still starting;
probed again with the next health-check round).
A worker's configured ``served_model_name`` wins over the discovered names. Probing is part of
the active health checks: with ``health_check.enabled: false`` pdlb sends the engines nothing but
requests, and nothing is discovered (configure ``model=NAME``; aborts then go to engines only with
``pd_protocol: sglang``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

MAX_MODELS = 256
"""Most model names kept per engine (an engine listing thousands of LoRA adapters is cut)."""
MAX_PROBE_BYTES = 1 << 20
"""Largest probe answer read (bytes); a longer one counts as not answered."""


@dataclass(slots=True)
class EngineCaps:
    """One engine's discovered capabilities (module docstring)."""

    engine: str = "unknown"
    served_models: tuple[str, ...] = ()
    abort_endpoint: str | None = None
    metrics_endpoint: str | None = None
    probed: bool = False  # some probe got an HTTP answer below 500

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine, "served_models": list(self.served_models), "abort_endpoint": self.abort_endpoint,
                "metrics_endpoint": self.metrics_endpoint, "probed": self.probed}


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes] | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            data = await r.content.read(MAX_PROBE_BYTES + 1)
            if len(data) > MAX_PROBE_BYTES:
                return None
            return r.status, data
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None


def model_names(listing: Any) -> tuple[str, ...]:
    """The ``id`` of each entry of an OpenAI ``/v1/models`` answer (at most :data:`MAX_MODELS`)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return ()
    out = [m["id"] for m in data[:MAX_MODELS] if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]
    return tuple(dict.fromkeys(out))


async def discover(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> EngineCaps:
    """Probe the engine at ``url`` (module docstring); never raises for engine behaviour."""
    models, info, old_info, version, metrics = await asyncio.gather(
        _get(session, url + "/v1/models", timeout_s), _get(session, url + "/server_info", timeout_s),
        _get(session, url + "/get_server_info", timeout_s), _get(session, url + "/version", timeout_s),
        _get(session, url + "/metrics", timeout_s))
    caps = EngineCaps()
    # an engine still starting (5xx everywhere, or no answer) is probed again later
    if not any(a is not None and a[0] < 500 for a in (models, info, old_info, version, metrics)):
        return caps
    caps.probed = True
    if models is not None and models[0] == 200:
        caps.served_models = model_names(_json(models[1]))
    if any(a is not None and a[0] == 200 and isinstance(_json(a[1]), dict) for a in (info, old_info)):
        caps.engine = "sglang"
        caps.abort_endpoint = "/abort_request"
    elif version is not None and version[0] == 200 and isinstance(v := _json(version[1]), dict) and "version" in v:
        caps.engine = "vllm"
    else:
        caps.engine = "openai"
    if metrics is not None and metrics[0] == 200 and (b"# TYPE" in metrics[1] or b"# HELP" in metrics[1]):
        caps.metrics_endpoint = "/metrics"
    return caps
