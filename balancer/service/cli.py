"""``pdlb serve``: run the PD router (config file plus flags; flags win).

With ``--processes N`` (N > 1) the parent process reserves the port, starts N router processes
that each listen on it with ``SO_REUSEPORT`` (the kernel spreads client connections over them),
prints the ready line once all of them listen, forwards SIGTERM/SIGINT to them and exits when they
have drained. If one of them dies, the others are stopped and ``pdlb serve`` exits with status 1
(let a supervisor restart it). Prometheus multiprocess mode aggregates ``/metrics`` over them
(a fresh temporary ``PROMETHEUS_MULTIPROC_DIR``, removed at exit).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

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
    p.add_argument("--processes", type=int, metavar="N",
                   help="router processes sharing the port (SO_REUSEPORT); each keeps its own load and prefix "
                        "state, the admin API cannot add/remove workers when N > 1 (default 1)")
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
                  "served_model_name": args.served_model_name, "processes": args.processes,
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


def _ready_line(cfg: ServiceConfig, port: int) -> str:
    n = {r: sum(1 for w in cfg.workers if w.role == r) for r in ("prefill", "decode", "mixed")}
    return (f"pdlb serve ready on http://{cfg.host}:{port} protocol={cfg.pd_protocol} "
            f"workers=P{n['prefill']}/D{n['decode']}/M{n['mixed']}" + (f" processes={cfg.processes}" if cfg.processes > 1 else ""))


async def _serve(cfg: ServiceConfig, process_index: int = 0, ready=None) -> int:  # noqa: ANN001
    """Serve until SIGINT/SIGTERM. One process: print the ready line. Process ``process_index`` of
    several: listen with ``SO_REUSEPORT`` and send ``("ready", port)`` or ``("error", message)``
    on the pipe ``ready`` instead."""
    try:
        app = create_app(cfg, process_index)
    except (ValueError, RuntimeError) as e:  # e.g. a bad tokenizer_path
        if ready is not None:
            ready.send(("error", str(e)))
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=cfg.shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024, reuse_port=True if cfg.processes > 1 else None)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if ready is not None:
            ready.send(("error", f"cannot listen on {cfg.host}:{cfg.port}: {e}"))
            return 2
        raise
    port = runner.addresses[0][1]
    if ready is None:
        print(_ready_line(cfg, port), flush=True)
    else:
        ready.send(("ready", port))
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
    if cfg.processes > 1:
        return _run_processes(cfg, args.event_loop, args.log_level)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(cfg))


# ---------------------------------------------------------------------- several processes
def _reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) ``SO_REUSEPORT`` socket holding ``host:port`` (``port`` 0: a free
    one) while the router processes start.

    Raises:
        OSError: the address is already in use (checked without ``SO_REUSEPORT`` first, so that
            another process's ``SO_REUSEPORT`` listener is not silently joined) or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port != 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))  # EADDRINUSE if anything listens there
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def _process_main(cfg_json: str, index: int, event_loop: str, log_level: str, ready) -> None:  # noqa: ANN001
    """Entry point of router process ``index`` (a spawned interpreter)."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    cfg = ServiceConfig.model_validate_json(cfg_json)
    with asyncio.Runner(loop_factory=event_loop_factory(event_loop)) as runner:
        code = runner.run(_serve(cfg, index, ready))
    sys.exit(code)


def _run_processes(cfg: ServiceConfig, event_loop: str, log_level: str) -> int:
    """Run ``cfg.processes`` router processes on one port (see the module docstring)."""
    try:
        reservation = _reserve_port(cfg.host, cfg.port)
    except OSError as e:
        what = "address already in use" if e.errno == errno.EADDRINUSE else str(e)
        print(f"error: cannot listen on {cfg.host}:{cfg.port}: {what}", file=sys.stderr)
        return 2
    port = reservation.getsockname()[1]
    cfg = cfg.model_copy(update={"port": port})
    metrics_dir = tempfile.mkdtemp(prefix="pdlb-metrics-")
    # read by prometheus_client at import in each spawned process (multiprocess mode)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    procs: list = []
    stop = {"signal": False}

    def on_signal(signum, frame):  # noqa: ANN001, ANN202
        stop["signal"] = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        pipes = []
        for i in range(cfg.processes):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_process_main, args=(cfg.model_dump_json(), i, event_loop, log_level, send),
                            name=f"pdlb-serve-{i}", daemon=False)
            p.start()
            send.close()
            procs.append(p)
            pipes.append(recv)
        for i, (p, recv) in enumerate(zip(procs, pipes)):
            msg = None
            while msg is None and not stop["signal"]:
                if recv.poll(0.2):
                    try:
                        msg = recv.recv()
                    except EOFError:
                        msg = ("error", f"exited with status {p.exitcode} before listening")
                elif not p.is_alive():
                    msg = ("error", f"exited with status {p.exitcode} before listening")
            if msg is None:
                return 0
            if msg[0] != "ready":
                print(f"error: router process {i}: {msg[1]}", file=sys.stderr)
                return 2
        reservation.close()
        print(_ready_line(cfg, port), flush=True)
        while not stop["signal"]:
            dead = [(i, p) for i, p in enumerate(procs) if not p.is_alive()]
            if dead:
                i, p = dead[0]
                print(f"error: router process {i} (pid {p.pid}) exited with status {p.exitcode}; stopping the others",
                      file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
        return code
    finally:
        reservation.close()
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + cfg.shutdown_timeout_s + 10
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for sig, h in old.items():
            signal.signal(sig, h)
        shutil.rmtree(metrics_dir, ignore_errors=True)
