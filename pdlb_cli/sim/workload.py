"""``pdlb sim workload ...``: write a benchmark workload (:mod:`sim.workload.benchmarks`) as JSONL.

The files are Mooncake-style JSONL (:func:`sim.workload.write_mooncake`), so ``pdlb sim run
--trace FILE`` replays them like any trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from pdlb_cli.args import check_out_file, int_at_least, nonnegative_float, positive_float, rate_list
from sim.workload.analysis import ideal_hit_rate
from sim.workload.benchmarks import GSP_DEFAULTS, load_ramp_workload, shared_prefix_workload
from sim.workload.writer import write_mooncake


def add_workload_parser(simsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb sim workload {shared-prefix,ramp}``."""
    p = simsub.add_parser("workload", help="generate a benchmark workload (shared-prefix groups, load ramps) as JSONL",
                          description="Write a standard router-benchmark workload as Mooncake-style JSONL, "
                                      "replayable with `pdlb sim run --trace FILE`.")
    sub = p.add_subparsers(dest="workload_kind", required=True)
    d = GSP_DEFAULTS
    sp = sub.add_parser("shared-prefix", help="N groups x M prompts sharing a system prompt (SGLang generated-shared-prefix)",
                        description="Mirrors SGLang bench_serving --dataset-name generated-shared-prefix: each of "
                                    "--groups system prompts is shared by --prompts-per-group prompts that add their "
                                    "own question. Defaults are SGLang's --gsp-* defaults.")
    sp.add_argument("--groups", type=int_at_least(1), default=d["num_groups"], help="prefix groups (default %(default)s)")
    sp.add_argument("--prompts-per-group", type=int_at_least(1), default=d["prompts_per_group"],
                    help="prompts per group (default %(default)s)")
    sp.add_argument("--system-prompt-tokens", type=int_at_least(0), default=d["system_prompt_tokens"],
                    help="shared system prompt length, tokens (default %(default)s)")
    sp.add_argument("--question-tokens", type=int_at_least(0), default=d["question_tokens"],
                    help="per-prompt question length, tokens (default %(default)s)")
    sp.add_argument("--output-tokens", type=int_at_least(1), default=d["output_tokens"],
                    help="output tokens per request (default %(default)s)")
    sp.add_argument("--rate", type=positive_float, default=None, metavar="REQ_PER_S",
                    help="Poisson arrival rate; omitted: every request at t = 0 (request rate inf)")
    sp.add_argument("--no-ignore-eos", action="store_true",
                    help="draw output lengths lognormal around --output-tokens instead of exactly that many")
    sp.add_argument("--no-shuffle", action="store_true", help="requests group by group instead of shuffled")
    rp = sub.add_parser("ramp", help="Poisson arrivals whose rate rises in steps",
                        description="A stepped load ramp: rate R_k req/s during step k of --step-s seconds "
                                    "(capacity searches; AIPerf request-rate ramping, vLLM --ramp-up-strategy).")
    rp.add_argument("--rates", type=rate_list, required=True, metavar="R1,R2,...", help="rate of each step, req/s")
    rp.add_argument("--step-s", type=positive_float, required=True, help="duration of each step, seconds")
    rp.add_argument("--prompt-tokens", type=positive_float, default=1024.0,
                    help="mean prompt length: the lognormal's mean, exact in expectation (default %(default)g)")
    rp.add_argument("--output-tokens", type=positive_float, default=256.0, help="mean output length (default %(default)g)")
    rp.add_argument("--prompt-sigma", type=nonnegative_float, default=0.0,
                    help="lognormal log-space sigma of prompt lengths, 0..2 (default 0: constant); the median is "
                         "mean x exp(-sigma^2/2), e.g. 61%% of the mean at 1")
    rp.add_argument("--output-sigma", type=nonnegative_float, default=0.0,
                    help="lognormal log-space sigma of output lengths, 0..2 (default 0: constant)")
    rp.add_argument("--shared-prefix-tokens", type=int_at_least(0), default=0,
                    help="shared prefix per group, tokens: 0 or from --block-size up to --prompt-tokens (default 0)")
    rp.add_argument("--prefix-groups", type=int_at_least(1), default=1, help="number of shared prefixes (default 1)")
    for q in (sp, rp):
        q.add_argument("--out", type=Path, required=True, help="output JSONL file (.gz: gzip); overwritten")
        q.add_argument("--seed", type=int_at_least(0), default=0, help="random seed (default 0)")
        q.add_argument("--block-size", type=int_at_least(1), default=512, help="tokens per hash block (default 512)")
    return p


#: load_ramp_workload's parameters by the flags that set them (its errors are reworded with them).
_RAMP_FLAGS = {"prompt_tokens_mean": "--prompt-tokens", "output_tokens_mean": "--output-tokens",
               "prompt_tokens_sigma": "--prompt-sigma", "output_tokens_sigma": "--output-sigma",
               "shared_prefix_tokens": "--shared-prefix-tokens", "num_prefix_groups": "--prefix-groups",
               "block_size": "--block-size"}


def run_workload(args: argparse.Namespace, console: Console) -> int:
    """Generate and write the workload; print a one-line summary. Returns 0."""
    if args.workload_kind == "shared-prefix":
        reqs = shared_prefix_workload(args.groups, args.prompts_per_group,
                                      system_prompt_tokens=args.system_prompt_tokens,
                                      question_tokens=args.question_tokens, output_tokens=args.output_tokens,
                                      rate_per_s=args.rate, seed=args.seed, block_size=args.block_size,
                                      ignore_eos=not args.no_ignore_eos, shuffle=not args.no_shuffle)
    else:
        try:
            reqs = load_ramp_workload(args.rates, args.step_s, prompt_tokens_mean=args.prompt_tokens,
                                      output_tokens_mean=args.output_tokens, prompt_tokens_sigma=args.prompt_sigma,
                                      output_tokens_sigma=args.output_sigma,
                                      shared_prefix_tokens=args.shared_prefix_tokens,
                                      num_prefix_groups=args.prefix_groups, seed=args.seed, block_size=args.block_size)
        except ValueError as e:  # the generator's checks, in the flags' names
            msg = str(e)
            for name, flag in _RAMP_FLAGS.items():
                msg = msg.replace(name, flag)
            raise ValueError(msg) from None
    if not reqs:  # e.g. --rates 0.001 over a 1 s step: an empty file would replay as "the trace has no requests"
        expected = sum(args.rates) * args.step_s
        raise ValueError(f"no request arrived (expected {expected:.3g}: the sum of --rates x --step-s); "
                         "raise --rates or --step-s, or try another --seed")
    check_out_file(args.out, "workload.jsonl")  # an error naming the flag, not "[Errno 21] Is a directory"
    n = write_mooncake(reqs, args.out, block_size=args.block_size)
    span = reqs[-1].arrival_time_s if reqs else 0.0
    hit, hit_tokens = ideal_hit_rate(reqs, args.block_size)
    # both weightings: `pdlb sim run` prints the token-weighted one for the same file
    console.print(f"wrote {n:,} requests over {span:,.1f} s to {args.out} (ideal prefix hit rate {hit:.1%} of blocks, "
                  f"{hit_tokens:.1%} of prompt tokens)", markup=False)
    return 0


class Workload:
    """``pdlb sim workload {shared-prefix,ramp}`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "workload"
    add_parser = staticmethod(add_workload_parser)
    run = staticmethod(run_workload)
