"""``pdlb serve``: run the PD router (config file plus flags; flags win)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from balancer.service.app import create_app
from balancer.service.config import ServiceConfig, load_service_config


def _worker_arg(role: str):  # noqa: ANN202
    def parse(text: str) -> dict:
        # URL[,dp=N][,bootstrap=PORT]
        parts = text.split(",")
        out: dict = {"url": parts[0], "role": role}
        for p in parts[1:]:
            k, _, v = p.partition("=")
            key = {"dp": "dp_size", "dp_size": "dp_size", "bootstrap": "bootstrap_port",
                   "bootstrap_port": "bootstrap_port", "kv": "kv_capacity_tokens"}.get(k)
            if key is None or not v:
                raise argparse.ArgumentTypeError(f"bad worker option {p!r} (use dp=N, bootstrap=PORT, kv=TOKENS)")
            out[key] = None if v == "none" else int(v)
        return out
    return parse


def event_loop_factory(choice: str = "asyncio"):  # noqa: ANN201
    """The event-loop factory for ``asyncio.Runner``: ``None`` for ``asyncio`` (the standard loop),
    ``uvloop.new_event_loop`` for ``uvloop`` (needs ``pip install uvloop``; measured no lower
    router CPU per request than the standard loop with aiohttp 3.14 on a 2-core host, so it is
    not the default).

    Raises:
        ValueError: ``uvloop`` asked for but not installed, or an unknown choice.
    """
    if choice not in ("uvloop", "asyncio"):
        raise ValueError(f"unknown event loop {choice!r} (asyncio, uvloop)")
    if choice == "asyncio":
        return None
    try:
        import uvloop  # optional, not a dependency of pdlb
    except ImportError:
        raise ValueError("--event-loop uvloop needs the 'uvloop' package (pip install uvloop)") from None
    return uvloop.new_event_loop


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``pdlb serve`` on the top-level subparsers."""
    p = subparsers.add_parser(
        "serve", help="run the PD router (OpenAI-compatible HTTP proxy)",
        description="Route OpenAI / SGLang requests to prefill and decode engines with pdlb's policies. "
                    "Workers: URL[,dp=N][,bootstrap=PORT]. Prints 'pdlb serve ready on http://HOST:PORT'.")
    d = ServiceConfig()
    p.add_argument("--config", metavar="FILE", help="YAML/TOML/JSON config (see docs/serving.md)")
    p.add_argument("--host", help=f"bind address (default {d.host})")
    p.add_argument("--port", type=int, help=f"port; 0 picks a free one (default {d.port})")
    p.add_argument("--pd-protocol", choices=["sglang", "vllm", "none"], help=f"PD wire protocol (default {d.pd_protocol})")
    p.add_argument("--prefill", nargs="+", default=[], type=_worker_arg("prefill"), metavar="URL", help="prefill workers")
    p.add_argument("--decode", nargs="+", default=[], type=_worker_arg("decode"), metavar="URL", help="decode workers")
    p.add_argument("--mixed", nargs="+", default=[], type=_worker_arg("mixed"), metavar="URL", help="mixed (aggregated) workers")
    p.add_argument("--prefill-policy", help=f"prefill policy (default {d.prefill_policy.name})")
    p.add_argument("--decode-policy", help=f"decode policy (default {d.decode_policy.name})")
    p.add_argument("--block-size", type=int, help=f"tokens per hashed block (default {d.block_size})")
    p.add_argument("--tokenizer", dest="tokenizer_path", metavar="TOKENIZER_JSON", help="local tokenizer.json (needs 'tokenizers')")
    p.add_argument("--pd-min-uncached-tokens", type=int, help="serve requests with fewer uncached tokens on decode alone")
    p.add_argument("--request-timeout-s", type=float, help=f"per client request, retries included (default {d.request_timeout_s:g})")
    p.add_argument("--first-byte-timeout-s", type=float,
                   help="per leg: fail and retry elsewhere when a worker sends no headers / first chunk within this (default: off)")
    p.add_argument("--max-retries", type=int)
    p.add_argument("--health-check-interval-s", type=float)
    p.add_argument("--served-model-name")
    p.add_argument("--admin-api-key", help="admin API bearer token (default: $PDLB_ADMIN_API_KEY; none = loopback only)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="event loop (default asyncio; uvloop needs 'pip install uvloop')")
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Merge ``--config`` with the flags. Raises ``ValueError`` with a readable message."""
    over: dict = {"host": args.host, "port": args.port, "pd_protocol": args.pd_protocol,
                  "block_size": args.block_size, "tokenizer_path": args.tokenizer_path,
                  "pd_min_uncached_tokens": args.pd_min_uncached_tokens, "request_timeout_s": args.request_timeout_s,
                  "first_byte_timeout_s": args.first_byte_timeout_s,
                  "served_model_name": args.served_model_name,
                  "admin_api_key": args.admin_api_key or os.environ.get("PDLB_ADMIN_API_KEY")}
    if args.prefill_policy:
        over["prefill_policy"] = {"name": args.prefill_policy}
    if args.decode_policy:
        over["decode_policy"] = {"name": args.decode_policy}
    data = load_service_config(args.config, over).model_dump()
    data["workers"] += args.prefill + args.decode + args.mixed
    if args.max_retries is not None:
        data["retry"]["max_retries"] = args.max_retries
    if args.health_check_interval_s is not None:
        data["health_check"]["interval_s"] = args.health_check_interval_s
    try:
        return ServiceConfig.model_validate(data)
    except ValueError as e:
        raise ValueError(f"invalid settings: {e}") from e


async def _serve(cfg: ServiceConfig) -> int:
    try:
        app = create_app(cfg)
    except (ValueError, RuntimeError) as e:  # e.g. a bad tokenizer_path
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=cfg.shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    n = {r: sum(1 for w in cfg.workers if w.role == r) for r in ("prefill", "decode", "mixed")}
    print(f"pdlb serve ready on http://{cfg.host}:{port} protocol={cfg.pd_protocol} "
          f"workers=P{n['prefill']}/D{n['decode']}/M{n['mixed']}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()  # stops listening, drains in-flight requests, closes
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Run ``pdlb serve`` until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        loop_factory = event_loop_factory(args.event_loop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.host not in ("127.0.0.1", "::1", "localhost") and not cfg.admin_api_key:
        print("note: no admin_api_key: the admin API (/workers) answers loopback clients only", file=sys.stderr)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(cfg))
