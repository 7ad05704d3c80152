"""``pdlb serve``: run the PD router (config file plus flags; flags win).

By default ``pdlb serve`` runs one router process per core it may run on
(``os.sched_getaffinity``; ``--processes N`` or ``processes:`` in the config to choose), one per
four cores when a worker runs on the same host (:func:`default_processes`). With N > 1
the parent process listens on the port, starts N router processes and hands each accepted client
connection to the next of them in turn (:mod:`balancer.service.handoff`: the kernel's
``SO_REUSEPORT`` hashing left some processes with twice the mean number of keep-alive clients),
prints the ready line once all of them are ready, forwards SIGTERM/SIGINT to them and exits when
they have drained. While they run it
applies admin changes (``POST``/``DELETE /workers``) to all of them, one at a time, all or none
(:mod:`balancer.service.shared_admin`). If one of them dies (any cause) it is started again with
the same index, bounded by a crash-loop limit after which ``pdlb serve`` exits with status 1
(:mod:`balancer.service.supervise`). Prometheus multiprocess mode aggregates
``/metrics`` over them (a fresh temporary ``PROMETHEUS_MULTIPROC_DIR``, removed at exit).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from urllib.parse import urlparse

from aiohttp import web

from balancer.policies import available_policies
from balancer.service.app import create_app, json_parser_errors, limit_connections, make_runner
from balancer.service.body_offload import tune_malloc
from balancer.service.config import (WORKER_SPEC_SYNTAX, ServiceConfig, WorkerConfig, config_warnings,
                                     load_service_config, move_legacy_router_keys, parse_worker_spec)

log = logging.getLogger("pdlb.serve")


GC_GEN0_THRESHOLD = 10_000
"""Net new container objects (allocations minus frees) that trigger a young-generation garbage
collection in a serving process (CPython's default: 700). A proxied request leaves almost no
cyclic garbage, but its live objects (about 40 per request in flight: tasks, futures, headers)
push the count past 700 about once per 18 requests, and each collection walks what is young
then: with one process under load, 10-13% of its CPU went to the collector (``perf``: gc_collect_main,
visit_decref, visit_reachable), and full collections of the startup heap (~70,000 objects:
numpy, pydantic, aiohttp) paused the event loop for 40-54 ms. At 10,000 a loaded process
collected once in a 5 s run (``bench/router_overhead.py``)."""


def tune_gc() -> None:
    """Move everything alive now (the imported modules, the app) to the collector's permanent
    generation (``gc.freeze()``: never walked again, so full collections only see objects made
    while serving) and raise the young generation's threshold to :data:`GC_GEN0_THRESHOLD`.
    Called once a serving process is ready; cyclic garbage is still collected, in fewer, larger
    passes (at most about 10,000 container objects wait for one)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def listen_error(host: str, port: int, err: OSError) -> str:
    """One line saying why ``host:port`` could not be listened on (``pdlb serve`` and ``pdlb engine``)."""
    if err.errno == errno.EADDRINUSE:
        return f"port {port} is already in use on {host} (another pdlb serve or engine still running?)"
    if err.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}:{port}: {host} is not an address of this machine"
    if err.errno == errno.EACCES:
        return f"cannot listen on {host}:{port}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {host}:{port}: {err.strerror or err}"


LOCAL_ENGINE_CORE_SHARE = 4
"""With an engine on the router's own host, ``pdlb serve`` takes one core in this many by default."""


def worker_on_this_host(url: str) -> bool:
    """Whether a worker URL names this host: a loopback address, ``localhost``, or this host's
    name (no name resolution)."""
    host = (urlparse(url).hostname or "").lower()
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost" or host == socket.gethostname().lower()


def default_processes(worker_urls: Iterable[str] = ()) -> int:
    """Router processes ``pdlb serve`` starts when none is configured: the CPUs this process
    may run on (``os.sched_getaffinity``, so a ``taskset`` or cpuset counts, a CPU quota does not;
    else ``os.cpu_count()``), at most 256 (the setting's limit); when a worker runs on this host
    (:func:`worker_on_this_host`), one in :data:`LOCAL_ENGINE_CORE_SHARE` of them (at least one),
    leaving the rest to the engines (issue 30: 16 router processes on a 16-core host starved two
    transformers engines there)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    if any(worker_on_this_host(u) for u in worker_urls):
        n //= LOCAL_ENGINE_CORE_SHARE
    return max(1, min(256, n))


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
    """Register ``pdlb serve`` on the top-level subparsers.

    Options that are also config-file settings default to ``None`` here (so that a ``--config``
    value is kept unless the flag is given); their help states the :class:`ServiceConfig` default.
    """
    d = ServiceConfig()
    policies = ", ".join(available_policies())
    p = subparsers.add_parser(
        "serve", help="run the PD router (OpenAI-compatible HTTP proxy)",
        description="Route OpenAI / SGLang requests to prefill and decode engines with pdlb's policies. "
                    f"Workers: {WORKER_SPEC_SYNTAX} (dp: attention DP ranks of the engine; bootstrap: SGLang "
                    "prefill KV bootstrap port; kv: KV capacity per DP rank in tokens, for KV-aware policies); "
                    "repeat --prefill/--decode/--mixed or list several specs after one. Flags override --config. "
                    "Prints 'pdlb serve ready on http://HOST:PORT ...' once listening.")
    p.add_argument("--config", metavar="FILE",
                   help="YAML/TOML/JSON config file, schema ServiceConfig (see docs/serving.md); flags override it "
                        "(default: none)")
    p.add_argument("--host", help=f"bind address (default: {d.host})")
    p.add_argument("--port", type=int, help=f"TCP port; 0 picks a free one (default: {d.port})")
    p.add_argument("--pd-protocol", choices=["sglang", "vllm", "none"],
                   help="PD wire protocol: sglang (both legs at once, bootstrap room), vllm (prefill, then decode "
                        f"with kv_transfer_params), none (mixed workers only) (default: {d.pd_protocol})")
    for role, what in (("prefill", "prefill engine(s)"), ("decode", "decode engine(s)"),
                       ("mixed", "mixed (aggregated, prefill + decode) engine(s)")):
        p.add_argument(f"--{role}", action="extend", nargs="+", default=[], metavar="SPEC",
                       help=f"{what}, each {WORKER_SPEC_SYNTAX}; the flag can be repeated (default: none)")
    p.add_argument("--prefill-policy", metavar="NAME[:K=V,...]",
                   help=f"prefill-pool routing policy with optional parameters (e.g. cache_aware:cache_threshold=0.5; "
                        f"'pdlb policies' lists them), one of: {policies} (default: {d.router.prefill_policy.name})")
    p.add_argument("--decode-policy", metavar="NAME[:K=V,...]",
                   help=f"decode- and mixed-pool routing policy, same names (default: {d.router.decode_policy.name}, "
                        "whatever --prefill-policy is; note that 'pdlb sim run --policy P' uses P for both pools)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="TOML/JSON cost-model table for ep_aware, as 'pdlb sim cost-model --scenario NAME' writes it "
                        "(default: a generic DeepSeek-V3-class model, refitted online)")
    p.add_argument("--no-learn-cost-model", action="store_true",
                   help="keep the cost model fixed instead of refitting it from observed timings (default: learn)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help=f"tokens per hashed prefix block of the router's prefix index (default: {d.router.block_size}; "
                        "the simulator's scenarios use 512, the Mooncake traces' block size; see docs/serving.md)")
    p.add_argument("--tokenizer", dest="tokenizer_path", metavar="MODEL_DIR_OR_TOKENIZER_JSON",
                   help="local model folder (tokenizer.json + tokenizer_config.json with its chat template) or a "
                        "tokenizer.json: hash the engine's real token blocks, chat requests rendered with the model's "
                        "chat template (needs 'tokenizers', 'jinja2') (default: none, hash "
                        f"chunks of block_size * {d.chars_per_token:g} characters)")
    p.add_argument("--chat-engine", choices=["vllm", "sglang"],
                   help="whose chat rendering --tokenizer reproduces: vllm or sglang (they join text content parts "
                        "and continue a final message differently) (default: %s)" % d.chat_engine)
    p.add_argument("--index-mode", choices=["approximate", "events", "hybrid"],
                   help="prefix index: approximate (what the router routed), events (the engines' KV events, workers' "
                        "events=tcp://HOST:PORT), hybrid (events plus the router's own routed prompts for "
                        f"--speculative-ttl-s) (default: {d.router.index_mode})")
    p.add_argument("--speculative-ttl-s", type=float, metavar="SECONDS",
                   help=f"hybrid mode: how long a routed prompt counts as cached before its engine announces it "
                        f"(default: {d.router.speculative_ttl_s:g})")
    p.add_argument("--scrape-load", action="store_true", default=None,
                   help="scrape the engines' /metrics (running, waiting, KV usage) every "
                        f"{d.load_scrape.interval_s:g} s as load reports, so that several routers see the whole load "
                        "(default: off)")
    p.add_argument("--pd-min-uncached-tokens", type=int, metavar="TOKENS",
                   help="conditional disaggregation: requests with fewer uncached prompt tokens run on the decode "
                        f"engine alone (default: {d.router.pd_min_uncached_tokens}, always prefill + decode)")
    p.add_argument("--request-timeout-s", type=float, metavar="SECONDS",
                   help=f"per client request, retries included; 504 after (default: {d.request_timeout_s:g})")
    p.add_argument("--stream-first-chunk-timeout-s", type=float, metavar="SECONDS",
                   help="without --first-byte-timeout-s, still fail and retry elsewhere a streamed decode leg whose "
                        f"headers and first chunk do not come within this; 0 turns it off (default: "
                        f"{d.stream_first_chunk_timeout_s:g})")
    p.add_argument("--first-byte-timeout-s", type=float, metavar="SECONDS",
                   help="per leg: fail and retry elsewhere when a worker sends no headers / first chunk within this "
                        "(default: off)")
    p.add_argument("--upstream-client", choices=["lean", "aiohttp"],
                   help="HTTP client of the legs to the engines: lean (keep-alive pool parsed by httptools) or aiohttp "
                        f"(aiohttp's client, the fallback) (default: {d.upstream_client})")
    p.add_argument("--prefill-timeout-s", type=float, metavar="SECONDS",
                   help="per attempt: fail and retry elsewhere when a prefill leg has not answered within this; "
                        f"0 turns it off (default: {d.prefill_timeout_s:g})")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="refuse (400) requests whose prompt plus output limit exceed this (default: no limit)")
    p.add_argument("--max-retries", type=int, metavar="N",
                   help="retries of a request that failed before any byte reached the client, each on a new "
                        f"prefill/decode pair (default: {d.retry.max_retries})")
    p.add_argument("--health-check-interval-s", type=float, metavar="SECONDS",
                   help=f"seconds between active health checks of each worker (default: {d.health_check.interval_s:g})")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="model id that /v1/models lists (default: ask a worker)")
    p.add_argument("--admin-api-key", help="admin API bearer token (default: $PDLB_ADMIN_API_KEY; none = loopback only; "
                                           "required with a non-loopback --host, and behind a reverse proxy)")
    p.add_argument("--allow-unauthenticated-admin", action="store_true", default=None,
                   help="allow a non-loopback --host without an admin API key (the admin API then answers loopback "
                        "peers only, which a reverse proxy on this host makes every client) (default: refuse)")
    p.add_argument("--processes", type=int, metavar="N",
                   help="router processes behind the port (client connections handed to them in turn); they share in-flight load (shared "
                        "memory), their routed prompts (approximate mode) or, with workers' events=, the engines' KV "
                        "events; admin API changes reach all of them (default: one per core this process may run "
                        f"on, {default_processes()} here; with a worker on this host one per "
                        f"{LOCAL_ENGINE_CORE_SHARE} cores, {default_processes(['http://127.0.0.1'])} here, leaving "
                        "the rest to the engines). Round robin counts per process")
    p.add_argument("--max-process-restarts", type=int, metavar="N",
                   help="--processes N > 1: restarts of one dead router process allowed within --restart-window-s; "
                        "one more death stops pdlb serve with status 1 (crash loop) (default: 5)")
    p.add_argument("--restart-window-s", type=float, metavar="SECONDS",
                   help="the crash-loop window of --max-process-restarts (default: 60)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="event loop; uvloop needs 'pip install uvloop' (default: %(default)s)")
    p.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   default="WARNING", help="log level of the router's own messages on stderr (default: %(default)s)")
    return p


def read_cost_model_file(path: str) -> dict:
    """The table of a ``--cost-model`` file: JSON when it ends in ``.json``, else TOML (what
    ``pdlb sim cost-model`` writes); a ``[cost_model]`` table or the bare table. Raises
    ValueError naming the file."""
    import json
    import tomllib
    from pathlib import Path

    p = Path(path)
    kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
    try:
        text = p.read_text()
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except OSError as e:
        raise ValueError(f"--cost-model {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"--cost-model {path}: not valid {kind} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--cost-model {path}: expected a table")
    data = data.get("cost_model", data)
    from balancer.cost_model import CostModel

    try:
        CostModel.from_dict(data)
    except ValueError as e:
        raise ValueError(f"--cost-model {path}: {e}") from None
    return data


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Merge ``--config`` with the flags (flags win; workers of both are kept).

    Raises:
        ValueError: one line: a bad config file (``"<file>: <field>: <problem>"``), a bad worker
            spec (``"worker spec '<spec>': <problem>"``) or a bad flag value (``"<field>: <problem>"``,
            problems joined by ``"; "``).
    """
    workers = [parse_worker_spec(text, role) for role in ("prefill", "decode", "mixed")
               for text in getattr(args, role)]
    file_cfg = load_service_config(args.config) if args.config else None
    data = file_cfg.model_dump() if file_cfg is not None else {}
    over: dict = {"host": args.host, "port": args.port, "pd_protocol": args.pd_protocol,
                  "block_size": args.block_size, "tokenizer_path": args.tokenizer_path, "chat_engine": args.chat_engine,
                  "pd_min_uncached_tokens": args.pd_min_uncached_tokens, "request_timeout_s": args.request_timeout_s,
                  "first_byte_timeout_s": args.first_byte_timeout_s, "max_model_len": args.max_model_len,
                  "prefill_timeout_s": args.prefill_timeout_s,
                  "allow_unauthenticated_admin": args.allow_unauthenticated_admin,
                  "served_model_name": args.served_model_name, "processes": args.processes,
                  "admin_api_key": args.admin_api_key or os.environ.get("PDLB_ADMIN_API_KEY"),
                  "index_mode": getattr(args, "index_mode", None),
                  "upstream_client": getattr(args, "upstream_client", None),
                  "speculative_ttl_s": getattr(args, "speculative_ttl_s", None)}
    data |= {k: v for k, v in over.items() if v is not None}
    off = []  # "0 turns it off": applied after loading (load_service_config ignores None overrides)
    if getattr(args, "stream_first_chunk_timeout_s", None) is not None:
        if args.stream_first_chunk_timeout_s == 0:
            off.append("stream_first_chunk_timeout_s")
        else:
            data["stream_first_chunk_timeout_s"] = args.stream_first_chunk_timeout_s
    if args.prefill_timeout_s == 0:
        data.pop("prefill_timeout_s", None)
        off.append("prefill_timeout_s")
    if args.prefill_policy:
        data["prefill_policy"] = args.prefill_policy  # "name" or "name:k=v,..." (balancer.policies.spec)
    if args.decode_policy:
        data["decode_policy"] = args.decode_policy
    if getattr(args, "cost_model", None):
        data["cost_model"] = read_cost_model_file(args.cost_model)
    if getattr(args, "no_learn_cost_model", False):
        data["learn_cost_model"] = False
    data, _ = move_legacy_router_keys(data, override=True)  # the router flags above go to the router: section
    data["workers"] = data.get("workers", []) + workers
    if args.max_retries is not None:
        data.setdefault("retry", {})["max_retries"] = args.max_retries
    if getattr(args, "scrape_load", None):
        data.setdefault("load_scrape", {})["enabled"] = True
    if args.health_check_interval_s is not None:
        data.setdefault("health_check", {})["interval_s"] = args.health_check_interval_s
    cfg = load_service_config(None, data)
    cfg = cfg.model_copy(update={k: None for k in off}) if off else cfg
    if file_cfg is not None:  # the file's deprecated top-level router keys, for config_warnings
        cfg._legacy_router_keys = file_cfg._legacy_router_keys
    return cfg


def no_workers_warning(cfg: ServiceConfig) -> str | None:
    """The warning ``pdlb serve`` prints when it starts with no workers (``None`` if it has some)."""
    if cfg.workers:
        return None
    return ("warning: no workers: every request gets 503 until workers are added with the admin API "
            "(POST /workers) or given with --prefill/--decode/--mixed")


def _ready_line(cfg: ServiceConfig, port: int) -> str:
    n = {r: sum(1 for w in cfg.workers if w.role == r) for r in ("prefill", "decode", "mixed")}
    return (f"pdlb serve ready on http://{cfg.host}:{port} protocol={cfg.pd_protocol} "
            f"workers=P{n['prefill']}/D{n['decode']}/M{n['mixed']}" +
            (f" processes={cfg.processes}" if (cfg.processes or 1) > 1 else ""))


async def _serve(cfg: ServiceConfig, process_index: int = 0, ready=None, shared_load: str | None = None,  # noqa: ANN001
                 shared_prefix_dir: str | None = None, handoff: socket.socket | None = None,
                 columns: dict[str, list[int]] | None = None, restart: tuple[bool, int] = (False, 0)) -> int:
    """Serve until SIGINT/SIGTERM. One process: listen, print the ready line. Process
    ``process_index`` of several: serve the connections the parent hands over on ``handoff``
    (:mod:`balancer.service.handoff`) and send ``("ready", port)`` or ``("error", message)`` on the
    duplex pipe ``ready`` instead, which then carries admin changes
    (:mod:`balancer.service.shared_admin`). ``columns``, ``restart``: see :func:`_process_main`."""
    try:
        app = create_app(cfg, process_index, shared_load=shared_load, shared_prefix_dir=shared_prefix_dir, control=ready)
    except (ValueError, RuntimeError) as e:  # e.g. a bad tokenizer_path
        if ready is not None:
            ready.send(("error", str(e)))
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ready is not None:
        _join_supervision(app, process_index, columns, restart)
    runner = make_runner(app, cfg)
    await runner.setup()
    limit_connections(runner, cfg.max_connections)
    json_parser_errors(runner)
    stop_adopting = None
    stop = asyncio.Event()
    orphaned = False

    def parent_stops() -> None:  # the parent said so on the hand-off channel, then sends SIGTERM
        log.info("router process %d: pdlb serve is stopping; draining and exiting", process_index)
        stop.set()

    def parent_gone() -> None:  # the channel ended without that: the parent died
        nonlocal orphaned
        orphaned = True
        log.error("router process %d: the pdlb serve parent is gone; draining and exiting", process_index)
        stop.set()

    if handoff is not None:
        from balancer.service.handoff import adopt_connections

        assert runner.server is not None
        stop_adopting = adopt_connections(handoff, runner.server, parent_gone, parent_stops)
        port = cfg.port
    else:
        site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
        try:
            await site.start()
        except OSError as e:  # port in use, address not ours, ...: one line, nothing left open
            await runner.cleanup()
            if ready is not None:
                ready.send(("error", listen_error(cfg.host, cfg.port, e)))
            else:
                print(f"error: {listen_error(cfg.host, cfg.port, e)}", file=sys.stderr)
            return 2
        port = runner.addresses[0][1]
    tune_gc()
    tune_malloc()
    if ready is None:
        print(_ready_line(cfg, port), flush=True)
    else:
        ready.send(("ready", port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if stop_adopting is not None:
        stop_adopting()
    await runner.cleanup()  # stops listening, drains in-flight requests, closes
    # orphaned (the channel ended without the parent's STOP): nobody else will remove the shared
    # folders the parent made. Not told by the parent pid: a dying parent's files close before
    # its children are re-parented, so that check raced (the SIGKILL test failed on it)
    if orphaned:
        for d in (shared_prefix_dir, os.environ.get("PROMETHEUS_MULTIPROC_DIR")):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        return 1
    return 0


def _join_supervision(app: web.Application, index: int, columns: dict[str, list[int]] | None,
                      restart: tuple[bool, int]) -> None:
    """Router process ``index`` of several: map its workers to the shared-load ``columns`` the
    parent gave (a replacement: admin changes may have moved them from the config's order) and
    export the restart counters (:mod:`balancer.service.supervise`)."""
    from balancer.service.app import SERVICE
    from balancer.service.supervise import restart_counters

    svc = app[SERVICE]
    if columns is not None and svc.shared_load is not None:
        cols = {rep: c for w in svc.pool.workers.values() for rep, c in zip(w.replicas, columns.get(w.url, ()))}
        svc.shared_load.remove(list(svc.shared_load.columns))
        svc.shared_load.add(cols)
    if svc.multiprocess:
        restart_counters(index, *restart)


def run_serve(args: argparse.Namespace) -> int:
    """Run ``pdlb serve`` until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        loop_factory = event_loop_factory(args.event_loop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (warning := no_workers_warning(cfg)) is not None:
        print(warning, file=sys.stderr)
    for warning in config_warnings(cfg):
        print(warning, file=sys.stderr)
    if cfg.processes is None:
        cfg = cfg.model_copy(update={"processes": default_processes(w.url for w in cfg.workers)})
    if cfg.host not in ("127.0.0.1", "::1", "localhost") and not cfg.admin_api_key:
        print("note: no admin_api_key (--allow-unauthenticated-admin): the admin API (/workers) answers loopback "
              "peers only; behind a reverse proxy on this host every client is one", file=sys.stderr)
    if cfg.processes is not None and cfg.processes > 1:
        return _run_processes(cfg, args.event_loop, args.log_level, getattr(args, "max_process_restarts", None),
                              getattr(args, "restart_window_s", None))
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(cfg))


# ---------------------------------------------------------------------- several processes
def _reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket holding ``host:port`` (``port`` 0: a free one) while the
    router processes start; the parent then listens on it (:class:`balancer.service.handoff.Acceptor`).

    Raises:
        OSError: the address is already in use (checked first with a plain bind, so that another
            process's ``SO_REUSEPORT`` listener is not silently joined) or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port != 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))  # EADDRINUSE if anything listens there
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def _process_main(cfg_json: str, index: int, event_loop: str, log_level: str, ready,  # noqa: ANN001
                  shared_load: str | None = None, shared_prefix_dir: str | None = None,
                  handoff: socket.socket | None = None, columns: dict[str, list[int]] | None = None,
                  restart: tuple[bool, int] = (False, 0)) -> None:
    """Entry point of router process ``index`` (a spawned interpreter); ``shared_load``: the name
    of the shared in-flight load block (:mod:`balancer.service.shared_load`); ``handoff``: its end
    of the channel its client connections come on (:mod:`balancer.service.handoff`); ``columns``:
    each worker's shared-load columns (a replacement: admin changes may have moved them from the
    config's order); ``restart``: (whether it replaces a dead process, the load the parent reaped)."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    cfg = ServiceConfig.model_validate_json(cfg_json)
    with asyncio.Runner(loop_factory=event_loop_factory(event_loop)) as runner:
        code = runner.run(_serve(cfg, index, ready, shared_load, shared_prefix_dir, handoff, columns, restart))
    sys.exit(code)


def _run_processes(cfg: ServiceConfig, event_loop: str, log_level: str, max_restarts: int | None = None,
                   restart_window_s: float | None = None) -> int:
    """Run ``cfg.processes`` router processes on one port, restarting any that dies (see the
    module docstring and :mod:`balancer.service.supervise`)."""
    from prometheus_client import multiprocess as prom_multiprocess

    from balancer.service.handoff import Acceptor, channel_pair
    from balancer.service.shared_load import create_shared_load_block
    from balancer.service.supervise import (CHECK_INTERVAL_S, DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S,
                                            READY_TIMEOUT_S, LoadReaper, RestartPolicy, TrackingCoordinator,
                                            describe_exit, exit_before_ready)
    from balancer.service.workers import MAX_REPLICAS

    n_processes = cfg.processes
    assert n_processes is not None
    policy = RestartPolicy(DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts,
                           DEFAULT_RESTART_WINDOW_S if restart_window_s is None else restart_window_s)
    try:
        reservation = _reserve_port(cfg.host, cfg.port)
    except OSError as e:
        print(f"error: {listen_error(cfg.host, cfg.port, e)}", file=sys.stderr)
        return 2
    port = reservation.getsockname()[1]
    cfg = cfg.model_copy(update={"port": port})
    # memory-backed where there is one: the metric files and prefix rings are written per request
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    metrics_dir = tempfile.mkdtemp(prefix="pdlb-metrics-", dir=shm_dir)
    # columns: the configured workers' DP ranks first, in order; room for admin-added ones
    shm = create_shared_load_block(n_processes, MAX_REPLICAS)
    reaper = LoadReaper(shm, n_processes, MAX_REPLICAS)
    columns: dict[str, list[int]] = {}
    c = 0
    for w in cfg.workers:
        columns[w.url] = list(range(c, c + w.dp_size))
        c += w.dp_size
    prefix_dir = tempfile.mkdtemp(prefix="pdlb-prefix-", dir=shm_dir)  # the processes' approximate-index rings
    # read by prometheus_client at import in each spawned process (multiprocess mode); restored at
    # exit, so that a caller of main() in process is not left in multiprocess mode
    old_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    procs: list = []
    stop = {"signal": False}

    def on_signal(signum, frame):  # noqa: ANN001, ANN202
        stop["signal"] = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    acceptor = None
    channels: list[socket.socket] = []
    generation = [0] * n_processes
    # replacements started and not yet ready: index -> (their pipe, their channel, deadline);
    # polled each pass, so that a replacement's start-up never holds up the supervision of the
    # others (their deaths, admin changes)
    starting: dict[int, tuple[multiprocessing.connection.Connection, socket.socket, float]] = {}

    def spawn(i: int, pcfg: ServiceConfig, cols: dict[str, list[int]] | None, restart: tuple[bool, int]):  # noqa: ANN202
        mine, theirs = ctx.Pipe(duplex=True)  # ready / error, then admin changes both ways
        ours, child_end = channel_pair()  # the client connections it serves
        p = ctx.Process(target=_process_main, args=(pcfg.model_dump_json(), i, event_loop, log_level, theirs,
                                                    shm.name, prefix_dir, child_end, cols, restart),
                        name=f"pdlb-serve-{i}", daemon=False)
        p.start()
        theirs.close()
        child_end.close()
        return p, mine, ours

    def poll_ready(p, recv, deadline: float, wait_s: float) -> tuple[str, object] | None:  # noqa: ANN001
        """("ready", port) / ("error", message) once ``p`` has answered or failed; None while it is
        still starting (after waiting up to ``wait_s`` for its answer)."""
        if recv.poll(wait_s):
            try:
                return recv.recv()
            except (EOFError, OSError):
                return ("error", exit_before_ready(p))
        if not p.is_alive():
            return ("error", f"{describe_exit(p.exitcode)} before listening")
        if time.monotonic() > deadline:
            return ("error", f"not ready within {READY_TIMEOUT_S:g} s")
        return None

    def wait_ready(p, recv) -> tuple[str, object] | None:  # noqa: ANN001
        """("ready", port) / ("error", message), or None on a stop signal."""
        while not stop["signal"]:
            msg = poll_ready(p, recv, float("inf"), 0.2)
            if msg is not None:
                return msg
        return None

    try:
        pipes = []
        for i in range(n_processes):
            p, mine, ours = spawn(i, cfg, None, (False, 0))
            procs.append(p)
            pipes.append(mine)
            channels.append(ours)
        for i, (p, recv) in enumerate(zip(procs, pipes)):
            msg = wait_ready(p, recv)
            if msg is None:
                return 0
            if msg[0] != "ready":
                print(f"error: {msg[1]} (router process {i} of {n_processes})", file=sys.stderr)
                return 2
        acceptor = Acceptor(reservation, channels)
        print(_ready_line(cfg, port), flush=True)
        admin = TrackingCoordinator(pipes, columns, MAX_REPLICAS, {w.url: w.model_dump() for w in cfg.workers},
                                    alive=lambda i: procs[i].is_alive())
        due: dict[int, tuple[float, int]] = {}  # index -> (restart time, reaped load)
        while not stop["signal"] and code == 0:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i in due or i in starting or p.is_alive():
                    continue
                acceptor.retire(i)
                prom_multiprocess.mark_process_dead(p.pid, metrics_dir)  # its live gauges leave the sums
                reaped = reaper.reap(i)
                delay = policy.on_death(i, now)
                if delay is None:
                    print(f"error: router process {i} (pid {p.pid}) {describe_exit(p.exitcode)}; it died "
                          f"{policy.deaths_in_window(i)} times within {policy.window_s:g} s (limit: "
                          f"{policy.max_restarts} restarts): crash loop, stopping pdlb serve", file=sys.stderr)
                    code = 1
                    break
                print(f"warning: router process {i} (pid {p.pid}) {describe_exit(p.exitcode)}; its connections "
                      f"are lost, {reaped} in-flight request count(s) it held reset; restarting it in {delay:g} s",
                      file=sys.stderr, flush=True)
                due[i] = (now + delay, reaped)
            for i, (at, reaped) in sorted(due.items()):
                if code or stop["signal"] or time.monotonic() < at:
                    continue
                del due[i]
                generation[i] += 1
                # the worker set every process has now, a fresh RNG seed (Service: seed + index)
                pcfg = cfg.model_copy(update={
                    "workers": [WorkerConfig.model_validate(d) for d in admin.workers.values()],
                    "router": cfg.router.with_(seed=cfg.router.seed + generation[i] * n_processes)})
                p, mine, ours = spawn(i, pcfg, dict(admin.columns), (True, reaped))
                procs[i] = p
                starting[i] = (mine, ours, time.monotonic() + READY_TIMEOUT_S)
            for i, (mine, ours, deadline) in sorted(starting.items()):
                p = procs[i]
                msg = poll_ready(p, mine, deadline, 0)
                if msg is None:
                    continue
                del starting[i]
                if msg[0] != "ready":
                    print(f"warning: replacement of router process {i} (pid {p.pid}) failed: {msg[1]}",
                          file=sys.stderr, flush=True)
                    if p.is_alive():
                        p.kill()
                        p.join(5)
                    mine.close()
                    ours.close()
                    continue  # dead: counted as another death on the next pass
                admin.conns[i].close()
                admin.conns[i] = mine
                acceptor.replace(i, ours)
                log.warning("router process %d restarted (pid %d)", i, p.pid)
                print(f"router process {i} restarted (pid {p.pid})", file=sys.stderr, flush=True)
            if code == 0:
                admin.poll(CHECK_INTERVAL_S)  # admin changes; otherwise sleeps
        return code
    finally:
        for mine, ours, _ in starting.values():
            mine.close()
            ours.close()
        if acceptor is not None:
            acceptor.close()  # stops taking connections, closes the listener and the channels
        reservation.close()
        for ch in channels:
            ch.close()
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
        if old_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = old_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
        reaper.close()
        shm.close()
        shm.unlink()
        shutil.rmtree(prefix_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``pdlb-serve ARGS``: ``pdlb serve`` for an install with only the ``serve`` extra
    (``pip install 'pdlb[serve]'``; the ``pdlb`` command also needs the simulator's ``sim`` extra)."""
    parser = argparse.ArgumentParser(prog="pdlb-serve", description="the pdlb router service (pdlb serve)")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub).prog = "pdlb-serve"
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return run_serve(args)
