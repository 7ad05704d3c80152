"""Reuse statistics of a corpus of Weka-format agent traces (run by hand; issue 23 part 1).

Reads every ``*.json`` trace of a directory (Weka format: ``block_size``, ``requests`` with ``t``,
``type`` ``n``/``s``/``subagent``, ``in``, ``out``, ``hash_ids``; a subagent entry holds its own
``requests``) and prints, as JSON:

* aiperf's theoretical prefix-cache hit rate: per request, the leading run of its block hashes
  that an earlier request of the same trace already sent, over the blocks it covers
  (``min(len(hash_ids), in // block_size)``); sums over all requests (root and subagent, one
  cache per trace, in recorded start order) and over root requests alone. This is the rule of
  aiperf's ``theoretical_prefix_cache`` metric (SemiAnalysisAI/aiperf); re-implemented here from
  its description;
* two simpler statistics over root requests: the previous prompt reusable, and the previous prompt
  and reply reusable (``sum min(., in_k) / sum in_k``, a trace's first request reusing nothing);
* prefix cuts: root turns whose leading run stops inside the previous prompt's whole blocks, their
  share, the kept fraction of the previous prompt (51 quantiles) and the miss they carry.

The committed numbers (``sim/data/measured/weka_trace_shapes.json``: ``prefix_cut``,
``theoretical_hit_definitions``) come from the public corpus callanjfox/kv-cache-tester
``traces/`` at 94f6046 (739 files, 710 readable)::

    git --git-dir <mirror> archive 94f6046 traces | tar -x -C /tmp/weka
    python bench/weka_corpus_reuse.py /tmp/weka/traces

Unreadable files (Git LFS pointers, truncated JSON) are counted and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

#: bound on the files read (every input-driven loop is bounded)
MAX_FILES = 100_000


def _leading_run(hashes: list, covered: int, seen: set) -> int:
    run = 0
    for h in hashes[:covered]:
        if h not in seen:
            break
        run += 1
    return run


def corpus_reuse(paths: list[Path]) -> dict:
    """The statistics above over the trace files ``paths`` (see the module docstring)."""
    if len(paths) > MAX_FILES:
        raise ValueError(f"more than {MAX_FILES} trace files")
    unreadable = 0
    hit_all = cov_all = hit_root = cov_root = 0
    in_root = prev_prompt = prev_both = 0
    later: list[tuple[int, int, int, bool, int]] = []  # (in_k, previous in, hit tokens, cut, block)
    traces = 0
    for path in paths:
        try:
            trace = json.loads(path.read_text(encoding="utf-8"))
            bs = int(trace.get("block_size", 64))
            reqs = []
            for r in trace["requests"]:
                if r.get("type") in ("n", "s"):
                    reqs.append((float(r["t"]), True, r))
                elif r.get("type") == "subagent":
                    reqs.extend((float(c["t"]), False, c) for c in r.get("requests", []))
        except (ValueError, KeyError, TypeError, OSError):
            unreadable += 1
            continue
        traces += 1
        reqs.sort(key=lambda x: x[0])
        seen_all: set = set()
        seen_root: set = set()
        prev = None
        for _, is_root, r in reqs:
            hashes = r.get("hash_ids") or []
            covered = min(len(hashes), int(r["in"]) // bs)
            hit_all += _leading_run(hashes, covered, seen_all)
            cov_all += covered
            seen_all.update(hashes)
            if not is_root:
                continue
            run = _leading_run(hashes, covered, seen_root)
            seen_root.update(hashes)
            hit_root += run
            cov_root += covered
            in_root += int(r["in"])
            if prev is not None:
                p_in, p_out = int(prev["in"]), int(prev["out"])
                prev_prompt += min(p_in, int(r["in"]))
                prev_both += min(p_in + p_out, int(r["in"]))
                later.append((int(r["in"]), p_in, run * bs, run < min(p_in // bs, covered), bs))
            prev = r
    if not later:
        raise ValueError("no trace with two root requests")
    a = np.asarray(later, dtype=np.float64)
    inp, pin, hit, cut, blk = a[:, 0], a[:, 1], a[:, 2], a[:, 3].astype(bool), a[:, 4]
    miss = inp - hit
    # kept fraction of a cut: hit tokens over the previous prompt's whole blocks
    full = (pin[cut] // blk[cut]) * blk[cut]
    kept = np.minimum(1.0, hit[cut] / np.maximum(1.0, full)) if cut.any() else np.zeros(1)
    return {
        "traces": traces, "unreadable": unreadable, "root_turns_after_first": int(len(a)),
        "aiperf_rule_all_requests": hit_all / max(1, cov_all),
        "aiperf_rule_root_requests": hit_root / max(1, cov_root),
        "previous_prompt_only_root": prev_prompt / max(1, in_root),
        "previous_prompt_plus_reply_root": prev_both / max(1, in_root),
        "cut_turns": int(cut.sum()), "cut_probability": float(cut.mean()),
        "kept_fraction_quantiles_0_to_100_step_2": [float(x) for x in np.percentile(kept, np.arange(0, 101, 2))],
        "miss_share_of_input_from_cuts": float(miss[cut].sum() / inp.sum()),
        "miss_share_of_input_from_extending_turns": float(miss[~cut].sum() / inp.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, help="directory of Weka-format trace JSON files")
    args = ap.parse_args(argv)
    if not args.traces.is_dir():
        ap.error(f"{args.traces} is not a directory")
    print(json.dumps(corpus_reuse(sorted(args.traces.glob("*.json"))), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
