"""The committed example scenarios of issue 23 part 3 (docs/examples/scenarios/): they load, their
shapes are what their comments say (hand-counted from the built-in presets), the length split
routes by prompt length, and ``bench/policy_goodput.py`` resolves their row names."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np

from sim.run.cluster import simulate
from sim.scenario import PRESETS, load_scenario
from sim.search.point import WorkloadSpec, load_workload

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "docs" / "examples" / "scenarios"
LONGSPLIT = EXAMPLES / "dsv3-pd-h200-longsplit.toml"
DBOUND = EXAMPLES / "llama70b-pd-h100-decode-bound.toml"


def test_length_split_is_the_default_scenario_split_4_plus_2():
    sc, base = load_scenario(LONGSPLIT), PRESETS["dsv3-pd-h200"]
    assert sc.name == LONGSPLIT.stem and (sc.model, sc.hardware) == (base.model, base.hardware)
    assert sc.long_prompt_threshold_tokens == 32768
    assert sc.prefill is not None and sc.long_prefill is not None and sc.decode is not None
    # hand count: 4 + 2 engines of EP8 = the default's 6 x 8 prefill GPUs; decode the default's 8
    assert (sc.prefill.num_engines, sc.long_prefill.num_engines) == (4, 2)
    assert sc.prefill.num_gpus + sc.long_prefill.num_gpus == base.prefill.num_gpus == 48
    assert sc.num_gpus == base.num_gpus == 56
    assert sc.decode == base.decode


def test_decode_bound_dense_doubles_the_preset_prefill_pool():
    sc, base = load_scenario(DBOUND), PRESETS["llama70b-pd-h100"]
    assert sc.name == DBOUND.stem and (sc.model, sc.hardware) == (base.model, base.hardware)
    assert sc.prefill.num_engines == 2 * base.prefill.num_engines == 8
    assert sc.decode == base.decode
    assert sc.num_gpus == 8 * 4 + 2 * 4  # 40 H100s


def test_the_threshold_splits_the_embedded_trace_as_the_comment_says():
    # read the trace file directly (not through pdlb's loader): 6.9% of prompts >= 32,768 tokens, 33% of tokens
    path = ROOT / "sim" / "data" / "mooncake_conversation.jsonl.gz"
    with gzip.open(path, "rt") as f:
        lengths = np.array([json.loads(line)["input_length"] for line in f if line.strip()])
    long = lengths >= 32768
    assert round(float(long.mean()), 3) == 0.069
    assert round(float(lengths[long].sum() / lengths.sum()), 2) == 0.33


def test_long_prompts_reach_only_the_long_pool():
    sc = load_scenario(LONGSPLIT)
    reqs = load_workload(WorkloadSpec(seed=0))[:300]
    res = simulate(sc, reqs, "ep_aware")
    # rank order: prefill (4 x 8 = ranks 0-31), decode (32-39), long prefill (40-55)
    rank = res.records.prefill_rank
    long = np.array([r.prompt_tokens >= 32768 for r in reqs])
    assert long.any() and (~long).any()
    assert np.all((rank[long] >= 40) & (rank[long] <= 55))
    assert np.all(rank[~long] <= 31)


def test_policy_goodput_names_the_rows():
    sys.path.insert(0, str(ROOT / "bench"))
    import policy_goodput as pg

    assert pg.scenario_of("longsplit") == load_scenario(LONGSPLIT)
    assert pg.scenario_of("dense_dbound") == load_scenario(DBOUND)
