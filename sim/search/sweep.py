"""Sweeps: many simulation points from one TOML file, run on an executor, resumable, one table.

A sweep file (``pdlb sim sweep SWEEP.toml``)::

    scenario = "dsv3-pd-h200"                 # base scenario: preset name or file (relative to this file)
    policies = ["cache_aware", "least_load", "cache_aware:cache_threshold=0.5,balance_abs=8"]
    decode_policy = "least_load"              # optional; default: each point's policy
    policy_modules = ["mypkg.mypolicy"]       # optional; @register-ed user policies
    rates = [0.5, 1.0, 2.0]                   # rate scales (default [1.0])
    seeds = [0, 1]                            # seeds (default [0]): as `pdlb sim run --seed`, each seeds the
                                              # router's RNG and the spreading of batched arrivals (spread_s)
    traces = ["a.jsonl.gz"]                   # optional; default: the embedded trace
    limit = 2000                              # optional workload cut (also duration_s, spread_s, format)
    warmup_s = 60                             # optional: simulate the first 60 s of arrivals, judge what follows

    route_slo = true                          # optional: the router is told [slo]'s TTFT budget (false: SLO-blind)

    [slo]                                     # optional (sim.search.point.SLO fields)
    ttft_s = 2.0
    attainment = 0.9

    [grid]                                    # cartesian product over scenario fields by dotted path
    "prefill.num_engines" = [4, 6, 8]
    "perf.mfu" = [0.4, 0.5]

    [[points]]                                # and/or listed points: each a set of dotted overrides
    "prefill.num_engines" = 4
    "decode.num_engines" = 2

The points are the product of policies x rates x seeds x traces x scenario variations, where the
variations are the grid's product, the listed points, or (both given) each listed point applied
after each grid combination. At most :data:`MAX_POINTS` points.

Results (folder ``--out``):

- ``points.jsonl``: one line per finished point, written as it finishes (a stopped sweep loses
  nothing), keyed by a stable ``point_id`` (a hash of the point's parameters, the base scenario
  and the SLO); rerunning the same sweep into the same folder skips the points already there
  (resumable). Failed points are kept with their ``error`` and retried on the next run.
- ``sweep.csv`` and ``sweep.json``: one row per point, every summary metric (dotted keys) and the
  point's parameters (``set.<path>`` columns for the scenario overrides), and ``goodput_burst``:
  the run ended more than 2 arrival windows after it started, so its goodput is a burst's
  (:func:`mark_bursts`).
- ``per_point/<point_id>/`` with each run's per-request CSV and summary, only with ``--per-point``
  (a full-trace per-request CSV is ~2 MB).
- plots: goodput and TTFT p99 vs request rate, one line per configuration (:func:`rates_figure`;
  when several rates), an SLO-attainment
  heatmap over the first two grid parameters (when the grid has two), and ``report.html``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from balancer.router import DEFAULT_TIER_WEIGHTS, INDEX_MODES
from balancer.validation import syntax_error_line
from sim.overrides import apply_overrides
from sim.search.point import SLO, Point, PointResult, PolicyPair, SimOptions, WorkloadSpec, parse_policy, point_row
from sim.scenario import PRESETS, Scenario, load_scenario
from sim.workload.loader import TRACE_FORMATS, check_trace_path

#: Most points one sweep may expand to (every input-driven loop is bounded).
MAX_POINTS = 10_000

_KEYS = {"scenario", "policies", "decode_policy", "policy_modules", "rates", "seeds", "traces", "limit", "duration_s",
         "spread_s", "format", "slo", "grid", "points", "index_mode", "router_tiers", "tier_weights",
         "route_slo", "warmup_s"}


@dataclass
class Sweep:
    """An expanded sweep.

    Attributes:
        base: the base scenario.
        points: the points, in file order (policies outermost, then traces, variations, rates, seeds).
        ids: ``point_id`` of each point.
        grid_keys: the grid's dotted paths, in file order (for the heatmap).
        source: the file.
        raw: the parsed file.
    """

    base: Scenario
    points: list[Point]
    ids: list[str]
    grid_keys: list[str]
    source: Path
    raw: dict[str, Any] = field(default_factory=dict)


def unknown_key_message(source: Path | str, table: str, key: str, valid: Sequence[str]) -> str:
    """``"<file>: [<table>]: unknown key 'k' (did you mean 'x'?); valid: a, b"``: the one form of
    every sweep-file table's unknown key (``table`` ``""`` for the top level)."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    where = f" [{table}]:" if table else ""
    return (f"{source}:{where} unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; valid: {', '.join(sorted(valid))}")


def _scenario_path_problem(path: str) -> str | None:
    """Why the dotted scenario path of a ``[grid]`` / ``[[points]]`` key names no field, or None.
    Below a non-table field (``shared_store.class_ttl_s.chatbot``, a mapping) any key is taken."""
    cls: Any = Scenario
    parts = path.split(".")
    for i, part in enumerate(parts):
        if cls is None:
            return None
        if part not in cls.model_fields:
            owner = ".".join(parts[:i]) or "the scenario"
            close = difflib.get_close_matches(part, list(cls.model_fields), n=1)
            return (f"{owner} has no field {part!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; valid: {', '.join(sorted(cls.model_fields))}")
        ann = cls.model_fields[part].annotation
        args = [a for a in (getattr(ann, "__args__", None) or (ann,)) if a is not type(None)]
        cls = args[0] if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel) else None
    return None


def _check_table_keys(source: Path, table: str, keys: Sequence[str]) -> None:
    for k in keys:
        problem = _scenario_path_problem(k)
        if problem is not None:
            raise ValueError(f"{source}: {table}: unknown key {k!r}: {problem}")


def _number(raw: dict, key: str, source: Path, *, table: str = "", integer: bool = False, minimum: float = 0.0,
            strict: bool = True) -> Any:
    """``raw[key]`` checked: a finite number (an int with ``integer``) > ``minimum`` (>= with ``strict=False``)."""
    v = raw[key]
    kind = "an integer" if integer else "a number"
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not math.isfinite(v) or not (v > minimum if strict else v >= minimum):
        where = f"[{table}] " if table else ""
        raise ValueError(f"{source}: {where}{key} must be {kind} {'>' if strict else '>='} {minimum:g}, got {v!r}")
    return v


_KIND_NAMES: dict[Any, str] = {int: "an integer", str: "a string", (int, float): "a number",
                               (str, type(None)): "a string"}


def _list(raw: dict, key: str, default: list, kind: type | tuple, source: Path) -> list:
    v = raw.get(key, default)
    if not isinstance(v, list) or not v:
        raise ValueError(f"{source}: {key} must be a non-empty list, got {v!r}")
    for x in v:
        if not isinstance(x, kind) or isinstance(x, bool):
            raise ValueError(f"{source}: {key}: {x!r} is not {_KIND_NAMES.get(kind, kind)}")
    return v


def point_id(base: Scenario, slo: SLO, overrides: Sequence[tuple[str, Any]], policy: PolicyPair, rate: float,
             seed: int, workload: WorkloadSpec, options: SimOptions) -> str:
    """A stable 16-hex-digit id of a point's parameters (base scenario, overrides, policy, rate,
    seed, workload, SLO, router options): equal ids mean the same simulation."""
    doc = {"base": json.loads(base.model_dump_json()), "set": [[k, v] for k, v in overrides],
           "policy": [policy.prefill.name, list(map(list, policy.prefill.params)), policy.decode_spec.name,
                      list(map(list, policy.decode.params if policy.decode is not None else ()))],
           "rate": rate, "seed": seed, "workload": [workload.trace, workload.format, workload.limit,
                                                   # duration_s counts simulated time (after rate scaling); tagged
                                                   # so results of the earlier order (cut first) are not resumed
                                                   # "v2": rows cut on Ray before issue 24's fix ignored duration_s
                                                   # under the same id; such rows are rerun, not resumed
                                                   None if workload.duration_s is None else
                                                   ["scaled-v2", workload.duration_s],
                                                   workload.spread_s, workload.seed,
                                                   *([["warmup", workload.warmup_s]] if workload.warmup_s else [])],
           "slo": [slo.ttft_s, slo.tpot_s, slo.attainment, slo.percentile, slo.ttft_per_1k_prompt_tokens_s],
           # route_slo: points made before the router was told the SLO (SLO-blind) are not resumed as SLO-aware
           "options": [options.index_mode, options.router_tiers, options.tier_weights, ["route_slo", options.route_slo]]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_sweep(path: str | Path, *, limit: int | None = None) -> Sweep:
    """Read and expand a sweep file (see the module docstring).

    Args:
        limit: override the file's ``limit`` (CLI ``--limit``).

    Raises:
        ValueError: unreadable file, unknown keys, wrong types, an unknown policy or scenario field
            (checked for every variation before anything runs), more than :data:`MAX_POINTS`.
    """
    source = Path(path)
    try:
        raw = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ValueError(f"{source}: no such sweep file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{source}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(syntax_error_line(str(source), e)) from None
    for k in raw:
        if k not in _KEYS:
            raise ValueError(unknown_key_message(source, "", k, _KEYS))
    for k in ("limit", "duration_s", "spread_s", "warmup_s"):
        if raw.get(k) is not None:
            _number(raw, k, source, integer=k == "limit", minimum=0.0, strict=k not in ("spread_s", "warmup_s"))
    if raw.get("format", "auto") not in TRACE_FORMATS:
        raise ValueError(f"{source}: format must be one of {', '.join(TRACE_FORMATS)}, got {raw['format']!r}")
    if raw.get("index_mode", "approximate") not in INDEX_MODES:
        raise ValueError(f"{source}: index_mode must be one of {', '.join(INDEX_MODES)}, got {raw['index_mode']!r}")
    if not isinstance(raw.get("router_tiers", True), bool):
        raise ValueError(f"{source}: router_tiers must be true or false, got {raw['router_tiers']!r}")
    scen = raw.get("scenario", "dsv3-pd-h200")
    if not isinstance(scen, str):
        raise ValueError(f"{source}: scenario must be a preset name or a file path")
    rel = source.parent / scen
    try:
        base = load_scenario(scen if scen in PRESETS or not rel.exists() else rel)
    except ValueError as e:  # named the scenario, not the sweep file that gave it
        raise ValueError(f"{source}: scenario: {e}") from None
    modules = _list(raw, "policy_modules", [""], str, source) if "policy_modules" in raw else []
    try:
        policies = [parse_policy(p, raw.get("decode_policy"), modules)
                    for p in _list(raw, "policies", ["cache_aware"], str, source)]
    except ValueError as e:
        if str(source) in str(e):
            raise
        raise ValueError(f"{source}: policies: {e}") from None
    rates = [float(r) for r in _list(raw, "rates", [1.0], (int, float), source)]
    if any(not (math.isfinite(r) and r > 0) for r in rates):
        raise ValueError(f"{source}: rates must be finite numbers > 0, got {rates}")
    seeds = _list(raw, "seeds", [0], int, source)
    if any(s < 0 for s in seeds):  # as the CLI's --seed (pdlb_cli.args.seed_int): numpy's seeds are >= 0
        raise ValueError(f"{source}: seeds must be integers >= 0, got {seeds}")
    traces = _list(raw, "traces", [None], (str, type(None)), source) if "traces" in raw else [None]
    traces = [None if t is None else str(source.parent / t) if not Path(t).is_absolute() and (source.parent / t).exists()
              else t for t in traces]
    for t in traces:  # before anything runs, as every command checks --trace
        if t is not None:
            try:
                check_trace_path(t)
            except OSError as e:
                where = "" if Path(t).is_absolute() else f" (nor in {source.parent.resolve()}/, the sweep file's folder)"
                raise ValueError(f"{source}: traces: {e}{where}") from None
    slo_raw = raw.get("slo", {})
    if not isinstance(slo_raw, dict):
        raise ValueError(f"{source}: [slo] must be a table")
    slo_keys = [f.name for f in dataclasses.fields(SLO)]
    for k in slo_raw:
        if k not in slo_keys:
            raise ValueError(unknown_key_message(source, "slo", k, slo_keys))
        _number(slo_raw, k, source, table="slo", strict=k != "ttft_per_1k_prompt_tokens_s")
    try:
        slo = SLO(**slo_raw)
    except ValueError as e:  # the ranges SLO checks (attainment <= 1, percentile <= 100)
        raise ValueError(f"{source}: [slo]: {e}") from None
    tw = raw.get("tier_weights")
    if tw is not None:
        if not isinstance(tw, dict):
            raise ValueError(f"{source}: tier_weights must be a table like {{host = 0.75, store = 0.5}}")
        for k in tw:
            if k not in DEFAULT_TIER_WEIGHTS:
                raise ValueError(unknown_key_message(source, "tier_weights", k, DEFAULT_TIER_WEIGHTS))
            w = _number(tw, k, source, table="tier_weights", strict=False)
            if w > 1:
                raise ValueError(f"{source}: [tier_weights] {k} must be in [0, 1], got {w!r}")
    route_slo = raw.get("route_slo", True)
    if not isinstance(route_slo, bool):
        raise ValueError(f"{source}: route_slo must be true or false, got {route_slo!r}")
    options = SimOptions(index_mode=raw.get("index_mode", "approximate"), router_tiers=bool(raw.get("router_tiers", True)),
                         tier_weights=tuple(sorted(tw.items())) if isinstance(tw, dict) else None, route_slo=route_slo)
    grid = raw.get("grid", {})
    if not isinstance(grid, dict):
        raise ValueError(f"{source}: [grid] must be a table of dotted.path = [values]")
    grid_keys = list(grid)
    _check_table_keys(source, "[grid]", grid_keys)
    for k, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            raise ValueError(f"{source}: grid.{k} must be a non-empty list of values")
    listed = raw.get("points", [])
    if not isinstance(listed, list) or any(not isinstance(p, dict) for p in listed):
        raise ValueError(f"{source}: [[points]] must be tables of dotted.path = value")
    for p in listed:
        _check_table_keys(source, "[[points]]", list(p))
    combos = [list(zip(grid_keys, vals)) for vals in itertools.product(*grid.values())] if grid else [[]]
    variations = [c + list(p.items()) for c in combos for p in listed] if listed else combos
    total = len(policies) * len(traces) * len(variations) * len(rates) * len(seeds)
    if total > MAX_POINTS:
        raise ValueError(f"{source}: {total} points; at most {MAX_POINTS}")
    scenarios = []
    for var in variations:
        try:
            scenarios.append(apply_overrides(base, var, source=str(source)))
        except ValueError as e:
            raise ValueError(f"{e} (point {dict(var)})") from None
    points, ids = [], []
    for policy in policies:
        for trace in traces:
            for var, sc in zip(variations, scenarios):
                for rate in rates:
                    for seed in seeds:
                        # a seed means what `pdlb sim run --seed` means (and capacity's, pdlb_cli.sim.capacity.workload_spec):
                        # the router's RNG and the arrival spreading, so seeds are replicates of the workload too
                        wl = WorkloadSpec(trace, raw.get("format", "auto"),
                                          limit if limit is not None else raw.get("limit"), raw.get("duration_s"),
                                          float(raw.get("spread_s", 3.0)), seed, float(raw.get("warmup_s", 0.0)))
                        tag = (("sweep_trace", trace or "embedded"),
                               *((f"set.{k}", json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in var))
                        points.append(Point(sc, wl, policy, rate, slo, seed, options, False, tag))
                        ids.append(point_id(base, slo, var, policy, rate, seed, wl, options))
    first: dict[str, int] = {}
    for i, pid in enumerate(ids):  # a point listed twice would run, count and plot twice under one id
        if pid in first:
            pt = points[i]
            where = " ".join([pt.policy.label, f"x{pt.rate_scale:g}", f"seed {pt.seed}",
                              *(f"{k.removeprefix('set.')}={v}" for k, v in pt.tag if k.startswith("set."))])
            raise ValueError(f"{source}: point {where} is listed more than once (a value repeated in policies, "
                             "rates, seeds, traces, [grid] or [[points]]); list each once")
        first[pid] = i
    return Sweep(base, points, ids, grid_keys, source, raw)


# ---------------------------------------------------------------------- results
def read_done(path: Path) -> dict[str, dict[str, Any]]:
    """``{point_id: row}`` of a ``points.jsonl`` (missing file: empty). Lines of failed points
    (``error`` set) are not counted as done. A truncated last line (a sweep killed mid-write) is
    ignored; any other malformed line raises.

    Raises:
        ValueError: a malformed line other than the last (names file and line).
    """
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    out: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue
            raise ValueError(f"{path}:{n}: not a JSON line") from None
        if not row.get("error"):
            out[row["point_id"]] = row
    return out


def result_row(pid: str, r: PointResult) -> dict[str, Any]:
    from sim.search.capacity_report import _jsonable

    return _jsonable({"point_id": pid} | point_row(r, summary=True))


def run_sweep(sweep: Sweep, out: Path, executor: Any, *, resume: bool = True, per_point: bool = False,
              on_point: Callable[[str, dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Run the points of ``sweep`` not yet in ``out/points.jsonl`` (all of them without
    ``resume``), appending each result line as it completes. Returns ``(rows, num_run)``: one
    row per point of the sweep in sweep order (from this run or an earlier one) and how many ran now."""
    import concurrent.futures as cf
    import dataclasses

    from sim.search.point import error_result

    out.mkdir(parents=True, exist_ok=True)
    log = out / "points.jsonl"
    done = read_done(log) if resume else {}
    if not resume and log.exists():
        log.unlink()
    todo = [(pid, p) for pid, p in zip(sweep.ids, sweep.points) if pid not in done]
    seen: set[str] = set()
    todo = [(pid, p) for pid, p in todo if not (pid in seen or seen.add(pid))]  # duplicates run once
    if per_point:
        todo = [(pid, dataclasses.replace(p, save_dir=str(out / "per_point" / pid))) for pid, p in todo]
    with open(log, "a") as fh:
        futures = {executor.submit(p): (pid, p) for pid, p in todo}
        for fut in cf.as_completed(futures):
            pid, p = futures[fut]
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001 - a dead worker after its retries: an error row
                res = error_result(p, f"{type(e).__name__}: {e}")
            row = result_row(pid, res)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            if not row.get("error"):
                done[pid] = row
            else:
                done.setdefault(pid, row)
            if on_point is not None:
                on_point(pid, row)
    rows = [done[pid] for pid in sweep.ids if pid in done]
    return rows, len(todo)


def mark_bursts(rows: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """Set each row's ``goodput_burst`` (the check of :func:`sim.run.metrics.burst_note`, the one
    ``pdlb sim capacity`` applies to its answer: the run ended more than 2 arrival windows after it
    started, so its goodput, per second of the arrival window, is a burst's, not a sustained rate;
    False for a failed point) and return ``[(row, note), ...]`` of the bursts, in row order."""
    from sim.run.metrics import burst_note

    out = []
    for row in rows:
        note = "" if row.get("error") else burst_note(row.get("num_requests", 0), row.get("summary.arrival_window_s"),
                                                      row.get("summary.makespan_s"))
        row["goodput_burst"] = bool(note)
        if note:
            out.append((row, note))
    return out


def burst_message(bursts: Sequence[tuple[dict[str, Any], str]], num_rows: int, duration_s: float | None = None) -> str:
    """One line on the burst points of :func:`mark_bursts` (``""`` without any): how many, the
    first as an example, and what to do (``duration_s``: the sweep file's ``duration_s``, if it
    sets one; the advice is then a longer one)."""
    if not bursts:
        return ""
    row, note = bursts[0]
    where = " ".join([str(row["policy"]), f"x{row['rate_scale']:g}", f"seed {row['seed']}",
                      *(f"{k.removeprefix('set.')}={v}" for k, v in row.items() if k.startswith("set."))])
    todo = (f"set a longer duration_s than {duration_s:g} in the sweep file" if duration_s is not None else
            "set duration_s = S in the sweep file (every rate then runs S seconds of arrivals)")
    return (f"note: the goodput of {len(bursts)} of {num_rows} points is a burst's (goodput_burst in sweep.csv, * in "
            f"the table); e.g. {where}: {note}; {todo} or use a longer trace")


def write_table(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """``sweep.csv`` and ``sweep.json`` (one row per point; columns the union in first-seen order)."""
    import csv

    cols: dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(cols))
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    (out / "sweep.json").write_text(json.dumps({"columns": list(cols), "rows": list(rows)}, indent=1) + "\n")
    return [out / "sweep.csv", out / "sweep.json"]


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


#: Most lines per panel of the rates plot: up to this many configurations get a line each; with more,
#: each policy gets one line of means over its configurations, and the plot's title says so.
MAX_RATE_LINES = 12


def _varying(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if len({json.dumps(r.get(k), sort_keys=True, default=str) for r in rows}) > 1]


def rates_figure(rows: Sequence[dict[str, Any]]) -> Any:
    """The figure of :func:`plot_rates` (axes: goodput, TTFT p99), or None with fewer than two rates.

    A configuration is a policy with the values of the sweep parameters that vary between rows
    (``set.<path>`` columns, the trace); seeds are its replicates. Up to :data:`MAX_RATE_LINES`
    configurations each get a line of means over their seeds (labelled ``policy, path=value``);
    with more, one line per policy of means over its configurations and seeds. The title says
    what each line averages."""
    rates = sorted({r["rate_scale"] for r in rows})
    if len(rates) < 2:
        return None
    from sim.run.plots import plain_log_ticks, pyplot

    plt = pyplot()
    ok = [r for r in rows if not r.get("error")]
    params = _varying(ok, list(dict.fromkeys(k for r in ok for k in r if k.startswith("set.") or k == "sweep_trace")))
    configs = list(dict.fromkeys((r["policy"], *(json.dumps(r.get(k), default=str) for k in params)) for r in ok))
    per_config = len(configs) <= MAX_RATE_LINES
    if not per_config:
        configs = list(dict.fromkeys((r["policy"],) for r in ok))

    def key(r: dict[str, Any]) -> tuple:
        return (r["policy"], *(json.dumps(r.get(k), default=str) for k in params)) if per_config else (r["policy"],)

    n_seeds = len({r["seed"] for r in ok})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    for cfg in configs:
        xs, gp, tt = [], [], []
        for f in rates:
            sel = [r for r in ok if key(r) == cfg and r["rate_scale"] == f]
            if not sel:
                continue
            xs.append(sum(_num(r["offered_rps"]) for r in sel) / len(sel))
            gp.append(sum(_num(r["goodput_rps"]) for r in sel) / len(sel))
            tt.append(sum(_num(r["ttft_p99_s"]) for r in sel) / len(sel))
        label = ", ".join([cfg[0], *(f"{k.removeprefix('set.').replace('sweep_trace', 'trace')}={json.loads(v)}"
                                     for k, v in zip(params, cfg[1:]))])
        axes[0].plot(xs, gp, "o-", label=label)
        axes[1].plot(xs, tt, "o-", label=label)
    top = max((_num(r["offered_rps"]) for r in ok), default=1.0)
    axes[0].plot([0, top], [0, top], "k--", lw=1, label="offered rate")
    for ax, yl in zip(axes, ("goodput (req/s)", "TTFT p99 (s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    plain_log_ticks(axes[1].yaxis)
    seeds = f" and {n_seeds} seeds" if n_seeds > 1 else ""
    if per_config:
        what = "one line per configuration" + (f" (mean over {n_seeds} seeds)" if n_seeds > 1 else "")
    else:
        n_cfg = len({tuple(json.dumps(r.get(k), default=str) for k in params) for r in ok})
        what = (f"one line per policy: the mean over its {n_cfg} configurations ({', '.join(p.removeprefix('set.') for p in params)})"
                f"{seeds}; every point in sweep.csv")
    fig.suptitle(what, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: a dozen entries would cover the lines
    fig.legend(handles, labels, loc="outside lower center", ncols=2 if len(labels) > 4 else len(labels), fontsize=7)
    return fig


def plot_rates(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Goodput and TTFT p99 vs offered request rate (:func:`rates_figure`) to ``path``; False
    (nothing written) with fewer than two rates."""
    fig = rates_figure(rows)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def heatmap_figure(rows: Sequence[dict[str, Any]], keys: Sequence[str], metric: str = "attainment") -> Any:
    """The figure of :func:`plot_heatmap`, or None without two grid keys. The y-axis label is on
    the left column's panels only and the x-axis label on each column's lowest panel (all panels
    share both axes, so no panel's y label overlaps the panel to its left)."""
    if len(keys) < 2:
        return None
    import numpy as np

    from sim.run.plots import pyplot

    plt = pyplot()
    kx, ky = f"set.{keys[0]}", f"set.{keys[1]}"
    xs = list(dict.fromkeys(r[kx] for r in rows))
    ys = list(dict.fromkeys(r[ky] for r in rows))
    panels = list(dict.fromkeys((r["policy"], r["rate_scale"]) for r in rows))[:12]
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols + 1, 3.0 * nrows + 0.6), squeeze=False,
                             layout="constrained")
    im = None
    for n, (ax, (pol, rate)) in enumerate(zip(axes.flat, panels)):
        z = np.full((len(ys), len(xs)), np.nan)
        for i, yv in enumerate(ys):
            for j, xv in enumerate(xs):
                sel = [_num(r[metric]) for r in rows if r["policy"] == pol and r["rate_scale"] == rate
                       and r[kx] == xv and r[ky] == yv and not r.get("error")]
                if sel:
                    z[i, j] = 100 * sum(sel) / len(sel)
        im = ax.imshow(z, origin="lower", cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i in range(len(ys)):
            for j in range(len(xs)):
                if not np.isnan(z[i, j]):
                    ax.text(j, i, f"{z[i, j]:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=7)
        ax.set_yticks(range(len(ys)), [str(y) for y in ys], fontsize=7)
        if n + cols >= len(panels):  # no panel below
            ax.set_xlabel(keys[0], fontsize=8)
        if n % cols == 0:
            ax.set_ylabel(keys[1], fontsize=8)
        ax.set_title(f"{pol} @x{rate:g}", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="SLO attainment (%)")
    ok = [r for r in rows if not r.get("error")]
    others = _varying(ok, list(dict.fromkeys(k for r in ok for k in r if (k.startswith("set.") and k not in (kx, ky))
                                             or k in ("sweep_trace", "seed"))))
    if others:  # the cells average over them: say so on the plot
        fig.suptitle("each cell: the mean over " + ", ".join(k.removeprefix("set.").replace("sweep_trace", "trace") + "s"
                                                            if k == "seed" else k.removeprefix("set.").replace("sweep_trace", "trace")
                                                            for k in others), fontsize=9)
    return fig


def plot_heatmap(rows: Sequence[dict[str, Any]], keys: Sequence[str], path: Path, metric: str = "attainment") -> bool:
    """SLO attainment over the first two grid parameters, one panel per (policy, rate) (at most
    12; means over seeds and other parameters), to ``path``; False (nothing written) without two
    grid keys."""
    fig = heatmap_figure(rows, keys, metric)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True
