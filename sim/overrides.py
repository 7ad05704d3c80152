"""Scenario overrides by dotted path (``prefill.num_engines=8``): what ``--set`` on the command line
and a sweep file's ``[grid]`` and ``[[points]]`` change in a scenario (:func:`apply_overrides`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from balancer.validation import format_validation_error
from sim.scenario import Scenario

#: most overrides one call applies (input bound)
MAX_OVERRIDES = 256


def apply_overrides(sc: Scenario, overrides: Sequence[tuple[str, Any]], *, source: str = "--set") -> Scenario:
    """A validated copy of ``sc`` with each ``(dotted.path, value)`` set, in order.

    A path may reach into a table that is unset in the scenario (``shared_store.ttl_s=3600`` on a
    scenario without a shared store creates one with defaults). The copy's description says what
    was overridden.

    Raises:
        ValueError: more than :data:`MAX_OVERRIDES`, a path through a non-table value, or an
            invalid result (one line per problem, with "did you mean" for unknown fields).
    """
    if not overrides:
        return sc
    if len(overrides) > MAX_OVERRIDES:
        raise ValueError(f"{source}: at most {MAX_OVERRIDES} overrides, got {len(overrides)}")
    data = sc.model_dump(exclude_unset=False)
    for path, value in overrides:
        node = data
        parts = path.split(".")
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"{source} {path}: {'.'.join(parts[:i + 1])} is {nxt!r}, not a table")
            node = nxt
        node[parts[-1]] = value
    try:
        out = Scenario.model_validate(data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source=f"{source} on scenario {sc.name!r}", model=Scenario)) from None
    what = ", ".join(f"{p}={v!r}" for p, v in overrides)
    return out.model_copy(update={"description": f"{sc.description or sc.name} (set {what})"})
