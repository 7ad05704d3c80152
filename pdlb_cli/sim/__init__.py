"""``pdlb sim`` and its subcommands, one module each (:data:`pdlb_cli.sim.main.SUBCOMMANDS`)."""
