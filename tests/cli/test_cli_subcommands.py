"""The ``pdlb`` command line's structure: one module per subcommand behind the
:class:`pdlb_cli.command.Subcommand` protocol, registered in order, dispatched through
``args.run``; ``pdlb-serve`` is ``pdlb serve``. Expected names and orders are written out by hand
from the README's command list."""

from __future__ import annotations

import argparse
import re

import pytest
from rich.console import Console

from pdlb_cli import main as pdlb_main
from pdlb_cli import serve as serve_mod
from pdlb_cli.command import add_subcommands
from pdlb_cli.sim import main as sim_main


class _Leaf:
    name = "leaf"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subparsers.add_parser("leaf")
        p.add_argument("--x", type=int, default=1)
        return p

    def run(self, args: argparse.Namespace, console: Console) -> int:
        return 10 + args.x


class _Group:
    name = "group"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subparsers.add_parser("group")
        add_subcommands(p.add_subparsers(dest="inner", required=True), [_Leaf()])
        return p

    def run(self, args: argparse.Namespace, console: Console) -> int:
        return -1


def test_the_innermost_subcommands_run_is_the_one_dispatched() -> None:
    parser = argparse.ArgumentParser(prog="t")
    add_subcommands(parser.add_subparsers(dest="command", required=True), [_Group(), _Leaf()])
    # nested: the leaf's run replaces its group's (argparse copies the innermost defaults last)
    args = parser.parse_args(["group", "leaf", "--x", "5"])
    assert args.run(args, Console()) == 15
    args = parser.parse_args(["leaf"])
    assert args.run(args, Console()) == 11


def test_a_subcommand_whose_parser_has_another_name_is_refused() -> None:
    class Misnamed(_Leaf):
        name = "other"

    parser = argparse.ArgumentParser(prog="t")
    with pytest.raises(ValueError, match="subcommand 'other' added a parser named 't leaf'"):
        add_subcommands(parser.add_subparsers(), [Misnamed()])


def test_each_command_is_one_module_named_after_it_in_the_help_order() -> None:
    # by hand, from the README's command list: pdlb {sim, policies, serve, engine}; pdlb sim's
    # eleven commands in the order `pdlb sim --help` lists them; a dash in the name is an
    # underscore in the module's
    top = [(c.name, type(c).__module__) for c in pdlb_main.SUBCOMMANDS]
    assert top == [("sim", "pdlb_cli.sim.main"), ("policies", "pdlb_cli.policies"), ("serve", "pdlb_cli.serve"),
                   ("engine", "pdlb_cli.engine")]
    names = ["compare", "run", "scenarios", "validate", "price", "sessions", "store-sweep", "workload", "cost-model",
             "capacity", "sweep"]
    assert [c.name for c in sim_main.SUBCOMMANDS] == names
    assert [type(c).__module__ for c in sim_main.SUBCOMMANDS] == [f"pdlb_cli.sim.{n.replace('-', '_')}" for n in names]


def test_pdlb_help_lists_the_commands_in_that_order(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        pdlb_main.main(["sim", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    listed = re.search(r"\{([a-z,-]+)\}", out).group(1).split(",")
    assert listed == [c.name for c in sim_main.SUBCOMMANDS]


def test_pdlb_serve_and_pdlb_serve_command_take_the_same_options(capsys) -> None:
    # pdlb-serve ARGS is pdlb serve ARGS for an install without the simulator: the same option list
    def options(run) -> list[str]:  # noqa: ANN001
        with pytest.raises(SystemExit):
            run()
        return sorted(set(re.findall(r"(--[a-z][a-z0-9-]+)", capsys.readouterr().out)))

    via_pdlb = options(lambda: pdlb_main.main(["serve", "--help"]))
    via_serve = options(lambda: serve_mod.main(["--help"]))
    assert via_pdlb == via_serve and "--prefill-policy" in via_pdlb and "--processes" in via_pdlb


def test_the_sim_group_called_without_a_subcommand_is_a_usage_error(capsys) -> None:
    assert sim_main.Sim().run(argparse.Namespace(), Console()) == 2
    assert capsys.readouterr().err == "pdlb sim: error: give a subcommand (pdlb sim --help lists them)\n"
