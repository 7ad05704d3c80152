"""The ``pdlb`` command line: builds the parser from :data:`SUBCOMMANDS` (one module each,
:class:`pdlb_cli.command.Subcommand`) and runs the one given.

    pdlb sim compare            every routing policy on the embedded Mooncake trace
    pdlb sim run --policy P     one policy
    pdlb sim scenarios          the scenario presets
    pdlb sim price              revenue per GPU-hour and cost per 1M tokens from a price sheet
    pdlb sim validate           the perf model vs published deployment figures
    pdlb sim sessions           generate a multi-turn chatbot/agent session workload (JSONL)
    pdlb sim store-sweep        shared KV store hit rate vs TTL and capacity (docs/kv_cache.md)
    pdlb sim workload           generate a benchmark workload (shared-prefix groups, load ramps)
    pdlb sim cost-model         the step-time cost model of a scenario, for pdlb serve --cost-model
    pdlb sim capacity           highest rate at SLO / fewest engines at a rate, per policy
    pdlb sim sweep SWEEP.toml   a resumable sweep of scenario fields, policies, rates, seeds
    pdlb policies               the routing policies and their parameters
    pdlb serve                  the router service (pdlb_cli/serve.py; also the pdlb-serve command)
    pdlb engine                 an emulated engine timed by the perf model

Bad arguments end in one error line and exit status 2, after one usage line that points at
``--help`` (:class:`pdlb_cli.args.ArgumentParser`): argparse's ``argument --flag: ...`` for
values checked while parsing (numbers, engine counts, tier weights), ``error: ...`` for the rest
(files, scenarios, policies: a ``ValueError``, ``OSError`` or ``PolicyError`` raised by a
subcommand's ``run``). A closed stdout (``pdlb sim compare | head -1``) does not stop a run: the
results folder is still written and the exit status is 141 (128 + SIGPIPE). Ctrl-C prints
``interrupted`` on stderr and exits 130 (128 + SIGINT).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from rich.console import Console

from balancer import kernels
from balancer.router import PolicyError
from pdlb_cli.args import ArgumentParser, command_line, given_options
from pdlb_cli.command import Subcommand, add_subcommands
from pdlb_cli.dev.main import Dev
from pdlb_cli.engine import Engine
from pdlb_cli.policies import Policies
from pdlb_cli.serve import Serve
from pdlb_cli.sim.main import Sim

#: the top-level commands, in the order ``pdlb --help`` lists them
SUBCOMMANDS: tuple[Subcommand, ...] = (Sim(), Policies(), Serve(), Engine(), Dev())


def _version() -> str:
    try:
        return importlib.metadata.version("pdlb")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without install
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``pdlb`` parser with every subcommand of :data:`SUBCOMMANDS`; a parsed command has
    ``args.run``, its :meth:`~pdlb_cli.command.Subcommand.run`."""
    parser = ArgumentParser(prog="pdlb", description="Cross-replica load balancer for PD-disaggregated LLM serving, and its simulator.",
                            epilog="Environment: PDLB_KERNELS=off runs ep_aware's and kv_cost's numpy code instead of "
                                   "their compiled kernels (same decisions) in every process a command starts; on "
                                   "(the default) or off.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    add_subcommands(parser.add_subparsers(dest="command", required=True), SUBCOMMANDS)
    return parser


class _PipeSafeStdout:
    """The console's file: the ``sys.stdout`` of when it was made (pytest's capture included; not
    rich's own redirect of ``sys.stdout`` during a live progress bar, which prints through the
    console and would loop), until the reader goes away (``pdlb sim compare | head -1``); from then
    on output is dropped, so the run still finishes and writes its results folder.

    On the first ``BrokenPipeError`` the stdout file descriptor is pointed at ``os.devnull``, the
    recipe of the Python docs (``signal`` module, "Note on SIGPIPE"), so the interpreter's final
    flush of what is still buffered does not raise again at exit.
    """

    def __init__(self) -> None:
        self.stream = sys.stdout
        self.broken = False

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self.close_pipe()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.close_pipe()

    def close_pipe(self) -> None:
        self.broken = True
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (pytest capture)
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


#: Exit status after stdout's reader went away: 128 + SIGPIPE, what a shell reports for a
#: process killed by SIGPIPE (``set -o pipefail`` sees it).
EXIT_BROKEN_PIPE = 141
#: Exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a process killed by SIGINT.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run the ``pdlb`` command line; returns the exit status (argparse exits 2 itself on bad flags)."""
    out = _PipeSafeStdout()
    try:
        rc = _main(argv, out)
    except BrokenPipeError:  # raised outside the console (argparse --help into a closed pipe)
        out.close_pipe()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C, often deep inside simpy: one line, not a traceback
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_BROKEN_PIPE if out.broken and rc == 0 else rc


def _main(argv: list[str] | None, out: _PipeSafeStdout) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command_line = command_line(parser, args.argv)  # for reports: the command that made them
    args.given = given_options(parser, args.argv)  # the flags given, for warn_idle_flags
    console = Console(file=out) if out.isatty() else Console(file=out, width=160)
    try:
        kernels.use_compiled(kernels.enabled_by_env(os.environ))  # PDLB_KERNELS (a bad value: one line, rc 2)
        return args.run(args, console)
    except (ValueError, OSError, PolicyError) as e:  # one line on stderr, however long; no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
