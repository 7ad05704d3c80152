#!/usr/bin/env python3
"""Benchmark (perf model only): prefill time of one long prompt vs context-parallel degree.

Mooncake's conversation trace reaches 126k-token prompts. On one DP rank such a prefill takes
longer than a 2 s TTFT SLO whatever the cluster size (more engines do not split one prompt);
context-parallel prefill splits it over the GPUs of a rank. This prints, for an 8-GPU EP engine
of each model, the prefill time of one prompt (no cached prefix, chunks of ``--chunk`` tokens, the
other ranks idle) when the 8 GPUs are 8 DP ranks (CP1, the baseline), 4 x CP2, 2 x CP4 or 1 x CP8,
with each configuration's speed-up over CP1 measured in the same run:

    .venv/bin/python bench/long_prompt_cp.py [--tokens 126000] [--chunk 16384]

Roofline defaults (mfu 0.5, mbu 0.7, 2 ms per step); CP terms as in ``sim/perf/roofline.py``.
"""

from __future__ import annotations

import argparse

import numpy as np

from sim.perf.base import causal_attn_pairs
from sim.perf.roofline import RooflinePerf

CASES = (("deepseek-v3", "H200"), ("deepseek-v4-flash", "B200"))


def prefill_time_s(model: str, hardware: str, cp: int, tokens: int, chunk: int, gpus: int = 8) -> float:
    e = RooflinePerf.for_engine(model, hardware, num_dp_ranks=gpus // cp, gpus_per_rank=cp,
                                ep_synchronous=True, context_parallel=cp > 1)
    R = gpus // cp
    total, done = 0.0, 0
    while done < tokens:
        c = min(chunk, tokens - done)
        pt, pp = np.zeros(R), np.zeros(R)
        pt[0], pp[0] = c, causal_attn_pairs(c, done)
        total += float(e.step_time_s(pt, pp, np.zeros(R), np.zeros(R), prefill_cached_tokens=np.where(pt > 0, done, 0)))
        done += c
    return total


def main() -> None:
    from pdlb_cli.arg_types import positive_int
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=positive_int, default=126_000, help="prompt tokens (default 126,000)")
    ap.add_argument("--chunk", type=positive_int, default=16_384, help="chunked-prefill budget per step (default 16,384)")
    a = ap.parse_args()
    print(f"one {a.tokens:,}-token prompt, chunks of {a.chunk:,}, one 8-GPU EP engine")
    print(f"{'model':<20}{'hardware':<9}{'CP':>4}{'prefill s':>11}{'vs CP1':>9}")
    for model, hw in CASES:
        base = prefill_time_s(model, hw, 1, a.tokens, a.chunk)
        for cp in (1, 2, 4, 8):
            t = base if cp == 1 else prefill_time_s(model, hw, cp, a.tokens, a.chunk)
            print(f"{model:<20}{hw:<9}{cp:>4}{t:>11.2f}{base / t:>8.2f}x")


if __name__ == "__main__":
    main()
