"""Analytic steady-state throughput of a PD scenario from the perf model (no simulation).

Decode: each rank runs ``B`` sequences of mean KV length ``ctx = prompt + output / 2``, one token
per sequence per decode step (``perf.step_time_s``), ``B`` capped by KV capacity. Prefill: prompt
tokens (cached + computed) a rank finishes per second with the computed parts packed into the
chunk budget, optionally capped by the NIC that sends the KV to decode. Sustained output
``O = min(O_d, I_p / r)`` with ``r`` input tokens per output token (:func:`steady_state` lists
what is not modelled). Rates in tokens per second (``_tokens_per_s``), step times in seconds
(``_s``); per-GPU :class:`~sim.pricing.revenue.TokenRates` average over all GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.perf.base import PerfModel, causal_attn_pairs
from sim.pricing.revenue import TokenRates
from sim.pricing.sheets import _check_fraction
from sim.scenario import PoolConfig, Scenario


# ---------------------------------------------------------------------------- analytic steady state
def _default_perf(scenario: Scenario, pool: PoolConfig) -> PerfModel:
    from sim.run.pool_perf import build_perf

    return build_perf(scenario, pool)


def decode_step_s(perf: PerfModel, dp_ranks: int, batch_per_rank: int, ctx_tokens: float) -> float:
    """One decode step of an engine whose ``dp_ranks`` ranks each run ``batch_per_rank`` sequences
    of mean KV length ``ctx_tokens`` (no prefill), from ``perf.step_time_s``."""
    r = dp_ranks if perf.ep_synchronous else 1
    z = np.zeros(r)
    return float(perf.step_time_s(z, z, np.full(r, float(batch_per_rank)),
                                  np.full(r, float(batch_per_rank) * ctx_tokens)))


def prefill_input_tokens_per_s_per_rank(perf: PerfModel, pool: PoolConfig, prompt_tokens: int,
                                        hit_rate: float) -> float:
    """Prompt tokens (cached + computed) one prefill rank finishes per second at steady state.

    Each prompt of ``prompt_tokens`` has ``cached = floor(h * L)`` tokens hit (at least one computed,
    as engines recompute the last token). If the computed part ``c`` fits the rank's chunk budget,
    a step packs ``n = budget // c`` prompts (``pt = n*c``, pairs ``n * causal_attn_pairs(c, cached)``);
    otherwise one prompt is chunked over several steps. All ranks of an EP engine carry the same
    work. Rate = prompt tokens finished / seconds of the steps that finish them.
    """
    _check_fraction("hit_rate", hit_rate)
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be >= 1")
    budget = pool.max_prefill_tokens
    cached = min(int(hit_rate * prompt_tokens), prompt_tokens - 1)
    new = prompt_tokens - cached
    r = pool.dp_ranks if perf.ep_synchronous else 1

    pass_cached = bool(perf.wants_prefill_cached_tokens)

    def step(pt: float, pairs: float, before: float) -> float:
        work = (np.full(r, pt), np.full(r, pairs), np.zeros(r), np.zeros(r))
        if pass_cached:  # n prompts in one step: a causal encoder-decoder pays a replay window each
            return float(perf.step_time_s(*work, prefill_cached_tokens=np.full(r, before)))
        return float(perf.step_time_s(*work))

    if new <= budget:
        n = budget // new
        return n * prompt_tokens / step(n * new, n * float(causal_attn_pairs(new, cached)), n * cached)
    total_s, done = 0.0, cached
    while done < prompt_tokens:
        c = min(budget, prompt_tokens - done)
        total_s += step(c, float(causal_attn_pairs(c, done)), done)
        done += c
    return prompt_tokens / total_s


def prefill_capacity_tokens_per_s_per_gpu(scenario: Scenario, perf: PerfModel, prompt_tokens: int, hit_rate: float,
                                           *, kv_link: bool = True) -> tuple[float, str]:
    """Prompt tokens (hits included) per second one prefill GPU sustains, and what limits it.

    ``compute``: :func:`prefill_input_tokens_per_s_per_rank` / ``gpus_per_rank``. ``kv link``
    (when ``kv_link``): the whole prompt's KV, hits included, leaves the prefill GPU for the decode
    pool over its NIC, ``kv_transfer_bandwidth_bytes_per_s / kv_bytes_per_token`` tokens/s (one
    link of the scenario's bandwidth per GPU; an assumption: a design where decode reads cached KV
    straight from a shared store would not pay it)."""
    pool = scenario.prefill
    if pool is None:
        raise ValueError(f"scenario {scenario.name!r} has no prefill pool")
    compute = prefill_input_tokens_per_s_per_rank(perf, pool, prompt_tokens, hit_rate) / pool.gpus_per_rank
    if not kv_link:
        return compute, "compute"
    link = scenario.kv_transfer_bandwidth_bytes_per_s / perf.kv_bytes_per_token
    return (compute, "compute") if compute <= link else (link, "kv link")


@dataclass(frozen=True)
class SteadyState:
    """Analytic steady-state throughput of a PD scenario (see :func:`steady_state`).

    Cluster-wide rates in tokens/s; ``rates`` per GPU over all GPUs.
    """

    scenario: str
    num_prefill_gpus: int
    num_decode_gpus: int
    prompt_tokens: int
    output_tokens: int
    hit_rate: float
    decode_batch_per_rank: int
    decode_batch_kv_limit: int
    decode_step_s: float
    decode_tokens_per_s_per_seq: float
    decode_output_tokens_per_s: float
    prefill_input_tokens_per_s: float
    prefill_limit: str
    output_tokens_per_s: float
    bottleneck: str
    rates: TokenRates

    @property
    def input_per_output(self) -> float:
        return self.prompt_tokens / self.output_tokens

    @property
    def num_gpus(self) -> int:
        return self.num_prefill_gpus + self.num_decode_gpus


def steady_state(scenario: Scenario, *, prompt_tokens: int, output_tokens: int, hit_rate: float,
                 decode_batch_per_rank: int | None = None, decode_tokens_per_s_per_seq: float | None = None,
                 kv_link: bool = True,
                 perf_factory: Callable[[Scenario, PoolConfig], PerfModel] = _default_perf) -> SteadyState:
    """Per-GPU throughput of a PD scenario at steady state, from the perf model (no simulation).

    Every request has ``prompt_tokens`` in (a fraction ``hit_rate`` cached) and ``output_tokens``
    out, so ``r = prompt_tokens / output_tokens``. Decode: each rank runs ``B`` sequences of mean
    KV length ``ctx = prompt + output / 2``; ``B`` = ``decode_batch_per_rank`` (default the pool's
    ``max_decode_batch``) capped by KV capacity ``floor(kv_capacity / ctx)``. Per-sequence speed is
    ``1 / decode_step_s`` from the perf model, or ``decode_tokens_per_s_per_seq`` when given (e.g.
    a published figure). Decode capacity ``O_d = decode ranks * B * speed``; prefill capacity
    ``I_p = prefill GPUs * prefill_capacity_tokens_per_s_per_gpu`` (compute or, with ``kv_link``,
    the KV link). Sustained output ``O = min(O_d, I_p / r)`` (``bottleneck`` says which), input
    ``r * O``.

    Not modelled: KV transfer and cache-load time, queueing (this is the saturated rate),
    speculative decoding unless folded into ``decode_tokens_per_s_per_seq``.

    Raises:
        ValueError: an aggregated scenario, or non-positive token counts / batch.
    """
    if not scenario.disaggregated:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; the steady-state model needs prefill and "
                         f"decode pools")
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt_tokens and output_tokens must be >= 1")
    _check_fraction("hit_rate", hit_rate)
    pp, dp = scenario.prefill, scenario.decode
    assert pp is not None and dp is not None
    b_req = dp.max_decode_batch if decode_batch_per_rank is None else int(decode_batch_per_rank)
    if b_req < 1:
        raise ValueError("decode_batch_per_rank must be >= 1")
    dperf = perf_factory(scenario, dp)
    ctx = prompt_tokens + output_tokens / 2.0
    cap = dp.kv_capacity_tokens or dperf.kv_capacity_tokens_per_rank
    b_kv = int(cap // (prompt_tokens + output_tokens))  # a sequence reserves its final length
    b = max(0, min(b_req, b_kv))
    step = decode_step_s(dperf, dp.dp_ranks, max(b, 1), ctx)
    speed = decode_tokens_per_s_per_seq if decode_tokens_per_s_per_seq is not None else 1.0 / step
    o_d = dp.num_ranks * b * speed
    pperf = perf_factory(scenario, pp)
    c_p, limit = prefill_capacity_tokens_per_s_per_gpu(scenario, pperf, prompt_tokens, hit_rate, kv_link=kv_link)
    i_p = pp.num_gpus * c_p
    r = prompt_tokens / output_tokens
    o = min(o_d, i_p / r)
    n = scenario.num_gpus
    return SteadyState(
        scenario=scenario.name, num_prefill_gpus=pp.num_gpus, num_decode_gpus=dp.num_gpus,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, hit_rate=hit_rate,
        decode_batch_per_rank=b, decode_batch_kv_limit=b_kv, decode_step_s=step,
        decode_tokens_per_s_per_seq=speed, decode_output_tokens_per_s=o_d, prefill_input_tokens_per_s=i_p,
        prefill_limit=limit,         output_tokens_per_s=o, bottleneck="decode" if o_d <= i_p / r else "prefill",
        rates=TokenRates.from_mix(o / n, r, hit_rate),
    )
