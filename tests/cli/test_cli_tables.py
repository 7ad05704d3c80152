"""What the commands print stays whole: ``summary.md`` has every column of the printed table, the
capacity progress bar ends at the simulations run, and the sweep table folds (never cuts) policy
and grid names. Expected cells are written out by hand from the inputs.
"""

from __future__ import annotations

import pytest

from pdlb_cli.main import main


def test_summary_md_has_every_column_of_the_printed_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: summary.md ("the same table as Markdown") lacked E2E p50 s and out tok/s/GPU
    out = tmp_path / "res"
    assert main(["sim", "run", "--policy", "round_robin", "--limit", "20", "--quiet", "--no-plots",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    head = [c.strip() for c in printed.split("┃")[1:-1] if "\n" not in c]
    assert head == ["policy", "TTFT mean s", "TTFT p99 s", "TPOT mean ms", "TPOT p99 ms", "E2E p50 s", "hit rate",
                    "SLO att.", "goodput r/s", "out tok/s/GPU", "P imb.", "D imb."]
    md_head, rule, row = (out / "summary.md").read_text().splitlines()[:3]
    assert [c.strip() for c in md_head.strip("|").split("|")] == head
    assert rule == "|" + "---|" * 12
    printed_row = next(line for line in printed.splitlines() if line.startswith("│ round_robin"))
    assert [c.strip() for c in row.strip("|").split("|")] == [c.strip() for c in printed_row.strip("│").split("│")]


def test_capacity_progress_ends_at_the_simulations_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: the bar ended at max(estimate, run), '11/11 above_bounds' for a search of 7 simulations
    # (x1, 2, 4, ..., 64: the SLO still holds at the upper bound)
    rc = main(["sim", "capacity", "--scenario", "llama8b-agg-h100", "--limit", "20", "--policies", "round_robin",
               "--jobs", "1", "--no-plots", "--out", str(tmp_path / "cap")])
    out = capsys.readouterr().out
    assert rc == 0
    bar = next(line for line in out.splitlines() if line.startswith("round_robin") and "━" in line)
    assert " 7/7 above_bounds " in bar, bar
    row = next(line for line in out.splitlines() if line.startswith("│ round_robin"))
    assert [c.strip() for c in row.strip("│").split("│")][9] == "7"  # the evals column


def test_sweep_table_never_cuts_the_policy_or_grid_names(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: 'cache_aware…' and 'mixed.num_…' in the 160-column table printed to a file or pipe, so two
    # variants of one policy, or two grid keys, read alike
    sweep = tmp_path / "s.toml"
    sweep.write_text('scenario = "llama8b-agg-h100"\npolicies = ["round_robin", "cache_aware:cache_threshold=0.5"]\n'
                     'rates = [1.0]\nlimit = 10\n[grid]\n"mixed.num_engines" = [2]\n"mixed.max_prefill_tokens" = [1024]\n')
    assert main(["sim", "sweep", str(sweep), "--jobs", "1", "--quiet", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("┏"):out.index("┘") + 1]
    assert "…" not in table
    cells = lambda line: [c.strip() for c in line.strip("│┃").split("│" if line.startswith("│") else "┃")]  # noqa: E731
    lines = table.splitlines()
    heads = [cells(x) for x in lines if x.startswith("┃")]
    # a folded header reads top to bottom
    assert ["".join(parts) for parts in zip(*heads)][:5] == [
        "policy", "rate", "seed", "mixed.num_engines", "mixed.max_prefill_tokens"]
    body = [cells(x) for x in lines if x.startswith("│")]
    # rows folded over several lines: a row starts where the rate column is filled
    labels, cur = [], None
    for c in body:
        if c[1]:
            cur = [c[0]]
            labels.append(cur)
        else:
            cur.append(c[0])
    assert ["".join(parts) for parts in labels] == ["round_robin", "cache_aware(cache_threshold=0.5)"]
