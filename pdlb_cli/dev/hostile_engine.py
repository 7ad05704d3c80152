"""``pdlb dev hostile-engine``: a fake engine whose misbehaviour is set at run time with
``POST /fake/mode`` (:mod:`sim.emulator.hostile`; :func:`sim.emulator.hostile.spawn_fake_engine`
starts it for issue 25's tests and ``bench/hostile_soak.py``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from rich.console import Console

from pdlb_cli.args import int_at_least
from sim.emulator.hostile import serve_fake_engine


class HostileEngine:
    """``pdlb dev hostile-engine`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "hostile-engine"

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subparsers.add_parser("hostile-engine", help="a fake engine whose misbehaviour is set with POST /fake/mode",
                                  description="A fake engine on 127.0.0.1 whose behaviour (ok, reject, "
                                              "sse_no_newline, wedged) is switched with POST /fake/mode.")
        p.add_argument("--port", type=int_at_least(0), default=0, help="port (default: 0, any free one)")
        return p

    def run(self, args: argparse.Namespace, console: Console) -> int:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_fake_engine(args.port))
        return 0
