"""Which of ``ep_aware``'s opt-in options change nothing on a simulated scenario, and the warnings
``pdlb sim run`` / ``compare`` / ``capacity`` / ``sweep`` print for them (review F9, session 15;
review R1-R2, session 16).

An option is *idle* on a scenario when the router of a run on it (its cost model, the pool its
policy routes) gives the option nothing to price, so that a run with it and one without make
the same decisions (the CLI tests compare the two runs' per-request CSVs):

- ``spec_decode`` on the decode policy, where no engine of the router's cost model has
  ``decode_tokens_per_step`` above 1 (the policy's tau is then 1: ``EpAware._tau``);
- ``parallel_chunks`` on the prefill policy of a PD scenario (it prices mixed pools only), or on
  the decode policy where the scenario is PD, ``cadence`` is off, or no engine of the cost model
  runs a rank's chunks in parallel (:func:`balancer.prefill_cadence.chunks_in_parallel`:
  ``max_num_seqs x request_chunk_tokens <= chunk_tokens``, from the mixed pool's
  ``max_num_seqs`` / ``max_decode_batch`` and ``max_chunk_tokens``: :func:`sim.run.router_cost.engine_cost`),
  or where those engines are dense (not ``ep_synchronous``): a dense engine's prompt has no group
  tokens (``EpAware._prefill_cost_one``'s cost is its TTFT), so the parallel model's group terms
  and FIFO draining's are both 0;
- ``prefill_at_once`` (either policy) where the scenario is PD (it prices mixed pools only), and
  ``session_forecast`` on the prefill policy of a PD scenario (it prices decode and mixed pools
  only), as ``pdlb serve`` warns of them (review3 S4, session 16).

The cost model is the one the run's router gets (:func:`sim.run.router_config.router_config_for`:
the scenario's exact one, or its ``[router]`` table's ``cost_model``). An option is named only where
it is idle on every scenario its run uses (a sweep's points may vary the scenario).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from balancer.cost_model import CostModel, EngineCost
from balancer.policies.ep_aware import EpAware
from balancer.prefill_cadence import chunks_in_parallel
from sim.run.router_config import router_config_for
from sim.scenario import Scenario


def _engines(model: CostModel) -> list[EngineCost]:
    # every engine the cost model prices (a named engine may stand in for any pool's):
    # an option is idle only if it is idle on all of them
    return [model.prefill, model.decode, *model.engines.values()]


def _router_cost_model(scenario: Scenario) -> CostModel | None:
    return router_config_for(scenario).cost_model


def idle_options(prefill: Any, decode: Any, scenario: Scenario) -> list[tuple[str, str]]:
    """``[(option, why it changes nothing)]`` for ``ep_aware``'s ``parallel_chunks`` and
    ``prefill_at_once`` (either policy), ``session_forecast`` (prefill policy) and ``spec_decode``
    (decode policy) set on ``prefill`` / ``decode`` (policy objects)
    that change nothing on ``scenario`` (module docstring); ``why`` reads after
    "<option> changes nothing on scenario 'NAME': ". Empty: nothing idle (or nothing set)."""
    out: list[tuple[str, str]] = []
    pd = scenario.disaggregated
    d = decode if isinstance(decode, EpAware) else None
    spec = d is not None and d.spec_decode
    chunks_d = d is not None and d.parallel_chunks
    # aggregated: the prefill policy routes nothing (the decode policy routes the mixed pool)
    chunks_p = pd and isinstance(prefill, EpAware) and prefill.parallel_chunks
    # the session facts (review3 S4, session 16), as pdlb serve warns of them: prefill_at_once prices
    # mixed pools only, session_forecast decode and mixed pools only
    at_once = pd and ((isinstance(prefill, EpAware) and prefill.prefill_at_once)
                      or (d is not None and d.prefill_at_once))
    forecast_p = pd and isinstance(prefill, EpAware) and prefill.session_forecast
    if at_once:
        out.append(("prefill_at_once", "it prices mixed pools only, and this scenario is PD (prefill and decode "
                                       "pools are priced the same either way)"))
    if forecast_p:
        out.append(("session_forecast", "on the prefill policy: it prices decode and mixed pools only, and this "
                                        "scenario's prefill pool is priced the same either way"))
    if not (spec or chunks_d or chunks_p):
        return out
    model = _router_cost_model(scenario)
    engines = _engines(model) if model is not None else []
    role = "decode" if pd else "mixed"
    if spec and all(e.decode_tokens_per_step <= 1.0 for e in engines):
        out.append(("spec_decode", f"its {role} pool gains one output token per step (a [speculative] table with "
                                   "verify = \"every_step\" gives more)"))
    if chunks_p or (chunks_d and pd):
        out.append(("parallel_chunks", "it prices mixed pools only, and this scenario is PD (prefill and decode "
                                       "pools are priced the same either way)"))
    elif d is not None and chunks_d and not d.cadence:
        out.append(("parallel_chunks", "it prices the cadence's parallel chunks, and cadence=false turns them off"))
    elif chunks_d:
        par = [e for e in engines if chunks_in_parallel(e.max_num_seqs, e.request_chunk_tokens, e.chunk_tokens)]
        if not par:
            out.append(("parallel_chunks", "its mixed pool does not run a rank's chunks in parallel (it needs "
                                           "max_chunk_tokens with max_num_seqs x max_chunk_tokens <= "
                                           "max_prefill_tokens, max_num_seqs capped by max_decode_batch)"))
        elif not any(e.ep_synchronous for e in par):
            out.append(("parallel_chunks", "its mixed engines are dense (each rank steps alone), so a prompt has no "
                                           "group tokens to price either way"))
    return out


def idle_option_warnings(runs: Sequence[tuple[str, str, Any, Any]], scenarios: Iterable[Scenario]) -> list[str]:
    """The ``warning: ...`` lines for :func:`idle_options` of each run, once per label and option,
    where the option is idle on every one of ``scenarios``.

    Args:
        runs: ``(prefill label, decode label, prefill policy, decode policy)`` (policy objects); a
            prefill policy's option is named by its prefill label, a decode policy's by its decode
            label.
        scenarios: the scenarios every run is simulated on (one, or a sweep's distinct ones).
    """
    scs = list({id(s): s for s in scenarios}.values())
    if not scs:
        return []
    lines: dict[str, None] = {}
    for plabel, dlabel, p, d in runs:
        per = [dict(idle_options(p, d, sc)) for sc in scs]
        for option in per[0]:
            if all(option in x for x in per[1:]):
                # an option both policies have is named by the policy it is set on (the decode one if both)
                by_decode = {"parallel_chunks": isinstance(d, EpAware) and d.parallel_chunks,
                             "prefill_at_once": isinstance(d, EpAware) and d.prefill_at_once,
                             "session_forecast": False}.get(option, True)
                label = dlabel if by_decode else plabel
                where = f"scenario {scs[0].name!r}" if len(scs) == 1 else f"any of the {len(scs)} scenarios"
                lines[f"warning: {label}: {option} changes nothing on {where}: {per[0][option]}"] = None
    return list(lines)
