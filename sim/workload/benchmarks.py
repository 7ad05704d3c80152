"""Standard router-benchmark workloads as generators: shared-prefix groups and stepped load ramps.

Published router results are measured on a few synthetic workloads; these generators reproduce
their shape as :class:`~balancer.types.Request` lists (write them with
:func:`sim.workload.write_mooncake`, or from the shell with ``pdlb sim workload ...``).

* :func:`shared_prefix_workload` mirrors SGLang's ``bench_serving --dataset-name
  generated-shared-prefix`` ("gsp"): ``N`` groups, each with one system prompt of
  ``system_prompt_tokens`` shared by ``M`` prompts that append their own question of
  ``question_tokens``; every request generates ``output_tokens`` (``--gsp-output-len``; the
  benchmark runs with ignore-EOS semantics, so the output length is exact). SGLang's defaults are
  64 groups x 16 prompts, system prompt 2,048, question 128, output 256 tokens (its
  ``--gsp-*`` option defaults); llm-d's prefix-aware routing benchmark uses the same layout.
* :func:`load_ramp_workload` mirrors stepped rate sweeps (NVIDIA AIPerf's request-rate ramping,
  vLLM ``bench serve --ramp-up-strategy``; vLLM raises the rate per request index, this generator
  holds each rate for a fixed wall-clock step, which is what a capacity search wants): a Poisson
  process whose rate is ``rates_per_s[k]`` during step ``k`` of ``step_duration_s`` seconds.

Both are deterministic for a given ``seed`` and build block hashes with
:func:`balancer.hashing.chain_block_ids` rooted at a hash of the generator name and seed, so two
workloads with different seeds share no block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import xxhash

from balancer.hashing import chain_block_ids
from balancer.types import Request

from ._checks import MAX_TRACE_TOKENS, check_positive_float, check_positive_int

__all__ = ["load_ramp_workload", "shared_prefix_workload"]

#: SGLang ``bench_serving`` generated-shared-prefix defaults (``--gsp-num-groups``,
#: ``--gsp-prompts-per-group``, ``--gsp-system-prompt-len``, ``--gsp-question-len``, ``--gsp-output-len``)
GSP_DEFAULTS = {"num_groups": 64, "prompts_per_group": 16, "system_prompt_tokens": 2048,
                "question_tokens": 128, "output_tokens": 256}


#: Most block hashes one generated workload may hold (sum over requests of the prompt's blocks):
#: about 2 GB of Python ints; the embedded Mooncake trace has 0.3M, SGLang's default gsp 5,120.
MAX_WORKLOAD_BLOCKS = 50_000_000

#: Largest log-space sigma of a lognormal length. Lengths are drawn with ``mu = ln(mean) - sigma^2/2``,
#: so the distribution's mean is the mean asked for, but its median is ``mean * exp(-sigma^2 / 2)``
#: and a sample's mean converges ever more slowly (variance ``mean^2 (exp(sigma^2) - 1)``): at sigma
#: 2 the median is 13.5% of the mean; at 50 every prompt is 1 token (``--prompt-sigma 50`` would
#: write 1-token prompts under a 1024-token "mean"). Real traces' prompt lengths have log-space
#: sigmas of about 1 to 1.5.
MAX_LENGTH_SIGMA = 2.0


def _check_bounds(num_requests: int, num_blocks: int, tokens: dict[str, float], max_requests: int) -> None:
    """Refuse, before any allocation, a workload no simulation could take: more than
    ``max_requests`` requests, more than :data:`MAX_WORKLOAD_BLOCKS` blocks, or a length over
    :data:`~sim.workload._checks.MAX_TRACE_TOKENS` (what the trace readers refuse too)."""
    for name, value in tokens.items():
        if value > MAX_TRACE_TOKENS:
            raise ValueError(f"{name} must be <= {MAX_TRACE_TOKENS:,} tokens (the longest a trace may give), "
                             f"got {value:,.0f}")
    if num_requests > max_requests:
        raise ValueError(f"{num_requests:,} requests, more than max_requests={max_requests:,}")
    if num_blocks > MAX_WORKLOAD_BLOCKS:
        raise ValueError(f"{num_blocks:,} prompt blocks in all, more than {MAX_WORKLOAD_BLOCKS:,}; "
                         "fewer requests, shorter prompts or a larger block size")


def _check_nonneg_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_sigma(sigma: float, name: str) -> float:
    """A log-space sigma in ``[0, MAX_LENGTH_SIGMA]`` (see :data:`MAX_LENGTH_SIGMA`)."""
    if not (isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and math.isfinite(sigma)
            and 0 <= sigma <= MAX_LENGTH_SIGMA):
        raise ValueError(f"{name} must be a number in [0, {MAX_LENGTH_SIGMA:g}] (lognormal lengths keep the mean "
                         f"asked for, but their median is mean x exp(-sigma^2/2): at {MAX_LENGTH_SIGMA:g}, 13.5% of it), "
                         f"got {sigma!r}")
    return sigma


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")


def _root(kind: str, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(f"pdlb/{kind}/{int(seed)}".encode())


def shared_prefix_workload(
    num_groups: int = GSP_DEFAULTS["num_groups"],
    prompts_per_group: int = GSP_DEFAULTS["prompts_per_group"],
    *,
    system_prompt_tokens: int = GSP_DEFAULTS["system_prompt_tokens"],
    question_tokens: int = GSP_DEFAULTS["question_tokens"],
    output_tokens: int = GSP_DEFAULTS["output_tokens"],
    rate_per_s: float | None = None,
    seed: int = 0,
    block_size: int = 512,
    ignore_eos: bool = True,
    output_tokens_sigma: float = 0.5,
    shuffle: bool = True,
    traffic_class: str | None = None,
    max_requests: int = 10_000_000,
) -> list[Request]:
    """``num_groups * prompts_per_group`` requests; the prompts of a group share a system prompt.

    Layout of request ``(g, j)``: ``system_prompt_tokens`` of group ``g``'s system prompt, then
    ``question_tokens`` of its own question. Prompt length = system + question (>= 1). Its first
    ``system_prompt_tokens // block_size`` block hashes are those of group ``g`` (only full
    blocks can be shared: the block that straddles the system/question boundary is unique), the
    rest are unique to the request.

    Order and arrivals: with ``shuffle`` (SGLang shuffles the generated prompts) the requests come
    in a seeded random order, else group by group. ``rate_per_s=None`` sends them all at t = 0
    (SGLang's default ``--request-rate inf``); otherwise arrivals are a Poisson process of that
    rate starting after one exponential gap.

    Output: ``ignore_eos=True`` (the benchmark's setting) makes every request generate exactly
    ``output_tokens``; ``False`` draws lengths lognormal with mean ``output_tokens`` and log-space
    sigma ``output_tokens_sigma`` (an EOS-terminated spread), rounded and clipped to >= 1.

    Returns:
        Requests sorted by arrival, ids ``f"g{g}-p{j}"``; ``session_id`` is ``f"g{g}"`` (the group),
        so session-affine policies see the groups.

    Raises:
        ValueError: a count < 1, a negative length, a prompt of 0 tokens, ``rate_per_s <= 0``, a
            non-finite sigma; or, checked before anything is drawn, more than ``max_requests``
            requests, a prompt or output over 2^24 tokens, more than :data:`MAX_WORKLOAD_BLOCKS`
            prompt blocks in all.

    Hand check (tests/sim/workload/test_workload_benchmarks.py): 2 groups x 3 prompts, system 1,024, question
    100, block 512 -> 1,124-token prompts of 3 blocks, the first 2 shared within a group, and an
    ideal (infinite-cache) hit rate of (6 * 2 - 2 * 2) / 18 = 8/18 blocks.
    """
    check_positive_int(num_groups, "num_groups")
    check_positive_int(prompts_per_group, "prompts_per_group")
    _check_nonneg_int(system_prompt_tokens, "system_prompt_tokens")
    _check_nonneg_int(question_tokens, "question_tokens")
    check_positive_int(output_tokens, "output_tokens")
    check_positive_int(block_size, "block_size")
    _check_seed(seed)
    if system_prompt_tokens + question_tokens < 1:
        raise ValueError("system_prompt_tokens + question_tokens must be >= 1 (a prompt needs a token)")
    check_positive_int(max_requests, "max_requests")
    _check_bounds(num_groups * prompts_per_group,
                  num_groups * prompts_per_group * -(-(system_prompt_tokens + question_tokens) // block_size),
                  {"system_prompt_tokens + question_tokens": system_prompt_tokens + question_tokens,
                   "output_tokens": output_tokens}, max_requests)
    if rate_per_s is not None:
        check_positive_float(rate_per_s, "rate_per_s")
    _check_sigma(output_tokens_sigma, "output_tokens_sigma")

    rng = np.random.default_rng(seed)
    n = num_groups * prompts_per_group
    prompt = system_prompt_tokens + question_tokens
    n_blocks = -(-prompt // block_size)
    shared = system_prompt_tokens // block_size
    order = rng.permutation(n) if shuffle else np.arange(n)
    arrivals = (np.zeros(n) if rate_per_s is None
                else np.cumsum(rng.exponential(1.0 / float(rate_per_s), size=n)))
    if ignore_eos or output_tokens_sigma == 0:
        outs = np.full(n, output_tokens, dtype=np.int64)
    else:
        mu = math.log(output_tokens) - output_tokens_sigma ** 2 / 2.0
        outs = np.maximum(np.rint(rng.lognormal(mu, output_tokens_sigma, size=n)), 1).astype(np.int64)

    root = _root("shared-prefix", seed)
    next_id = num_groups * shared  # ids below are the groups' system-prompt blocks
    out: list[Request] = []
    for pos, idx in enumerate(order):
        g, j = divmod(int(idx), prompts_per_group)
        ids = list(range(g * shared, (g + 1) * shared))
        own = n_blocks - shared
        ids.extend(range(next_id, next_id + own))
        next_id += own
        o = int(outs[pos])
        out.append(Request(request_id=f"g{g}-p{j}", arrival_time_s=float(arrivals[pos]), prompt_tokens=prompt,
                           block_hashes=tuple(chain_block_ids(ids, parent_hash=root)),
                           max_output_tokens=o, expected_output_tokens=o, session_id=f"g{g}",
                           traffic_class=traffic_class))
    return out


def load_ramp_workload(
    rates_per_s: Sequence[float],
    step_duration_s: float,
    *,
    prompt_tokens_mean: float = 1024,
    output_tokens_mean: float = 256,
    prompt_tokens_sigma: float = 0.0,
    output_tokens_sigma: float = 0.0,
    shared_prefix_tokens: int = 0,
    num_prefix_groups: int = 1,
    seed: int = 0,
    block_size: int = 512,
    max_requests: int = 10_000_000,
    traffic_class: str | None = None,
) -> list[Request]:
    """A Poisson process whose rate rises (or falls) in steps: ``rates_per_s[k]`` requests/s
    during ``[k * step_duration_s, (k + 1) * step_duration_s)``.

    Arrivals of step ``k`` are a homogeneous Poisson process on that interval (exponential gaps,
    the process restarted at each step boundary, which is exact: a Poisson process is memoryless).
    A rate of 0 leaves the step empty. Prompt / output lengths are lognormal with the given means
    (the distribution's mean: ``mu = ln(mean) - sigma^2 / 2``; the median is ``mean * exp(-sigma^2/2)``)
    and log-space sigmas in ``[0, MAX_LENGTH_SIGMA]`` (0 = constant, the usual ``random`` benchmark
    setting with range ratio 1), rounded and clipped to ``[1, 2^24]``. With ``shared_prefix_tokens``
    (0, or ``block_size`` .. ``prompt_tokens_mean``) each request joins one of ``num_prefix_groups``
    groups uniformly at random and shares its first ``min(shared_prefix_tokens, prompt) // block_size``
    blocks with the group (a drawn prompt shorter than the prefix shares its own length).

    Returns:
        Requests sorted by arrival, ids ``f"s{k}-r{i}"`` (step ``k``, ``i``-th of the step).

    Raises:
        ValueError: no rates, a negative or non-finite rate, every rate 0, ``step_duration_s <= 0``, bad lengths,
            a sigma outside ``[0, MAX_LENGTH_SIGMA]``, ``shared_prefix_tokens`` above ``prompt_tokens_mean`` or
            between 1 and ``block_size - 1``,
            a mean length over 2^24 tokens, or more than ``max_requests`` requests (the expected
            count ``sum(rates) * step`` is checked before anything is drawn, so a typo cannot
            exhaust memory), or more than :data:`MAX_WORKLOAD_BLOCKS` prompt blocks in all (checked
            once the lengths are drawn, before any hash is made).
    """
    rates = [float(r) for r in rates_per_s]
    if not rates:
        raise ValueError("rates_per_s: give at least one rate")
    for r in rates:
        if not math.isfinite(r) or r < 0:
            raise ValueError(f"rates_per_s: every rate must be a finite number >= 0, got {r!r}")
    if not any(rates):
        raise ValueError("rates_per_s: every rate is 0, so the workload would be empty; give at least one rate > 0")
    step = check_positive_float(step_duration_s, "step_duration_s")
    pmean = check_positive_float(prompt_tokens_mean, "prompt_tokens_mean")
    omean = check_positive_float(output_tokens_mean, "output_tokens_mean")
    for name, s in (("prompt_tokens_sigma", prompt_tokens_sigma), ("output_tokens_sigma", output_tokens_sigma)):
        _check_sigma(s, name)
    _check_nonneg_int(shared_prefix_tokens, "shared_prefix_tokens")
    check_positive_int(num_prefix_groups, "num_prefix_groups")
    check_positive_int(block_size, "block_size")
    if shared_prefix_tokens > pmean:  # else silently cut to each prompt's length
        raise ValueError(f"shared_prefix_tokens ({shared_prefix_tokens}) is longer than the prompts "
                         f"(prompt_tokens_mean {pmean:g}); a prefix is part of its prompt: lower shared_prefix_tokens "
                         "or raise prompt_tokens_mean")
    if 0 < shared_prefix_tokens < block_size:  # else silently nothing shared (prefixes are shared by whole blocks)
        raise ValueError(f"shared_prefix_tokens ({shared_prefix_tokens}) is shorter than one block (block_size "
                         f"{block_size}), so nothing would be shared; give 0 or at least {block_size}")
    check_positive_int(max_requests, "max_requests")
    _check_seed(seed)
    _check_bounds(0, 0, {"prompt_tokens_mean": pmean, "output_tokens_mean": omean}, max_requests)
    expected = sum(rates) * step
    if expected > max_requests:
        raise ValueError(f"the ramp expects {expected:,.0f} requests (sum of rates x step), more than "
                         f"max_requests={max_requests:,}; shorten the steps or lower the rates")

    rng = np.random.default_rng(seed)
    times: list[tuple[int, int, float]] = []
    for k, r in enumerate(rates):
        if r == 0:
            continue
        t, i, end = k * step, 0, (k + 1) * step
        while True:  # bounded: the count is Poisson(r * step) and capped below
            t += float(rng.exponential(1.0 / r))
            if t >= end:
                break
            times.append((k, i, t))
            i += 1
            if len(times) > max_requests:
                raise ValueError(f"more than max_requests={max_requests:,} arrivals drawn")
    n = len(times)

    def lengths(mean: float, sigma: float) -> np.ndarray:
        if sigma == 0:
            return np.full(n, max(1, round(mean)), dtype=np.int64)
        mu = math.log(mean) - sigma * sigma / 2.0
        return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, MAX_TRACE_TOKENS).astype(np.int64)

    prompts = lengths(pmean, float(prompt_tokens_sigma))
    outs = lengths(omean, float(output_tokens_sigma))
    _check_bounds(n, int(np.sum(-(-prompts // block_size))), {}, max_requests)
    shared = shared_prefix_tokens // block_size
    groups = rng.integers(0, num_prefix_groups, size=n) if shared else None
    root = _root("load-ramp", seed)
    next_id = num_prefix_groups * shared
    out: list[Request] = []
    for m, (k, i, t) in enumerate(times):
        p = int(prompts[m])
        nb = -(-p // block_size)
        ids: list[int] = []
        if groups is not None:
            kk = min(shared_prefix_tokens, p) // block_size
            base = int(groups[m]) * shared
            ids.extend(range(base, base + kk))
        own = nb - len(ids)
        ids.extend(range(next_id, next_id + own))
        next_id += own
        o = int(outs[m])
        out.append(Request(request_id=f"s{k}-r{i}", arrival_time_s=t, prompt_tokens=p,
                           block_hashes=tuple(chain_block_ids(ids, parent_hash=root)),
                           max_output_tokens=o, expected_output_tokens=o, traffic_class=traffic_class))
    return out
