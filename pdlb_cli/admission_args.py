"""The ``--admission*`` flags of ``pdlb serve`` and ``pdlb sim run|compare`` (deadline admission,
:mod:`balancer.deadline_admission`), and what they set: the ``admission`` config section's fields
(:class:`balancer.service.admission_config.AdmissionSettings`) or, in the simulator, the core's
:class:`~balancer.deadline_admission.AdmissionConfig`.

Imports nothing of the simulator (``pdlb-serve`` runs without it).
"""

from __future__ import annotations

import argparse
from typing import Any

from balancer.deadline_admission import WAIT_MODELS, AdmissionConfig
from balancer.service.admission_config import AdmissionSettings
from balancer.types import TtftSlo
from pdlb_cli.comma_lists import comma_items


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``"A=2,B=0.5"`` -> ``{"A": 2.0, "B": 0.5}`` (argparse type).

    Raises:
        argparse.ArgumentTypeError: a part without ``=``, an empty name, a weight not > 0, an empty
            part (``A=1,,B=2``), a tenant given twice.
    """
    out: dict[str, float] = {}
    for part in comma_items(text, "TENANT=WEIGHT pairs"):
        name, sep, w = part.partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not sep or not name.strip() or not 0 < weight < float("inf"):
            raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT[,TENANT=WEIGHT...] with weights > 0, got {part!r}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"expected distinct tenants, got {text!r} (tenant {name.strip()!r} "
                                             "is given twice)")
        out[name.strip()] = weight
    return out


def add_admission_args(p: argparse.ArgumentParser, *, serve: bool) -> argparse._ArgumentGroup:
    """The ``--admission*`` flags (``serve``: also the TTFT budget; ``pdlb sim`` uses ``--slo-ttft-s``)."""
    g = p.add_argument_group("deadline admission (off by default; docs/serving.md, README 'Overload and admission')")
    g.add_argument("--admission", action="store_true", default=None,
                   help="hold requests the cluster cannot serve in time, order them by deadline with per-tenant fair "
                        "share, and shed " + ("(HTTP 429 + Retry-After) " if serve else "(counted as SLO misses) ")
                        + "those whose predicted wait passes their deadline"
                        + ("" if serve else " (arrival + --slo-ttft-s); a request's tenant is its trace's "
                                            "traffic class"))
    if serve:
        g.add_argument("--admission-ttft-slo-s", type=float, metavar="S",
                       help="TTFT budget that sets each request's deadline (default: 2)")
    g.add_argument("--admission-dispatch-wait-s", type=float, metavar="S",
                   help="dispatch held requests while the predicted engine wait is below S (default: a quarter of the TTFT SLO)")
    g.add_argument("--admission-prefill-tokens-per-s", type=float, metavar="TOKENS",
                   help="one prefill replica's prefill rate (default: from the cost model)")
    g.add_argument("--admission-max-queue", type=int, metavar="N", help="most requests held at once (default: 1024)")
    g.add_argument("--admission-max-queue-per-tenant", type=int, metavar="N",
                   help="most requests one tenant may have held (default: 256)")
    g.add_argument("--admission-quantum-tokens", type=int, metavar="TOKENS",
                   help="deficit round robin quantum in prompt tokens (default: 8192)")
    g.add_argument("--admission-tenant-weights", type=parse_tenant_weights, metavar="T=W,...",
                   help="deficit round robin weight per tenant (default: 1 each)")
    g.add_argument("--admission-wait-model", choices=WAIT_MODELS, metavar="MODEL",
                   help="how the gate predicts a request's wait and own prefill: 'backlog' (prefill backlog / "
                        "rate), 'policy' (the routing policy's TTFT prediction when it has one: ep_aware), 'max' "
                        "(the larger of the two; README 'Overload and admission') (default: backlog)")
    return g


_FLAGS = {"admission_ttft_slo_s": "ttft_slo_s", "admission_dispatch_wait_s": "dispatch_wait_s",
          "admission_prefill_tokens_per_s": "prefill_tokens_per_s", "admission_max_queue": "max_queue_requests",
          "admission_max_queue_per_tenant": "max_queue_per_tenant", "admission_quantum_tokens": "quantum_tokens",
          "admission_tenant_weights": "tenant_weights", "admission_wait_model": "wait_model"}


def admission_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``admission`` section's fields the flags set (``--admission`` sets ``enabled``)."""
    out = {field: getattr(args, flag) for flag, field in _FLAGS.items() if getattr(args, flag, None) is not None}
    if getattr(args, "admission", None):
        out["enabled"] = True
    return out


def flag_names(overrides: dict[str, Any]) -> str:
    """The command-line flags behind :func:`admission_overrides`' fields, for error messages."""
    back = {field: "--" + flag.replace("_", "-") for flag, field in _FLAGS.items()}
    return ", ".join(sorted(back[f] for f in overrides if f in back))


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig | None:
    """``pdlb sim``'s ``--admission*`` flags as the core's config (the deadline from ``--slo-ttft-s``),
    or None without ``--admission``.

    Raises:
        ValueError: a flag value out of range (pydantic's message), or ``--admission-*`` flags
            without ``--admission``.
    """
    over = admission_overrides(args)
    if not over:
        return None
    if not over.get("enabled"):
        raise ValueError(f"{flag_names(over)} need --admission")
    return AdmissionSettings(**over).to_core(TtftSlo(args.slo_ttft_s))
