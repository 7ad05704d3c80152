"""``pdlb engine``: run one emulated SGLang/vLLM engine (see :mod:`sim.emulator.app`)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from aiohttp import web

from balancer.service.cli import event_loop_factory
from sim.emulator.app import STATE, create_engine_app
from sim.emulator.config import EmulatorConfig, FaultConfig


def add_engine_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb engine`` on the top-level subparsers."""
    p = subparsers.add_parser(
        "engine", help="run an emulated SGLang/vLLM engine timed by the perf model",
        description="An HTTP server that behaves like an SGLang/vLLM engine of one role (prefill, decode or "
                    "mixed), timed in real time by the simulator's roofline perf model divided by --speed. "
                    "Prints 'pdlb engine ready on http://HOST:PORT' once listening.")
    d = EmulatorConfig()
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port; 0 picks a free one (default 30000)")
    p.add_argument("--bootstrap-port", type=int, default=None,
                   help="also serve the SGLang bootstrap endpoint on this port (default: the HTTP port)")
    p.add_argument("--role", choices=["prefill", "decode", "mixed"], default=d.role)
    p.add_argument("--model", default=d.model, help=f"model preset (default {d.model})")
    p.add_argument("--hardware", default=d.hardware, help=f"hardware preset (default {d.hardware})")
    p.add_argument("--dp-ranks", type=int, default=d.dp_ranks)
    p.add_argument("--gpus-per-rank", type=int, default=d.gpus_per_rank)
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--max-decode-batch", type=int, default=d.max_decode_batch)
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument("--speed", type=float, default=d.speed, help="run this many times faster than the perf model (default 1)")
    p.add_argument("--zero-delay", action="store_true", help="answer at once, no perf model (router benchmarks)")
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--engine-id", default=None, help="vLLM remote_engine_id (default emulator-PORT)")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--kv-transfer-bandwidth", type=float, default=d.kv_transfer_bandwidth_bytes_per_s, metavar="BYTES_PER_S")
    p.add_argument("--kv-transfer-latency-s", type=float, default=d.kv_transfer_latency_s)
    g = p.add_argument_group("faults (for tests)")
    g.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered with --error-status")
    g.add_argument("--error-status", type=int, default=503)
    g.add_argument("--hang", action="store_true", help="never answer generation requests")
    g.add_argument("--hang-after-headers", action="store_true", help="streamed answers: send headers, then nothing")
    g.add_argument("--die-after-tokens", type=int, default=None, help="exit abruptly after streaming N tokens")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="event loop (default asyncio; uvloop needs 'pip install uvloop')")
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """Validate the parsed flags into an :class:`EmulatorConfig` (raises pydantic's ``ValueError``)."""
    return EmulatorConfig(
        role=args.role, model=args.model, hardware=args.hardware, dp_ranks=args.dp_ranks,
        gpus_per_rank=args.gpus_per_rank, block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens,
        max_decode_batch=args.max_decode_batch, kv_capacity_tokens=args.kv_capacity_tokens, speed=args.speed,
        zero_delay=args.zero_delay, served_model_name=args.served_model_name, engine_id=args.engine_id,
        default_max_tokens=args.default_max_tokens, kv_transfer_bandwidth_bytes_per_s=args.kv_transfer_bandwidth,
        kv_transfer_latency_s=args.kv_transfer_latency_s,
        faults=FaultConfig(error_rate=args.error_rate, error_status=args.error_status, hang=args.hang,
                           hang_after_headers=args.hang_after_headers,
                           die_after_tokens=args.die_after_tokens, seed=args.seed))


async def _serve(cfg: EmulatorConfig, host: str, port: int, bootstrap_port: int | None) -> None:
    app = create_engine_app(cfg, exit_on_die=True)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    app[STATE].port = bound
    if bootstrap_port is not None:
        await web.TCPSite(runner, host, bootstrap_port).start()
    print(f"pdlb engine ready on http://{host}:{bound} role={cfg.role} speed={cfg.speed}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run_engine(args: argparse.Namespace) -> int:
    """Run ``pdlb engine`` until SIGINT/SIGTERM; returns the exit status."""
    try:
        cfg = config_from_args(args)
        loop_factory = event_loop_factory(args.event_loop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(cfg, args.host, args.port, args.bootstrap_port))
    return 0
