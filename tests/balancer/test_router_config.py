"""RouterConfig and PolicySpec (balancer/config.py): one set of defaults shared by the library, the
service and the simulator; every router built from a config; bad settings refused by class.

Expected values are the defaults as documented in balancer/config.py's table (written there by
hand: 64-token blocks, ep_aware for both pools, 262,144 blocks per replica, 4,194,304 in all), and
the simulator's settings as sim/run/router_config.py's docstring states them.
"""

from __future__ import annotations

import math
import pickle

import pytest
from pydantic import ValidationError

from balancer import PolicySpec, Router, RouterConfig, TtftSlo
from balancer.cost_model import DEFAULT_COST_MODEL
from balancer.policies import available_policies
from balancer.service.config import LEGACY_ROUTER_KEYS, ServiceConfig, config_warnings
from sim.run.router_config import RankCacheBlocks, index_capacity_blocks, router_config_for, router_factory
from sim.scenario import load_scenario


def test_the_documented_defaults() -> None:
    c = RouterConfig()
    assert (c.prefill_policy.name, c.decode_policy.name) == ("ep_aware", "ep_aware")
    assert c.block_size == 64
    assert (c.index_capacity_blocks, c.index_total_capacity_blocks) == (262_144, 4_194_304)
    assert c.index_mode == "approximate" and c.learn_cost_model is None and c.ttft_slo is None
    assert c.weights == {"host": 0.75, "store": 0.5}
    # the table in the module docstring states the same numbers
    import balancer.config as mod
    doc = mod.__doc__ or ""
    for text in ("``ep_aware``", "64 tokens", "262,144", "4,194,304", "host 0.75", "store 0.5"):
        assert text in doc, text


def test_library_and_service_take_the_same_defaults() -> None:
    assert Router().config == RouterConfig()
    assert ServiceConfig().router == RouterConfig()
    r = Router()
    assert (r.prefill_policy.name, r.decode_policy.name, r.block_size) == ("ep_aware", "ep_aware", 64)
    assert (r.index.capacity_blocks, r.index.total_capacity_blocks) == (262_144, 4_194_304)
    assert r.cost_learner is not None  # auto: ep_aware reads the cost model


def test_simulator_sets_only_what_its_docstring_names() -> None:
    sc = load_scenario("dsv3-pd-h200")
    c = router_config_for(sc, seed=3)
    changed = {k for k in RouterConfig.model_fields if getattr(c, k) != getattr(RouterConfig(), k)}
    # block size (the trace's: 512), no total bound, the scenario's exact cost model without a fit, the seed
    assert changed == {"block_size", "index_total_capacity_blocks", "cost_model", "learn_cost_model", "seed"}
    assert (c.block_size, c.index_total_capacity_blocks, c.learn_cost_model, c.seed) == (512, None, False, 3)
    # the "auto" index bound: a first-pool rank's cache, the largest rank's in events mode
    ranks = RankCacheBlocks(first=39, largest=723)
    assert index_capacity_blocks(sc, ranks, "approximate") == 39
    assert index_capacity_blocks(sc, ranks, "hybrid") == 39
    assert index_capacity_blocks(sc, ranks, "events") == 723
    fixed = sc.model_copy(update={"index_capacity_blocks": 1000})
    assert index_capacity_blocks(fixed, ranks, "events") == 1000
    r = router_factory(sc, c, PolicySpec.parse("round_robin"))(ranks)
    assert r.index.capacity_blocks == 39 and r.prefill_policy.name == "round_robin" and r.decode_policy.name == "ep_aware"
    assert r.cost_learner is None and r.cost_model is c.cost_model


def test_from_config_carries_every_setting() -> None:
    cfg = RouterConfig(prefill_policy="cache_aware:cache_threshold=0.5", decode_policy={"name": "least_load"},
                       block_size=16, index_mode="hybrid", index_capacity_blocks=100, index_total_capacity_blocks=1000,
                       index_ttl_s=120, speculative_ttl_s=2.5, pd_min_uncached_tokens=256, seed=7, host_tier=True,
                       host_index_capacity_blocks=50, shared_store=True, store_index_capacity_blocks=500,
                       store_ttl_s=math.inf, tier_weights={"host": 0.5}, cost_model=DEFAULT_COST_MODEL.to_dict(),
                       learn_cost_model=True, ttft_slo={"ttft_s": 2.0}, inflight_timeout_s=600,
                       load_report_max_age_s=10)
    r = Router.from_config(cfg)
    assert r.config is cfg
    assert (r.prefill_policy.name, r.prefill_policy.cache_threshold, r.decode_policy.name) == ("cache_aware", 0.5,
                                                                                              "least_load")
    assert (r.block_size, r.index_mode, r.pd_min_uncached_tokens) == (16, "hybrid", 256)
    assert (r.index.capacity_blocks, r.index.total_capacity_blocks, r.index.ttl_s) == (100, 1000, 120.0)
    assert r.speculative is not None and r.speculative.ttl_s == 2.5 == r.speculative_ttl_s
    assert r.host_index is not None and r.host_index.capacity_blocks == 50
    assert r.store_index is not None and r.store_index.capacity_blocks == 500 and r.store_index.ttl_s == math.inf
    assert r.tier_weights == {"host": 0.5, "store": 0.5}
    assert r.cost_learner is not None and r.cost_model == DEFAULT_COST_MODEL  # the dict form read back
    assert r.ttft_slo == TtftSlo(2.0)
    assert (r.inflight_timeout_s, r.load_report_max_age_s) == (600.0, 10.0)
    assert r.rng.random() == __import__("random").Random(7).random()
    # keywords over a config: the same fields
    assert Router(config=cfg, block_size=32).config == cfg.with_(block_size=32)


@pytest.mark.parametrize("learn,policies,fits", [
    (None, ("ep_aware", "round_robin"), True), (None, ("round_robin", "least_load"), False),
    (True, ("round_robin", "round_robin"), True), (False, ("ep_aware", "ep_aware"), False)])
def test_learn_cost_model_auto_fits_only_for_a_policy_that_reads_the_model(learn, policies, fits) -> None:
    # the policies that read the model are the ones that declare it (Policy.uses_cost_model)
    from balancer.policies.base import policy_class
    assert [n for n in available_policies() if policy_class(n).uses_cost_model] == ["ep_aware"]
    r = Router(*policies, learn_cost_model=learn)
    assert (r.cost_learner is not None) is fits


def test_policy_spec_forms_agree() -> None:
    a = PolicySpec.parse("cache_aware:cache_threshold=0.5,balance_abs=8")
    b = PolicySpec.model_validate({"name": "cache_aware", "params": {"balance_abs": 8, "cache_threshold": 0.5}})
    c = PolicySpec(name="cache_aware", params=(("cache_threshold", 0.5), ("balance_abs", 8)))
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert a.params == (("balance_abs", 8), ("cache_threshold", 0.5))  # sorted by name
    assert a.label == "cache_aware(balance_abs=8,cache_threshold=0.5)"
    assert PolicySpec.parse(a.text) == a and a.text == "cache_aware:balance_abs=8,cache_threshold=0.5"
    p = a.build()
    assert (p.name, p.cache_threshold, p.balance_abs) == ("cache_aware", 0.5, 8)
    of_object = PolicySpec.model_validate(p)  # a registered policy object's spec: every parameter spelled out
    assert of_object.kwargs == {"balance_abs": 8, "balance_rel": 1.5, "cache_threshold": 0.5} and of_object.build() == p
    assert pickle.loads(pickle.dumps(a)) == a
    assert RouterConfig(prefill_policy=a).prefill_policy is a


@pytest.mark.parametrize("settings,error,message", [
    ({"block_size": 0}, ValueError, "block_size must be an integer >= 1, got 0"),
    ({"block_size": 16.5}, TypeError, "block_size must be an integer >= 1, got float 16.5"),
    ({"block_size": True}, TypeError, "block_size must be an integer >= 1, got bool True"),
    ({"index_mode": "exact"}, ValueError, "unknown index_mode 'exact'; valid: approximate, events, hybrid"),
    ({"index_capacity_blocks": 0}, ValueError, "index_capacity_blocks must be an integer >= 1, got 0"),
    ({"index_total_capacity_blocks": -1}, ValueError, "index_total_capacity_blocks must be an integer >= 1"),
    ({"index_ttl_s": 0}, ValueError, "index_ttl_s must be a number of seconds > 0 or None, got 0"),
    ({"store_ttl_s": math.nan}, ValueError, "store_ttl_s must be a number of seconds > 0 or None"),
    ({"speculative_ttl_s": 0}, ValueError, "speculative_ttl_s must be a number of seconds > 0, got int 0"),
    ({"speculative_ttl_s": None}, ValueError, "speculative_ttl_s must be a number of seconds > 0, got NoneType None"),
    ({"inflight_timeout_s": -1}, ValueError, "inflight_timeout_s must be a number of seconds > 0, got int -1"),
    ({"load_report_max_age_s": math.nan}, ValueError, "load_report_max_age_s must be a number of seconds > 0, got float nan"),
    ({"pd_min_uncached_tokens": -1}, ValueError, "pd_min_uncached_tokens must be an integer >= 0, got -1"),
    ({"tier_weights": {"ssd": 0.5}}, ValueError, "unknown tier 'ssd' in tier_weights; valid: host, store"),
    ({"tier_weights": {"host": 1.5}}, ValueError, "tier_weights['host'] must be a number in [0, 1], got float 1.5"),
    ({"ttft_slo": 2.0}, TypeError, "ttft_slo must be a table {ttft_s = SECONDS"),
    ({"ttft_slo": {"ttft_s": -1}}, ValueError, "TtftSlo ttft_s must be a finite number > 0"),
    ({"cost_model": {"bogus": 1}}, ValueError, "bogus"),
    ({"prefill_policy": "nope"}, ValueError, "unknown policy 'nope'"),
    ({"decode_policy": "cache_aware:bogus=1"}, ValueError, "policy 'cache_aware' has no parameter 'bogus'"),
    ({"bogus_setting": 1}, TypeError, "unknown setting(s) bogus_setting"),
])
def test_bad_settings_are_refused_by_class_with_the_field_named(settings, error, message) -> None:
    # the same error through Router(**settings) and (as pydantic's ValueError) RouterConfig(**settings)
    with pytest.raises(error) as ei:
        Router(**settings)
    assert message in str(ei.value) and "\n" not in str(ei.value)
    if "bogus_setting" not in settings:
        # RouterConfig always answers pydantic's ValidationError (a ValueError), wrong types
        # included (not a TypeError traceback)
        with pytest.raises(ValidationError):
            RouterConfig(**settings)


def test_config_is_frozen() -> None:
    c = RouterConfig()
    with pytest.raises(ValueError):
        c.block_size = 16  # type: ignore[misc]
    assert c.with_(block_size=16).block_size == 16 and c.block_size == 64


def test_service_reads_the_router_section_and_the_old_keys() -> None:
    new = ServiceConfig.model_validate({"router": {"block_size": 16, "decode_policy": "round_robin", "seed": 5}})
    old = ServiceConfig.model_validate({"block_size": 16, "decode_policy": "round_robin", "seed": 5})
    assert new.router == old.router == RouterConfig(block_size=16, decode_policy="round_robin", seed=5)
    assert config_warnings(new) == []
    assert config_warnings(old) == ["warning: deprecated top-level setting(s) decode_policy, block_size, seed: they "
                                    "are router settings now; put them under router: (read there this time)"]
    # every old key is a router setting (so none is lost on the way)
    assert set(LEGACY_ROUTER_KEYS) <= set(RouterConfig.model_fields)
    with pytest.raises(ValueError, match="seed given both at the top level and under router:"):
        ServiceConfig.model_validate({"seed": 1, "router": {"seed": 2}})


def test_documented_service_keys_are_still_accepted() -> None:
    # the keys docs/serving.md's example config uses at the top level (before the router: section)
    from pathlib import Path
    text = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    used = [k for k in LEGACY_ROUTER_KEYS if f"\n{k}:" in text]
    assert used == []  # the docs show the router: section now
    assert "\nrouter:" in text
