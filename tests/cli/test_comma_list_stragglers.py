"""Comma lists main's :mod:`pdlb_cli.comma_lists` did not reach yet (review findings 1 and 1b of
session 14's fresh-user review, /work/notes/review.md).

* ``pdlb sim price --prices ,`` printed five empty tables and exited 0 (the empty item was dropped,
  so no sheet was priced); ``--prices a,,b`` priced fewer sheets than named.
* ``pdlb sim run --policy cache_aware:cache_threshold=0.5,`` (a stray comma inside one policy spec)
  ran with the empty parameter dropped, where ``--policies a,,b`` is refused.

The expected messages are written out by hand from the format of
:func:`pdlb_cli.comma_lists.comma_items` and :func:`balancer.policies.spec.parse_policy_spec`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlb_cli.main import main
from sim.pricing.sheets import load_price_sheets, shipped_price_sheets


@pytest.mark.parametrize("prices, message", [
    (",", "error: --prices: expected price sheet names or files separated by single commas, got ',' "
          "(item 1 is empty: a leading comma)"),
    ("deepseek-r1-2025-02,,deepseek-r1-2025-02",
     "error: --prices: expected price sheet names or files separated by single commas, got "
     "'deepseek-r1-2025-02,,deepseek-r1-2025-02' (item 2 is empty: two commas in a row after 'deepseek-r1-2025-02')"),
])
def test_price_sheets_with_an_empty_item_are_one_error_line_and_no_table(prices: str, message: str, capsys) -> None:
    rc = main(["sim", "price", "--prices", prices])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err == message + "\n"
    assert out == ""  # before: five empty tables on stdout, exit status 0


def test_price_sheets_library_refuses_an_empty_item_and_keeps_all() -> None:
    with pytest.raises(ValueError, match=r"^price sheets ',': an empty name"):
        load_price_sheets(",")  # a caller without the command line
    assert [s.name for s in load_price_sheets(" deepseek-r1-2025-02 ")] == ["deepseek-r1-2025-02"]
    names = shipped_price_sheets()
    assert len(names) >= 2  # the '' / 'all' cases below would be vacuous with one sheet
    assert [s.name for s in load_price_sheets("")] == [s.name for s in load_price_sheets("all")] == list(names)


def test_price_with_one_sheet_prints_its_rows(capsys) -> None:
    # the control: a list without the empty item prices what it names
    assert main(["sim", "price", "--prices", "deepseek-r1-2025-02", "--hit-rate", "0.5,0.9", "--ratio", "2"]) == 0
    assert "deepseek-r1-2025-02" in capsys.readouterr().out


CACHE_AWARE_ACCEPTED = "balance_abs=64, balance_rel=1.5, cache_threshold=0.3"  # its dataclass defaults


@pytest.mark.parametrize("text", ["cache_aware:cache_threshold=0.5,", "cache_aware:,cache_threshold=0.5",
                                  "cache_aware:cache_threshold=0.5,,balance_abs=8"])
def test_a_stray_comma_inside_one_policy_spec_is_refused(text: str) -> None:
    # before: `pdlb sim run --policy cache_aware:cache_threshold=0.5,` ran, the empty parameter dropped
    from balancer.policies.spec import parse_policy_spec
    with pytest.raises(ValueError) as e:
        parse_policy_spec(text)
    assert str(e.value) == (f"policy 'cache_aware': an empty parameter in {text!r} (a stray comma); write "
                            f"cache_aware:param=value[,param=value]; accepted: {CACHE_AWARE_ACCEPTED}")


@pytest.mark.parametrize("text, expected", [
    ("cache_aware:", ("cache_aware", {})),  # a colon and nothing after it: no parameters, as before
    ("cache_aware: ", ("cache_aware", {})),
    ("cache_aware: cache_threshold=0.5 , balance_abs=8", ("cache_aware", {"cache_threshold": 0.5, "balance_abs": 8})),
])
def test_policy_specs_without_a_stray_comma_still_parse(text: str, expected) -> None:
    from balancer.policies.spec import parse_policy_spec
    assert parse_policy_spec(text) == expected


def test_sim_run_policy_with_a_stray_comma_is_one_error_line(tmp_path: Path, capsys) -> None:
    assert main(["sim", "run", "--policy", "cache_aware:cache_threshold=0.5,", "--limit", "5", "--quiet",
                 "--no-plots", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        "error: --policy: policy 'cache_aware': an empty parameter in 'cache_aware:cache_threshold=0.5,' (a stray "
        f"comma); write cache_aware:param=value[,param=value]; accepted: {CACHE_AWARE_ACCEPTED}\n")
    assert not (tmp_path / "o").exists()
