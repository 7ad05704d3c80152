"""Every executor :func:`sim.search.executor.make_executor` gives can be stopped the same way,
``shutdown(kill=...)`` (review R8, session 16: the serial executor's ``shutdown`` took no ``kill``, so
``bench/policy_goodput.py --jobs 1``, which stops its pool with it, ended in a TypeError every run)."""

from __future__ import annotations

import inspect

import pytest

from sim.search import executor as ex


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


@pytest.mark.parametrize("cls", [ex.Executor, *_subclasses(ex.Executor)], ids=lambda c: c.__name__)
def test_every_executor_class_takes_kill(cls: type) -> None:
    params = inspect.signature(cls.shutdown).parameters
    assert "kill" in params and params["kill"].default is False, cls


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("kill", [False, True])
def test_made_executors_stop_with_kill_twice(jobs: int, kill: bool) -> None:
    e = ex.make_executor("process", jobs=jobs)
    assert type(e).__name__ == ("SerialExecutor" if jobs == 1 else "ProcessExecutor")
    e.shutdown(kill=kill)
    e.shutdown(kill=kill)  # idempotent
