"""File-name parts made from free text (run labels, scenario names): :func:`safe_file_stem`, for
the per-run files of :mod:`sim.run.report` and the default results folders of :mod:`pdlb_cli.args`."""

from __future__ import annotations

import re

#: Characters kept in file names made from labels; every other run of characters becomes "-".
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]+")


def safe_file_stem(label: str) -> str:
    """A file-name part from a run label: ``ep_aware(horizon_weight=2.0,ttft_slo_s=2.0)`` ->
    ``ep_aware-horizon_weight=2.0-ttft_slo_s=2.0``: no spaces, parentheses, commas, slashes or
    quotes (nothing a shell needs quoted), never empty, never starting with ``.`` or ``-``, at most
    120 characters; plain names (``round_robin``, ``kv_cost+least_load``) are unchanged."""
    stem = _UNSAFE.sub("-", label).strip("-.")
    return stem[:120] or "run"
