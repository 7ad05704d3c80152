"""``pdlb dev``: developer commands (experiments and tools of the repository, not of a deployment),
one module each, listed in :mod:`pdlb_cli.dev.main`."""
