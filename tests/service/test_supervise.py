"""Restart policy and load reaping of ``pdlb serve --processes N`` (:mod:`balancer.service.processes.supervise`).
Expected values by hand from the documented rule: the k-th death of one index within the window
waits min(5, 0.1 * 2**(k-1)) s; a death beyond max_restarts within the window gives up."""

import signal
from multiprocessing import shared_memory

import numpy as np
import pytest

from balancer.service.processes.supervise import LoadReaper, RestartPolicy, describe_exit


def test_backoff_doubles_per_death_in_the_window_and_resets_after_it():
    p = RestartPolicy(max_restarts=10, window_s=60)
    assert [p.on_death(0, t) for t in (0, 1, 2, 3)] == [0.1, 0.2, 0.4, 0.8]
    assert p.on_death(1, 3) == 0.1  # per index
    assert p.on_death(0, 200) == 0.1  # the earlier deaths left the window
    for t in range(201, 207):
        p.on_death(0, t)
    assert p.on_death(0, 207) == 5.0  # 0.1 * 2**7 = 12.8, capped
    assert p.restarts == {0: 12, 1: 1}


def test_a_death_beyond_the_limit_within_the_window_gives_up():
    p = RestartPolicy(max_restarts=2, window_s=10)
    assert p.on_death(3, 0) == 0.1 and p.on_death(3, 5) == 0.2
    assert p.on_death(3, 9) is None and p.deaths_in_window(3) == 3
    q = RestartPolicy(max_restarts=2, window_s=10)
    assert [q.on_death(3, t) for t in (0, 5, 11)] == [0.1, 0.2, 0.2]  # death 0 left the window
    assert RestartPolicy(max_restarts=0).on_death(0, 0) is None
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(window_s=0)


def test_reap_zeroes_only_the_dead_row_and_counts_its_requests():
    shm = shared_memory.SharedMemory(create=True, size=2 * 3 * 8 * 8)
    try:
        rows = np.ndarray((2, 3, 8), dtype=np.int64, buffer=shm.buf)
        rows[0, 0, :3] = [1, 2, 3]  # process 0: 6 requests
        rows[0, 1, 1] = 500
        rows[1, 0, 2] = 4  # process 1: 4 requests, 900 decode KV tokens
        rows[1, 2, 2] = 900
        reaper = LoadReaper(shm, 2, 8)
        assert reaper.reap(1) == 4
        assert not rows[1].any() and rows[0, 0, :3].tolist() == [1, 2, 3] and rows[0, 1, 1] == 500
        assert reaper.reap(1) == 0 and reaper.reaped_requests == 4
        assert reaper.reap(0) == 6 and not rows.any() and reaper.reaped_requests == 10
        reaper.close()
        del rows
    finally:
        shm.close()
        shm.unlink()


def test_exit_descriptions():
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(None) == "is still running"


class _DyingProcess:
    """A process whose ready pipe already closed: it is reaped on the join (SIGKILL, exit code -9)."""

    def __init__(self, reaped_on_join: bool) -> None:
        self.alive = True
        self.reaped_on_join = reaped_on_join
        self.exitcode = None
        self.joined: list[float] = []

    def join(self, timeout: float | None = None) -> None:
        self.joined.append(timeout)
        if self.reaped_on_join:
            self.alive, self.exitcode = False, -signal.SIGKILL

    def is_alive(self) -> bool:
        return self.alive


def test_a_replacement_dying_before_ready_is_described_once_reaped():
    """A replacement SIGKILLed while starting was once logged 'failed: is still running
    before listening' (its pipe closed a moment before it could be reaped); it is joined first."""
    from balancer.service.processes.supervise import exit_before_ready

    p = _DyingProcess(reaped_on_join=True)
    assert exit_before_ready(p) == "was killed by SIGKILL before listening" and p.joined == [2.0]
    assert exit_before_ready(_DyingProcess(reaped_on_join=False), 0.0) == "closed its ready pipe before listening"
