"""``pdlb engine``: run one emulated SGLang/vLLM engine (see :mod:`sim.emulator.app`)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pydantic import ValidationError
from rich.console import Console

from balancer.service.launch import event_loop_factory
from balancer.validation import format_validation_error
from sim.emulator.config import EmulatorConfig
from sim.emulator.launch import serve_engine
from sim.models.hardware import HARDWARE
from sim.models.presets import MODELS


def add_engine_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb engine`` on the top-level subparsers."""
    p = subparsers.add_parser(
        "engine", help="run an emulated SGLang/vLLM engine timed by the perf model",
        description="An HTTP server that behaves like an SGLang/vLLM engine of one role (prefill, decode or "
                    "mixed), timed in real time by the simulator's roofline perf model divided by --speed. "
                    "Prints 'pdlb engine ready on http://HOST:PORT' once listening.")
    d = EmulatorConfig()
    f = d.faults
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--bootstrap-port", type=int, default=None, metavar="PORT",
                   help="also serve the SGLang bootstrap endpoint on this port (default: the HTTP port only)")
    p.add_argument("--role", choices=["prefill", "decode", "mixed"], default=d.role,
                   help="engine role: prefill, decode or mixed (aggregated) (default: %(default)s)")
    p.add_argument("--model", default=d.model, metavar="NAME",
                   help=f"model preset, one of: {', '.join(sorted(MODELS))} (default: %(default)s)")
    p.add_argument("--hardware", default=d.hardware, metavar="NAME",
                   help=f"GPU preset (case-insensitive), one of: {', '.join(sorted(HARDWARE))} (default: %(default)s)")
    p.add_argument("--dp-ranks", type=int, default=d.dp_ranks, metavar="N",
                   help="attention data-parallel ranks of the engine, each with its own scheduler and KV cache "
                        "(default: %(default)s)")
    p.add_argument("--gpus-per-rank", type=int, default=d.gpus_per_rank, metavar="N",
                   help="GPUs per DP rank (tensor/expert parallel inside a rank) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help="tokens per KV block of the engine's prefix cache (default: %(default)s)")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens, metavar="TOKENS",
                   help="prompt tokens per prefill batch (chunk) per rank (default: %(default)s)")
    p.add_argument("--max-decode-batch", type=int, default=d.max_decode_batch, metavar="N",
                   help="requests decoded together per rank (default: %(default)s)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None, metavar="TOKENS",
                   help="KV cache capacity per rank in tokens (default: from the perf model: GPU memory left "
                        "after weights)")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="run this many times faster than the perf model (default: %(default)s)")
    p.add_argument("--zero-delay", action="store_true", help="answer at once, no perf model (router benchmarks)")
    p.add_argument("--served-model-name", default=d.served_model_name, metavar="NAME",
                   help="model id in responses and /v1/models (default: %(default)s)")
    p.add_argument("--engine-id", default=None, help="vLLM remote_engine_id (default: emulator-PORT)")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens, metavar="TOKENS",
                   help="output tokens of a request that gives no max_tokens (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, metavar="TOKENS",
                   help="most prompt + max_tokens per request; longer requests get HTTP 400, as in vLLM "
                        "(default: %(default)s)")
    p.add_argument("--kv-transfer-bandwidth", type=float, default=d.kv_transfer_bandwidth_bytes_per_s,
                   metavar="BYTES_PER_S",
                   help="prefill -> decode KV transfer bandwidth in bytes/s (default: %(default)g)")
    p.add_argument("--kv-transfer-latency-s", type=float, default=d.kv_transfer_latency_s, metavar="SECONDS",
                   help="fixed latency of one KV transfer in seconds (default: %(default)s)")
    p.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV cache events on vLLM's ZMQ wire from this endpoint (DP rank r on PORT + r), "
                        "for pdlb serve --index-mode events; only token-id prompts' blocks are announced "
                        "(default: none)")
    p.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT",
                   help="with --kv-events: the replay endpoint (a ZMQ ROUTER; DP rank r on PORT + r) (default: none, no "
                        "replay)")
    p.add_argument("--stream-format", choices=["openai", "transformers"], default=d.stream_format,
                   help="framing of streamed answers: openai (role with the first token, [DONE] at the end) or "
                        "transformers (as transformers serve: a role-only chunk before prefill, usage in the "
                        "finish chunk, no [DONE]) (default: %(default)s)")
    g = p.add_argument_group("faults (for tests)")
    g.add_argument("--error-rate", type=float, default=f.error_rate,
                   help="fraction 0..1 of requests answered with --error-status (default: %(default)s)")
    g.add_argument("--error-status", type=int, default=f.error_status,
                   help="HTTP status 400..599 of injected errors (default: %(default)s)")
    g.add_argument("--hang", action="store_true", help="never answer generation requests")
    g.add_argument("--hang-after-headers", action="store_true", help="streamed answers: send headers, then nothing")
    g.add_argument("--die-after-tokens", type=int, default=None, metavar="TOKENS",
                   help="exit abruptly after streaming this many tokens in total, counted over all requests, not per request (default: never)")
    g.add_argument("--seed", type=int, default=f.seed, help="seed of the --error-rate coin (default: %(default)s)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="event loop; uvloop needs 'pip install uvloop' (default: %(default)s)")
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """Validate the parsed flags into an :class:`EmulatorConfig`.

    Raises:
        ValueError: one line, ``"<field>: <problem>"`` per problem joined by ``"; "``
            (:func:`balancer.validation.format_validation_error`).
    """
    try:
        return EmulatorConfig(
            role=args.role, model=args.model, hardware=args.hardware, dp_ranks=args.dp_ranks,
            gpus_per_rank=args.gpus_per_rank, block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens,
            max_decode_batch=args.max_decode_batch, kv_capacity_tokens=args.kv_capacity_tokens, speed=args.speed,
            zero_delay=args.zero_delay, served_model_name=args.served_model_name, engine_id=args.engine_id,
            default_max_tokens=args.default_max_tokens, max_model_len=args.max_model_len, kv_transfer_bandwidth_bytes_per_s=args.kv_transfer_bandwidth,
            kv_transfer_latency_s=args.kv_transfer_latency_s, stream_format=args.stream_format,
            kv_events_endpoint=args.kv_events, kv_events_replay_endpoint=args.kv_events_replay,
            faults={"error_rate": args.error_rate, "error_status": args.error_status, "hang": args.hang,
                    "hang_after_headers": args.hang_after_headers, "die_after_tokens": args.die_after_tokens,
                    "seed": args.seed})
    except ValidationError as e:
        raise ValueError(format_validation_error(e, None, EmulatorConfig)) from None


def run_engine(args: argparse.Namespace) -> int:
    """Run ``pdlb engine`` until SIGINT/SIGTERM; returns the exit status (2 after one ``error:``
    line on stderr for bad flags, a model that does not fit, or a port in use)."""
    try:
        for flag, value in (("--port", args.port), ("--bootstrap-port", args.bootstrap_port)):
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{flag} {value}: not a TCP port (0..65535)")
        cfg = config_from_args(args)
        loop_factory = event_loop_factory(args.event_loop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve_engine(cfg, args.host, args.port, args.bootstrap_port))


class Engine:
    """``pdlb engine`` (:class:`pdlb_cli.command.Subcommand`)."""

    name = "engine"
    add_parser = staticmethod(add_engine_parser)

    def run(self, args: argparse.Namespace, console: Console) -> int:
        return run_engine(args)
