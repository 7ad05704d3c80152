"""The ``pdlb`` and ``pdlb-serve`` command lines: one module per subcommand behind one protocol
(:mod:`pdlb_cli.command`), the entry point :mod:`pdlb_cli.main`, the argument types and option
groups :mod:`pdlb_cli.args`, the simulator's commands in :mod:`pdlb_cli.sim`.

The layer above :mod:`balancer` and :mod:`sim`: nothing there imports this package. Importing it
imports nothing, so that ``pdlb-serve`` (:mod:`pdlb_cli.serve`) runs with the ``serve`` extra alone.
"""
