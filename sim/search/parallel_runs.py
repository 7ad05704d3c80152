"""Several whole simulations of one workload at once, in local worker processes (``pdlb sim compare --jobs``).

:func:`simulate_in_parallel` runs :func:`sim.run.cluster.simulate` for each ``(prefill, decode)`` policy
pair on a ``concurrent.futures.ProcessPoolExecutor`` (``forkserver`` start, as
:class:`sim.search.executor.ProcessExecutor`): the scenario and the requests go to each worker once, at
start; each worker reports its progress through a queue, throttled to about 100 updates per run,
so the parent's progress bars move per policy. Results are the same objects ``simulate`` returns
in this process, in the order of the pairs (the simulator is deterministic wherever it runs).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import queue as queue_mod
from collections.abc import Callable, Sequence
from typing import Any

from balancer.types import Request
from sim.run.cluster import SimResult, simulate
from sim.search.executor import stop_pool_now
from sim.search.point import import_policy_modules
from sim.scenario import Scenario

_STATE: dict[str, Any] = {}


def _init(scenario: Scenario, requests: Sequence[Request], modules: Sequence[str], q: Any) -> None:
    from sim.search.executor import apply_kernels_env

    apply_kernels_env()  # PDLB_KERNELS, as in the parent (review R1)
    import_policy_modules(modules)
    _STATE.update(scenario=scenario, requests=list(requests), queue=q)


def _run(i: int, prefill: Any, decode: Any, kw: dict[str, Any]) -> SimResult:
    q = _STATE["queue"]
    step = max(1, len(_STATE["requests"]) // 100)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            q.put((i, done))

    return simulate(_STATE["scenario"], _STATE["requests"], prefill, decode, progress=progress, **kw)


def simulate_in_parallel(scenario: Scenario, requests: Sequence[Request], pairs: Sequence[tuple[Any, Any]],
                         sim_kw: dict[str, Any], jobs: int, modules: Sequence[str] = (),
                         on_progress: Callable[[int, int], None] | None = None) -> list[SimResult]:
    """:func:`sim.run.cluster.simulate` of ``requests`` on ``scenario`` for each ``(prefill, decode)``
    policy pair, ``jobs`` at a time in worker processes; ``sim_kw`` are simulate's other keyword
    arguments (seed, index mode, ...). ``on_progress(pair index, requests done)`` is called in this
    process as workers report. Returns the results in the order of ``pairs``.

    Raises:
        ValueError: ``jobs`` < 1; any exception of a simulation (re-raised here; the others are
            cancelled and the workers stopped).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    q = ctx.Queue()  # handed to each worker at start (initargs)
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init,
                                  initargs=(scenario, list(requests), tuple(modules), q))
    futures = {pool.submit(_run, i, p, d, sim_kw): i for i, (p, d) in enumerate(pairs)}
    out: list[SimResult | None] = [None] * len(pairs)
    ok = False
    try:
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            _drain(q, on_progress)
            for fut in finished:
                out[futures[fut]] = fut.result()  # raises the simulation's exception
        _drain(q, on_progress)
        ok = True
    finally:
        if ok:
            pool.shutdown(wait=True)
        else:  # an error or Ctrl-C: stop the workers at once
            stop_pool_now(pool)
        q.close()
        q.join_thread()
    return out  # type: ignore[return-value]


def _drain(q: Any, on_progress: Callable[[int, int], None] | None) -> None:
    while True:
        try:
            i, done = q.get_nowait()
        except queue_mod.Empty:
            return
        if on_progress is not None:
            on_progress(i, done)
