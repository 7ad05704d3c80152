#!/usr/bin/env python3
"""Benchmark: routing decision latency per policy, and prefix-index memory.

For 8, 64 and 512 decode replicas (plus as many prefill replicas), prompts of 1k and 32k tokens
(512-token blocks, half of them sharing a prefix with earlier requests), measures
``Router.route`` wall time per request, p50 / p99, after a warm-up that routes until the prefix
index is full (2,048 blocks = 1M tokens per replica, about one GPU's KV; then every insert
evicts, as in a long-running router) or 20,000 decisions were made. The "index fill" column
says how full it got: policies that keep prompts on few replicas, and short prompts on many
replicas, leave most replicas' indexes partly empty. Baseline in the same run: ``round_robin`` (the cheapest policy), so the ratio column
shows what each policy costs on top of the router's fixed work. Then the prefix index alone
(one match and two inserts per decision) for the radix tree (``PrefixIndex``) against the flat
per-block index (``BlockIndex``) as the same-run baseline, and both indexes' bytes per million
held blocks (tracemalloc).

    .venv/bin/python bench/route_latency.py [--requests 2000]
    .venv/bin/python bench/route_latency.py --against ../main --policies ep_aware,round_robin \
        --prompts 32768 --rounds 3 --kv-events-per-s 2000

``--against DIR`` measures another checkout (e.g. main's) in the same run: every configuration
is measured ``--rounds`` times, alternating between DIR's ``balancer`` and this one's (each in its
own process), and the table gives both and the ratio of the medians, this / DIR: on a busy
host that ratio, not the absolute figures, is the measurement.

``--repeat N`` measures this checkout's table N times in one process, the configurations
interleaved round by round (round k measures every configuration once, starting k*C/N
configurations into the table of C: a fixed rotation, so a burst on the host lands on different
rows in different rounds), and prints per row the median p50 / p99 over the rounds with their
min-max range. Default 1: one sample per row, the table as before.

``--numpy-baseline`` does the same against this checkout with :mod:`balancer.kernels`' compiled
loops turned off (``use_compiled(False)``): what numba buys, the decisions being the same.

``--kv-events-per-s R`` runs the routers in events mode (``index_mode="events"``) and applies KV
events concurrently with the decisions: R events per second of wall-clock time (one
``BlockStored`` of a whole prompt of the workload on a random replica, or, one time in four, a
``BlockRemoved`` of a prompt's second half), applied with ``Router.on_kv_event`` between
decisions on the routing thread, as ``pdlb serve`` does (its subscriber thread hands events to
the event loop, ``LoopDelivery``, which applies them between requests); the warm-up applies one
event per warm-up decision. The index then changes under the decisions (new runs, removals,
splits), and the table's time is the decision's alone. 0 (default): approximate mode, no events.

Goals: issue 4: p99 <= 100 us at 64 replicas, <= 300 us at 512; issue 26: <= 100 / 200 us for
every policy, 32k-token prompts, with KV events applied concurrently.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np

#: the checkout whose ``balancer`` is measured: this one, or ``--against``'s (set for the child)
TREE_ENV = "PDLB_ROUTE_LATENCY_TREE"
# the list options' parser is this checkout's (standard library only), imported before the measured
# checkout (maybe an older one, without it) goes first on the path; nothing of balancer is imported here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdlb_cli.comma_lists import list_arg, one_of  # noqa: E402
sys.path.insert(0, os.environ.get(TREE_ENV) or str(Path(__file__).resolve().parents[1]))

from balancer.block_index import BlockIndex  # noqa: E402
from balancer.hashing import chain_block_ids  # noqa: E402
from balancer.kv_events import BlockRemoved, BlockStored  # noqa: E402
from balancer.policies import available_policies  # noqa: E402
from balancer.prefix_index import PrefixIndex  # noqa: E402
from balancer.router import Router  # noqa: E402
from balancer.types import Choice, ReplicaId, Request, Route  # noqa: E402

#: tokens per KV block: 512 (Mooncake's blocks; the anchors' setting) or ``--block-size`` (the live
#: router's default is 64: a 32k-token prompt is then 512 block hashes, not 64); the children of
#: ``--against`` read it from :data:`BLOCK_ENV`
BLOCK_ENV = "PDLB_ROUTE_LATENCY_BLOCK"
BLOCK = int(os.environ.get(BLOCK_ENV) or 512)


def make_requests(n: int, prompt_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    blocks = -(-prompt_tokens // BLOCK)
    roots = [[rng.getrandbits(40) for _ in range(blocks // 2)] for _ in range(32)]
    out = []
    for i in range(n):
        ids = rng.choice(roots) + [rng.getrandbits(40) for _ in range(blocks - blocks // 2)]
        out.append(Request(f"r{i}", 0.0, prompt_tokens, tuple(chain_block_ids(ids)), 128, 128))
    return out


#: Prefix-index bound per replica in the bench: 1M tokens (2,048 blocks of 512), about one GPU's HBM KV.
INDEX_CAPACITY_BLOCKS = 2048 * 512 // BLOCK  # 2,048 at 512-token blocks; the same tokens at other sizes
#: Most warm-up decisions (short prompts at 512 replicas would need millions to fill the index).
MAX_WARM = 20_000
#: With a decision log (``--decisions``), KV events are due as if each decision took this long
#: (a virtual clock: the events fall between the same decisions in every run).
VIRTUAL_DECISION_S = 100e-6


class _EventFeeder:
    """KV events for ``router`` at ``rate_per_s`` of wall-clock time (see the module docstring):
    a ``BlockStored`` of one of ``prompts`` on a random replica, every fourth event a
    ``BlockRemoved`` of the second half of a prompt. :meth:`catch_up` applies the events due
    since :meth:`start`, between two decisions, on the routing thread, as the service's
    ``LoopDelivery`` applies events on the event loop's thread between requests."""

    def __init__(self, router: Router, replicas: list[ReplicaId], prompts: list[tuple[int, ...]],
                 rate_per_s: float, seed: int = 3) -> None:
        self.router, self.replicas, self.prompts = router, replicas, prompts
        self.rate_per_s = rate_per_s
        self.rng = random.Random(seed)
        self.applied = 0
        self._t0 = 0.0
        self._due0 = 0
        #: seconds for :meth:`catch_up`: wall-clock time, or with a decision log a virtual clock
        #: that :meth:`tick` advances by :data:`VIRTUAL_DECISION_S` per decision (reproducible)
        self.clock: Callable[[], float] = time.perf_counter
        self._virtual_s = 0.0

    def virtual(self) -> None:
        """Run on the virtual clock (see :attr:`clock`): the same events between the same decisions
        in every run, so that two checkouts' decision logs can be compared byte for byte."""
        self.clock = lambda: self._virtual_s

    def tick(self) -> None:
        """One decision passed (the virtual clock advances by :data:`VIRTUAL_DECISION_S`)."""
        self._virtual_s += VIRTUAL_DECISION_S

    def event(self) -> None:
        """Apply one event now."""
        rng = self.rng
        rep = self.replicas[rng.randrange(len(self.replicas))]
        hs = self.prompts[rng.randrange(len(self.prompts))]
        if self.applied % 4 == 3:
            self.router.on_kv_event(rep, BlockRemoved(hs[len(hs) // 2:]))
        else:
            self.router.on_kv_event(rep, BlockStored(hs))
        self.applied += 1

    def start(self) -> None:
        self._t0, self._due0 = self.clock(), self.applied

    def catch_up(self) -> None:
        """Apply the events due by now (at most 10,000 at once: a stall does not snowball)."""
        due = self._due0 + int((self.clock() - self._t0) * self.rate_per_s)
        for _ in range(min(10_000, due - self.applied)):
            self.event()


def bench(policy: str, replicas: int, prompt_tokens: int, n: int,
          kv_events_per_s: float = 0.0, in_flight: int = 0, clock_name: str = "wall",
          compiled: bool = True, decision_log: list[str] | None = None) -> tuple[float, float, float]:
    """p50 and p99 decision latency (us) and the index fill (held / capacity) when measured.

    Warm-up first routes (and finishes) requests until every replica's index is full or
    :data:`MAX_WARM` decisions were made, so the measurement sees the steady state of a
    long-running router (LRU eviction on every insert, no dict growth), not a growing index.
    With ``kv_events_per_s`` > 0: events mode, the warm-up also applies as many KV events, and a
    thread applies events at that rate while the decisions are measured (module docstring).
    ``in_flight``: requests kept dispatched (the oldest finishes when one more is routed; 0: each
    finishes at once, an idle pool). ``clock_name``: ``"wall"`` (``perf_counter``) or ``"cpu"``
    (``thread_time``: this thread's CPU time, blind to the host preempting it). ``compiled``:
    False turns ``balancer.kernels``' compiled loops off (their numpy code runs). ``decision_log``:
    a list to append one CSV line per measured decision to (:func:`decision_line`); the KV events
    then run on the feeder's virtual clock (:meth:`_EventFeeder.virtual`), so the log is the same
    in every run of the same code.
    """
    if not compiled:
        from balancer import kernels

        kernels.use_compiled(False)
    events = kv_events_per_s > 0
    # the decision alone: no online cost fit (RouterConfig's default fits the model when ep_aware
    # reads it, which the service measures on its own), no total index bound (2,048 blocks per
    # replica stay under the 4,194,304 default anyway); both as the routers before RouterConfig
    router = Router(policy, policy, block_size=BLOCK, index_capacity_blocks=INDEX_CAPACITY_BLOCKS, seed=0,
                    index_mode="events" if events else "approximate", learn_cost_model=False,
                    index_total_capacity_blocks=None)
    reps = []
    for i in range(replicas):
        reps += [ReplicaId(f"p{i // 8}", i % 8), ReplicaId(f"d{i // 8}", i % 8)]
        router.add_replica(reps[-2], "prefill")
        router.add_replica(reps[-1], "decode", kv_capacity_tokens=1_000_000)
    blocks = -(-prompt_tokens // BLOCK)
    n_warm = min(MAX_WARM, max(n, 3 * replicas * INDEX_CAPACITY_BLOCKS // blocks))
    warm = make_requests(n_warm, prompt_tokens, seed=1)
    feeder = _EventFeeder(router, reps, [r.block_hashes for r in warm], kv_events_per_s or 1.0)
    if decision_log is not None:
        feeder.virtual()
    pending: deque[str] = deque()

    def finish_some(now_s: float) -> None:
        while len(pending) > in_flight:
            router.on_finished(pending.popleft(), now_s)

    for r in warm:
        router.route(r, 0.0)
        pending.append(r.request_id)
        finish_some(0.0)
        if events:
            feeder.event()
    fill = router.index.num_blocks() / (2 * replicas * INDEX_CAPACITY_BLOCKS)
    reqs = [Request("m" + r.request_id, 0.0, r.prompt_tokens, r.block_hashes, 128, 128)
            for r in make_requests(n, prompt_tokens, seed=2)]
    lat = np.empty(n)
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    feeder.start()
    for k, r in enumerate(reqs):
        if events:
            feeder.catch_up()
        t0 = clock()
        route = router.route(r, 1.0)
        lat[k] = clock() - t0
        if decision_log is not None:
            decision_log.append(decision_line(policy, replicas, prompt_tokens, route))
            feeder.tick()
        pending.append(r.request_id)
        finish_some(1.0)
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6), fill


def decision_line(policy: str, replicas: int, prompt_tokens: int, route: Route) -> str:
    """One decision as a CSV line: the configuration, the request, the chosen prefill and decode
    DP ranks with the policies' reasons, and the chosen ranks' scores (``repr``: every bit; empty
    for a policy that computes none)."""
    def chosen(choice: Choice | None, replica: ReplicaId | None) -> str:
        if choice is None or replica is None:
            return ",,"
        score = choice.scores.get(replica)  # empty for policies that compute none (round_robin)
        return f"{replica},{choice.reason},{'' if score is None else repr(score)}"
    return (f"{policy},{replicas},{prompt_tokens},{route.request_id},{chosen(route.prefill_choice, route.prefill)},"
            f"{chosen(route.decode_choice, route.decode)}")


def bench_in(tree: str | None, policy: str, replicas: int, prompt_tokens: int, n: int,
             kv_events_per_s: float, in_flight: int, clock_name: str, compiled: bool = True) -> tuple[float, float, float]:
    """:func:`bench` in a fresh process measuring ``tree``'s ``balancer`` (None: this checkout's),
    with its compiled loops on or off (``compiled``)."""
    env = dict(os.environ)
    env.pop(TREE_ENV, None)
    if tree:
        env[TREE_ENV] = str(Path(tree).resolve())
    conf = [policy, replicas, prompt_tokens, n, kv_events_per_s, in_flight, clock_name] + ([] if compiled else [False])
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(conf)],
                         env=env, check=True, capture_output=True, text=True).stdout
    p50, p99, fill = json.loads(out.strip().splitlines()[-1])
    return p50, p99, fill


def compare(args: argparse.Namespace, policies: list[str]) -> None:
    """This checkout against ``--against`` (or, with ``--numpy-baseline``, against itself with its
    compiled loops off), interleaved rounds; medians and ratios (this / that)."""
    base_name = "this checkout's numpy code (compiled loops off)" if args.numpy_baseline else args.against
    py_us, np_us = host_calibration_us()
    print(f"host: Python {sys.version.split()[0]}, numpy {np.__version__}; calibration (thread CPU, best of 20): "
          f"10,000 dict operations {py_us:.0f} us, 100 numpy adds of 64 floats {np_us:.0f} us")
    print(f"this checkout vs {base_name} (medians of {args.rounds} interleaved rounds, each its own process"
          + (f"; KV events {args.kv_events_per_s:g}/s, events mode" if args.kv_events_per_s else "; approximate mode")
          + f"; {args.in_flight} requests in flight; {args.clock} clock)")
    print(f"{'policy':<16}{'replicas':>9}{'prompt':>8}{'p50 us':>9}{'p99 us':>9}{'base p50':>10}{'base p99':>10}"
          f"{'p50 ratio':>11}{'p99 ratio':>11}")
    for replicas in args.replica_counts:
        for prompt in args.prompt_sizes:
            for policy in policies:
                ours, base = [], []
                for _ in range(args.rounds):
                    conf = (args.requests, args.kv_events_per_s, args.in_flight, args.clock)
                    base.append(bench_in(None, policy, replicas, prompt, *conf, compiled=False) if args.numpy_baseline
                                else bench_in(args.against, policy, replicas, prompt, *conf))
                    ours.append(bench_in(None, policy, replicas, prompt, *conf))
                o50, o99 = (statistics.median(x[i] for x in ours) for i in (0, 1))
                b50, b99 = (statistics.median(x[i] for x in base) for i in (0, 1))
                print(f"{policy:<16}{replicas:>9}{prompt:>8}{o50:>9.1f}{o99:>9.1f}{b50:>10.1f}{b99:>10.1f}"
                      f"{o50 / b50:>11.2f}{o99 / b99:>11.2f}", flush=True)


#: Most rounds of ``--repeat`` (every input-driven loop is bounded).
MAX_REPEAT = 100


def interleaved_rounds(configs: list[Any], repeat: int, measure: Callable[[Any], Any],
                       progress: Callable[[int, float], None] | None = None) -> dict[Any, list[Any]]:
    """``measure(config)`` ``repeat`` times for every one of ``configs``, round by round: round k
    (0-based) measures each configuration once, in the table's order rotated to start at
    configuration ``k * len(configs) // repeat`` (so a burst on the host lands on different rows in
    different rounds, and no row is always first or last). Returns config -> its ``repeat``
    results in round order. ``progress(k, seconds)``: called after each round with its wall
    seconds (for the log). Raises ValueError for ``repeat`` < 1,
    repeated configurations or none."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if not configs or len(set(configs)) != len(configs):
        raise ValueError("configs must be non-empty and distinct")
    out: dict[Any, list[Any]] = {c: [] for c in configs}
    n = len(configs)
    for k in range(repeat):
        t0 = time.perf_counter()
        start = k * n // repeat
        for c in configs[start:] + configs[:start]:
            out[c].append(measure(c))
        if progress is not None:
            progress(k, time.perf_counter() - t0)
    return out


def summarise_rounds(results: list[tuple[float, float, float]]) -> dict[str, float]:
    """One row's rounds, each ``bench``'s (p50 us, p99 us, index fill): the medians of p50, p99 and
    fill over the rounds (``statistics.median``: the mean of the middle two for an even count) and
    the min and max of p50 and p99. Raises ValueError for no rounds."""
    if not results:
        raise ValueError("no rounds")
    p50s, p99s, fills = ([r[i] for r in results] for i in range(3))
    return {"p50": statistics.median(p50s), "p99": statistics.median(p99s), "fill": statistics.median(fills),
            "p50_min": min(p50s), "p50_max": max(p50s), "p99_min": min(p99s), "p99_max": max(p99s)}


def repeated_table(args: argparse.Namespace, policies: list[str], conf: tuple[int, float, int, str]) -> list[str]:
    """``--repeat`` N > 1: the decision table measured N times (:func:`interleaved_rounds` over
    every (replicas, prompt, policy), round_robin always among them as the ratio's baseline), one
    line per row (medians over rounds, min-max ranges, p99 / round_robin's median p99)."""
    configs = [(replicas, prompt, policy) for replicas in args.replica_counts for prompt in args.prompt_sizes
               for policy in ["round_robin"] + [p for p in policies if p != "round_robin"]]
    results = interleaved_rounds(
        configs, args.repeat, lambda c: bench(c[2], c[0], c[1], *conf),
        lambda k, s: print(f"round {k + 1} of {args.repeat} measured ({s:.1f} s)", flush=True))
    def span(lo: float, hi: float) -> str:
        return f"{lo:.1f}-{hi:.1f}"

    lines = [f"medians of {args.repeat} rounds (ranges: min-max over the rounds); configurations interleaved, "
             f"round k (from 0) starting at configuration k*{len(configs)}//{args.repeat} of the table",
             f"{'policy':<16}{'replicas':>9}{'prompt':>8}{'p50 us':>9}{'p99 us':>9}{'p50 range':>15}{'p99 range':>15}"
             f"{'p99 / round_robin':>19}{'index fill':>12}"]
    for replicas in args.replica_counts:
        for prompt in args.prompt_sizes:
            base = summarise_rounds(results[(replicas, prompt, "round_robin")])
            for policy in policies:
                r = summarise_rounds(results[(replicas, prompt, policy)])
                lines.append(f"{policy:<16}{replicas:>9}{prompt:>8}{r['p50']:>9.1f}{r['p99']:>9.1f}"
                             f"{span(r['p50_min'], r['p50_max']):>15}{span(r['p99_min'], r['p99_max']):>15}"
                             f"{r['p99'] / base['p99']:>19.2f}{100 * r['fill']:>11.0f}%")
    return lines


def hashing_us(prompt_tokens: int, block_size: int, n: int = 200) -> tuple[float, float]:
    """p50 / p99 (us, thread CPU time) of hashing one prompt's token ids into its block hashes as
    the service does before it routes (:meth:`PromptHasher.hash_token_ids` of a token-id array, at
    ``block_size`` tokens per block; the xxhash package's XXH3-64 per block): work the service pays
    per request that ``Router.route`` (the decision measured in the tables) does not include."""
    from balancer.service.prompt import PromptHasher

    hasher = PromptHasher(block_size)
    rng = np.random.default_rng(0)
    lat = np.empty(n)
    for k in range(n):
        ids = rng.integers(0, 150_000, prompt_tokens)
        t0 = time.thread_time()
        hasher.hash_token_ids(ids)
        lat[k] = time.thread_time() - t0
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def hashing_lines(prompt_sizes: list[int]) -> list[str]:
    """One line per prompt size and block size (the bench's, and 64 tokens, ``pdlb serve``'s
    default): the hashing's p50 / p99."""
    out = []
    for prompt in prompt_sizes:
        for bs in sorted({BLOCK, 64}):
            h50, h99 = hashing_us(prompt, bs)
            out.append(f"block hashing of one {prompt}-token prompt at {bs}-token blocks ({prompt // bs} blocks; pdlb "
                       f"serve hashes the token ids before it routes): p50 {h50:.1f} us, p99 {h99:.1f} us")
    return out


def prefill_kernel_lines(replica_counts: list[int], pools: int = 64, rounds: int = 5) -> list[str]:
    """One line per replica count: ``ep_aware``'s wide-EP prefill kernel (features, horizon,
    ``N_after``; :func:`balancer.kernels.prefill_ep_rows`) on ``pools`` random pools that differ
    in every rank (a third of the ranks idle, queues up to 60k tokens, prefix hits 0-63 blocks),
    cycled so that no branch pattern repeats within a call, against its branching loop
    (``prefill_ep_rows_plain``, the same bits) in the same run: thread CPU per call, best of
    ``rounds``. The decision table's pools repeat the same few queues decision after decision
    (every rank's branches predictable), which hides the difference; real queues and hits differ by
    rank. Empty when numba is not installed."""
    from balancer import kernels
    from balancer.cost_model import engine_groups

    k = kernels.compiled()
    if k is None:
        return []
    out = []
    rng = np.random.default_rng(0)
    for replicas in replica_counts:
        reps = tuple(ReplicaId(f"p{i // 8}", i % 8) for i in range(replicas))
        _, idx, rows = engine_groups(reps)
        if rows is None:
            continue
        n = len(reps)
        data = []
        for _ in range(pools):
            q = rng.integers(0, 60_000, n).astype(np.float64) * (rng.random(n) < 0.7)
            cached = np.minimum(rng.integers(0, 64, n) * 512.0, 32_767.0)
            data.append((q, q * rng.uniform(0, 3000, n), 32_768.0 - cached, cached, rng.integers(0, 40, n)))
        res = np.empty((n, 4)), np.empty(n), np.empty(n)
        best = {}
        for name in ("prefill_ep_rows", "prefill_ep_rows_plain") * rounds:
            fn = getattr(k, name)
            t0 = time.thread_time()
            for q, a, u, cached, n_req in data:
                fn(q, a, u, cached, n_req, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *res)
            best[name] = min(best.get(name, np.inf), (time.thread_time() - t0) / pools * 1e6)
        sel, plain = best["prefill_ep_rows"], best["prefill_ep_rows_plain"]
        out.append(f"ep_aware prefill kernel, {replicas} ranks (8 per engine), {pools} random pools cycled: selects "
                   f"{sel:.1f} us, branching loop {plain:.1f} us per call (thread CPU, best of {rounds}); ratio "
                   f"{sel / plain:.2f}")
    return out


def prefill_memo_lines(replica_counts: list[int], decisions: int = 400, rounds: int = 5) -> list[str]:
    """Two lines per replica count: ``ep_aware``'s wide-EP prefill kernel with its memo
    (:func:`balancer._jit_kernels.prefill_ep_rows_memo`, with the router's share rule: per-rank and
    per-engine numbers kept between decisions) against the same kernel afresh (``prefill_ep_rows``,
    the same bits) in the same run, on a pool whose load changes as a router's does between two
    decisions: each decision moves two ranks' queues (its own dispatch and a finish). Two kinds
    of pools: queues shorter than the prompt (under 16k tokens; 32k-token prompts with hits of at
    most 8 blocks: every candidate's ``X`` reaches past its engine's queues, the memo's case) and
    random queues up to 60k tokens with hits of 0-63 blocks per rank (most candidates' ``X`` below
    some queue of their engine: the share rule hands them to the fresh kernel). Thread CPU per
    call, best of ``rounds``; and the memo's first call (every engine computed: after a pool
    change or a refit of the cost model). Empty without numba."""
    from balancer import kernels
    from balancer.cost_model import engine_groups

    k = kernels.compiled()
    if k is None:
        return []
    out = []
    for replicas in replica_counts:
        reps = tuple(ReplicaId(f"p{i // 8}", i % 8) for i in range(replicas))
        _, idx, rows = engine_groups(reps)
        if rows is None:
            continue
        n = len(reps)
        for kind, q_max, hit_blocks in (("queues under 16k tokens", 16_000, 9), ("random queues to 60k", 60_000, 64)):
            rng = np.random.default_rng(1)
            q = rng.integers(0, q_max, n).astype(np.float64) * (rng.random(n) < 0.7)
            a = q * rng.uniform(0, 3000, n)
            n_req = rng.integers(0, 40, n)
            steps = []
            for _ in range(decisions):  # the same sequence for both kernels
                q2, a2, n2 = q.copy(), a.copy(), n_req.copy()
                for r in rng.integers(0, n, 2):
                    q2[r] = float(rng.integers(0, q_max))
                    a2[r] = q2[r] * rng.uniform(0, 3000)
                    n2[r] = int(rng.integers(0, 40))
                cached = np.minimum(rng.integers(0, hit_blocks, n) * 512.0, 32_767.0)
                steps.append((q2, a2, 32_768.0 - cached, cached, n2.astype(np.float64)))  # counts as the queues
                q, a, n_req = q2, a2, n2
            res = np.empty((n, 4)), np.empty(n), np.empty(n)
            memo = (np.zeros(4), np.zeros((k.MEMO_RANK_ROWS, n)), np.zeros((len(rows), 2)),
                    np.zeros((len(rows), 2), dtype=np.int64))
            share = k.MEMO_MAX_BELOW
            best = {"memo": np.inf, "fresh": np.inf, "first": np.inf}
            answered = 0
            for _ in range(rounds):
                memo[0][3] = 0.0  # stale: the first call computes every engine
                t0 = time.thread_time()
                k.prefill_ep_rows_memo(*steps[0], 8192.0, 5.1e-5, 1e-8, idx, rows, *res, share, *memo)
                best["first"] = min(best["first"], (time.thread_time() - t0) * 1e6)
                answered = 0
                t0 = time.thread_time()
                for st in steps[1:]:
                    answered += k.prefill_ep_rows_memo(*st, 8192.0, 5.1e-5, 1e-8, idx, rows, *res, share, *memo) == 2
                best["memo"] = min(best["memo"], (time.thread_time() - t0) / (decisions - 1) * 1e6)
                t0 = time.thread_time()
                for st in steps[1:]:
                    k.prefill_ep_rows(*st, 8192.0, 5.1e-5, 1e-8, idx, rows, True, *res)
                best["fresh"] = min(best["fresh"], (time.thread_time() - t0) / (decisions - 1) * 1e6)
            out.append(f"ep_aware prefill kernel with its memo, {replicas} ranks (8 per engine), {kind}, 2 ranks' load "
                       f"changed per decision: memo {best['memo']:.1f} us (it answered {answered} of {decisions - 1}), "
                       f"afresh {best['fresh']:.1f} us per call (thread CPU, best of {rounds}); ratio "
                       f"{best['memo'] / best['fresh']:.2f}; the memo's first call (every engine) {best['first']:.1f} us")
    return out


def host_calibration_us() -> tuple[float, float]:
    """Thread CPU microseconds of two fixed pieces of work that use no pdlb code: a pure-Python
    loop (10,000 dict stores and loads) and 100 small numpy calls (``np.add`` of two 64-element
    float64 arrays); the fastest of 20 runs each. Decision times from two hosts compare through
    these (a host whose Python runs 3x slower decides 3x slower)."""
    def py_loop() -> None:
        d: dict[int, int] = {}
        for i in range(10_000):
            d[i & 1023] = d.get(i & 511, 0) + i

    x, y = np.ones(64), np.ones(64)

    def np_calls() -> None:
        for _ in range(100):
            np.add(x, y)

    out = []
    for fn in (py_loop, np_calls):
        best = np.inf
        for _ in range(20):
            t0 = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t0)
        out.append(best * 1e6)
    return out[0], out[1]


def index_bytes_per_million_blocks(index_cls: Callable[[], object], num_blocks: int = 200_000, replicas: int = 8) -> float:
    """Bytes per million held blocks (replica, block pairs) when every replica holds its own
    distinct 32-block prompts: no sharing, the tree's worst case per block."""
    rng = random.Random(0)
    prompts = [tuple(chain_block_ids([rng.getrandbits(40) for _ in range(32)]))
               for _ in range(num_blocks // 32)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    idx = index_cls()
    for k, p in enumerate(prompts):
        idx.insert(ReplicaId("e", k % replicas), p)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(st.size_diff for st in after.compare_to(before, "filename"))
    return used / idx.num_blocks() * 1e6


def index_only(index_cls: type, replicas: int, prompt_tokens: int, n: int) -> tuple[float, float]:
    """p50 / p99 (us) of the prefix-index work of one PD decision alone (one match, two inserts
    on random replicas), in steady state (index full, every insert evicts)."""
    idx = index_cls(INDEX_CAPACITY_BLOCKS)
    reps = [ReplicaId(f"e{i // 8}", i % 8) for i in range(replicas)]
    rng = random.Random(0)
    blocks = -(-prompt_tokens // BLOCK)
    n_warm = min(MAX_WARM, max(n, 3 * replicas * INDEX_CAPACITY_BLOCKS // (2 * blocks)))
    for r in make_requests(n_warm, prompt_tokens, seed=1):
        a, b = rng.sample(reps, 2)
        idx.insert(a, r.block_hashes)
        idx.insert(b, r.block_hashes)
    # the tree answers the router's vectorised query; the flat index its per-replica dict
    match = idx.match_depths if isinstance(idx, PrefixIndex) else idx.match
    lat = np.empty(n)
    clock = time.perf_counter
    for k, r in enumerate(make_requests(n, prompt_tokens, seed=2)):
        a, b = rng.sample(reps, 2)
        t0 = clock()
        match(r.block_hashes)
        idx.insert(a, r.block_hashes, 1.0)
        idx.insert(b, r.block_hashes, 1.0)
        lat[k] = clock() - t0
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def _count(text: str) -> int:
    """A ``--replicas`` / ``--prompts`` item: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    from pdlb_cli.arg_types import int_between, nonnegative_float, nonnegative_int, positive_int
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=positive_int, default=2000, help="measured decisions per configuration (default 2000)")
    ap.add_argument("--replicas", default="8,64,512", help="comma-separated replica counts per pool (default 8,64,512)")
    ap.add_argument("--prompts", default="1024,32768", help="comma-separated prompt sizes, tokens (default 1024,32768)")
    ap.add_argument("--policies", default="", help="comma-separated policies (default: all registered)")
    ap.add_argument("--kv-events-per-s", type=nonnegative_float, default=0.0, metavar="R",
                    help="events mode with R KV events per second applied concurrently (default 0: approximate mode)")
    ap.add_argument("--against", metavar="DIR", help="another checkout to measure in the same run (ratios this / DIR)")
    ap.add_argument("--numpy-baseline", action="store_true",
                    help="like --against, the baseline being this checkout with balancer.kernels' compiled loops off")
    ap.add_argument("--rounds", type=positive_int, default=3, help="with --against: interleaved rounds (default 3)")
    ap.add_argument("--repeat", type=int_between(1, MAX_REPEAT), default=1, metavar="N",
                    help=f"without --against: measure the table N times, configurations interleaved round by round; "
                         f"per row the median p50/p99 and their min-max range (default 1: one sample per row; "
                         f"at most {MAX_REPEAT})")
    ap.add_argument("--in-flight", type=nonnegative_int, default=0, metavar="N",
                    help="requests kept in flight, so that policies see load (default 0: each finishes at once)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter (default); cpu: the thread's CPU time, blind to preemption on a busy host")
    ap.add_argument("--block-size", type=positive_int, default=512, metavar="TOKENS",
                    help="tokens per KV block (default 512, the anchors' setting; pdlb serve's default is 64)")
    ap.add_argument("--decisions", metavar="FILE",
                    help="write every measured decision (chosen ranks, reasons, scores) to FILE as CSV; KV events "
                         "then run on a virtual clock (100 us per decision), so two checkouts' files compare byte "
                         "for byte (PDLB_ROUTE_LATENCY_TREE=DIR measures DIR's balancer)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process of --against: one JSON configuration
    return ap


def list_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--replicas``, ``--prompts`` and ``--policies`` read through :mod:`pdlb_cli.comma_lists`
    into ``args.replica_counts``, ``args.prompt_sizes`` and ``args.policy_names`` (all registered
    policies for ``--policies ""``, the default); a bad list stops ``ap`` naming the option."""
    args.replica_counts = list_arg(ap, "--replicas", args.replicas, "replica counts >= 1", _count)
    args.prompt_sizes = list_arg(ap, "--prompts", args.prompts, "prompt sizes in tokens >= 1", _count)
    args.policy_names = (available_policies() if args.policies == "" else  # the default; "  " is refused
                         list_arg(ap, "--policies", args.policies, "policies", one_of(available_policies())))


def check_repeat(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--repeat``: an integer 1..:data:`MAX_REPEAT`, only for this checkout's table (``--against``
    and ``--numpy-baseline`` have ``--rounds``), not with ``--decisions`` (one log per run); else
    ``ap`` stops naming the option (exit status 2)."""
    if not 1 <= args.repeat <= MAX_REPEAT:
        ap.error(f"--repeat must be an integer from 1 to {MAX_REPEAT}, got {args.repeat}")
    if args.repeat > 1 and (args.against or args.numpy_baseline):
        ap.error("--repeat is for this checkout's table alone; with --against or --numpy-baseline use --rounds")
    if args.repeat > 1 and args.decisions:
        ap.error("--repeat with --decisions: the decision log is one run's (give --repeat 1)")


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    global BLOCK, INDEX_CAPACITY_BLOCKS
    if args.block_size < 1:
        ap.error("--block-size must be >= 1")
    if args.block_size != BLOCK:  # for this process and the --against children
        os.environ[BLOCK_ENV] = str(args.block_size)
        BLOCK, INDEX_CAPACITY_BLOCKS = args.block_size, 2048 * 512 // args.block_size
    if args.one:
        print(json.dumps(bench(*json.loads(args.one))))
        return 0
    if args.requests < 1 or args.rounds < 1 or args.kv_events_per_s < 0 or args.in_flight < 0:
        ap.error("--requests and --rounds must be >= 1, --kv-events-per-s and --in-flight >= 0")
    list_options(ap, args)
    check_repeat(ap, args)
    policies = args.policy_names
    if args.against and args.numpy_baseline:
        ap.error("--against and --numpy-baseline are two baselines: give one")
    if args.decisions and (args.against or args.numpy_baseline):
        ap.error("--decisions logs one checkout's decisions: run it once per checkout (PDLB_ROUTE_LATENCY_TREE)")
    if args.against or args.numpy_baseline:
        compare(args, policies)
        return 0
    rate = args.kv_events_per_s
    py_us, np_us = host_calibration_us()
    from balancer import kernels

    print(f"host: Python {sys.version.split()[0]}, numpy {np.__version__}, compiled kernels (numba): "
          f"{'yes' if kernels.compiled() is not None else 'no: numpy code'}; calibration (thread CPU, best of 20): 10,000 dict "
          f"operations {py_us:.0f} us, 100 numpy adds of 64 floats {np_us:.0f} us")
    print(("events mode, KV events applied concurrently at %g/s" % rate if rate else "approximate mode (no KV events)")
          + f"; {args.in_flight} requests in flight; {args.clock} clock")
    conf = (args.requests, rate, args.in_flight, args.clock)
    log: list[str] | None = [] if args.decisions else None
    print(f"{BLOCK}-token blocks; the time is Router.route's (prefix match, both pools' candidates and policies, "
          "load and index bookkeeping); the prompt's block hashing is not in it (its own line below)")
    if args.repeat > 1:
        for line in repeated_table(args, policies, conf):
            print(line, flush=True)
    else:
        print(f"{'policy':<16}{'replicas':>9}{'prompt':>8}{'p50 us':>9}{'p99 us':>9}{'p99 / round_robin':>19}"
              f"{'index fill':>12}")
    for replicas in (args.replica_counts if args.repeat == 1 else []):
        for prompt in args.prompt_sizes:
            base = bench("round_robin", replicas, prompt, *conf, decision_log=log if "round_robin" in policies else None)
            for policy in policies:
                p50, p99, fill = base if policy == "round_robin" else bench(policy, replicas, prompt, *conf,
                                                                             decision_log=log)
                print(f"{policy:<16}{replicas:>9}{prompt:>8}{p50:>9.1f}{p99:>9.1f}{p99 / base[1]:>19.2f}"
                      f"{100 * fill:>11.0f}%")
    if log is not None:
        Path(args.decisions).write_text("policy,replicas,prompt_tokens,request,prefill,prefill_reason,prefill_score,"
                                        "decode,decode_reason,decode_score\n" + "".join(line + "\n" for line in log))
        print(f"{len(log)} decisions written to {args.decisions}")
    for line in hashing_lines(args.prompt_sizes) + prefill_kernel_lines(args.replica_counts) + \
            prefill_memo_lines(args.replica_counts):
        print(line)
    print()
    print("prefix index alone, one PD decision (match + 2 inserts), steady state; baseline: the flat"
          " BlockIndex in the same run")
    print(f"{'replicas':>9}{'prompt':>8}{'tree p50':>10}{'tree p99':>10}{'flat p50':>10}{'flat p99':>10}"
          f"{'p50 tree/flat':>15}")
    for replicas in args.replica_counts:
        for prompt in args.prompt_sizes:
            t50, t99 = index_only(PrefixIndex, replicas, prompt, args.requests)
            f50, f99 = index_only(BlockIndex, replicas, prompt, args.requests)
            print(f"{replicas:>9}{prompt:>8}{t50:>10.1f}{t99:>10.1f}{f50:>10.1f}{f99:>10.1f}{t50 / f50:>15.2f}")
    flat_mb = index_bytes_per_million_blocks(BlockIndex) / 1e6
    tree_mb = index_bytes_per_million_blocks(PrefixIndex) / 1e6
    mapped_mb = index_bytes_per_million_blocks(functools.partial(PrefixIndex, block_map=True)) / 1e6
    print(f"memory per million held blocks (unshared 32-block prompts): flat {flat_mb:.1f} MB; tree {tree_mb:.1f} MB"
          f" ({tree_mb / flat_mb:.2f}x), tree with its block map (events mode) {mapped_mb:.1f} MB"
          f" ({mapped_mb / flat_mb:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
