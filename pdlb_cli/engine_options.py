"""The vLLM engine options of the ``pdlb sim`` commands: flags that set a scenario pool's scheduler
and KV options (:class:`sim.scenario.PoolConfig`) on every pool of the scenario.

Each flag is the TOML key of the pool table (``[mixed]``, ``[prefill]``, ``[decode]``) of the same
name, applied after ``--set`` as ``--set POOL.KEY=VALUE`` would be on each pool, so a scenario
file and the flags validate alike. Off by default (the scenario's own values stand).
"""

from __future__ import annotations

import argparse

from sim.overrides import apply_overrides
from sim.scenario import Scenario

__all__ = ["ENGINE_OPTION_FLAGS", "add_engine_option_args", "apply_engine_options", "retention_arg"]

#: ``(PoolConfig field, flag)`` of every engine option flag, in the order they are applied
ENGINE_OPTION_FLAGS = (
    ("max_num_seqs", "--max-num-seqs"),
    ("max_chunk_tokens", "--max-chunk-tokens"),
    ("prefill_schedule_interval", "--prefill-schedule-interval"),
    ("prefix_cache_retention_interval_tokens", "--prefix-cache-retention"),
)


#: Largest token count these flags take (as pdlb_cli.args.MAX_FLAG_TOKENS and the scenarios)
MAX_FLAG_TOKENS = 1 << 24


def _count_arg(text: str) -> int:
    """An int in ``1..MAX_FLAG_TOKENS``."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if not 1 <= n <= MAX_FLAG_TOKENS:
        raise argparse.ArgumentTypeError(f"expected a whole number in 1..{MAX_FLAG_TOKENS}, got {text!r}")
    return n


def retention_arg(text: str) -> int | str:
    """``--prefix-cache-retention``: ``dense`` or a token count >= 0 (the scenario checks that it
    is a multiple of its block size and that the model has sliding-window KV)."""
    t = text.strip().lower()
    if t == "dense":
        return "dense"
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dense' or a token count >= 0, got {text!r}") from None
    if not 0 <= n <= MAX_FLAG_TOKENS:
        raise argparse.ArgumentTypeError(f"expected 'dense' or a token count in 0..{MAX_FLAG_TOKENS}, got {text!r}")
    return n


def add_engine_option_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--max-num-seqs``, ``--max-chunk-tokens``, ``--prefill-schedule-interval``,
    ``--prefix-cache-retention`` (each sets the pool key of the same name on every pool) and
    ``--speculative-verify`` (the ``[speculative]`` table's ``verify``)."""
    g = p.add_argument_group(
        "vLLM engine options (set on every pool of the scenario; --set POOL.KEY=VALUE sets one pool; "
        "default: the scenario's values, off in the presets)")
    g.add_argument("--max-num-seqs", type=_count_arg, metavar="N",
                   help="vLLM max_num_seqs: most sequences per DP rank running or admitted to prefill (TOML key "
                        "max_num_seqs)")
    g.add_argument("--max-chunk-tokens", type=_count_arg, metavar="N",
                   help="vLLM --long-prefill-token-threshold: most prompt tokens one request computes per step "
                        "(TOML key max_chunk_tokens)")
    g.add_argument("--prefill-schedule-interval", type=_count_arg, metavar="N",
                   help="vLLM --prefill-schedule-interval (DP prefill balancing): ranks with decodes admit and "
                        "continue prefills only on every N-th step of their EP group (TOML key "
                        "prefill_schedule_interval; 1 = every step)")
    g.add_argument("--prefix-cache-retention", dest="prefix_cache_retention_interval_tokens", type=retention_arg,
                   metavar="TOKENS|dense",
                   help="vLLM VLLM_PREFIX_CACHE_RETENTION_INTERVAL on a model with sliding-window KV (DeepSeek-V4): "
                        "a prefix hit ends only at a retained window checkpoint (each request's prompt end, "
                        "shared-prefix junctions, every TOKENS tokens; 0 = only those prompt ends and junctions; 'dense' = every "
                        "block, vLLM's default; "
                        "under MTP one 64-token window block past it must be shared too). TOML key "
                        "prefix_cache_retention_interval_tokens")
    g.add_argument("--speculative-verify", dest="speculative_verify", choices=["mean_field", "every_step"],
                   help="how the scenario's [speculative] table is simulated: 'every_step' = vLLM's MTP as it runs "
                        "(every decoding sequence verifies 1 + draft_tokens tokens in every step, mixed steps "
                        "included), 'mean_field' = time per accepted token (TOML key speculative.verify; default "
                        "the scenario's, mean_field)")
    return g


def apply_engine_options(sc: Scenario, args: argparse.Namespace) -> Scenario:
    """``sc`` with each given engine option flag set on every pool it has (and
    ``--speculative-verify`` on its ``[speculative]`` table).

    Raises:
        ValueError: ``"<flag>: ..."``, the scenario's own check of the value (e.g. a retention
            interval that is not a multiple of the block size, or a model without sliding-window KV),
            ``--speculative-verify`` on a scenario without a ``[speculative]`` table.
    """
    pools = [name for name in ("prefill", "decode", "mixed", "long_prefill") if getattr(sc, name) is not None]
    for key, flag in ENGINE_OPTION_FLAGS:
        value = getattr(args, key, None)
        if value is None:
            continue
        sc = apply_overrides(sc, [(f"{pool}.{key}", value) for pool in pools], source=flag)
    verify = getattr(args, "speculative_verify", None)
    if verify is not None:
        if sc.speculative is None:
            raise ValueError(f"--speculative-verify: scenario {sc.name!r} has no [speculative] table (draft_tokens, "
                             "acceptance) to verify")
        sc = apply_overrides(sc, [("speculative.verify", verify)], source="--speculative-verify")
    return sc
