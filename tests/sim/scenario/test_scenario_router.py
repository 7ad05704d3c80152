"""A scenario's ``[router]`` table (sim.scenario.Scenario.router): the RouterConfig settings it
names replace the simulator's (sim/run/router_config.py), the ones a scenario or run sets elsewhere are
refused, and a scenario without the table dumps, and hashes into sweep point ids, as before."""

from __future__ import annotations

import pytest

from balancer.config import DEFAULT_TIER_WEIGHTS, RouterConfig
from sim.overrides import apply_overrides
from sim.search.point import SLO, SimOptions, WorkloadSpec, parse_policy
from sim.run.router_config import RankCacheBlocks, router_config_for, router_factory
from sim.scenario import PRESETS, load_scenario
from sim.search.sweep import point_id

#: Sweep point ids computed by main 5e05c84 (before the table existed; /tmp script run on a
#: ``git archive`` of that commit), with ``point_id(preset, SLO(), [], ep_aware, 1.0, 0,
#: WorkloadSpec(), SimOptions())``, and one point with overrides, another policy, rate, seed,
#: workload and index mode (the last entry).
PINNED_IDS = {
    "deepinfer-sm100": "9296fcf3225fefee",
    "deepseek-v3-h800": "3b973dbe599ebe7f",
    "dsv3-pd-h200": "e7ddd2a825e9d585",
    "dsv3-pd-h200-store": "4b9012d035a0f47d",
    "dsv3-pd-h800": "d05cb593ca672ce0",
    "llama70b-pd-h100": "621a72a7b9e5ef1a",
    "llama8b-agg-h100": "ba6eed808d61aef6",
    "sglang-h100-ep": "e2aeff36b344dd51",
}


def _id(sc, overrides=(), policy="ep_aware", rate=1.0, seed=0, workload=None, options=None) -> str:  # noqa: ANN001
    return point_id(sc, SLO(), list(overrides), parse_policy(policy), rate, seed, workload or WorkloadSpec(),
                    options or SimOptions())


def test_point_ids_of_scenarios_without_the_table_do_not_move():
    assert {name: _id(load_scenario(name)) for name in sorted(PRESETS) if name in PINNED_IDS} == PINNED_IDS
    assert set(PINNED_IDS) <= set(PRESETS)
    sc = load_scenario("dsv3-pd-h200")
    assert _id(sc, [("prefill.num_engines", 8)], "cache_aware", 1.5, 3, WorkloadSpec(limit=500),
               SimOptions(index_mode="events")) == "093a8ca144c8dc16"
    assert "router" not in sc.model_dump_json()


def test_the_table_is_read_applied_and_written_back(tmp_path):
    """index_ttl_s and learn_cost_model given in a TOML scenario reach the run's RouterConfig; the
    settings not given keep the simulator's values (block size 512 from the scenario, no total
    index bound, the scenario's cost model); the dump holds exactly the two given, and the point
    id changes with them."""
    base = tmp_path / "base.toml"
    text = 'name = "t"\nmodel = "llama-3.1-8b"\nhardware = "h100"\n[mixed]\nnum_engines = 2\n'
    base.write_text(text)
    with_table = tmp_path / "router.toml"
    with_table.write_text(text + "[router]\nindex_ttl_s = 120\nlearn_cost_model = true\n")
    plain, sc = load_scenario(base), load_scenario(with_table)
    assert sc.router_settings == {"index_ttl_s": 120.0, "learn_cost_model": True}
    cfg, ref = router_config_for(sc, seed=2), router_config_for(plain, seed=2)
    assert (cfg.index_ttl_s, cfg.learn_cost_model) == (120.0, True)
    assert (ref.index_ttl_s, ref.learn_cost_model) == (None, False)
    assert cfg.with_(index_ttl_s=None, learn_cost_model=False) == ref  # nothing else differs
    assert (cfg.block_size, cfg.index_total_capacity_blocks, cfg.seed) == (512, None, 2)
    assert sc.model_dump()["router"] == {"index_ttl_s": 120.0, "learn_cost_model": True}
    assert _id(sc) != _id(plain)
    router = router_factory(sc, cfg, parse_policy("ep_aware").prefill)(RankCacheBlocks(100, 100))
    assert router.config.index_ttl_s == 120.0 and router.cost_learner is not None  # the router fits online


def test_set_reaches_into_the_table_and_tier_weights_yield_to_the_run():
    sc = apply_overrides(load_scenario("dsv3-pd-h200-store"), [("router.tier_weights", {"store": 0.25})])
    assert sc.router_settings == {"tier_weights": {"store": 0.25}}
    assert router_config_for(sc).weights == {**DEFAULT_TIER_WEIGHTS, "store": 0.25}
    assert router_config_for(sc, tier_weights={"store": 0.9}).weights["store"] == 0.9  # the run's own win


def test_settings_that_belong_elsewhere_are_refused_with_where():
    sc = load_scenario("dsv3-pd-h200")
    for key, value, where in (("block_size", 64, "top-level block_size"), ("decode_policy", "least_load", "--policies"),
                              ("index_mode", "events", "--index-mode"), ("seed", 3, "--seed"),
                              ("pd_min_uncached_tokens", 256, "top-level pd_min_uncached_tokens")):
        with pytest.raises(ValueError, match=where):
            apply_overrides(sc, [(f"router.{key}", value)])
    with pytest.raises(ValueError, match="router.nope"):
        apply_overrides(sc, [("router.nope", 1)])
    with pytest.raises(ValueError, match="index_ttl_s"):
        apply_overrides(sc, [("router.index_ttl_s", -1)])
    with pytest.raises(ValueError):
        type(sc)(**{**sc.model_dump(), "router": RouterConfig(seed=4)})


def test_a_typo_of_a_refused_key_points_where_it_belongs():
    # a typo of a refused key: router.ttft_slo_s must not hint at ttft_slo, itself refused
    sc = load_scenario("dsv3-pd-h200")
    with pytest.raises(ValueError, match=r"router\.ttft_slo_s: unknown field; the nearest, ttft_slo, is not a "
                                         r"scenario router setting: set it in the run's SLO \(--route-slo\)"):
        apply_overrides(sc, [("router.ttft_slo_s", 2)])
    # a typo nearer an allowed key still gets the plain "did you mean"
    with pytest.raises(ValueError, match=r"did you mean 'index_ttl_s'"):
        apply_overrides(sc, [("router.index_tll_s", 2)])
    with pytest.raises(ValueError, match=r"sim run --policy, compare --policies"):
        apply_overrides(sc, [("router.prefill_policy", "least_load")])
