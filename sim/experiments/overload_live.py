"""Overload and fairness with deadline admission, live: ``pdlb``'s router in front of emulated engines on loopback.

The same three measurements as :mod:`sim.experiments.overload` (a 10x burst from tenant ``B``;
every tenant at 2x the prefill pool's capacity; every request answered), but through the real
service: an in-process router (:func:`balancer.service.app.create_app`) and emulated SGLang PD engines
(:mod:`sim.emulator`, Llama-3.1-8B on H100 slowed by ``speed``, so that the 2-core test host is not
the bottleneck), with each request sent at its arrival time as a streamed ``/v1/completions`` call
carrying ``x-pdlb-tenant``. TTFT is the client's: arrival to the first streamed token. A request ends
``ok`` (200 and its stream complete), ``shed`` (429 with ``Retry-After``) or ``error`` (any other
answer); ``lost`` counts requests with none of these (must be 0).

Prompts are unique per request (a numbered first block), so prefix caching plays no part.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np

from balancer.deadline_admission import prefill_rate_tokens_per_s
from balancer.types import Request
from sim.run.router_cost import cost_model_for
from sim.emulator.testing import inprocess_cluster
from sim.experiments.overload import TENANTS, small_pd_scenario, tenant_workload

CHARS_PER_TOKEN = 4  # the router's and the emulator's default estimate for text prompts


def prompt_text(i: int, tokens: int) -> str:
    """``tokens`` tokens of text (4 characters each) whose first block is unique to request ``i``."""
    head = f"r{i:07d}"
    return head + "abcd" * max(0, tokens - 2)


async def _send(s: aiohttp.ClientSession, url: str, i: int, req: Request, t0: float,
                out: list[dict[str, Any]]) -> None:
    delay = t0 + req.arrival_time_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    row: dict[str, Any] = {"tenant": req.traffic_class, "outcome": "lost", "ttft_s": float("nan")}
    body = {"prompt": prompt_text(i, req.prompt_tokens), "max_tokens": req.max_output_tokens, "stream": True}
    try:
        async with s.post(url + "/v1/completions", json=body, headers={"x-pdlb-tenant": req.traffic_class or ""}) as r:
            if r.status == 429:
                row["outcome"] = "shed"
                row["retry_after_s"] = float(r.headers.get("Retry-After", "nan"))
                await r.read()
            elif r.status != 200:
                row["outcome"] = f"error {r.status}"
                await r.read()
            else:
                done = False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        row["outcome"] = "stream_error"
                        break
                    if np.isnan(row["ttft_s"]) and ev.get("choices") and ev["choices"][0].get("text"):
                        row["ttft_s"] = time.monotonic() - sent
                if done:
                    row["outcome"] = "ok"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        row["outcome"] = f"error {type(e).__name__}"
    out.append(row)


def slowed_cost_model(sc: Any, speed: float) -> dict[str, Any]:
    """The scenario's cost model (:func:`sim.run.router_cost.cost_model_for`) with every time divided by
    ``speed`` (the emulated engines run ``speed`` times as fast as the hardware), as a dict."""
    d = cost_model_for(sc).to_dict()

    def scale(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: v if k in ("chunk_tokens", "ep_synchronous") else scale(v) for k, v in x.items()}
        return x / speed if isinstance(x, float) else x

    return scale(d)


async def run_live(reqs: Sequence[Request], *, admission: bool, speed: float, ttft_slo_s: float,
                   num_prefill: int = 2, num_decode: int = 2, policy: str = "least_load",
                   wait_model: str = "backlog") -> dict[str, Any]:
    """Send ``reqs`` at their arrival times through a fresh in-process cluster; returns the figures
    (per-tenant SLO attainment counts a shed or failed request as a miss). ``policy``: the prefill
    policy (decode: ``least_load``; a policy that reads the cost model gets the scenario's, slowed
    by ``speed``: :func:`slowed_cost_model`); ``wait_model``: the gate's."""
    sc = small_pd_scenario(num_prefill, num_decode)
    rate = prefill_rate_tokens_per_s(cost_model_for(sc), True) * speed
    router: dict[str, Any] = {"prefill_policy": {"name": policy}, "decode_policy": {"name": "least_load"},
                              "request_timeout_s": 120.0}
    if policy == "ep_aware":
        router["cost_model"] = slowed_cost_model(sc, speed)
    if admission:
        router["admission"] = {"enabled": True, "ttft_slo_s": ttft_slo_s, "prefill_tokens_per_s": rate,
                               "wait_model": wait_model}
    rows: list[dict[str, Any]] = []
    async with inprocess_cluster("sglang", num_prefill, num_decode, engine={"speed": speed}, router=router) as c, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        t0 = time.monotonic() + 0.2
        await asyncio.gather(*(_send(s, c.url, i, r, t0, rows) for i, r in enumerate(reqs)))
    window = max(r.arrival_time_s for r in reqs) - min(r.arrival_time_s for r in reqs)
    ok = [r["outcome"] == "ok" and r["ttft_s"] <= ttft_slo_s for r in rows]
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    ttft = np.array([r["ttft_s"] for r in rows if r["outcome"] == "ok"])
    by_tenant = {t: float(np.mean([k for k, r in zip(ok, rows) if r["tenant"] == t]))
                 for t in sorted({r["tenant"] for r in rows})}
    return {"requests": len(reqs), "answered": len(rows) - outcomes.get("lost", 0), "outcomes": outcomes,
            "slo_attainment": float(np.mean(ok)), "goodput_rps": sum(ok) / window if window > 0 else float("nan"),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "by_tenant": by_tenant}


def live_table(*, duration_s: float = 30.0, speed: float = 0.1, burst_x: float = 10.0, overload_x: float = 2.0,
               ttft_slo_s: float = 2.5, seed: int = 0, prompt_tokens: tuple[int, int] = (1000, 3000),
               output_tokens: int = 8, runs: Sequence[str] = ("calm", "burst", "overload"),
               policy: str = "least_load", wait_models: Sequence[str] = ()) -> dict[str, Any]:
    """The live runs (``calm``, ``burst``, ``overload``, each with admission off and on; with
    ``wait_models``, "on" once per wait model, keyed ``<run>/on:<model>``)."""
    sc = small_pd_scenario()
    rate = prefill_rate_tokens_per_s(cost_model_for(sc), True) * speed
    cap = rate * sc.prefill.num_engines / (sum(prompt_tokens) / 2)
    base = cap / 10.0
    kw = dict(seed=seed, prompt_min=prompt_tokens[0], prompt_max=prompt_tokens[1], output_tokens=output_tokens)
    loads = {"calm": tenant_workload({t: base for t in TENANTS}, duration_s, **kw),
             "burst": tenant_workload({t: base for t in TENANTS}, duration_s,
                                      burst=("B", burst_x, duration_s / 3, 2 * duration_s / 3), **kw),
             "overload": tenant_workload({t: overload_x * cap / len(TENANTS) for t in TENANTS}, duration_s,
                                         **{**kw, "seed": seed + 1})}
    out: dict[str, Any] = {"capacity_rps": cap, "speed": speed, "ttft_slo_s": ttft_slo_s}
    labels = ("off", *(f"on:{m}" for m in wait_models)) if wait_models else ("off", "on")
    for name in runs:
        for label in labels:
            wm = label.partition(":")[2] or "backlog"
            out[f"{name}/{label}"] = asyncio.run(run_live(loads[name], admission=label != "off", speed=speed,
                                                          ttft_slo_s=ttft_slo_s, policy=policy, wait_model=wm))
    return out
