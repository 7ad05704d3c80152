"""What the plots show, checked on the figures (matplotlib's Agg backend, nothing looked at):
legend entries, tick label text, line counts, label placement."""

from __future__ import annotations

import math

import pytest

from sim.search.capacity import RateSearchResult
from sim.search.capacity_report import STOPPED_EARLY_LABEL, rate_figure
from sim.run.plots import plain_log_ticks, pyplot
from sim.search.point import SLO, Point, PointResult, PolicyPair
from tests.capacity_factories import mixed_scenario

plt = pyplot()


def _result(policy: str, pts: list[tuple[float, float, float, bool]]) -> RateSearchResult:
    """A rate search of ``policy`` over points ``(offered_rps, attainment, ttft_p99_s, stopped_early)``."""
    sc = mixed_scenario()
    out = []
    for rps, att, ttft, early in pts:
        point = Point(sc, "wl", PolicyPair("round_robin"), rps)  # the plots read the label from the result
        out.append(PointResult(point, att >= 0.9, att, float("nan") if early else att * rps, rps, 10, sc.num_gpus,
                               None, None, 1, ttft_p99_s=float("nan") if early else ttft, stopped_early=early))
    return RateSearchResult(policy, sc.name, sc.num_gpus, SLO(), "found", 1.0, 1.0, (1.0, 2.0), out[0], out, None)


def _legend(ax) -> list[str]:  # noqa: ANN001
    return [t.get_text() for t in ax.get_legend().get_texts()]


def _tick_labels(axis) -> list[tuple[float, str]]:  # noqa: ANN001
    """(value, text) of the labelled ticks inside the view, after a draw."""
    lo, hi = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    return [(t.get_loc(), t.label1.get_text()) for t in ticks
            if t.label1.get_text() and lo <= t.get_loc() <= hi]


def _fig_legend(fig) -> list[str]:  # noqa: ANN001
    return [t.get_text() for t in fig.legends[0].get_texts()]


ANSWER = "answer: highest rate\nmeeting the SLO"


def test_capacity_rate_plot_lists_stopped_early_only_when_a_run_stopped_early() -> None:
    steady = [_result("a", [(1.0, 1.0, 0.6, False), (2.0, 0.95, 1.5, False)]),
              _result("b", [(1.0, 1.0, 0.7, False), (2.0, 0.92, 2.5, False)])]
    fig = rate_figure(steady, {})
    # one legend for the figure, each policy with its answer (_result: 1.0 req/s)
    assert _fig_legend(fig) == ["a: 1 req/s", "b: 1 req/s", ANSWER, "target 90%"]  # no "stopped early"
    plt.close(fig)
    # the second policy's run stopped early: listed once, whichever policy it was (was: tied to the first)
    mixed = [steady[0], _result("b", [(1.0, 1.0, 0.7, False), (4.0, 0.5, 0.0, True)])]
    fig = rate_figure(mixed, {})
    assert _fig_legend(fig) == ["a: 1 req/s", "b: 1 req/s", ANSWER, STOPPED_EARLY_LABEL, "target 90%"]
    plt.close(fig)


def _rated(policy: str, answer_rps: float, rates: list[float]) -> RateSearchResult:
    r = _result(policy, [(x, 1.0 if x <= answer_rps else 0.5, 0.5 * x, False) for x in rates])
    r.rate_rps = answer_rps
    r.best = next(p for p in r.points if p.offered_rps == answer_rps)
    return r


def test_capacity_rate_plot_reads_without_the_text() -> None:
    # issue 24 item 17: 8 policies with answers between 0.1 and 0.8 req/s, rates tried up to 12.8:
    # the rate axis is logarithmic (12.8 / 0.1 = 128 > 4), the legend sits right of every panel,
    # each answer is starred and labelled with its req/s, the SLO target line is labelled
    rates = [0.1 * 2 ** k for k in range(8)]  # 0.1 .. 12.8
    results = [_rated(f"p{i}", rates[i % 4], rates) for i in range(8)]
    fig = rate_figure(results, {})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    att, good, ttft = fig.axes
    assert ttft.get_xscale() == "log" and att.get_xscale() == "log"  # shared axis
    legend_box = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:  # the legend covers no panel (was: drawn over the points of the first)
        assert legend_box.x0 >= ax.get_window_extent(renderer).x1
    # each panel at least 800 px wide and 250 px tall at the report's 110 dpi (was ~370 x 330 px)
    fig.set_dpi(110)
    fig.canvas.draw()
    for ax in fig.axes:
        box = ax.get_window_extent(fig.canvas.get_renderer())
        assert box.width >= 800 and box.height >= 250
    labels = [t.get_text() for t in att.texts]
    assert "SLO target: 90% of requests" in labels
    assert sorted(x for x in labels if x[0].isdigit()) == sorted(f"{rates[i % 4]:.3g}" for i in range(8))
    # answer labels do not overlap one another (was: 0.405, 0.482, 0.526 ... printed over each other)
    fig.canvas.draw()
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in att.texts if t.get_text()[0].isdigit()]
    assert not [(a, b) for k, a in enumerate(boxes) for b in boxes[k + 1:] if a.overlaps(b)]
    assert _fig_legend(fig)[:8] == [f"p{i}: {rates[i % 4]:.3g} req/s" for i in range(8)]
    plt.close(fig)
    # rates within 4x: a linear axis
    fig = rate_figure([_rated("a", 1.0, [1.0, 2.0, 3.0])], {})
    assert fig.axes[2].get_xscale() == "linear"
    plt.close(fig)


def test_capacity_rate_plot_ttft_axis_has_decimal_tick_labels() -> None:
    # TTFT p99 from 0.6 s to 2.5 s: less than a decade, where matplotlib's default labels the minor
    # ticks "6×10^-1", "2×10^0"
    fig = rate_figure([_result("a", [(1.0, 1.0, 0.6, False), (2.0, 0.95, 2.5, False)])], {})
    fig.canvas.draw()
    labels = _tick_labels(fig.axes[2].yaxis)
    texts = [t for _, t in labels]
    assert not [t for t in texts if "10^" in t or "times" in t or "$" in t], texts
    # each label is its tick's value in decimals (the independent formula: float(text) == value)
    assert all(float(text) == pytest.approx(loc) for loc, text in labels), labels
    assert {"1", "2"} <= set(texts)  # a decade and a minor tick of mantissa 2
    plt.close(fig)


@pytest.mark.parametrize("lo, hi, expected", [
    (0.45, 3.3, {"0.5", "1", "2", "3"}),  # 0.87 decades: the decade and mantissas 2, 3, 5 (not 0.6 .. 0.9)
    (0.2, 1.5, {"0.2", "0.3", "0.5", "1"}),  # 0.88 decades
    (0.01, 100.0, {"0.01", "0.1", "1", "10", "100"}),  # 4 decades: the decades only
    (0.6, 0.9, {"0.6", "0.7", "0.8", "0.9"}),  # 0.18 decades: every minor tick
    (1.5, 2.5, {"1.6", "1.8", "2", "2.2", "2.4"}),  # within a decade's step: matplotlib's finer ticks, all labelled
])
def test_plain_log_ticks_labels(lo: float, hi: float, expected: set[str]) -> None:
    fig, ax = plt.subplots()
    ax.plot([lo, hi], [lo, hi])
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    plain_log_ticks(ax.yaxis)
    fig.canvas.draw()
    labels = _tick_labels(ax.yaxis)
    assert {t for _, t in labels} == expected
    assert all(float(text) == pytest.approx(loc) for loc, text in labels), labels
    plt.close(fig)


def _sweep_rows(policies=("round_robin", "least_load"), grid=((1, 1), (1, 2), (2, 1), (2, 2)), rates=(0.5, 1.0),
                seeds=(0, 1)) -> list[dict]:
    """Rows as sweep.csv holds them; goodput = a distinct value per configuration so averaging shows."""
    rows = []
    for pi, pol in enumerate(policies):
        for gi, (p, d) in enumerate(grid):
            for rate in rates:
                for seed in seeds:
                    rows.append({"policy": pol, "rate_scale": rate, "seed": seed, "set.prefill.num_engines": p,
                                 "set.decode.num_engines": d, "sweep_trace": "embedded", "offered_rps": 2 * rate,
                                 "goodput_rps": rate * (1 + gi + 10 * pi) + seed, "ttft_p99_s": 0.5 + gi + seed,
                                 "attainment": 0.1 * (gi + 1), "error": ""})
    return rows


def test_sweep_rates_plot_draws_one_line_per_configuration() -> None:
    from sim.search.sweep import rates_figure

    fig = rates_figure(_sweep_rows())
    gp, tt = fig.axes
    # 2 policies x 4 grid points = 8 configurations (was: 2 lines, 2 and 4 engines averaged into one)
    assert len(tt.get_lines()) == 8 and len(gp.get_lines()) == 9  # + the offered-rate diagonal
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["round_robin, prefill.num_engines=1, decode.num_engines=1",
                          "round_robin, prefill.num_engines=1, decode.num_engines=2"] and len(labels) == 9
    # each line is the mean over its 2 seeds, by hand: rate * (1 + gi) + mean(0, 1) for round_robin's gi = 1
    assert list(gp.get_lines()[1].get_ydata()) == [0.5 * 2 + 0.5, 1.0 * 2 + 0.5]
    assert fig._suptitle.get_text() == "one line per configuration (mean over 2 seeds)"
    plt.close(fig)


def test_sweep_rates_plot_says_when_it_averages_configurations() -> None:
    from sim.search.sweep import MAX_RATE_LINES, rates_figure

    grid = [(p, d) for p in (1, 2, 3, 4) for d in (1, 2)]  # 2 x 8 = 16 > MAX_RATE_LINES configurations
    assert 2 * len(grid) > MAX_RATE_LINES
    fig = rates_figure(_sweep_rows(grid=grid, seeds=(0,)))
    assert len(fig.axes[1].get_lines()) == 2
    assert fig._suptitle.get_text() == ("one line per policy: the mean over its 8 configurations "
                                        "(prefill.num_engines, decode.num_engines); every point in sweep.csv")
    plt.close(fig)
    # one grid value, one trace: nothing varies but the policy, and the label says no more
    fig = rates_figure(_sweep_rows(grid=((1, 1),), seeds=(0,)))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["round_robin", "least_load", "offered rate"]
    assert fig._suptitle.get_text() == "one line per configuration"
    plt.close(fig)


@pytest.mark.parametrize("ys", [(1, 2), (0.123456789, 0.987654321)])  # short and wide y tick labels
def test_sweep_heatmap_labels_do_not_overlap_the_neighbouring_panels(ys: tuple) -> None:
    from sim.search.sweep import heatmap_figure

    grid = [(p, d) for p in (1, 2) for d in ys]
    rows = _sweep_rows(policies=("round_robin", "least_load:metric=requests", "random"), grid=grid)
    fig = heatmap_figure(rows, ["prefill.num_engines", "decode.num_engines"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_title()]  # not the colorbar
    assert len(panels) == 6  # 3 policies x 2 rates, 4 per row
    assert [ax.get_ylabel() for ax in panels] == ["decode.num_engines", "", "", "", "decode.num_engines", ""]
    assert [ax.get_xlabel() for ax in panels] == ["", "", "prefill.num_engines", "prefill.num_engines",
                                                  "prefill.num_engines", "prefill.num_engines"]
    for left, right in [(panels[i], panels[i + 1]) for i in (0, 1, 2, 4)]:
        # the right panel's y axis (label and tick labels) starts right of the left panel's frame
        assert right.yaxis.get_tightbbox(renderer).x0 > left.get_window_extent(renderer).x1
    for upper, lower in [(panels[0], panels[4]), (panels[1], panels[5])]:
        # the upper panel's x axis (ticks, label) ends above the title of the panel below (was: on it)
        assert upper.xaxis.get_tightbbox(renderer).y0 > lower.title.get_window_extent(renderer).y1
    assert fig._suptitle.get_text() == "each cell: the mean over seeds"
    plt.close(fig)
