"""Subagent shapes of a corpus of Weka-format agent traces (run by hand; issue 23 part 1).

Reads every ``*.json`` trace of a directory (Weka format: ``requests`` with ``t``, ``type``
``n``/``s`` (root requests) or ``subagent`` (an entry with ``t``, ``duration_ms`` and its own
``requests``), ``in``, ``out``, ``api_time``) and prints, as JSON, what
``AgenticWorkloadConfig``'s subagent tree needs:

* spawns: the subagents grouped by the root request that launched them (the last root request
  that starts at or before the subagent), so a group is a set of siblings; the count of groups
  by size (``fanout_counts``: siblings per spawn);
* joined or background, by aiperf's rule (SemiAnalysisAI/aiperf ``dataset/loader/weka_trace.py``,
  re-implemented from its description): a subagent is joined when a later root request starts at
  or after its recorded end (``t + duration_ms``; without ``duration_ms``, the end of its last
  request), else it runs in the background;
* per subagent: its requests (turns), its first prompt, its new tokens per turn
  (``in_k - in_{k-1} - out_{k-1}``), its outputs, the idle gaps between its requests
  (``t_k - (t_{k-1} + api_time_{k-1})``, aiperf's end-to-start delay) and its recorded duration;
  medians, quantiles and the log-space sigma of the positive values;
* the stagger of siblings (start minus the first sibling's start) and the subagents' share of
  all requests.

A subagent request's ``t`` before its entry's ``t`` is read as relative to the entry (aiperf's
``_subagent_request_absolute_t``). The committed numbers (``sim/data/measured/weka_trace_shapes.json``,
key ``subagents``) come from the public corpus callanjfox/kv-cache-tester ``traces/`` at 94f6046
(739 files, 710 readable; 17 traces hold subagents)::

    python bench/weka_subagent_shapes.py /tmp/weka/traces

Unreadable files (Git LFS pointers, truncated JSON) are counted and skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np

#: bound on the files read (every input-driven loop is bounded)
MAX_FILES = 100_000


def _abs_t(entry: dict, req: dict) -> float:
    t = float(req["t"])
    return float(entry["t"]) + t if t + 1e-6 < float(entry["t"]) else t


def _end_s(entry: dict) -> float:
    d = entry.get("duration_ms")
    if d is not None and math.isfinite(float(d)):
        return float(entry["t"]) + max(0.0, float(d)) / 1000.0
    reqs = entry.get("requests") or []
    if reqs:
        return max(_abs_t(entry, r) + max(0.0, float(r.get("api_time") or 0.0)) for r in reqs)
    return float(entry["t"])


def _summary(v: list[float]) -> dict:
    a = np.asarray(v, dtype=np.float64)
    if len(a) == 0:
        return {"n": 0}
    pos = a[a > 0]
    return {"n": int(len(a)), "mean": float(a.mean()),
            "p10": float(np.percentile(a, 10)), "p25": float(np.percentile(a, 25)),
            "p50": float(np.percentile(a, 50)), "p75": float(np.percentile(a, 75)),
            "p90": float(np.percentile(a, 90)),
            "log_sigma_of_positive": float(np.log(pos).std()) if len(pos) > 1 else 0.0}


def subagent_shapes(paths: list[Path]) -> dict:
    """The statistics above over the trace files ``paths`` (see the module docstring).

    Raises:
        ValueError: more than :data:`MAX_FILES` files, or no subagent in any readable trace."""
    if len(paths) > MAX_FILES:
        raise ValueError(f"more than {MAX_FILES} trace files")
    unreadable = traces = with_subagents = root_requests = 0
    fanout: Counter = Counter()
    joined = background = 0
    turns: list[float] = []
    first: list[float] = []
    new: list[float] = []
    outs: list[float] = []
    gaps: list[float] = []
    durations: list[float] = []
    stagger: list[float] = []
    for path in paths:
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
            roots = sorted((float(r["t"]), float(r.get("api_time") or 0.0)) for r in trace["requests"]
                           if r.get("type") in ("n", "s"))
            subs = [r for r in trace["requests"] if r.get("type") == "subagent" and r.get("requests")]
            for e in subs:
                float(e["t"])
                for q in e["requests"]:
                    int(q["in"]), int(q["out"]), float(q["t"])
        except (ValueError, KeyError, TypeError, OSError):
            unreadable += 1
            continue
        traces += 1
        root_requests += len(roots)
        if not subs:
            continue
        with_subagents += 1
        starts = [t for t, _ in roots]
        groups: dict[int, list[float]] = {}
        for e in subs:
            t0 = float(e["t"])
            k = int(np.searchsorted(starts, t0, side="right")) - 1  # the last root request at or before
            groups.setdefault(k, []).append(t0)
            end = _end_s(e)
            if any(t >= end for t in starts[k + 1:]):
                joined += 1
            else:
                background += 1
            reqs = sorted(e["requests"], key=lambda q: _abs_t(e, q))
            turns.append(len(reqs))
            first.append(int(reqs[0]["in"]))
            outs.extend(int(q["out"]) for q in reqs)
            if e.get("duration_ms") is not None:
                durations.append(end - t0)
            for a, b in zip(reqs, reqs[1:]):
                new.append(int(b["in"]) - int(a["in"]) - int(a["out"]))
                gaps.append(_abs_t(e, b) - (_abs_t(e, a) + max(0.0, float(a.get("api_time") or 0.0))))
        for ts in groups.values():
            fanout[len(ts)] += 1
            ts.sort()
            stagger.extend(t - ts[0] for t in ts[1:])
    if not turns:
        raise ValueError("no subagent in any readable trace")
    sub_requests = int(sum(turns))
    return {
        "traces": traces, "unreadable": unreadable, "traces_with_subagents": with_subagents,
        "subagents": len(turns), "spawns": int(sum(fanout.values())),
        "fanout_counts": {str(k): int(v) for k, v in sorted(fanout.items())},
        "joined": joined, "background": background,
        "subagent_requests": sub_requests, "root_requests": root_requests,
        "subagent_share_of_requests": sub_requests / max(1, sub_requests + root_requests),
        "turns": _summary(turns), "first_prompt_tokens": _summary(first),
        "new_tokens_per_turn": _summary(new), "output_tokens": _summary(outs),
        "gap_s": _summary(gaps), "duration_s": _summary(durations), "sibling_stagger_s": _summary(stagger),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, help="directory of Weka-format trace JSON files")
    args = ap.parse_args(argv)
    if not args.traces.is_dir():
        ap.error(f"{args.traces} is not a directory")
    print(json.dumps(subagent_shapes(sorted(args.traces.glob("*.json"))), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
