"""The one protocol of a ``pdlb`` subcommand, and how a parent command registers its children.

The shape is vLLM's ``vllm/entrypoints/cli``: one module per subcommand, each defining a class with
a ``name``, a parser builder and a runner; the entry point (:mod:`pdlb_cli.main`) only builds the
parser from the list of subcommands and dispatches. ``pdlb sim`` is a subcommand with
subcommands of its own (:mod:`pdlb_cli.sim.main`).

Adding a command: write ``pdlb_cli/<name>.py`` (``pdlb_cli/sim/<name>.py`` for ``pdlb sim <name>``)
with a class implementing :class:`Subcommand`, and append an instance to its parent's
``SUBCOMMANDS``. Its options come from :mod:`pdlb_cli.args` (argument types and option groups);
subcommand modules never import each other, except that ``pdlb sim compare`` runs its policies with
``pdlb sim run``'s :func:`pdlb_cli.sim.run.run_policies`.

Contract of :meth:`Subcommand.run`: return the exit status (0 success, 1 a check failed as the
command documents, 2 bad input); raise ``ValueError``, ``OSError`` or
:class:`balancer.router.PolicyError` for bad input that the parser could not see, which
:func:`pdlb_cli.main.main` prints as one ``error: ...`` line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # rich is the simulator's dependency; pdlb-serve runs without it
    from rich.console import Console


class Subcommand(Protocol):
    """One subcommand of ``pdlb`` (or of ``pdlb sim``)."""

    #: the word on the command line (``"compare"`` in ``pdlb sim compare``)
    name: str

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Add this command's parser (named :attr:`name`) to its parent's ``subparsers``; return it."""
        ...

    def run(self, args: argparse.Namespace, console: Console) -> int:
        """Run the command on the parsed ``args``, printing through ``console``; return the exit status."""
        ...


def add_subcommands(subparsers: argparse._SubParsersAction, commands: Sequence[Subcommand]) -> None:
    """Add each command's parser in order (the order ``--help`` lists them) and make
    ``args.run`` its :meth:`Subcommand.run` (a nested subcommand's own ``run`` replaces its
    parent's: argparse copies the innermost parser's defaults last)."""
    for cmd in commands:
        p = cmd.add_parser(subparsers)
        if p.prog.rsplit(" ", 1)[-1] != cmd.name:
            raise ValueError(f"subcommand {cmd.name!r} added a parser named {p.prog!r}")
        p.set_defaults(run=cmd.run)
