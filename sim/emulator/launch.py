"""Serve one emulated engine (:func:`sim.emulator.app.create_engine_app`) on a TCP port until
SIGINT/SIGTERM: what ``pdlb engine`` (:mod:`pdlb_cli.engine`) runs once its flags are checked."""

from __future__ import annotations

import asyncio
import signal
import sys

from aiohttp import web

from balancer.service.launch import listen_error
from sim.emulator.app import STATE, create_engine_app
from sim.emulator.config import EmulatorConfig


async def serve_engine(cfg: EmulatorConfig, host: str, port: int, bootstrap_port: int | None) -> int:
    """Listen until SIGINT/SIGTERM (0); 2 after printing one ``error:`` line if the engine cannot
    be built (e.g. the model does not fit the GPUs) or a port cannot be listened on."""
    try:
        app = create_engine_app(cfg, exit_on_die=True)  # builds the perf model: ValueError if it does not fit
    except ValueError as e:
        hint = " (pdlb engine: --gpus-per-rank, --dp-ranks, --hardware)" if "does not fit" in str(e) else ""
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    try:
        await runner.setup()  # binds the KV event sockets (--kv-events)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    listening = port
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        if bootstrap_port is not None:
            listening = bootstrap_port
            await web.TCPSite(runner, host, bootstrap_port).start()
    except OSError as e:
        await runner.cleanup()  # closes the app's client session too
        print(f"error: {listen_error(host, listening, e)}", file=sys.stderr)
        return 2
    app[STATE].port = bound
    print(f"pdlb engine ready on http://{host}:{bound} role={cfg.role} speed={cfg.speed}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    return 0
