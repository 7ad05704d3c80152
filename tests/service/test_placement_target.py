"""``placement_target_util`` (``pdlb serve --placement-target-util``): the cores per active router
process that follow_load sizes the active set for (issue 26, session 16).

Expected values by hand from the rule (balancer/service/processes/placement.py): k = ceil(U / T),
growing at once when the active processes' mean is over T + (1 - T) / 2, to every process when
over SATURATED_UTIL 0.95; shrinking after SHRINK_PASSES 3 passes in a row; HOLD_PASSES 2 after a change.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from balancer.service.config import ServiceConfig
from balancer.service.processes.placement import (GROW_UTIL, TARGET_UTIL, PlacementBlock, PlacementControl,
                                                  check_target_util, grow_util, next_active)


def test_grow_threshold_is_half_way_to_a_core_and_the_default_is_unchanged():
    assert grow_util(TARGET_UTIL) == pytest.approx(GROW_UTIL) == pytest.approx(0.85)  # 0.7 + 0.3 / 2
    assert grow_util(0.9) == pytest.approx(0.95)
    assert grow_util(0.3) == pytest.approx(0.65)


def test_a_higher_target_packs_the_same_load_onto_fewer_processes():
    # SGLang PD on the 16-core host (call 2): 4-5 active processes at ~0.6 core each.
    # 4 active at 0.6 (U = 2.4): T 0.7 wants ceil(3.43) = 4 -> stays; T 0.9 wants ceil(2.67) = 3
    u = [0.6] * 4 + [0.0] * 4
    assert next_active(4, 8, u, 2) == (4, 0, "")
    assert next_active(4, 8, u, 0, 0.9) == (4, 1, "")
    assert next_active(4, 8, u, 2, 0.9) == (3, 0, "shrink")  # on the third pass in a row
    # 3 active at 0.9 (mean 0.9): over 0.85, grows under T 0.7 (to ceil(2.7 / 0.7) = 4); under 0.95, stays with T 0.9
    u3 = [0.9] * 3 + [0.0] * 5
    assert next_active(3, 8, u3, 0) == (4, 0, "grow")
    assert next_active(3, 8, u3, 0, 0.9) == (3, 0, "")
    # saturated (mean 0.96 > 0.95): every process at once, whatever the target
    assert next_active(3, 8, [0.96] * 3 + [0.0] * 5, 0, 0.9) == (8, 0, "grow")
    # a low target spreads: T 0.3, 2 active at 0.7 (mean over 0.65): ceil(1.4 / 0.3) = 5
    assert next_active(2, 8, [0.7, 0.7] + [0.0] * 6, 0, 0.3) == (5, 0, "grow")


def test_the_control_uses_its_target_on_hand_fed_clocks():
    # 8 processes, each 0.3 core per pass (U = 2.4 cores): T 0.9 -> ceil(2.67) = 3 on the third pass
    # (the first tick only sets the clocks); T 0.7 -> ceil(3.43) = 4
    for target, expected in ((0.9, 3), (0.7, 4)):
        block = PlacementBlock(8)
        try:
            c = PlacementControl(block, target)
            t, cpu = 10.0, [0.0] * 8
            ks = [c.tick(t, cpu)]
            for _ in range(3):
                t += 0.2
                cpu = [x + 0.3 * 0.2 for x in cpu]
                ks.append(c.tick(t, cpu))
            assert ks == [8, 8, 8, expected], (target, ks)
            assert block.active == expected
        finally:
            block.close()


@pytest.mark.parametrize("bad", [0.29, 0.951, 0.0, -1.0, 1.0, math.nan, math.inf, True, "0.8", None])
def test_bad_targets_are_refused(bad):
    with pytest.raises(ValueError):
        check_target_util(bad)
    block = PlacementBlock(2)
    try:
        with pytest.raises(ValueError):
            PlacementControl(block, bad)
    finally:
        block.close()
    if bad != "0.8":  # the config takes a numeric string as its other numbers do (a JSON or YAML file's "0.8")
        with pytest.raises(ValidationError):
            ServiceConfig(placement_target_util=bad)


def test_config_default_and_bounds():
    assert ServiceConfig().placement_target_util == TARGET_UTIL
    assert ServiceConfig(placement_target_util=0.3).placement_target_util == 0.3
    assert ServiceConfig(placement_target_util=0.95).placement_target_util == 0.95
    assert check_target_util(0.3) == 0.3 and check_target_util(0.95) == 0.95


def test_cli_flag_config_file_and_a_bad_value_is_one_line(tmp_path, capsys):
    from pdlb_cli.main import main
    from tests.cli.test_serve_cli import _fails, _serve_cfg

    base = ["--pd-protocol", "none", "--mixed", "http://127.0.0.1:31000"]
    assert _serve_cfg(*base).placement_target_util == 0.7
    assert _serve_cfg(*base, "--placement-target-util", "0.9").placement_target_util == 0.9
    f = tmp_path / "pdlb.yaml"
    f.write_text("placement_target_util: 0.85\n")
    assert _serve_cfg("--config", str(f), *base).placement_target_util == 0.85  # the file's value survives
    assert _serve_cfg("--config", str(f), *base, "--placement-target-util", "0.5").placement_target_util == 0.5
    err = _fails(["serve", *base, "--placement-target-util", "0.99"], capsys)
    assert err.count("\n") == 1 and "placement_target_util" in err, err
    assert main  # imported for _fails' use


def test_even_out_is_opt_in_from_the_cli_and_the_config_file(tmp_path):
    # issue 26 (pdtail): off by default (no 16-core measurement of its effect), on with the flag or the file
    from tests.cli.test_serve_cli import _serve_cfg

    assert ServiceConfig().placement_even_out is False
    base = ["--pd-protocol", "none", "--mixed", "http://127.0.0.1:31000"]
    assert _serve_cfg(*base).placement_even_out is False
    assert _serve_cfg(*base, "--placement-even-out").placement_even_out is True
    f = tmp_path / "pdlb.yaml"
    f.write_text("placement_even_out: true\n")
    assert _serve_cfg("--config", str(f), *base).placement_even_out is True
    assert _serve_cfg("--config", str(f), *base, "--no-placement-even-out").placement_even_out is False
