"""Run the PD router service of a :class:`~balancer.service.config.ServiceConfig` (:func:`serve`):
what ``pdlb serve`` runs once :mod:`pdlb_cli.serve` has merged its flags over the config file.

By default ``pdlb serve`` runs one router process per core it may run on
(``os.sched_getaffinity``; ``--processes N`` or ``processes:`` in the config to choose), one per
four cores when a worker runs on the same host (:func:`default_processes`). With N > 1
the parent process listens on the port, starts N router processes and hands each accepted client
connection to the next of them in turn (:mod:`balancer.service.handoff`: the kernel's
``SO_REUSEPORT`` hashing left some processes with twice the mean number of keep-alive clients),
prints the ready line once all of them are ready, forwards SIGTERM/SIGINT to them and exits when
they have drained. While they run it
applies admin changes (``POST``/``DELETE /workers``) to all of them, one at a time, all or none
(:mod:`balancer.service.processes.shared_admin`). If one of them dies (any cause) it is started again with
the same index, bounded by a crash-loop limit after which ``pdlb serve`` exits with status 1
(:mod:`balancer.service.processes.supervise`). Prometheus multiprocess mode aggregates
``/metrics`` over them (a fresh temporary ``PROMETHEUS_MULTIPROC_DIR``, removed at exit).
"""

from __future__ import annotations

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

from balancer.service.app import SERVICE, create_app, json_parser_errors, limit_connections, make_runner
from balancer.service.body_offload import tune_malloc
from balancer.service.config import ServiceConfig, WorkerConfig, config_warnings
from balancer.service.fd_limit import effective_max_connections, install_accept_error_limit, raise_nofile_limit

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
    ``uvloop.new_event_loop`` for ``uvloop`` (in the ``serve`` extra; ``pip install uvloop``
    otherwise), and for ``auto`` (``pdlb serve``'s default) uvloop where it is installed, else the
    standard loop. uvloop is the default since issue 26: one router process with the lean front
    spent 0.81x (regular), 0.94x (SGLang PD) and 0.95x (vLLM PD) the CPU per request of the
    standard loop, paired on a 2-core host; 8 processes on a 16-core host 0.92-0.97x
    (docs/serving.md, "HTTP front" and "Overhead").

    Raises:
        ValueError: ``uvloop`` asked for but not installed, or an unknown choice.
    """
    if choice not in ("uvloop", "asyncio", "auto"):
        raise ValueError(f"unknown event loop {choice!r} (auto, asyncio, uvloop)")
    if choice == "asyncio":
        return None
    try:
        import uvloop  # the serve extra's; optional for the library
    except ImportError:
        if choice == "auto":
            return None
        raise ValueError("--event-loop uvloop needs the 'uvloop' package (pip install uvloop)") from None
    return uvloop.new_event_loop


def no_workers_warning(cfg: ServiceConfig) -> str | None:
    """The warning ``pdlb serve`` prints when it starts with no workers (``None`` if it has some)."""
    if cfg.workers:
        return None
    return ("warning: no workers: every request gets 503 until workers are added with the admin API "
            "(POST /workers) or given with --prefill/--decode/--mixed")


def placement_warning(cfg: ServiceConfig) -> str | None:
    """The warning ``pdlb serve`` prints when several router processes would place connections by
    load (``connection_placement`` ``follow_load``, the default) but the HTTP front cannot give
    connections back (``http_front`` ``aiohttp``): the parent then places them round robin, never
    given back (review R4, session 16). ``None`` otherwise; ``cfg.processes`` resolved."""
    if not (cfg.processes and cfg.processes > 1 and cfg.http_front == "aiohttp"
            and cfg.connection_placement == "follow_load"):
        return None
    given = "connection_placement" in cfg.model_fields_set
    return (f"warning: {'--connection-placement follow_load' if given else 'load-following connection placement'} "
            f"needs the lean HTTP front (it gives connections back with Connection: close): with --http-front "
            f"aiohttp the {cfg.processes} router processes get new connections round robin, never given back "
            "(say --connection-placement round_robin to silence this)")


def _ready_line(cfg: ServiceConfig, port: int) -> str:
    n = {r: sum(1 for w in cfg.workers if w.role == r) for r in ("prefill", "decode", "mixed")}
    return (f"pdlb serve ready on http://{cfg.host}:{port} protocol={cfg.pd_protocol} "
            f"workers=P{n['prefill']}/D{n['decode']}/M{n['mixed']}" +
            (f" processes={cfg.processes}" if (cfg.processes or 1) > 1 else ""))


async def _serve(cfg: ServiceConfig, process_index: int = 0, ready=None, shared_load: str | None = None,  # noqa: ANN001
                 shared_prefix_dir: str | None = None, handoff: socket.socket | None = None,
                 columns: dict[str, list[int]] | None = None, restart: tuple[bool, int] = (False, 0),
                 placement: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM. One process: listen, print the ready line. Process
    ``process_index`` of several: serve the connections the parent hands over on ``handoff``
    (:mod:`balancer.service.handoff`) and send ``("ready", port)`` or ``("error", message)`` on the
    duplex pipe ``ready`` instead, which then carries admin changes
    (:mod:`balancer.service.processes.shared_admin`). ``columns``, ``restart``: see :func:`_process_main`."""
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
    install_accept_error_limit(asyncio.get_running_loop())
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

    # processes taking new connections: every one without the load-following placement (round
    # robin, one process; was left at 0: review2), else the placement's k at each refresh
    metrics = app[SERVICE].metrics
    metrics.processes_active.set(cfg.processes if handoff is not None and cfg.processes else 1)
    if handoff is not None:
        from balancer.service.handoff import adopt_connections

        assert runner.server is not None
        on_adopted = None
        if placement is not None and cfg.processes:
            from balancer.service.processes.placement import PlacementBlock, PlacementView

            view = PlacementView(PlacementBlock(cfg.processes, placement), process_index)
            metrics.placement = view
            for reason in ("inactive", "rebalance"):  # both series from the start, at 0
                metrics.given_back.labels(reason)
            view.on_give_back = lambda reason: metrics.count(metrics.given_back, reason)
            runner.router_server.follow_placement(view)
            on_adopted = view.adopted
        stop_adopting = adopt_connections(handoff, runner.server, parent_gone, parent_stops, on_adopted)
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
    export the restart counters (:mod:`balancer.service.processes.supervise`)."""
    from balancer.service.processes.supervise import restart_counters

    svc = app[SERVICE]
    if columns is not None and svc.shared_load is not None:
        cols = {rep: c for w in svc.pool.workers.values() for rep, c in zip(w.replicas, columns.get(w.url, ()))}
        svc.shared_load.remove(list(svc.shared_load.columns))
        svc.shared_load.add(cols)
    if svc.multiprocess:
        restart_counters(index, *restart)


def serve(cfg: ServiceConfig, *, event_loop: str = "auto", log_level: str = "WARNING",
          max_process_restarts: int | None = None, restart_window_s: float | None = None) -> int:
    """Run the router service of ``cfg`` until SIGINT/SIGTERM; returns the exit status (0 after a
    drain, 1 after a crash loop of router processes or an orphaned process, 2 after one ``error:``
    line on stderr: the app cannot be built or the port not listened on).

    Prints the no-workers warning and ``cfg``'s warnings (:func:`balancer.service.config.config_warnings`)
    on stderr first. ``cfg.processes`` unset: :func:`default_processes`. More than one process:
    :func:`_run_processes` (``max_process_restarts`` within ``restart_window_s``: the crash-loop
    bound, defaults of :mod:`balancer.service.processes.supervise`); else one process on an
    ``event_loop`` (``"auto"``: uvloop where installed, ``"asyncio"`` or ``"uvloop"``; :func:`event_loop_factory`).

    Raises:
        ValueError: an unknown or missing ``event_loop``.
    """
    loop_factory = event_loop_factory(event_loop)
    if (warning := no_workers_warning(cfg)) is not None:
        print(warning, file=sys.stderr)
    for warning in config_warnings(cfg):
        print(warning, file=sys.stderr)
    if cfg.processes is None:
        cfg = cfg.model_copy(update={"processes": default_processes(w.url for w in cfg.workers)})
    if (warning := placement_warning(cfg)) is not None:
        print(warning, file=sys.stderr)
    if cfg.host not in ("127.0.0.1", "::1", "localhost") and not cfg.admin_api_key:
        print("note: no admin_api_key (--allow-unauthenticated-admin): the admin API (/workers) answers loopback "
              "peers only; behind a reverse proxy on this host every client is one", file=sys.stderr)
    cfg = _fit_open_file_limit(cfg)
    if cfg.processes is not None and cfg.processes > 1:
        return _run_processes(cfg, event_loop, log_level, max_process_restarts, restart_window_s)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(cfg))


def _fit_open_file_limit(cfg: ServiceConfig) -> ServiceConfig:
    """Raise the soft open-file limit for ``cfg.max_connections`` (per router process) and, where
    it still cannot hold them, return ``cfg`` with the cap lowered, after one warning on stderr
    (:mod:`balancer.service.fd_limit`)."""
    soft = raise_nofile_limit(cfg.max_connections)
    cap = effective_max_connections(cfg.max_connections, soft)
    if cap < cfg.max_connections:
        print(f"warning: the open-file limit ({soft}, hard limit reached) holds {cap} client connections per "
              f"router process, not max_connections={cfg.max_connections}: serving with max_connections={cap} "
              f"(raise `ulimit -n` / LimitNOFILE to allow more)", file=sys.stderr)
        cfg = cfg.model_copy(update={"max_connections": cap})
    return cfg


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


def _kernels_from_env() -> None:
    """``PDLB_KERNELS`` (:data:`balancer.kernels.ENV_VAR`) in a spawned router process, as the
    command that started ``pdlb serve`` applied it in its own (a bad value was refused there)."""
    from balancer import kernels

    try:
        kernels.use_compiled(kernels.enabled_by_env(os.environ))
    except ValueError:
        pass


def _process_main(cfg_json: str, index: int, event_loop: str, log_level: str, ready,  # noqa: ANN001
                  shared_load: str | None = None, shared_prefix_dir: str | None = None,
                  handoff: socket.socket | None = None, columns: dict[str, list[int]] | None = None,
                  restart: tuple[bool, int] = (False, 0), placement: str | None = None) -> None:
    """Entry point of router process ``index`` (a spawned interpreter); ``shared_load``: the name
    of the shared in-flight load block (:mod:`balancer.service.processes.shared_load`); ``handoff``: its end
    of the channel its client connections come on (:mod:`balancer.service.handoff`); ``columns``:
    each worker's shared-load columns (a replacement: admin changes may have moved them from the
    config's order); ``restart``: (whether it replaces a dead process, the load the parent reaped);
    ``placement``: the name of the connection placement's block
    (:mod:`balancer.service.processes.placement`), None for round robin."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    cfg = ServiceConfig.model_validate_json(cfg_json)
    if cfg.pin_processes:  # before any thread starts: they inherit the CPU
        from balancer.service.processes.pinning import pin_process
        pin_process(index)
    _kernels_from_env()
    with asyncio.Runner(loop_factory=event_loop_factory(event_loop)) as runner:
        code = runner.run(_serve(cfg, index, ready, shared_load, shared_prefix_dir, handoff, columns, restart, placement))
    sys.exit(code)


def _run_processes(cfg: ServiceConfig, event_loop: str, log_level: str, max_restarts: int | None = None,
                   restart_window_s: float | None = None) -> int:
    """Run ``cfg.processes`` router processes on one port, restarting any that dies (see the
    module docstring and :mod:`balancer.service.processes.supervise`)."""
    from prometheus_client import multiprocess as prom_multiprocess

    from balancer.service.handoff import Acceptor, channel_pair
    from balancer.service.processes.placement import PlacementBlock, PlacementControl, process_cpu_s
    from balancer.service.processes.shared_load import create_shared_load_block
    from balancer.service.processes.supervise import (CHECK_INTERVAL_S, DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S,
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
    # connections where the load needs them (the lean front gives connections back; /proc for CPU times)
    place = (PlacementControl(PlacementBlock(n_processes), cfg.placement_target_util,
                              even_out=cfg.placement_even_out)
             if cfg.connection_placement == "follow_load"
             and cfg.http_front == "lean" and os.path.exists(f"/proc/{os.getpid()}/stat") else None)
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
                                                    shm.name, prefix_dir, child_end, cols, restart,
                                                    None if place is None else place.block.name),
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
        acceptor = Acceptor(reservation, channels, placement=place)
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
                # one line, as the death's above (printed, whatever the log level; review F5: it was
                # logged and printed, so the log showed it twice)
                print(f"router process {i} restarted (pid {p.pid})", file=sys.stderr, flush=True)
            if place is not None and code == 0:
                place.tick(time.monotonic(), [process_cpu_s(p.pid) if i not in due and i not in starting and p.pid
                                              else None for i, p in enumerate(procs)])
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
        if place is not None:
            place.block.close()
        shm.close()
        shm.unlink()
        shutil.rmtree(prefix_dir, ignore_errors=True)
