"""``pdlb sim price``: argument parser (:func:`add_price_parser`) and runner (:func:`run_price`).

Modes: the analytic target analysis on ``--scenario`` (default; :mod:`sim.pricing.analysis`),
``--from-summary`` (price the runs of a results ``summary.json``) and ``--simulate`` (simulate,
then price the measured throughput; :mod:`sim.pricing.measured`). See docs/pricing.md.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from balancer.policies.spec import build_policy, format_policy_spec, parse_policy_spec
from pdlb_cli.args import (
    CommaListError,
    add_set_arg,
    comma_items,
    seed_int,
    token_count,
    warn_idle_flags,
)
from pdlb_cli.args import positive_float as pos_float
from pdlb_cli.args import positive_int as pos_int
from sim.pricing.analysis import (
    DEEPINFER_DECODE_BATCH_PER_RANK,
    DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ,
    DEEPINFER_TARGET_USD_PER_GPU_HOUR,
    DEEPINFER_TOKENS_PER_DAY,
    implied_fleet_gpus,
    operating_point_table,
    revenue_grid,
    target_table,
)
from sim.pricing.measured import load_summaries, rates_from_summary, simulate_rates
from sim.pricing.report import (
    economics_table,
    operating_point_markdown,
    plot_revenue_heatmaps,
    sheets_table,
    target_markdown,
    target_rows_table,
)
from sim.pricing.revenue import DEFAULT_GPU_HOUR_COST_USD, TokenRates, economics
from sim.pricing.sheets import (
    PERIODS,
    PriceSheet,
    _check_fraction,
    _check_nonneg,
    load_price_sheets,
    shipped_price_sheets,
)
from sim.pricing.throughput import steady_state
from sim.overrides import apply_overrides
from sim.scenario import load_scenario
from sim.workload import scale_rate
from sim.workload.loader import read_trace_cut


DEFAULT_SCENARIO = "deepinfer-sm100"
DEFAULT_HIT_RATES = (0.563, 0.8, 0.9, 0.96)
DEFAULT_RATIOS = (1.0, 2.0, 3.6, 8.0, 16.0, 32.0)


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in comma_items(text, "numbers", flag=what)]
    except CommaListError:
        raise
    except ValueError as e:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from e
    if not vals:
        raise ValueError(f"{what}: no values in {text!r}")
    return vals


def check_output_tokens(output_tokens: int, max_ratio: float, max_model_len: int) -> None:
    """Refuse an ``--output-tokens`` whose longest request (prompt ``max_ratio x N`` plus ``N``
    output tokens) the scenario's engines would reject (``max_model_len``): such a row prices a
    request no engine serves, and the analytic tables' cost grows with the prompt's length (an
    unbounded count runs for minutes).

    Raises:
        ValueError: one line with the largest ``--output-tokens`` that fits.
    """
    longest = output_tokens * (1.0 + max_ratio)
    if longest > max_model_len:
        fits = int(max_model_len // (1.0 + max_ratio))
        raise ValueError(f"--output-tokens {output_tokens:,}: with --ratio up to {max_ratio:g} a request has "
                         f"{longest:,.0f} tokens, over the scenario's max_model_len {max_model_len:,}; give at most "
                         f"{fits:,} output tokens (or smaller ratios)")


def add_price_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim price``. Numbers that must be positive are checked while parsing
    (``argument --flag: must be ...``, exit 2), before any table is printed."""

    p = simsub.add_parser(
        "price", help="revenue per GPU-hour and cost per million tokens from a price sheet",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serving economics from an API price sheet (USD per 1M tokens: input cache hit / miss, output, "
                    "off-peak discount) and a GPU-hour cost.\n\n"
                    "  default          what load and hit rate earn --target $/GPU-h on --scenario (analytic, "
                    "no simulation)\n"
                    "  --from-summary   price the measured throughput of simulation runs (results/*/summary.json)\n"
                    "  --simulate       simulate --scenario on a trace, then price its measured throughput\n\n"
                    f"Shipped sheets: {', '.join(shipped_price_sheets())}. See docs/pricing.md.")
    p.add_argument("--prices", default="all", metavar="NAME|FILE[,...]",
                   help="price sheets: shipped names or .toml/.yaml/.json files, comma-separated (default: all shipped)")
    p.add_argument("--period", default="valley", choices=PERIODS,
                   help="list prices, valley (off-peak) prices, or blended over the day (default valley)")
    p.add_argument("--gpu-hour-cost", type=float, default=DEFAULT_GPU_HOUR_COST_USD, metavar="USD",
                   help=f"GPU cost per hour for cost per 1M tokens and margin (default {DEFAULT_GPU_HOUR_COST_USD:g}, "
                        "DeepSeek's H800 basis)")
    p.add_argument("--scenario", default=DEFAULT_SCENARIO, metavar="NAME|FILE",
                   help=f"PD scenario preset or file (default {DEFAULT_SCENARIO})")
    add_set_arg(p)
    p.add_argument("--target", type=pos_float, default=DEEPINFER_TARGET_USD_PER_GPU_HOUR, metavar="USD",
                   help=f"target revenue per GPU-hour (default {DEEPINFER_TARGET_USD_PER_GPU_HOUR:g}, DeepInfer)")
    p.add_argument("--hit-rate", default=",".join(f"{h:g}" for h in DEFAULT_HIT_RATES), metavar="H[,...]",
                   help="input cache-hit rates to tabulate (default %(default)s)")
    p.add_argument("--ratio", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), metavar="R[,...]",
                   help="input:output token ratios to tabulate (default %(default)s)")
    p.add_argument("--output-tokens", type=token_count, default=1000, metavar="N",
                   help="output tokens per request; prompt = ratio x N, and (ratio + 1) x N must fit the scenario's "
                        "max_model_len (default 1000)")
    p.add_argument("--tok-s-per-seq", type=pos_float, default=DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ, metavar="TPS",
                   help=f"decode tokens/s per sequence (default {DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ:g}, DeepInfer)")
    p.add_argument("--roofline-decode", action="store_true",
                   help="take decode speed from the perf model instead of --tok-s-per-seq (heatmap and steady state)")
    p.add_argument("--published-batch", type=pos_int, default=DEEPINFER_DECODE_BATCH_PER_RANK, metavar="B",
                   help="decode sequences per rank of the operating-point table (default %(default)s, DeepInfer's "
                        "'~60 sequences per rank')")
    p.add_argument("--decode-batch", type=pos_int, metavar="B",
                   help="decode sequences per rank for the heatmap (default: the scenario's max_decode_batch)")
    p.add_argument("--no-kv-link", action="store_true",
                   help="do not cap prefill by its NIC sending every prompt's KV to decode")
    p.add_argument("--png", type=Path, metavar="PATH", help="write the revenue heatmap PNG here")
    p.add_argument("--markdown", action="store_true", help="also print the target table as Markdown")
    src = p.add_argument_group("measured throughput")
    src.add_argument("--from-summary", type=Path, metavar="SUMMARY.json",
                     help="price the runs of a results summary.json (pdlb sim run/compare)")
    src.add_argument("--simulate", action="store_true", help="simulate --scenario on a trace and price it")
    src.add_argument("--trace", metavar="PATH", help="trace for --simulate (default: the embedded Mooncake trace)")
    src.add_argument("--limit", type=pos_int, default=2000, metavar="N", help="first N requests for --simulate (default 2000)")
    src.add_argument("--rate-scale", type=pos_float, default=1.0, metavar="F", help="arrival-rate multiplier for --simulate (default 1)")
    src.add_argument("--policy", default="cache_aware", metavar="NAME[:K=V,...]",
                     help="routing policy for --simulate, with optional parameters (default cache_aware)")
    src.add_argument("--seed", type=seed_int, default=0, help="seed for --simulate (default 0)")
    src.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _price_runs(console, labelled_rates: Sequence[tuple[str, TokenRates]], sheets: Sequence[PriceSheet],
                args) -> None:  # noqa: ANN001
    rows = [(label, economics(rates, s, args.gpu_hour_cost, args.period))
            for label, rates in labelled_rates for s in sheets]
    console.print(economics_table(rows, f"measured throughput priced at {args.period} prices, "
                                        f"GPU ${args.gpu_hour_cost:g}/h"))


def hit_rates(text: str) -> list[float]:
    """``--hit-rate``: distinct fractions in [0, 1] (ValueError naming the flag otherwise)."""
    hits = _floats(text, "--hit-rate")
    for h in hits:
        _check_fraction("--hit-rate", h)
    return hits


def prompt_ratios(text: str) -> list[float]:
    """``--ratio``: distinct finite numbers > 0 (ValueError naming the flag otherwise)."""
    ratios = _floats(text, "--ratio")
    for r in ratios:
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"--ratio: values must be finite and > 0, got {r:g}")
    return ratios


def run_price(args: argparse.Namespace, console: Console) -> int:
    """Run ``pdlb sim price`` (see :func:`add_price_parser`). Returns the exit status."""

    if args.prices not in ("", "all"):  # ',' or 'a,,b' priced no sheet or fewer (empty tables, exit 0)
        comma_items(args.prices, "price sheet names or files", flag="--prices")
    sheets = load_price_sheets(args.prices)
    hits, ratios = hit_rates(args.hit_rate), prompt_ratios(args.ratio)
    _check_nonneg("--gpu-hour-cost", args.gpu_hour_cost)

    measured = [("trace", "without --simulate"), ("limit", "without --simulate"), ("rate_scale", "without --simulate"),
                ("policy", "without --simulate"), ("seed", "without --simulate"), ("quiet", "without --simulate")]
    idle = [] if args.simulate and args.from_summary is None else measured
    if args.from_summary is not None:
        why = "with --from-summary: the summary's runs are priced as they are"
        idle += [("simulate", why), ("scenario", why), ("overrides", why)]
    if args.simulate or args.from_summary is not None:
        why = "with --simulate or --from-summary: it shapes the analytic tables only"
        idle += [(d, why) for d in ("target", "hit_rate", "ratio", "output_tokens", "tok_s_per_seq", "roofline_decode",
                                    "published_batch", "decode_batch", "no_kv_link", "png", "markdown")]
    warn_idle_flags(args, idle)
    # read (and check) the summaries and the scenario before printing anything: one error line
    runs = load_summaries(args.from_summary) if args.from_summary is not None else None
    scenario = apply_overrides(load_scenario(args.scenario), args.overrides) if runs is None else None
    if scenario is not None and not args.simulate and (scenario.prefill is None or scenario.decode is None):
        raise ValueError(f"--scenario {scenario.name}: the scenario is aggregated; pdlb sim price needs prefill "
                         "and decode pools (or --simulate)")
    if scenario is not None and not args.simulate:
        check_output_tokens(args.output_tokens, max(ratios), scenario.effective_max_model_len)
    reqs: list = []
    policy = None
    if args.simulate and runs is None:  # the trace and the policy before any output, as every command reads them
        try:
            name, params = parse_policy_spec(args.policy)
        except ValueError as e:
            raise ValueError(f"--policy: {e}") from None
        policy, policy_label = build_policy(args.policy), format_policy_spec(name, params)
        reqs, _ = read_trace_cut(args.trace, "auto", limit=args.limit, spread_s=3.0, seed=args.seed)
        if args.rate_scale != 1.0:
            reqs = scale_rate(reqs, args.rate_scale)
    console.print(sheets_table(sheets))
    if runs is not None:
        _price_runs(console, [(f"{r.get('scenario', '?')}/{r.get('policy', i)}",
                               rates_from_summary(r, f"{args.from_summary} run {i}")) for i, r in enumerate(runs)],
                    sheets, args)
        return 0
    assert scenario is not None
    if args.simulate:
        with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=args.quiet) as prog:
            task = prog.add_task("sim", total=len(reqs))
            rates, summary = simulate_rates(scenario, reqs, policy, seed=args.seed,
                                            progress=lambda d, t: prog.update(task, completed=d))
        console.print(f"{scenario.name}: {len(reqs)} requests, makespan {summary['makespan_s']:.0f} s, "
                      f"{scenario.num_gpus} GPUs, prefix hit {100 * summary['prefix_hit_rate']:.1f}%")
        _price_runs(console, [(f"{scenario.name}/{policy_label}", rates)], sheets, args)
        return 0

    kv_link = not args.no_kv_link
    speed = None if args.roofline_decode else args.tok_s_per_seq
    pp, dp = scenario.prefill, scenario.decode
    if pp is None or dp is None:
        raise ValueError(f"scenario {scenario.name!r} is aggregated; pdlb sim price needs prefill and decode pools")
    console.print(f"[bold]{scenario.name}[/]: {scenario.description} ({pp.num_gpus} prefill + {dp.num_gpus} decode "
                  f"GPUs, {dp.num_ranks} decode ranks)")
    rows = target_table(scenario, sheets, hits, ratios, target_usd_per_gpu_hour=args.target, period=args.period,
                        output_tokens=args.output_tokens, tokens_per_s_per_seq=args.tok_s_per_seq, kv_link=kv_link)
    console.print(target_rows_table(rows, f"what earns ${args.target:g}/GPU-h at {args.period} prices "
                                          f"({args.tok_s_per_seq:g} tok/s per sequence, "
                                          f"{args.output_tokens} output tokens per request)"))
    if args.markdown:
        console.print(target_markdown(rows), markup=False, highlight=False, soft_wrap=True)
    ops = operating_point_table(scenario, sheets, hits, batch_per_rank=args.published_batch,
                                tokens_per_s_per_seq=args.tok_s_per_seq, target_usd_per_gpu_hour=args.target,
                                period=args.period, output_tokens=args.output_tokens, kv_link=kv_link)
    ot = Table(title=f"at {args.published_batch} sequences per rank x {args.tok_s_per_seq:g} tok/s: the input:output "
                     f"ratio that earns ${args.target:g}/GPU-h ({args.period} prices)")
    for c in ("sheet", "hit", "out tok/s/GPU", "fixed: in:out", "fixed: P load", "balanced: in:out",
              "balanced: P/D GPUs"):
        ot.add_column(c, justify="left" if c == "sheet" else "right", no_wrap=c == "sheet")
    for o in ops:
        ot.add_row(o.sheet, f"{100 * o.hit_rate:.1f}%", f"{o.output_tokens_per_s_per_gpu:,.0f}",
                   f"{o.fixed_input_per_output:.2f}",
                   f"[red]{o.fixed_prefill_load:.2f}[/]" if o.fixed_prefill_load > 1 else f"{o.fixed_prefill_load:.2f}",
                   f"{o.balanced_input_per_output:.2f}", f"{o.balanced_prefill_gpus_per_decode_gpu:.3f}")
    console.print(ot)
    if args.markdown:
        console.print(operating_point_markdown(ops), markup=False, highlight=False, soft_wrap=True)
    batch = args.decode_batch or dp.max_decode_batch
    ss = steady_state(scenario, prompt_tokens=int(round(ratios[0] * args.output_tokens)),
                      output_tokens=args.output_tokens, hit_rate=hits[-1], decode_batch_per_rank=batch,
                      decode_tokens_per_s_per_seq=speed, kv_link=kv_link)
    roof = steady_state(scenario, prompt_tokens=ss.prompt_tokens, output_tokens=args.output_tokens,
                        hit_rate=hits[-1], decode_batch_per_rank=batch, kv_link=kv_link)
    console.print(f"perf model at decode batch {ss.decode_batch_per_rank}/rank, context "
                  f"{ss.prompt_tokens + args.output_tokens / 2:.0f}: decode step {1e3 * roof.decode_step_s:.1f} ms "
                  f"= {roof.decode_tokens_per_s_per_seq:.0f} tok/s per sequence (published: "
                  f"{DEEPINFER_DECODE_TOKENS_PER_S_PER_SEQ:g}); prefill {ss.prefill_input_tokens_per_s / pp.num_gpus:,.0f} "
                  f"input tok/s per GPU at {100 * hits[-1]:.0f}% hit ({ss.prefill_limit}-bound)")
    grids = {split: [(s, revenue_grid(scenario, s, hits, ratios, period=args.period, output_tokens=args.output_tokens,
                                      decode_batch_per_rank=batch, tokens_per_s_per_seq=speed, kv_link=kv_link,
                                      split=split)) for s in sheets]
             for split in ("fixed", "balanced")}
    speed_txt = "perf-model" if speed is None else f"{speed:g} tok/s"
    split_txt = {"fixed": f"{pp.num_gpus} prefill + {dp.num_gpus} decode GPUs",
                 "balanced": "prefill pool sized to the decode pool"}
    for split, gs in grids.items():
        t = Table(title=f"revenue $/GPU-h, {split_txt[split]}, decode batch <= {batch}/rank ({speed_txt} per "
                        f"sequence), {args.period} prices")
        t.add_column("sheet", no_wrap=True)
        t.add_column("hit", justify="right")
        for r in ratios:
            t.add_column(f"in:out {r:g}", justify="right")
        for s, g in gs:
            for i, h in enumerate(hits):
                t.add_row(s.name if i == 0 else "", f"{100 * h:.1f}%",
                          *[(f"[green]{v:.1f}[/]" if v >= args.target else f"{v:.1f}") for v in g[i]])
        console.print(t)
    h_pub = 0.96
    ft = Table(title=f"cross-check: {DEEPINFER_TOKENS_PER_DAY / 1e12:g}T tokens/day at {100 * h_pub:.0f}% hit "
                     f"earning ${args.target:g}/GPU-h implies a fleet of")
    ft.add_column("sheet")
    for r in ratios:
        ft.add_column(f"in:out {r:g}", justify="right")
    for s in sheets:
        ft.add_row(s.name, *[f"{implied_fleet_gpus(s, tokens_per_day=DEEPINFER_TOKENS_PER_DAY, hit_rate=h_pub, input_per_output=r, target_usd_per_gpu_hour=args.target, period=args.period):,.0f} GPUs" for r in ratios])
    console.print(ft)
    if args.png:
        out = plot_revenue_heatmaps(args.png, grids["fixed"] + grids["balanced"], hits, ratios,
                                    target_usd_per_gpu_hour=args.target, row_labels=(f"{pp.num_gpus}P+{dp.num_gpus}D",
                                                                                     "balanced"),
                                    title=f"{scenario.name}: revenue per GPU-hour at {args.period} prices, decode "
                                          f"batch <= {batch}/rank, {speed_txt} per sequence")
        console.print(f"wrote {out}")
    return 0


class Price:
    """``pdlb sim price`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "price"
    add_parser = staticmethod(add_price_parser)
    run = staticmethod(run_price)
