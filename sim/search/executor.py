"""Where simulation points run: this process, a local process pool, or a Ray cluster.

Every executor has one method that matters, :meth:`Executor.submit`, which takes a
:class:`sim.search.point.Point` and returns a :class:`concurrent.futures.Future` of its
:class:`sim.search.point.PointResult`, and a number of ``slots`` (points it runs at once). Searches and
sweeps submit points and consume futures as they complete (:func:`concurrent.futures.wait`), so
results stream back in completion order.

- :class:`SerialExecutor`: runs each point when submitted (1 slot); for tests and ``--jobs 1``.
- :class:`ProcessExecutor`: a ``concurrent.futures.ProcessPoolExecutor`` of ``jobs`` worker
  processes (``forkserver`` start: no fork of a multi-threaded parent). In-memory workloads are
  handed to each worker once, at start; trace workloads are read once per worker and cached.
- :class:`RayExecutor` (``pip install 'pdlb[ray]'``): one Ray task per point; every workload (a
  trace is read once, by the driver) goes to the object store once (``ray.put``) and each task
  fetches only its own, so workers on other machines need no copy of the trace. A task whose worker dies is retried
  (``max_retries``), then its future raises; callers turn that into an error row, never a silently
  missing one.

Ray on a small shared machine: :func:`ray_init_kwargs` gives the settings the tests and the
benchmark use: ``num_cpus`` bounded, a small object store, no dashboard, and Ray's memory monitor
(which kills workers when the *node's* memory use, every process on the machine included, crosses
``RAY_memory_usage_threshold``, default 0.95) raised to 0.98 so that other tenants of a shared
24 GB machine do not get pdlb's workers killed; ``RAY_memory_monitor_refresh_ms=0`` turns the
monitor off altogether. These are environment variables read when Ray starts its local instance.
Ray's own output stays off pdlb's terminal: workers' logs are not forwarded (``log_to_driver``),
and while Ray starts or connects its loggers pass errors only (:func:`quiet_ray_logs`), so its
"Token authentication is enabled for this Ray cluster..." banner (Ray turns token authentication
on for a new local instance; setting ``RAY_AUTH_MODE=token`` ourselves instead breaks the start,
Ray having read its config at import) does not land in the middle of a table.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from balancer.types import Request
from sim.search.host import default_jobs
from sim.search.point import (
    Point,
    PointResult,
    WorkloadSpec,
    error_result,
    evaluate_point,
    import_policy_modules,
    load_workload,
    register_workload,
)



def stop_pool_now(pool: cf.ProcessPoolExecutor) -> None:
    """Stop ``pool`` at once (an error or Ctrl-C): cancel what has not started, terminate the
    workers and wait up to 10 s for each to exit."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(timeout=10)

class Executor:
    """Base class: ``submit(point) -> Future[PointResult]``, ``slots``, context manager."""

    slots: int = 1
    name: str = "serial"

    def submit(self, point: Point) -> cf.Future:  # pragma: no cover - abstract
        raise NotImplementedError

    def add_workloads(self, workloads: Mapping[str, Sequence[Request]]) -> None:
        """Make in-memory workloads available to the points submitted from now on."""
        for key, reqs in workloads.items():
            register_workload(key, reqs)

    def shutdown(self, kill: bool = False) -> None:
        """Release workers (idempotent); ``kill`` (on Ctrl-C or an error): without waiting for the
        running points, where the executor can (every executor takes it: a caller that stops
        whichever :func:`make_executor` gave it passes it, review R8)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class SerialExecutor(Executor):
    """Evaluate each point in this process, at submit time (the returned future is done).

    Args:
        workloads: in-memory workloads ``{key: requests}`` the points refer to by key.
    """

    def __init__(self, workloads: Mapping[str, Sequence[Request]] | None = None) -> None:
        for key, reqs in (workloads or {}).items():
            register_workload(key, reqs)

    def submit(self, point: Point) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(evaluate_point(point))
        except Exception as e:  # noqa: BLE001 - delivered through the future like the others
            fut.set_exception(e)
        return fut


def apply_kernels_env() -> None:
    """``PDLB_KERNELS`` (:data:`balancer.kernels.ENV_VAR`) in a pool worker, as the command that
    started the pool applied it in its own process (a bad value was refused there). Every pool
    initializer of the simulator calls it (this one, :mod:`sim.search.parallel_runs`)."""
    from balancer import kernels

    try:
        kernels.use_compiled(kernels.enabled_by_env(os.environ))
    except ValueError:
        pass


def _init_worker(workloads: Mapping[str, Sequence[Request]], modules: Sequence[str]) -> None:
    apply_kernels_env()
    for key, reqs in workloads.items():
        register_workload(key, reqs)
    import_policy_modules(modules)


class ProcessExecutor(Executor):
    """A local pool of ``jobs`` worker processes.

    Args:
        jobs: worker processes (>= 1).
        workloads: in-memory workloads handed to every worker once, at start.
        modules: policy modules imported in every worker (``--policy-module``).

    Raises:
        ValueError: ``jobs`` < 1.
    """

    name = "process"

    def __init__(self, jobs: int, workloads: Mapping[str, Sequence[Request]] | None = None,
                 modules: Sequence[str] = ()) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.slots = jobs
        self._workloads = {k: list(v) for k, v in (workloads or {}).items()}
        self._modules = tuple(modules)
        self._pool: cf.ProcessPoolExecutor | None = None

    def add_workloads(self, workloads: Mapping[str, Sequence[Request]]) -> None:
        """Add in-memory workloads; a started pool is restarted so every worker has them."""
        self._workloads.update({k: list(v) for k, v in workloads.items()})
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def submit(self, point: Point) -> cf.Future:
        if self._pool is None:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            self._pool = cf.ProcessPoolExecutor(max_workers=self.slots, mp_context=ctx, initializer=_init_worker,
                                                initargs=(self._workloads, self._modules))
        return self._pool.submit(evaluate_point, point)

    def shutdown(self, kill: bool = False) -> None:
        """Stop the workers: wait for the running points, or (``kill``, on Ctrl-C or an error)
        terminate them at once. A pool interrupted mid-call can leave a worker that never
        reads its stop sentinel, and the interpreter would wait for it at exit forever."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        if not kill:
            pool.shutdown(wait=True, cancel_futures=True)
            return
        stop_pool_now(pool)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.shutdown(kill=exc_type is not None)


def ray_init_kwargs(num_cpus: int | None = None, object_store_memory_bytes: int = 200 * 2**20) -> dict[str, Any]:
    """``ray.init`` keyword arguments for a small local instance (see the module docstring), and
    the memory-monitor environment set for it: ``num_cpus`` (default: :func:`default_jobs`), an
    object store of ``object_store_memory_bytes`` (default 200 MiB; a full trace is ~4 MB), no
    dashboard, logs kept off the terminal, every Ray process on the loopback address."""
    os.environ.setdefault("RAY_memory_usage_threshold", "0.98")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    _loopback_only()
    return {"num_cpus": num_cpus or default_jobs(), "object_store_memory": object_store_memory_bytes,
            "include_dashboard": False, "log_to_driver": False, "configure_logging": False,
            "_node_ip_address": "127.0.0.1"}


@contextlib.contextmanager
def quiet_ray_logs():  # noqa: ANN201 - a context manager
    """While Ray starts or connects: its loggers (``ray`` and below) pass errors only, so its
    banners and notices (``logger.info`` / ``logger.warning``, which reach the terminal through
    Python's last-resort handler with ``configure_logging=False``) stay out of pdlb's tables and
    progress bars; real errors still show. The level is restored afterwards."""
    logger = logging.getLogger("ray")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _loopback_only() -> None:
    """Keep a local Ray instance on 127.0.0.1. On Linux Ray registers its node under the
    machine's outward address; with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (what Ray does on
    macOS/Windows, read by every Ray process it starts) it uses the loopback address. The driver
    read that flag when ``ray`` was imported, so its module constant is set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # pragma: no cover - a Ray without the flag
        pass


_RAY_EVAL = None


def _ray_eval_fn():  # noqa: ANN202 - the remote function, made once per process
    global _RAY_EVAL
    if _RAY_EVAL is None:
        import ray

        @ray.remote(num_cpus=1)
        def ray_evaluate(point: Point, modules: Sequence[str], key: str | WorkloadSpec | None,
                         requests: Sequence[Request] | None) -> PointResult:
            # ``requests`` arrives resolved from the object store (a top-level ObjectRef argument);
            # a trace's requests are registered under their WorkloadSpec itself, so evaluate_point
            # cuts them (rate scale, then duration_s) exactly as in a local worker
            if key is not None:
                register_workload(key, requests or [])
            import_policy_modules(modules)
            return evaluate_point(point)

        _RAY_EVAL = ray_evaluate
    return _RAY_EVAL


class RayExecutor(Executor):
    """One Ray task per point.

    Args:
        address: a running cluster (``"auto"``, ``"ray://host:port"``, ``"host:port"``) or
            ``None`` to start a local instance (:func:`ray_init_kwargs`; stopped by
            :meth:`shutdown`). An already initialised Ray is used as it is.
        num_cpus: CPUs of a local instance (default: this machine's).
        workloads / modules: as for :class:`ProcessExecutor`.
        max_retries: times a task whose worker died is retried before its future raises.
        runtime_env: Ray's ``runtime_env`` for the job (e.g. ``{"env_vars": {"PYTHONPATH": ...}}`` so
            workers find a ``--policy-module`` outside the installed packages).

    Raises:
        ImportError: Ray is not installed (the message says ``pip install 'pdlb[ray]'``).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 workloads: Mapping[str, Sequence[Request]] | None = None, modules: Sequence[str] = (),
                 max_retries: int = 2, runtime_env: dict | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError("--executor ray needs Ray: pip install 'pdlb[ray]'") from None
        self._ray = ray
        self._owns = False
        if not ray.is_initialized():
            extra = {"runtime_env": runtime_env} if runtime_env else {}
            with quiet_ray_logs():
                if address is None:
                    ray.init(**ray_init_kwargs(num_cpus), **extra)
                else:
                    ray.init(address=address, log_to_driver=False, configure_logging=False, **extra)
            self._owns = True
        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._refs: dict[object, Any] = {}
        self.add_workloads(workloads or {})
        self._modules = tuple(modules)
        self._fn = _ray_eval_fn().options(max_retries=max_retries)

    def add_workloads(self, workloads: Mapping[str, Sequence[Request]]) -> None:
        """Put each workload in the object store once (a task fetches only its own)."""
        for key, reqs in workloads.items():
            self._refs[key] = self._ray.put(list(reqs))

    def submit(self, point: Point) -> cf.Future:
        """Submit one task. A trace workload is read here, once, and shipped through the object
        store, so workers on other machines need neither the trace file nor the time to parse it."""
        wl = point.workload
        if not isinstance(wl, WorkloadSpec):
            return self._fn.remote(point, self._modules, wl, self._refs.get(wl)).future()
        # the point travels unchanged: an in-memory key instead would be taken by evaluate_point as
        # already cut, and --duration-s ignored on Ray (issue 24)
        if wl not in self._refs:
            self._refs[wl] = self._ray.put(load_workload(wl))
        inner = self._fn.remote(point, self._modules, wl, self._refs[wl]).future()
        outer: cf.Future = cf.Future()

        def done(f: cf.Future) -> None:  # the result names the point as it was submitted
            try:
                res = f.result()
            except BaseException as e:  # noqa: BLE001 - delivered as the task's failure
                outer.set_exception(e)
                return
            res.point = point
            outer.set_result(res)

        inner.add_done_callback(done)
        return outer

    def shutdown(self, kill: bool = False) -> None:
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns = False


def run_points(points: Sequence[Point], executor: Executor,
               on_point: Callable[[int, PointResult], None] | None = None) -> list[PointResult]:
    """Evaluate independent ``points`` on ``executor`` (all submitted at once, at most ``slots``
    running); returns results in the order of ``points``. ``on_point(index, result)`` is called
    as each completes. A point whose future raises becomes an error result (never a gap)."""
    futures = {executor.submit(p): i for i, p in enumerate(points)}
    out: list[PointResult | None] = [None] * len(points)
    for fut in cf.as_completed(futures):
        i = futures[fut]
        try:
            res = fut.result()
        except Exception as e:  # noqa: BLE001 - a dead worker or failed task, after retries
            res = error_result(points[i], f"{type(e).__name__}: {e}")
        out[i] = res
        if on_point is not None:
            on_point(i, res)
    return out  # type: ignore[return-value]


def make_executor(kind: str = "process", *, jobs: int | None = None, ray_address: str | None = None,
                  workloads: Mapping[str, Sequence[Request]] | None = None, modules: Sequence[str] = ()) -> Executor:
    """``"serial"``, ``"process"`` (``jobs`` workers, default :func:`default_jobs`; 1 job = serial)
    or ``"ray"`` (``ray_address``: None = a local instance of ``jobs`` CPUs).

    Raises:
        ValueError: unknown kind.
        ImportError: ``"ray"`` without Ray installed.
    """
    if kind == "serial" or (kind == "process" and (jobs or default_jobs()) == 1):
        import_policy_modules(modules)
        return SerialExecutor(workloads)
    if kind == "process":
        return ProcessExecutor(jobs or default_jobs(), workloads, modules)
    if kind == "ray":
        return RayExecutor(ray_address, num_cpus=jobs, workloads=workloads, modules=modules)
    raise ValueError(f"unknown executor {kind!r}; valid: serial, process, ray")
