"""Sim-to-live: one small workload through ``pdlb serve`` + emulated engines (real processes) and
through the simulator (:func:`sim.run.cluster.simulate`) with matching pools; mean TTFT (less the live
path's own time, measured by probes in the same run) and TPOT agree within 5%. Both sides use the
same roofline perf model (Llama-3.1-70B, H100, TP4 per engine), the same policies (round robin)
and the same block hashing; the emulated engines run at SPEED x real time and live times are
multiplied back by SPEED.

The emulated decode engine moves only the prompt blocks its prefix cache lacks, as the simulator
does (sessions come back to the same decode engine under round robin here).

SPEED = 0.5 (engines run at half real time): the live path adds real time per request (client ->
router -> both legs -> bootstrap poll -> first SSE chunk back, Python on a small host) that the
simulator does not model, and it grows faster than linearly with SPEED on a busy 2-core host (6
processes share it), so it is CPU starvation rather than a fixed per-request HTTP cost. Measured
live - sim TTFT gap (load average ~5): SPEED 0.25: 2.1% (0.7 ms real), 0.5: 3.4% (2.3 ms),
1.0: 7.8-9.0% (10-12 ms). TPOT agrees within 0.2% at every speed (decode steps run on a virtual
clock).

Why TTFT is compared without the live path's own time: that time is host time, not engine time.
The engines step on a virtual clock, so the simulator models them exactly; every live leg
(client, router, both legs, the first SSE chunk; 6 processes on 2 shared cores) only adds real
time per request, and it grows with host load: the raw gap was 2-5% at load averages 1.5-5
and once 5.2% under other jobs, +10% with one extra busy process. So the workload carries pairs
of probes (one block, 2 output tokens) among its requests; their live TTFT minus their simulated
TTFT is the path's time at that moment, and the check subtracts its mean from the live mean.
Measured (2026-12-01, 2 cores shared by 5 agents): raw +4.3% -> -0.5% (load 4.4), +5.2% -> +1.3%
(5.4), +10.0% -> -0.0% (6.3, plus a busy process). Live faster than the simulator by more than
5% cannot come from the host and fails as it is. TPOT needs nothing of the kind (0.0-0.4%).
What the probes cannot tell from host time is a model error of the same size for every request
whatever its prompt (a fixed per-request latency); errors that scale with the prompt, the
queueing, the cache hits and the KV moved still show in full.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import numpy as np

from balancer.hashing import hash_token_blocks
from balancer.types import Request
from sim.run.cluster import simulate
from sim.emulator.testing import spawn_engines, spawn_router
from sim.run.metrics import per_request
from sim.scenario import PoolConfig, Scenario

SPEED = 0.5
BLOCK = 64
MODEL = ("--model", "llama-3.1-70b", "--hardware", "h100", "--gpus-per-rank", "4", "--block-size", str(BLOCK),
         "--speed", str(SPEED))


def _workload(n: int = 20, gap_s: float = 0.3, seed: int = 1) -> tuple[list[tuple[float, list[int], int]], np.ndarray]:
    """``(arrival_s, prompt token ids, output tokens)`` per request, and which are probes.

    ``n`` requests whose prompts share per-session prefixes, and after every 4th a pair of probes
    (one 64-token block of fresh tokens, 2 output tokens) at a third and two thirds of the gap: in
    pairs, so round robin still sends each session back to the same engines."""
    rng = random.Random(seed)
    sessions = [[rng.randrange(1, 30000) for _ in range(rng.randrange(1000, 3000))] for _ in range(4)]
    out, probe = [], []
    for i in range(n):
        prefix = sessions[i % 4]
        ids = prefix + [rng.randrange(1, 30000) for _ in range(rng.randrange(500, 2000))]
        out.append((i * gap_s, ids, rng.randrange(16, 48)))
        probe.append(False)
        if i % 4 == 3:
            for k in (1, 2):
                out.append((i * gap_s + k * gap_s / 3, [rng.randrange(1, 30000) for _ in range(BLOCK)], 2))
                probe.append(True)
    return out, np.array(probe)


async def _live(url: str, work) -> tuple[np.ndarray, np.ndarray]:
    """Per request (in ``work``'s order): TTFT and TPOT in engine time (real time x SPEED)."""
    ttft, tpot = np.full(len(work), np.nan), np.full(len(work), np.nan)

    async def one(s: aiohttp.ClientSession, t_start: float, i: int, arrival: float, ids: list[int], n_out: int) -> None:
        await asyncio.sleep(max(0.0, t_start + arrival / SPEED - time.monotonic()))
        t0 = time.monotonic()
        stamps = []
        async with s.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": n_out, "stream": True}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {") and b'"text": " t' in line:
                    stamps.append(time.monotonic())
        assert len(stamps) == n_out
        ttft[i] = (stamps[0] - t0) * SPEED
        tpot[i] = (stamps[-1] - stamps[0]) / (n_out - 1) * SPEED

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        t_start = time.monotonic() + 0.2
        await asyncio.gather(*(one(s, t_start, i, a, ids, n) for i, (a, ids, n) in enumerate(work)))
    return ttft, tpot


def _sim(work) -> tuple[np.ndarray, np.ndarray]:
    pool_p = PoolConfig(num_engines=2, dp_ranks=1, gpus_per_rank=4, max_prefill_tokens=8192, max_decode_batch=256)
    pool_d = PoolConfig(num_engines=2, dp_ranks=1, gpus_per_rank=4, max_prefill_tokens=8192, max_decode_batch=256)
    sc = Scenario(name="sim-to-live", model="llama-3.1-70b", hardware="h100", block_size=BLOCK,
                  prefill=pool_p, decode=pool_d, fast_forward=False)
    reqs = [Request(f"r{i}", a, len(ids), tuple(hash_token_blocks(ids, BLOCK)), max_output_tokens=n,
                    expected_output_tokens=n) for i, (a, ids, n) in enumerate(work)]
    res = simulate(sc, reqs, "round_robin", "round_robin")
    pr = per_request(res)  # row i: the i-th request of work
    return pr["ttft_s"], pr["tpot_s"]


async def _measure_live(work) -> tuple[np.ndarray, np.ndarray]:
    """Live TTFTs and TPOTs of ``work`` on a fresh router and 4 emulated engines."""
    engines = spawn_engines([("prefill", *MODEL), ("prefill", *MODEL), ("decode", *MODEL), ("decode", *MODEL)])
    procs = list(engines)
    try:
        router = spawn_router("sglang", engines[:2], engines[2:], "--prefill-policy", "round_robin",
                              "--decode-policy", "round_robin", "--block-size", str(BLOCK))
        procs.append(router)
        return await _live(router.url, work)
    finally:
        for p in procs:
            p.stop()



async def test_sim_and_live_agree_within_5_percent():
    work, probe = _workload()
    sim_ttft, sim_tpot = _sim(work)
    live_ttft, live_tpot = await _measure_live(work)
    real = ~probe
    # the live path's own time per request, measured on the probes at the same moments (their sim
    # TTFT, a few ms of queueing and one block, is what the engines spend; the rest is the path)
    path_s = float(np.mean(live_ttft[probe] - sim_ttft[probe]))
    raw_gap = live_ttft[real].mean() / sim_ttft[real].mean() - 1
    ttft_gap = (live_ttft[real].mean() - path_s) / sim_ttft[real].mean() - 1
    tpot_gap = abs(live_tpot[real].mean() / sim_tpot[real].mean() - 1)
    print(f"\nload average {os.getloadavg()[0]:.1f}: TTFT mean live {live_ttft[real].mean() * 1e3:.1f} ms vs sim "
          f"{sim_ttft[real].mean() * 1e3:.1f} ms ({raw_gap:+.1%}); live path {path_s * 1e3:.1f} ms "
          f"({path_s * 1e3 * SPEED:.1f} ms real) per request from {probe.sum()} probes; without it {ttft_gap:+.1%}; "
          f"TPOT mean live {live_tpot[real].mean() * 1e3:.2f} ms vs sim {sim_tpot[real].mean() * 1e3:.2f} ms "
          f"({tpot_gap:.1%}); speed x{SPEED}")
    assert abs(ttft_gap) < 0.05 and tpot_gap < 0.05
    assert raw_gap > -0.05  # live faster than the engines' model: no host load explains that
